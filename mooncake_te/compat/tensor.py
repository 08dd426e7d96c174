# SPDX-License-Identifier: Apache-2.0
"""Mooncake Store's tensor calls (``put_tensor``, ``get_tensor``, the ``*_with_tp``
forms, ...) on :class:`~mooncake_te.compat.store.MooncakeDistributedStore` (issue 39).

An object written by a tensor call is laid out as Mooncake lays it out
(``mooncake-integration/integration_utils.h``, ``TensorMetadata``, version 1): a
304-byte little-endian header, then the tensor's bytes (C order). So an object put here
reads in Mooncake and the other way round. The header, by byte offset:

====== ======================================================================
0      ``magic`` u32 = 0x4d4f4f4e, ``version`` u16 = 1, ``header_size`` u16 = 304
8      ``dtype`` i32 (:data:`DTYPES`' index), ``ndim`` i32 (0..8)
16     ``layout_kind`` u32 (0 FULL, 1 SHARD), ``reserved_flags`` u32 = 0
24     ``data_offset`` u64 = 304, ``data_bytes`` u64 (object size - data_offset)
40     ``global_shape`` 8 x i64 (unused dims -1)
104    ``local_shape`` 8 x i64 (the stored tensor's shape; unused dims -1)
168    ``axis_count`` u32 (0..4), ``reserved0`` u32
176    4 axes of 32 bytes: ``kind`` i32 (0 DP, 1 TP, 2 EP, 3 PP), ``axis_index``,
       ``shard_rank``, ``shard_count``, ``split_dim`` (i32 each), ``reserved0`` i32,
       ``reserved1`` i64 (a TP shard: its extent along ``split_dim``)
====== ======================================================================

A whole tensor is FULL with no axes (``global_shape == local_shape``). The
``*_with_tp`` puts split the tensor along ``split_dim`` into ``tp_size`` equal parts
(the dimension must divide evenly, as in Mooncake) and store part ``r`` under
``f"{key}_tp_{r}"`` as a SHARD with one TP axis; ``get_tensor_with_tp(key, tp_rank,
tp_size)`` reads ``f"{key}_tp_{tp_rank}"`` (``tp_size <= 1``: the key itself).

torch is imported when a tensor call is made, never before; without it the call raises
:class:`TorchNotInstalledError`. CPU tensors are stored from their memory (one copy into
the object); tensors on another device (CUDA) are copied to the host first
(``tensor.to("cpu")``) and tensors read back are CPU tensors. ``get_tensor_into_cuda``
copies the object's payload through the host into the given tensor (any device).
The ``*_with_parallelism`` calls and their request objects are in :mod:`.parallelism`.
"""
from __future__ import annotations

import ctypes
import logging
import struct
from typing import Any

import numpy as np

from .store_types import FILE_NOT_FOUND, INTERNAL_ERROR, INVALID_PARAMS, OK

log = logging.getLogger("mooncake_te.compat.store")

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
LAYOUT_FULL = 0
LAYOUT_SHARD = 1
AXIS_DP, AXIS_TP, AXIS_EP, AXIS_PP = 0, 1, 2, 3

_HEAD = "<IHHiiIIQQ"                      # TensorObjectHeader, 40 bytes
_SHAPE = "8q"
_AXIS = "iiiiiiq"                         # LayoutAxis, 32 bytes
HEADER = struct.Struct(_HEAD + _SHAPE + _SHAPE + "II" + _AXIS * MAX_AXES)
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 304

#: Mooncake's ``TensorDtype``: index -> (torch attribute, element bytes)
DTYPES = (("float32", 4), ("float64", 8), ("int8", 1), ("uint8", 1), ("int16", 2),
          ("uint16", 2), ("int32", 4), ("uint32", 4), ("int64", 8), ("uint64", 8),
          ("bool", 1), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1),
          ("float8_e5m2", 1))


class TorchNotInstalledError(ModuleNotFoundError):
    """A tensor call was made in a Python without torch."""


def torch_module():
    """``import torch``, or :class:`TorchNotInstalledError` saying what to do."""
    try:
        import torch
    except ImportError as e:
        raise TorchNotInstalledError(
            f"Mooncake Store's tensor calls (put_tensor, get_tensor, ...) need PyTorch, "
            f"which this Python ({e}) cannot import: install it (`pip install torch`) or "
            f"use the byte calls (put, get, put_from, get_into)", name="torch") from None
    return torch


def dtype_code(torch, dtype) -> int:
    """Mooncake's ``TensorDtype`` of a torch dtype, -1 when it has none."""
    for i, (name, _) in enumerate(DTYPES):
        d = getattr(torch, name, None)
        if d is not None and dtype == d:
            return i
    return -1


def _supported() -> str:
    return ", ".join(n for n, _ in DTYPES)


def pack_header(dtype: int, global_shape, local_shape, data_bytes: int,
                axes=()) -> bytes:
    """The 304-byte header; ``axes``: ``(kind, shard_rank, shard_count, split_dim,
    reserved0, reserved1)`` tuples (SHARD when there are any)."""
    ndim = len(local_shape)

    def shape(s):
        return list(s) + [-1] * (MAX_DIMS - len(s))
    ax: list = []
    for i in range(MAX_AXES):
        if i < len(axes):
            kind, rank, count, split_dim, r0, r1 = axes[i]
            ax += [kind, i, rank, count, split_dim, r0, r1]
        else:
            ax += [0] * 7
    return HEADER.pack(MAGIC, VERSION, HEADER_SIZE, dtype, ndim,
                       LAYOUT_SHARD if axes else LAYOUT_FULL, 0, HEADER_SIZE, data_bytes,
                       *shape(global_shape), *shape(local_shape), min(len(axes), MAX_AXES),
                       0, *ax)


def parse_header(buf, total: int) -> "dict | None":
    """The header at the start of ``buf`` (an object of ``total`` bytes) as a dict, or
    None (logged) when it is not a valid Mooncake tensor header for that size (the checks
    of Mooncake's ``ValidateTensorMetadata``)."""
    if total < HEADER_SIZE:
        log.error("not a tensor object: %d bytes, less than the %d-byte header", total,
                  HEADER_SIZE)
        return None
    f = HEADER.unpack_from(buf, 0)
    magic, version, hsize, dtype, ndim, kind, _, off, nbytes = f[:9]
    gshape, lshape = f[9:17], f[17:25]
    axis_count = f[25]
    axes = [f[27 + 7 * i:34 + 7 * i] for i in range(MAX_AXES)]
    why = None
    if magic != MAGIC or version != VERSION or hsize != HEADER_SIZE:
        why = (f"magic/version/header_size {magic:#x}/{version}/{hsize}, expected "
               f"{MAGIC:#x}/{VERSION}/{HEADER_SIZE}")
    elif not 0 <= dtype < len(DTYPES):
        why = f"dtype {dtype} is none of Mooncake's {len(DTYPES)}"
    elif not 0 <= ndim <= MAX_DIMS:
        why = f"ndim {ndim} outside 0..{MAX_DIMS}"
    elif axis_count > MAX_AXES or kind > LAYOUT_SHARD:
        why = f"axis_count {axis_count} / layout_kind {kind} out of range"
    elif not HEADER_SIZE <= off <= total or nbytes != total - off:
        why = f"data_offset {off} / data_bytes {nbytes} do not match {total} bytes"
    elif any(d < 0 for d in gshape[:ndim] + lshape[:ndim]) or \
            any(d != -1 for d in gshape[ndim:] + lshape[ndim:]):
        why = f"shape {gshape} / {lshape} invalid for ndim {ndim}"
    else:
        n = DTYPES[dtype][1]
        for d in lshape[:ndim]:
            n *= d
        if n != nbytes:
            why = f"data_bytes {nbytes}, the shape and dtype make {n}"
        for a in axes[:axis_count]:
            if not (0 <= a[0] <= 4 and 0 <= a[2] < a[3] and -1 <= a[4] < ndim):
                why = f"layout axis {a} invalid"
    if why:
        log.error("not a valid Mooncake tensor object: %s", why)
        return None
    return {"dtype": dtype, "ndim": ndim, "layout_kind": kind, "data_offset": off,
            "data_bytes": nbytes, "global_shape": tuple(gshape[:ndim]),
            "local_shape": tuple(lshape[:ndim]), "axes": axes[:axis_count]}


# --- tensors <-> objects ----------------------------------------------------------------
def _host(torch, tensor, what: str):
    """``tensor`` as a contiguous CPU tensor and its dtype code, or None (logged)."""
    if not isinstance(tensor, torch.Tensor):
        log.error("%s: a %s is not a torch.Tensor", what, type(tensor).__name__)
        return None
    code = dtype_code(torch, tensor.dtype)
    if code < 0:
        log.error("%s: dtype %s is not one Mooncake's tensor format stores (%s); convert "
                  "the tensor (tensor.to(...)) first", what, tensor.dtype, _supported())
        return None
    if tensor.dim() > MAX_DIMS:
        log.error("%s: the tensor has %d dimensions, Mooncake's format at most %d", what,
                  tensor.dim(), MAX_DIMS)
        return None
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")                   # CUDA and other devices: through the host
    return t.contiguous(), code


def _bytes_of(t) -> np.ndarray:
    n = t.numel() * t.element_size()
    if n == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(t.data_ptr()))


def encode(torch, tensor, what: str, global_shape=None, axes=()) -> "np.ndarray | None":
    """Header + payload of ``tensor`` (one array), or None (logged)."""
    h = _host(torch, tensor, what)
    if h is None:
        return None
    t, code = h
    data = _bytes_of(t)
    shape = tuple(t.shape)
    head = pack_header(code, shape if global_shape is None else global_shape, shape,
                       data.nbytes, axes)
    out = np.empty(HEADER_SIZE + data.nbytes, np.uint8)
    out[:HEADER_SIZE] = np.frombuffer(head, np.uint8)
    out[HEADER_SIZE:] = data
    return out


def tp_shards(torch, tensor, tp_size: int, split_dim: int, what: str) -> "list | None":
    """``tensor`` split for tensor parallelism: ``tp_size`` objects (SHARD, one TP
    axis), or None (logged) when the dimension does not divide evenly."""
    h = _host(torch, tensor, what)
    if h is None:
        return None
    t, _ = h
    shape = tuple(t.shape)
    if tp_size <= 0 or not 0 <= split_dim < len(shape):
        log.error("%s: split_dim %d / tp_size %d invalid for a tensor of shape %s", what,
                  split_dim, tp_size, shape)
        return None
    if shape[split_dim] % tp_size:
        log.error("%s: dimension %d (%d) does not split evenly into tp_size %d (Mooncake "
                  "supports only even splits)", what, split_dim, shape[split_dim], tp_size)
        return None
    out = []
    for r in range(tp_size):
        start = shape[split_dim] * r // tp_size
        n = shape[split_dim] * (r + 1) // tp_size - start
        part = t.narrow(split_dim, start, n).contiguous()
        out.append(encode(torch, part, what, global_shape=shape,
                          axes=[(AXIS_TP, r, tp_size, split_dim, 0, n)]))
    return out


def decode(torch, arr) -> "object | None":
    """The tensor an object (a uint8 array: header + payload) holds; it shares the
    array's memory. None (logged) when the object is not a tensor object."""
    h = parse_header(arr, arr.nbytes)
    if h is None:
        return None
    dtype = getattr(torch, DTYPES[h["dtype"]][0])
    if h["data_bytes"] == 0:
        return torch.empty(h["local_shape"], dtype=dtype)
    off = h["data_offset"]
    flat = torch.from_numpy(arr[off:off + h["data_bytes"]])
    return flat.view(dtype).reshape(h["local_shape"])


def view_at(ptr: int, n: int) -> np.ndarray:
    """``n`` bytes at ``ptr`` as a writable uint8 array (no copy)."""
    if n == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(ptr))


def tp_key(key: str, rank: int) -> str:
    """Mooncake's per-rank key of a tensor-parallel shard."""
    return f"{key}_tp_{rank}"


# --- Mooncake's module-level helpers ------------------------------------------------------
def serialize_tensor(tensor):
    """``mooncake.store._serialize_tensor``: ``(header bytes, data_ptr, nbytes, owner)``
    of a tensor (``owner`` the contiguous CPU tensor the pointer points into)."""
    torch = torch_module()
    h = _host(torch, tensor, "_serialize_tensor")
    if h is None:
        raise ValueError("unsupported tensor for Mooncake tensor serialization (the log "
                         "says why)")
    t, code = h
    n = t.numel() * t.element_size()
    return (pack_header(code, tuple(t.shape), tuple(t.shape), n), t.data_ptr(), n, t)


def tensor_metadata_size() -> int:
    """``mooncake.store._tensor_metadata_size``: 304."""
    return HEADER_SIZE


def deserialize_tensor(payload):
    """``mooncake.store._deserialize_tensor``: the tensor a header+payload bytes hold."""
    torch = torch_module()
    arr = np.frombuffer(bytearray(payload), np.uint8)
    t = decode(torch, arr)
    if t is None:
        raise ValueError("invalid serialized Mooncake tensor payload (the log says why)")
    return t


# --- the store's tensor calls -------------------------------------------------------------
class TensorCalls:
    """Mooncake Store's tensor calls, mixed into ``MooncakeDistributedStore``. They run in
    the calling process (a dummy client's too) over the store's byte calls (a dummy's
    puts stage the objects in its shared local buffer and have the real client store
    them from there: ``DummyClient._put_objects``); return values are Mooncake's: a put
    returns 0 or a negative code, a get the tensor or None."""

    # the byte calls each path needs -------------------------------------------------------
    def _tensor_write(self, keys, blobs, config, replace: bool) -> list:
        st: Any = self
        if getattr(st, "_real", ""):                 # a dummy client: its local buffer
            return st._put_objects(list(keys), list(blobs), config, replace)
        return st._guard(lambda: st._put_many(list(keys), list(blobs), config,
                                              replace=replace),
                         [INTERNAL_ERROR] * len(keys))

    def _tensor_put(self, keys, tensors, config, replace: bool, what: str) -> list:
        torch = torch_module()
        keys = list(keys)
        tensors = list(tensors)
        if len(keys) != len(tensors):
            log.error("%s: %d keys but %d tensors", what, len(keys), len(tensors))
            return [INVALID_PARAMS] * len(keys)
        out = [INVALID_PARAMS] * len(keys)
        good, blobs = [], []
        for i, (k, t) in enumerate(zip(keys, tensors)):
            b = encode(torch, t, f"{what} {k!r}")
            if b is not None:
                good.append(i)
                blobs.append(b)
        if good:
            for i, c in zip(good, self._tensor_write([keys[i] for i in good], blobs, config,
                                                     replace)):
                out[i] = c
        return out

    def _tensor_put_tp(self, keys, tensors, config, replace, tp_size, split_dim,
                       what: str) -> list:
        torch = torch_module()
        keys = list(keys)
        tensors = list(tensors)
        if len(keys) != len(tensors):
            log.error("%s: %d keys but %d tensors", what, len(keys), len(tensors))
            return [INVALID_PARAMS] * len(keys)
        out = [INVALID_PARAMS] * len(keys)
        wkeys, blobs, owner = [], [], []
        for i, (k, t) in enumerate(zip(keys, tensors)):
            shards = tp_shards(torch, t, int(tp_size), int(split_dim), f"{what} {k!r}")
            if shards is None or any(s is None for s in shards):
                continue
            for r, s in enumerate(shards):
                wkeys.append(tp_key(k, r))
                blobs.append(s)
                owner.append(i)
        codes = self._tensor_write(wkeys, blobs, config, replace) if wkeys else []
        seen: set = set()
        for i, c in zip(owner, codes):
            if i not in seen:
                out[i] = OK
                seen.add(i)
            if c != OK and out[i] == OK:
                out[i] = c
        return out

    def _tensor_get(self, keys) -> list:
        torch = torch_module()
        st: Any = self
        out: list = []
        for k, h in zip(keys, st.batch_get_buffer(list(keys))):
            if h is None:
                out.append(None)
                continue
            arr = np.asarray(h).view(np.uint8).reshape(-1)
            if not arr.flags.writeable:
                arr = arr.copy()
            t = decode(torch, arr)
            if t is None:
                log.error("get_tensor %r: the object is not a tensor (written by put, not "
                          "put_tensor?)", k)
            out.append(t)
        return out

    def _tensor_get_into(self, keys, buffer_ptrs, sizes, what: str) -> list:
        """Read each object into its buffer; the tensors (views of the buffers) or None.
        A buffer registered with ``register_buffer`` is filled by ``batch_get_into``; one
        that is not (a ``ctypes`` buffer, as Mooncake's TCP path accepts) is filled by a
        copy, after checking that this process has the range mapped writable."""
        torch = torch_module()
        st: Any = self
        keys = list(keys)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            log.error("%s: %d keys, %d buffer_ptrs and %d sizes (one each per key)", what,
                      len(keys), len(buffer_ptrs), len(sizes))
            return [INVALID_PARAMS] * len(keys)
        if any(not p for p in buffer_ptrs):
            log.error("%s: a buffer pointer is NULL", what)
            return [INVALID_PARAMS] * len(keys)
        from ._maps import mapped_rw as _mapped_rw
        got: list = [INVALID_PARAMS] * len(keys)
        reg, copy = [], []
        for i, (p, n) in enumerate(zip(buffer_ptrs, sizes)):
            if int(n) > 0 and self._tensor_buffer_ok(int(p), int(n)):
                reg.append(i)
            elif int(n) > 0 and _mapped_rw(int(p), int(n)):
                copy.append(i)
            else:
                log.error("%s %r: [%#x, +%d) is neither a registered buffer nor memory "
                          "this process has mapped writable", what, keys[i], int(p), int(n))
        if reg:
            for i, n in zip(reg, st.batch_get_into([keys[i] for i in reg],
                                                   [buffer_ptrs[i] for i in reg],
                                                   [sizes[i] for i in reg])):
                got[i] = n
        if copy:
            for i, h in zip(copy, st.batch_get_buffer([keys[i] for i in copy])):
                if h is None:
                    got[i] = -704
                    continue
                src = np.asarray(h).view(np.uint8).reshape(-1)
                if src.nbytes > int(sizes[i]):
                    continue                                   # INVALID_PARAMS
                view_at(int(buffer_ptrs[i]), src.nbytes)[:] = src
                got[i] = src.nbytes
        out: list = []
        for k, p, n in zip(keys, buffer_ptrs, got):
            if not isinstance(n, int) or n < 0:
                why = ("no such object" if n == -704 else
                       "the buffer is smaller than the object (get_size(key) says how many "
                       "bytes it needs) or unusable" if n == INVALID_PARAMS else
                       "the read failed")
                log.error("%s %r: %s (%s); nothing was written", what, k, why, n)
                out.append(None)
                continue
            out.append(decode(torch, view_at(int(p), n)))
        return out

    def _tensor_put_from(self, keys, buffer_ptrs, sizes, config, replace, what: str) -> list:
        st: Any = self
        keys = list(keys)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            log.error("%s: %d keys, %d buffer_ptrs and %d sizes (one each per key)", what,
                      len(keys), len(buffer_ptrs), len(sizes))
            return [INVALID_PARAMS] * len(keys)
        out = [INVALID_PARAMS] * len(keys)
        good = []
        for i, (k, p, n) in enumerate(zip(keys, buffer_ptrs, sizes)):
            if not p or int(n) < HEADER_SIZE or not self._tensor_buffer_ok(int(p), int(n)):
                log.error("%s %r: the buffer (%#x, %d bytes) must be registered "
                          "(register_buffer) and hold a tensor object ([304-byte header]"
                          "[data], as get_tensor_into leaves it)", what, k, int(p or 0),
                          int(n))
                continue
            if parse_header(view_at(int(p), int(n)), int(n)) is None:
                continue
            good.append(i)
        if good:
            fn = st.batch_upsert_from if replace else st.batch_put_from
            codes = fn([keys[i] for i in good], [buffer_ptrs[i] for i in good],
                       [sizes[i] for i in good], config)
            for i, c in zip(good, codes):
                out[i] = c
        return out

    def _tensor_buffer_ok(self, ptr: int, n: int) -> bool:
        """``[ptr, ptr + n)`` lies in a buffer registered with ``register_buffer``
        (read before a byte of it is touched)."""
        st: Any = self
        if getattr(st, "_real", ""):                 # a dummy client: its shared buffers
            return any(s.registered and s.addr <= ptr and ptr + n <= s.addr + s.size
                       for s in getattr(st, "_shm", {}).values())
        return bool(st._registered(ptr, n))

    def _tensor_from_buffer(self, ptr, size, what: str):
        torch = torch_module()
        if not ptr or int(size) < HEADER_SIZE or not self._tensor_buffer_ok(int(ptr),
                                                                            int(size)):
            log.error("%s: the buffer (%#x, %d bytes) must be registered and hold a tensor "
                      "object", what, int(ptr or 0), int(size))
            return None
        return decode(torch, view_at(int(ptr), int(size)))

    # puts ------------------------------------------------------------------------------
    def put_tensor(self, key: str, tensor) -> int:
        """Store ``tensor`` (any of Mooncake's 15 dtypes, up to 8 dimensions) under
        ``key`` in Mooncake's tensor layout. 0, or a negative code (-600: not a tensor,
        an unsupported dtype)."""
        return self._tensor_put([key], [tensor], None, False, "put_tensor")[0]

    def batch_put_tensor(self, keys, tensors_list) -> list:
        """:meth:`put_tensor` of several; a code per key."""
        return self._tensor_put(keys, tensors_list, None, False, "batch_put_tensor")

    def upsert_tensor(self, key: str, tensor) -> int:
        """:meth:`put_tensor`, replacing an object under ``key``."""
        return self._tensor_put([key], [tensor], None, True, "upsert_tensor")[0]

    def batch_upsert_tensor(self, keys, tensors_list) -> list:
        return self._tensor_put(keys, tensors_list, None, True, "batch_upsert_tensor")

    def pub_tensor(self, key: str, tensor, config=None) -> int:
        """:meth:`put_tensor` with a ``ReplicateConfig``."""
        return self._tensor_put([key], [tensor], config, False, "pub_tensor")[0]

    def batch_pub_tensor(self, keys, tensors_list, config=None) -> list:
        return self._tensor_put(keys, tensors_list, config, False, "batch_pub_tensor")

    def upsert_pub_tensor(self, key: str, tensor, config=None) -> int:
        return self._tensor_put([key], [tensor], config, True, "upsert_pub_tensor")[0]

    def batch_upsert_pub_tensor(self, keys, tensors_list, config=None) -> list:
        return self._tensor_put(keys, tensors_list, config, True, "batch_upsert_pub_tensor")

    def put_tensor_with_tp(self, key: str, tensor, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Split ``tensor`` along ``split_dim`` into ``tp_size`` equal shards and store
        shard ``r`` under ``f"{key}_tp_{r}"`` (every rank's; ``tp_rank`` is not used, as
        in Mooncake). ``tp_size <= 1``: :meth:`put_tensor`. 0 or the first error."""
        if tp_size <= 1:
            return self.put_tensor(key, tensor)
        return self._tensor_put_tp([key], [tensor], None, False, tp_size, split_dim,
                                   "put_tensor_with_tp")[0]

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list:
        if tp_size <= 1:
            return self.batch_put_tensor(base_keys, tensors_list)
        return self._tensor_put_tp(base_keys, tensors_list, None, False, tp_size,
                                   split_dim, "batch_put_tensor_with_tp")

    def pub_tensor_with_tp(self, key: str, tensor, config=None, tp_rank: int = 0,
                           tp_size: int = 1, split_dim: int = 0) -> int:
        if tp_size <= 1:
            return self.pub_tensor(key, tensor, config)
        return self._tensor_put_tp([key], [tensor], config, False, tp_size, split_dim,
                                   "pub_tensor_with_tp")[0]

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None,
                                 tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list:
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        return self._tensor_put_tp(base_keys, tensors_list, config, False, tp_size,
                                   split_dim, "batch_pub_tensor_with_tp")

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store the tensor object at ``buffer_ptr`` (a registered buffer holding
        [header][data], as :meth:`get_tensor_into` leaves it; ``size`` its bytes)."""
        return self._tensor_put_from([key], [buffer_ptr], [size], None, False,
                                     "put_tensor_from")[0]

    def batch_put_tensor_from(self, keys, buffer_ptrs, sizes) -> list:
        return self._tensor_put_from(keys, buffer_ptrs, sizes, None, False,
                                     "batch_put_tensor_from")

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._tensor_put_from([key], [buffer_ptr], [size], None, True,
                                     "upsert_tensor_from")[0]

    def batch_upsert_tensor_from(self, keys, buffer_ptrs, sizes) -> list:
        return self._tensor_put_from(keys, buffer_ptrs, sizes, None, True,
                                     "batch_upsert_tensor_from")

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int,
                                tp_rank: int = 0, tp_size: int = 1,
                                split_dim: int = 0) -> int:
        """The tensor object at ``buffer_ptr``, split as :meth:`put_tensor_with_tp`."""
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank,
                                                  tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys, buffer_ptrs, sizes,
                                      tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list:
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        if not (len(base_keys) == len(buffer_ptrs) == len(sizes)):
            log.error("batch_put_tensor_with_tp_from: %d keys, %d buffer_ptrs, %d sizes",
                      len(base_keys), len(buffer_ptrs), len(sizes))
            return [INVALID_PARAMS] * len(base_keys)
        tensors = [self._tensor_from_buffer(p, n, f"put_tensor_with_tp_from {k!r}")
                   for k, p, n in zip(base_keys, buffer_ptrs, sizes)]
        return self._tensor_put_tp(base_keys, tensors, None, False, tp_size, split_dim,
                                   "put_tensor_with_tp_from")

    # gets ------------------------------------------------------------------------------
    def get_tensor(self, key: str):
        """The tensor stored under ``key`` (a CPU tensor), or None when it is missing or
        not a tensor object."""
        return self._tensor_get([key])[0]

    def batch_get_tensor(self, keys) -> list:
        return self._tensor_get(keys)

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0):
        """Rank ``tp_rank``'s shard (``f"{key}_tp_{tp_rank}"``); ``tp_size <= 1``: the
        whole tensor under ``key``."""
        return self.get_tensor(key if tp_size <= 1 else tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys, tp_rank: int = 0, tp_size: int = 1) -> list:
        return self._tensor_get(list(base_keys) if tp_size <= 1 else
                                [tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int):
        """Read the tensor object into the registered buffer at ``buffer_ptr`` (``size``
        bytes: at least :meth:`get_size`); the tensor returned is a view of that buffer
        (its data at ``buffer_ptr + 304``). None when missing or the buffer is too small
        (nothing written then)."""
        return self._tensor_get_into([key], [buffer_ptr], [size], "get_tensor_into")[0]

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes) -> list:
        """:meth:`get_tensor_into` of several; lists of unequal length give -600 for
        every key (Mooncake's answer)."""
        return self._tensor_get_into(keys, buffer_ptrs, sizes, "batch_get_tensor_into")

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int,
                                tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0):
        return self.get_tensor_into(key if tp_size <= 1 else tp_key(key, tp_rank),
                                    buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes,
                                      tp_rank: int = 0, tp_size: int = 1) -> list:
        keys = list(base_keys) if tp_size <= 1 else [tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def get_tensor_into_cuda(self, key: str, tensor) -> int:
        """Copy the payload of the tensor under ``key`` into ``tensor`` (contiguous, same
        dtype and shape; CUDA or CPU: copied through the host). Bytes copied or a negative
        code."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys, tensors_list) -> list:
        torch = torch_module()
        keys, dst = list(keys), list(tensors_list)
        if len(keys) != len(dst):
            log.error("batch_get_tensor_into_cuda: %d keys but %d tensors", len(keys),
                      len(dst))
            return [INVALID_PARAMS] * len(keys)
        out = []
        for k, src, d in zip(keys, self._tensor_get(keys), dst):
            if src is None:
                out.append(-704)
            elif not isinstance(d, torch.Tensor) or not d.is_contiguous() or \
                    d.dtype != src.dtype or tuple(d.shape) != tuple(src.shape):
                log.error("get_tensor_into_cuda %r: the destination must be a contiguous "
                          "tensor of dtype %s and shape %s", k, src.dtype, tuple(src.shape))
                out.append(INVALID_PARAMS)
            else:
                d.copy_(src)
                out.append(src.numel() * src.element_size())
        return out

    # safetensors files ----------------------------------------------------------------------
    def save_tensor_to_safetensor(self, key: str, file_name=None) -> int:
        """Write the tensor under ``key`` to a safetensors file (``file_name``, else the
        key), as the file's entry ``key``. 0; -1100 (FILE_NOT_FOUND) when the key holds no
        tensor; -600 when the file cannot be written or ``safetensors`` is missing."""
        t = self.get_tensor(key)
        if t is None:
            log.error("save_tensor_to_safetensor: no tensor under %r", key)
            return FILE_NOT_FOUND
        try:
            from safetensors.torch import save_file
            save_file({str(key): t}, str(key if file_name is None else file_name))
        except ImportError:
            log.error("save_tensor_to_safetensor needs the safetensors package: pip "
                      "install safetensors")
            return INVALID_PARAMS
        except Exception as e:                       # noqa: BLE001  (Mooncake: -600)
            log.error("save_tensor_to_safetensor %r: %s: %s", key, type(e).__name__, e)
            return INVALID_PARAMS
        return OK

    def load_tensor_from_safetensor(self, key=None, file_name: str = ""):
        """Read a safetensors file and :meth:`put_tensor` one of its tensors under ``key``
        (else the file name): the entry named ``key`` when there is one, else the first
        (logged). The tensor, or None when the file cannot be read or the put fails."""
        torch_module()
        try:
            from safetensors.torch import load_file
            loaded = load_file(str(file_name))
        except ImportError:
            log.error("load_tensor_from_safetensor needs the safetensors package: pip "
                      "install safetensors")
            return None
        except Exception as e:                       # noqa: BLE001  (Mooncake: None)
            log.error("load_tensor_from_safetensor %r: %s: %s", file_name, type(e).__name__,
                      e)
            return None
        if not loaded:
            log.error("load_tensor_from_safetensor: no tensors in %r", file_name)
            return None
        target = str(file_name) if key is None else str(key)
        entry = target if key is not None and target in loaded else next(iter(loaded))
        if key is not None and entry != target:
            log.warning("load_tensor_from_safetensor: %r is not in %r; using its first "
                        "entry %r", target, file_name, entry)
        t = loaded[entry]
        rc = self.put_tensor(target, t)
        if rc != OK:
            log.error("load_tensor_from_safetensor: put_tensor %r failed (%d)", target, rc)
            return None
        return t

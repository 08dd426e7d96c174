# SPDX-License-Identifier: Apache-2.0
"""The dummy client's side of Mooncake's dummy/real client pair (issue 39).

``MooncakeDistributedStore.setup_dummy(mem_pool_size, local_buffer_size,
server_address)`` turns a store into a dummy client (:class:`.store.DummyStore`) of the
real client at ``server_address`` (:mod:`.dummy`, which also describes the pair): each
store call is sent to the real client, which runs it on its store and answers. Bytes
(``put``'s value, ``get``'s result) travel in the call. ``alloc_from_mem_pool(size)``
makes a shared-memory buffer (``memfd``), ``register_buffer`` of exactly such a buffer has
the real client map it (``/proc/<dummy pid>/fd/<fd>``: the two must run on one host as
one user, as Mooncake's shared memory needs) and register it with its engine; the
pointer calls (``put_from``, ``get_into``, ``batch_*``, ``get_into_ranges``, the
multi-buffer forms) then read and write the dummy's buffer in place.

This module is the dummy's behaviour (:class:`DummyClient`) and the wire encoding both
sides use, written on the store's types (:mod:`.store_types`), not on the store:
:mod:`.store` builds ``DummyStore`` from :class:`DummyClient` and
``MooncakeDistributedStore`` (so a set-up dummy is still a ``MooncakeDistributedStore``),
and the real client (:mod:`.dummy`) imports the store. No import cycle: store ->
dummy_client, dummy -> store and dummy_client.

Wire: :mod:`.store_service`'s one call per connection (JSON header, payload). Arguments
are JSON; ``bytes``-like values are carried in the payload (``{"$b": i}``),
``ReplicateConfig`` as its fields.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import uuid

import numpy as np

from .. import errors as E
from .store_service import call
from .store_types import (INTERNAL_ERROR, INVALID_PARAMS, NO_AVAILABLE_HANDLE, OK,
                          BufferHandle,
                          QueryTaskResponse, ReplicaDescriptor, ReplicateConfig, TaskStatus,
                          TaskType, _parse_size)

log = logging.getLogger("mooncake_te.compat.store")

#: store methods a dummy runs locally (the rest are sent to the real client)
LOCAL = frozenset({"setup", "setup_dummy", "close", "alloc_from_mem_pool",
                   "register_buffer", "unregister_buffer", "get_hostname", "health_check",
                   "get_offload_rpc_read_count"})


# --- argument and result encoding ------------------------------------------------------
_RC_FIELDS = ("replica_num", "nof_replica_num", "dfs_replica_num", "with_soft_pin",
              "with_hard_pin", "preferred_segment", "preferred_segments",
              "prefer_alloc_in_same_node", "group_ids", "soft_pin_action", "soft_pin_ttl_ms",
              "data_type", "preferred_nof_segments")


def _encode(obj, blobs: list):
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return int(obj) if isinstance(obj, int) and not isinstance(obj, bool) else obj
    if isinstance(obj, ReplicateConfig):
        return {"$rc": {k: _encode(getattr(obj, k), blobs) for k in _RC_FIELDS
                        if hasattr(obj, k)}}
    if isinstance(obj, ReplicaDescriptor):
        if obj._mem is not None:
            b = obj._mem.buffer_descriptor
            return {"$rd": [obj._kind, b.segment_name, b.buffer_address_, b.size_, ""]}
        d = obj._disk
        return {"$rd": [obj._kind, "", 0, d.object_size if d else 0, d.file_path if d else ""]}
    if isinstance(obj, np.ndarray):
        blobs.append(np.ascontiguousarray(obj).view(np.uint8).reshape(-1).tobytes())
        return {"$a": len(blobs) - 1}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        blobs.append(bytes(obj))
        return {"$b": len(blobs) - 1}
    if isinstance(obj, QueryTaskResponse):
        return {"$qt": {k: _encode(v, blobs) for k, v in vars(obj).items()}}
    if isinstance(obj, tuple):          # a task id, (value, code) answers: stay tuples
        return {"$t": [_encode(x, blobs) for x in obj]}
    if isinstance(obj, list):
        return [_encode(x, blobs) for x in obj]
    if isinstance(obj, dict):
        return {"$d": [[_encode(k, blobs), _encode(v, blobs)] for k, v in obj.items()]}
    try:
        mv = memoryview(obj)           # any other buffer-protocol value (a put's bytes)
    except TypeError:
        raise E.InvalidArgumentError(
            f"a dummy client cannot send a {type(obj).__name__} to the real client "
            f"(bytes-like values, numbers, strings, lists and ReplicateConfig only)") from None
    blobs.append(mv.tobytes())
    return {"$b": len(blobs) - 1}


def _decode(obj, blobs: list):
    if isinstance(obj, list):
        return [_decode(x, blobs) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "$b" in obj:
        return blobs[int(obj["$b"])]
    if "$a" in obj:
        return np.frombuffer(bytearray(blobs[int(obj["$a"])]), np.uint8).view(BufferHandle)
    if "$rc" in obj:
        rc = ReplicateConfig()
        for k, v in obj["$rc"].items():
            if k in _RC_FIELDS:
                setattr(rc, k, _decode(v, blobs))
        return rc
    if "$rd" in obj:
        kind, seg, addr, size, path = obj["$rd"]
        return ReplicaDescriptor(str(kind), str(seg), int(addr), int(size), str(path))
    if "$d" in obj:
        return {_decode(k, blobs): _decode(v, blobs) for k, v in obj["$d"]}
    if "$t" in obj:
        return tuple(_decode(x, blobs) for x in obj["$t"])
    if "$qt" in obj:
        resp = QueryTaskResponse()
        for k, v in obj["$qt"].items():
            if hasattr(resp, k):
                setattr(resp, k, _decode(v, blobs))
        resp.type, resp.status = TaskType(resp.type), TaskStatus(resp.status)
        return resp
    raise E.InvalidArgumentError(f"an unknown encoded value {sorted(obj)[:3]}")


def _pack(blobs: list) -> "tuple[list, bytes]":
    return [len(b) for b in blobs], b"".join(blobs)


def _unpack(sizes, payload: bytes) -> list:
    out, off, mv = [], 0, memoryview(payload)
    for n in sizes:
        n = int(n)
        out.append(bytes(mv[off:off + n]))
        off += n
    if off != len(payload):
        raise E.InvalidArgumentError("blob sizes do not add up to the payload")
    return out


# --- the dummy client -----------------------------------------------------------------
class _Shm:
    """A buffer of ``alloc_from_mem_pool``: anonymous shared memory (memfd)."""

    def __init__(self, size: int):
        self.fd = os.memfd_create("mooncake-te-dummy", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self._c = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._c)
        self.size = size
        self.registered = False

    def close(self) -> None:
        del self._c
        try:
            self.mm.close()
        except BufferError:            # a view of it is still alive: the GC frees it
            pass
        os.close(self.fd)


#: address -> _Shm of MooncakeHostMemAllocator: the process's shared buffers (Mooncake's
#: ShmHelper singleton), which any dummy client of this process registers
HOST_SHM: dict = {}


class MooncakeHostMemAllocator:
    """Mooncake's ``mooncake.store.MooncakeHostMemAllocator``: shared host memory
    (``memfd``) for dummy clients. ``alloc(size)`` returns the address of a new buffer
    (RuntimeError when it cannot be made, as Mooncake's); a dummy client of this
    process registers it whole with ``register_buffer(ptr, size)`` and its pointer calls
    then read and write it in place. ``free(ptr)``: 0, or -1 for an address ``alloc``
    did not return or a buffer still registered (unregister it first)."""

    def alloc(self, size: int) -> int:
        try:
            n = int(size)
            if n <= 0:
                raise ValueError(f"size {size!r} must be positive")
            shm = _Shm(n)
        except (OSError, ValueError, TypeError) as e:
            raise RuntimeError(f"Failed to create anonymous shared memory: {e}") from e
        HOST_SHM[shm.addr] = shm
        return shm.addr

    def free(self, ptr: int) -> int:
        shm = HOST_SHM.get(ptr) if isinstance(ptr, int) else None
        if shm is None or shm.registered:
            log.error("free(%r): %s", ptr, "still registered; unregister_buffer it first"
                      if shm is not None else "not an address this allocator returned")
            return INTERNAL_ERROR
        del HOST_SHM[ptr]
        shm.close()
        return OK


def _failure(name: str, args: tuple, kwargs: dict):
    """What a call returns when the real client cannot be reached or fails."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    n = len(first) if isinstance(first, (list, tuple)) else 1
    if name == "get":
        return b""
    if name == "get_batch":
        return [b""] * n
    if name == "get_buffer":
        return None
    if name == "batch_get_buffer":
        return [None] * n
    if name == "get_into_ranges":
        dst = args[2] if len(args) > 2 else kwargs.get("all_dst_offsets", [])
        return [[[INTERNAL_ERROR] * len(d) for d in dsts] for dsts in dst]
    if name in ("batch_get_replica_desc",):
        return {}
    if name in ("get_replica_desc",):
        return []
    if name.startswith("batch_") or name.endswith("_batch"):
        if name in ("put_batch", "upsert_batch", "batch_get_session_end"):
            return INTERNAL_ERROR
        return [INTERNAL_ERROR] * n
    if name in ("create_copy_task", "create_move_task"):
        return (0, 0), INTERNAL_ERROR
    if name == "query_task":
        return None, INTERNAL_ERROR
    if name in ("mount_segment", "allocate_and_mount_segment"):
        return {"ret": INTERNAL_ERROR, "segment_ids": []}
    return INTERNAL_ERROR


def _make_forward(name: str):
    def forward(self, *args, **kwargs):
        return self._send(name, args, kwargs)
    forward.__name__ = name
    forward.__qualname__ = f"DummyStore.{name}"
    forward.__doc__ = f"``{name}`` run by the real client (setup_dummy)."
    return forward


def become_dummy(store, dummy_class: type, mem_pool_size, local_buffer_size,
                 server_address: str) -> int:
    """``store.setup_dummy(...)``: make ``store`` (a ``MooncakeDistributedStore`` not set
    up) a ``dummy_class`` (:class:`.store.DummyStore`) talking to the real client at
    ``server_address``; 0, or -1 (logged) when it is set up already or the real client
    does not answer."""
    try:
        if store._cache is not None or getattr(store, "_real", None):
            raise E.InvalidArgumentError("this store is set up already; use a new "
                                         "MooncakeDistributedStore for setup_dummy")
        addr = str(server_address or "")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise E.InvalidArgumentError(f"server_address {server_address!r} is not "
                                         f"host:port of a real client (mooncake_client)")
        mem_pool_size, local_buffer_size = (_parse_size(mem_pool_size),
                                            _parse_size(local_buffer_size))
        cid = uuid.uuid4().hex
        rh, _ = call(addr, {"op": "hello", "client": cid, "pid": os.getpid()}, timeout=10.0)
    except (E.MooncakeError, ValueError, TypeError) as e:
        log.error("setup_dummy(%r): %s (is a real client — `mooncake-te compat client` or "
                  "Mooncake's mooncake_client — listening there?)", server_address, e)
        return INTERNAL_ERROR
    store.__class__ = dummy_class
    store._real = addr
    store._cid = cid
    store._shm = {}
    store._registered_host = set()
    store._mem_pool_size = mem_pool_size
    store._local_buffer = local_buffer_size
    store._stage = None
    store._stage_lock = threading.Lock()
    store._real_segment = str(rh.get("segment", ""))
    log.info("dummy client of %s (segment %s)", addr, store._real_segment)
    return OK


class DummyClient:
    """What a store is after ``setup_dummy``: its calls run in the real client's process
    (module docstring). Mixed in ahead of ``MooncakeDistributedStore`` by
    :class:`.store.DummyStore`, whose other public methods :func:`add_forwarders` makes
    calls to the real client."""

    _real: str = ""
    _cid: str = ""
    _shm: dict = {}
    _registered_host: set = set()
    _real_segment: str = ""
    #: the shared local buffer the tensor calls stage objects in (:meth:`_put_objects`)
    _stage = None
    _stage_lock = threading.Lock()
    #: the store calls sent to the real client (set by :func:`add_forwarders`); the real
    #: client runs these and no others
    forwarded: frozenset = frozenset()

    def _send(self, name: str, args: tuple, kwargs: dict):
        if not self._real:
            log.error("%s: the dummy client is closed", name)
            return _failure(name, args, kwargs)
        try:
            blobs: list = []
            head = {"op": "call", "client": self._cid, "method": name,
                    "args": _encode(list(args), blobs),
                    "kwargs": _encode(kwargs, blobs)}
            sizes, payload = _pack(blobs)
            head["blobs"] = sizes
            rh, rp = call(self._real, head, payload, timeout=600.0)
            return _decode(rh.get("result"), _unpack(rh.get("blobs", []), rp))
        except E.MooncakeError as e:
            log.error("%s through the real client %s: %s", name, self._real, e)
            return _failure(name, args, kwargs)

    def _put_objects(self, keys: list, blobs: list, config, replace: bool) -> list:
        """Store tensor objects (uint8 arrays) as Mooncake's dummy client does when it
        does not use CUDA IPC: each object is staged in the dummy's local buffer (shared
        memory of setup_dummy's ``local_buffer_size``, made and registered with the
        real client on first use, which maps it) and the real client stores it from
        there (``batch_put_from`` / ``batch_upsert_from``, unbounded by its own
        ``local_buffer_size``, which its ``put`` applies: a 16 MiB tensor would not
        fit a real client's default 16 MB). Objects go in groups that fit the buffer
        together; one larger than the buffer is -200 (``NO_AVAILABLE_HANDLE``, as
        Mooncake's failed ``allocate_client_buffer``). A code per key."""
        out = [NO_AVAILABLE_HANDLE] * len(keys)
        with self._stage_lock:
            stage = self._stage_buffer()
            if stage is None:
                return out
            fits = []
            for i, (k, b) in enumerate(zip(keys, blobs)):
                if b.nbytes > stage.size:
                    log.error("%r: the object's %d bytes do not fit the dummy client's "
                              "local buffer (local_buffer_size %d of setup_dummy)", k,
                              b.nbytes, stage.size)
                else:
                    fits.append(i)
            # the forwarders add_forwarders made: the real client runs them
            fn = getattr(self, "batch_upsert_from" if replace else "batch_put_from")
            while fits:
                group, ptrs, off = [], [], 0
                while fits and off + blobs[fits[0]].nbytes <= stage.size:
                    i = fits.pop(0)
                    ctypes.memmove(stage.addr + off, blobs[i].ctypes.data, blobs[i].nbytes)
                    group.append(i)
                    ptrs.append(stage.addr + off)
                    off += blobs[i].nbytes
                codes = fn([keys[i] for i in group], ptrs, [blobs[i].nbytes for i in group],
                           config)
                for i, c in zip(group, codes):
                    out[i] = c
        return out

    def _stage_buffer(self):
        """The local buffer, made and registered on first use; None (logged) if it
        cannot be (``local_buffer_size`` 0, or the real client does not map it)."""
        if self._stage is not None and self._stage.registered:
            return self._stage
        n = int(getattr(self, "_local_buffer", 0) or 0)
        if n <= 0:
            log.error("tensor put: the dummy client has no local buffer (local_buffer_size "
                      "0 in setup_dummy); it stages tensor objects there")
            return None
        ptr = self.alloc_from_mem_pool(n)
        if not ptr:
            return None
        if self.register_buffer(ptr, n) != OK:
            log.error("tensor put: the real client did not map the dummy client's local "
                      "buffer")
            shm = self._shm.pop(ptr)
            shm.close()
            return None
        self._stage = self._shm[ptr]
        return self._stage

    def setup(self, *a, **kw) -> int:
        log.error("setup: this store is a dummy client already (setup_dummy); use a "
                  "new MooncakeDistributedStore")
        return INTERNAL_ERROR

    def setup_dummy(self, *a, **kw) -> int:
        return self.setup()

    def get_hostname(self) -> str:
        """Empty: a dummy client has no segment (as in Mooncake)."""
        return ""

    def health_check(self) -> int:
        """Mooncake's dummy codes: 0 while the real client answers, 2 when it does not,
        1 once closed."""
        if not self._real:
            return 1
        try:
            call(self._real, {"op": "ping", "client": self._cid}, timeout=10.0)
            return OK
        except E.MooncakeError as e:
            log.error("health_check: %s", e)
            return 2

    def get_offload_rpc_read_count(self) -> int:
        """0: a dummy client reads nothing itself (as Mooncake's, which counts only in
        a real client)."""
        return 0

    def alloc_from_mem_pool(self, size) -> int:
        """A shared-memory buffer of ``size`` bytes the real client can map when it
        is registered (``register_buffer(ptr, size)`` with exactly this pointer and
        size); its address, or 0."""
        try:
            n = int(size)
            if n <= 0:
                raise E.InvalidArgumentError(f"size {size!r} must be positive")
            shm = _Shm(n)
        except (E.MooncakeError, OSError, ValueError, TypeError) as e:
            log.error("alloc_from_mem_pool(%r): %s", size, e)
            return 0
        self._shm[shm.addr] = shm
        return shm.addr

    def _shm_at(self, ptr):
        """This dummy's buffer at ``ptr``, or the process's (MooncakeHostMemAllocator)."""
        if not isinstance(ptr, int):
            return None
        return self._shm.get(ptr) or HOST_SHM.get(ptr)

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        shm = self._shm_at(buffer_ptr)
        if shm is None or int(size) != shm.size:
            log.error("register_buffer(%r, %r): a dummy client registers buffers of "
                      "alloc_from_mem_pool or MooncakeHostMemAllocator, whole (their "
                      "pointer and size): the real client maps them", buffer_ptr, size)
            return INVALID_PARAMS
        try:
            rh, _ = call(self._real, {"op": "map", "client": self._cid,
                                      "pid": os.getpid(), "fd": shm.fd,
                                      "size": shm.size, "addr": shm.addr})
        except E.MooncakeError as e:
            log.error("register_buffer: %s", e)
            return INTERNAL_ERROR
        rc = int(rh.get("rc", INTERNAL_ERROR))
        shm.registered = rc == 0
        if shm.registered:
            self._registered_host.add(shm)
        return rc

    def unregister_buffer(self, buffer_ptr: int) -> int:
        shm = self._shm_at(buffer_ptr)
        if shm is None or not shm.registered:
            log.error("unregister_buffer(%r): not a registered buffer of "
                      "alloc_from_mem_pool", buffer_ptr)
            return INVALID_PARAMS
        try:
            rh, _ = call(self._real, {"op": "unmap", "client": self._cid,
                                      "addr": shm.addr})
        except E.MooncakeError as e:
            log.error("unregister_buffer: %s", e)
            return INTERNAL_ERROR
        shm.registered = False
        return int(rh.get("rc", INTERNAL_ERROR))

    def close(self) -> int:
        real, self._real = self._real, ""
        if real:
            try:
                call(real, {"op": "bye", "client": self._cid}, timeout=10.0)
            except E.MooncakeError as e:
                log.info("close: %s", e)
        shm, self._shm = self._shm, {}
        self._stage = None
        for s in shm.values():
            s.close()
        for s in self._registered_host:           # the real client dropped its maps
            s.registered = False
        self._registered_host = set()
        return OK

    def __del__(self):
        if self._real and not sys.is_finalizing():
            try:
                threading.Thread(target=self.close, daemon=True).start()
            except RuntimeError:
                pass


def add_forwarders(dummy_class: type, store_class: type) -> None:
    """Give ``dummy_class`` a method sending each public call of ``store_class`` (but
    :data:`LOCAL`) to the real client, and list them in its ``forwarded``."""
    names = frozenset(n for n, v in vars(store_class).items()
                      if not n.startswith("_") and callable(v) and n not in LOCAL)
    for name in names:
        setattr(dummy_class, name, _make_forward(name))
    setattr(dummy_class, "forwarded", names)

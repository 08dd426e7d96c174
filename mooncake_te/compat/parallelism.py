# SPDX-License-Identifier: Apache-2.0
"""Mooncake Store's ``*_with_parallelism`` tensor calls and their request objects
(``ParallelAxis``, ``TensorParallelism``, ``ReadTarget``) (issue 39).

Mooncake (``mooncake-integration/store/store_py_parallel_write.h``,
``store_py_parallel_read.h``, ``store_py_internal.h``, 3b5a594) describes where a tensor
sits in a parallel job by a ``TensorParallelism``: up to four ``ParallelAxis`` of
distinct kinds (``"tp"``, ``"dp"``, ``"ep"``, ``"pp"``, any case), each a ``rank`` of a
``size``; a TP axis needs ``split_dim``, an EP axis ``expert_id``, a PP axis
``stage_id``, and DP/EP/PP take no ``split_dim``. The objects it writes, and so ours
(same keys, same bytes: a Mooncake reader reads them and the other way round):

================================ ===========================================================
request                          what is stored
================================ ===========================================================
none                             the plain ``put_tensor`` object under ``key``
one TP axis                      the tensor passed is **rank's shard**: stored under
                                 ``f"{key}_tp_{rank}"`` (the ``*_with_tp`` key), SHARD
                                 header with that axis, ``global_shape`` the shard's with
                                 ``split_dim`` times ``size``; plus the manifest
                                 ``f"{key}__parallelism_manifest"``
TP and other axes                the tensor passed is **the whole tensor**: rank's part
                                 along ``split_dim`` (must divide evenly) stored under
                                 the axes' key (below), SHARD header with every axis in
                                 the order given; plus the parallelism manifest
axes without TP                  the tensor as it is, SHARD header with the axes, under
                                 the axes' key
``writer_partition``             (any object with ``rank``, ``size``, ``split_dim``): the
                                 whole tensor passed, rank's part stored under
                                 ``f"{key}__writer_{rank}of{size}_sd{split_dim}"`` with a
                                 one-TP-axis SHARD header, plus the manifest
                                 ``f"{key}__writer_manifest"``
================================ ===========================================================

The axes' key is ``key`` then, per axis in the order DP, TP, EP, PP,
``__{kind}_{rank}of{size}`` with ``_sd{split_dim}``, ``_eid{expert_id}``,
``_sid{stage_id}`` when set (``w__dp_1of2__tp_0of4_sd1``). A manifest is 96 bytes
(``WriterShardManifest``): magic u32 0x574d414e, version u16 1, header_size u16 96,
dtype, ndim, split_dim, shard_count, reserved (i32 each), 4 bytes of padding, then the
whole tensor's shape (8 x i64, unused -1).

The ``_from`` forms read a tensor object ([header][data], as ``get_tensor_into`` leaves
it) from a registered buffer; with a TP axis that object is the whole tensor and **every**
rank's shard is stored (no manifest), as Mooncake does.

A read names a ``ReadTarget``: ``mode`` ``"as_stored"`` (no parallelism: the object
under ``key``), ``"shard"`` (the object stored for exactly that parallelism, else, with
a TP axis, that rank's part of the tensor reassembled from the stored shards: a read for
another TP size re-shards), ``"full"`` (the whole tensor reassembled from the shards a
TP-axis parallelism names, found through the parallelism manifest or the shards'
headers; with no parallelism, from the writer-partition shards, else the object under
``key``). A reassembled tensor's header is FULL, a re-shard's SHARD with the request's
axes. Bad requests are -600 (``INVALID_PARAMS``) for a put and None for a read, with a
log line saying what was wrong, as Mooncake answers.

The reads and writes run in the calling process over the store's byte calls, so a dummy
client (``setup_dummy``) does them too; Mooncake refuses the reassembling reads on a
dummy client.
"""
from __future__ import annotations

import logging
import operator
import struct
from typing import Any, NamedTuple

import numpy as np

from .store_types import INVALID_PARAMS, OK
from .tensor import (AXIS_DP, AXIS_EP, AXIS_PP, AXIS_TP, DTYPES, HEADER_SIZE, LAYOUT_SHARD,
                     MAX_AXES, _host, decode, encode, pack_header, parse_header, torch_module,
                     view_at)

log = logging.getLogger("mooncake_te.compat.store")

_KIND_OF = {"DP": AXIS_DP, "TP": AXIS_TP, "EP": AXIS_EP, "PP": AXIS_PP}
_NAME_OF = {AXIS_DP: "dp", AXIS_TP: "tp", AXIS_EP: "ep", AXIS_PP: "pp"}
_MODES = ("as_stored", "shard", "full")

MANIFEST_MAGIC = 0x574D414E
MANIFEST = struct.Struct("<IHHiiiii4x8q")        # WriterShardManifest, 96 bytes
assert MANIFEST.size == 96


# --- the request objects (Mooncake's pybind classes) ------------------------------------
def _int(value, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None


def _opt_int(value, what: str):
    return None if value is None else _int(value, what)


class _IntField:
    """An int attribute (optionally None) checked on assignment, as pybind's casts."""

    def __init__(self, optional: bool):
        self.optional = optional
        self.slot = self.what = ""

    def __set_name__(self, owner, name: str) -> None:
        self.slot, self.what = "_" + name, f"{owner.__name__}.{name}"

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj, value) -> None:
        setattr(obj, self.slot, _opt_int(value, self.what) if self.optional
                else _int(value, self.what))


class ParallelAxis:
    """One axis of a :class:`TensorParallelism` (Mooncake's ``ParallelAxis``):
    ``kind`` (``"tp"``, ``"dp"``, ``"ep"``, ``"pp"``; checked when used), ``rank`` of
    ``size``, and the optional ``split_dim`` (TP), ``expert_id`` (EP), ``stage_id`` (PP).
    Mooncake's has no constructor arguments; ours also takes the fields as keywords."""

    __slots__ = ("_kind", "_rank", "_size", "_split_dim", "_expert_id", "_stage_id")
    rank = _IntField(False)
    size = _IntField(False)
    split_dim = _IntField(True)
    expert_id = _IntField(True)
    stage_id = _IntField(True)

    def __init__(self, *, kind: str = "", rank: int = 0, size: int = 1,
                 split_dim=None, expert_id=None, stage_id=None):
        self.kind, self.rank, self.size = kind, rank, size
        self.split_dim, self.expert_id, self.stage_id = split_dim, expert_id, stage_id

    @property
    def kind(self) -> str:
        return self._kind

    @kind.setter
    def kind(self, value) -> None:
        if not isinstance(value, str):
            raise TypeError(f"ParallelAxis.kind must be a str ('tp', 'dp', 'ep', 'pp'), "
                            f"not {type(value).__name__}")
        self._kind = value

    def _fields(self) -> tuple:
        return (self.kind, self.rank, self.size, self.split_dim, self.expert_id,
                self.stage_id)

    def _copy(self) -> "ParallelAxis":
        return ParallelAxis(kind=self.kind, rank=self.rank, size=self.size,
                            split_dim=self.split_dim, expert_id=self.expert_id,
                            stage_id=self.stage_id)

    def __eq__(self, other) -> bool:
        return isinstance(other, ParallelAxis) and self._fields() == other._fields()

    # mutable, so unhashable (as an object with __eq__ and no __hash__)
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        extra = "".join(f", {n}={v}" for n, v in (("split_dim", self.split_dim),
                                                   ("expert_id", self.expert_id),
                                                   ("stage_id", self.stage_id))
                        if v is not None)
        return f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}{extra})"


class TensorParallelism:
    """Where a tensor sits in a parallel job (Mooncake's ``TensorParallelism``):
    ``axes``, a list of :class:`ParallelAxis`. As in Mooncake, assigning ``axes`` copies
    the axes, and ``axes`` reads back a new list of the stored axes (so
    ``p.axes[0].rank = 1`` changes ``p``, ``p.axes.append(...)`` does not)."""

    __slots__ = ("_axes",)

    def __init__(self, axes=()):
        self.axes = list(axes)

    @property
    def axes(self) -> list:
        return list(self._axes)

    @axes.setter
    def axes(self, value) -> None:
        axes = list(value)
        for a in axes:
            if not isinstance(a, ParallelAxis):
                raise TypeError(f"TensorParallelism.axes takes ParallelAxis objects, not "
                                f"{type(a).__name__}")
        self._axes = [a._copy() for a in axes]

    def _copy(self) -> "TensorParallelism":
        return TensorParallelism(self._axes)

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorParallelism) and self._axes == other._axes

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorParallelism(axes={self._axes!r})"


class ReadTarget:
    """What a ``get_tensor_with_parallelism`` read returns (Mooncake's ``ReadTarget``):
    ``mode`` ``"as_stored"`` (default), ``"shard"`` or ``"full"`` (set in any case, read
    back lower case; another string raises RuntimeError, as Mooncake's), and
    ``parallelism``, a :class:`TensorParallelism` or None."""

    __slots__ = ("_mode", "_parallelism")

    def __init__(self, mode: str = "as_stored", parallelism=None):
        self.mode = mode
        self.parallelism = parallelism

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value) -> None:
        m = _mode(value)
        if m is None:
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = m

    @property
    def parallelism(self):
        return self._parallelism

    @parallelism.setter
    def parallelism(self, value) -> None:
        if value is not None and not isinstance(value, TensorParallelism):
            raise TypeError(f"ReadTarget.parallelism takes a TensorParallelism or None, "
                            f"not {type(value).__name__}")
        self._parallelism = None if value is None else value._copy()

    def __eq__(self, other) -> bool:
        return isinstance(other, ReadTarget) and (self._mode, self._parallelism) == \
            (other._mode, other._parallelism)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ReadTarget(mode={self._mode!r}, parallelism={self._parallelism!r})"


def _mode(value) -> "str | None":
    if not isinstance(value, str):
        raise TypeError(f"ReadTarget.mode must be a str, not {type(value).__name__}")
    m = value.lower()
    if m not in _MODES:
        log.error("Unsupported ReadTarget mode: %s (one of %s)", value, ", ".join(_MODES))
        return None
    return m


# --- requests as plain values ---------------------------------------------------------
class Axis(NamedTuple):
    """A parsed axis: ``kind`` is Mooncake's ``LayoutAxisKind`` number."""
    kind: int
    rank: int
    size: int
    split_dim: "int | None" = None
    expert_id: "int | None" = None
    stage_id: "int | None" = None


class Writer(NamedTuple):
    rank: int
    size: int
    split_dim: int


def parse_axes(obj, what: str) -> "list | None":
    """The axes of a ``TensorParallelism`` (any object with ``axes``, each with
    ``kind``, ``rank``, ``size`` and the optional fields: Mooncake reads them by name),
    checked as Mooncake's ``validate_parallelism_spec``; None (logged) when invalid."""
    if not hasattr(obj, "axes"):
        log.error("%s: TensorParallelism must provide axes (got a %s)", what,
                  type(obj).__name__)
        return None
    axes: list = []
    try:
        for a in obj.axes:
            if not all(hasattr(a, f) for f in ("kind", "rank", "size")):
                log.error("%s: ParallelAxis must provide kind, rank, and size", what)
                return None
            kind = _KIND_OF.get(str(a.kind).upper())
            if kind is None:
                log.error("%s: unsupported parallel axis kind %r (tp, dp, ep or pp)", what,
                          a.kind)
                return None
            axes.append(Axis(kind, _int(a.rank, "rank"), _int(a.size, "size"),
                             *(_opt_int(getattr(a, f, None), f)
                               for f in ("split_dim", "expert_id", "stage_id"))))
    except TypeError as e:
        log.error("%s: %s", what, e)
        return None
    why = None
    if not axes:
        why = "parallelism axes cannot be empty"
    elif len(axes) > MAX_AXES:
        why = f"{len(axes)} axes, at most {MAX_AXES}"
    elif len({a.kind for a in axes}) != len(axes):
        why = "duplicate axis kinds are not supported"
    for a in axes:
        if why:
            break
        name = _NAME_OF[a.kind]
        if a.size <= 0 or not 0 <= a.rank < a.size:
            why = f"invalid rank/size for axis {name}: rank {a.rank} of size {a.size}"
        elif a.kind == AXIS_TP and a.split_dim is None:
            why = "TP axis requires split_dim"
        elif a.kind != AXIS_TP and a.split_dim is not None:
            why = f"{name.upper()} axis must not provide split_dim"
        elif a.kind == AXIS_EP and a.expert_id is None:
            why = "EP axis requires expert_id"
        elif a.kind == AXIS_PP and a.stage_id is None:
            why = "PP axis requires stage_id"
    if why:
        log.error("%s: %s", what, why)
        return None
    return axes


def parse_writer(obj, what: str) -> "Writer | None":
    """A ``writer_partition`` (any object with ``rank``, ``size``, ``split_dim``), or
    None (logged) when it lacks one or ``rank``/``size``/``split_dim`` are out of range."""
    if not all(hasattr(obj, f) for f in ("rank", "size", "split_dim")):
        log.error("%s: writer_partition must provide rank, size, and split_dim", what)
        return None
    try:
        w = Writer(_int(obj.rank, "rank"), _int(obj.size, "size"),
                   _int(obj.split_dim, "split_dim"))
    except TypeError as e:
        log.error("%s: %s", what, e)
        return None
    if w.size <= 0 or not 0 <= w.rank < w.size or w.split_dim < 0:
        log.error("%s: invalid writer partition rank %d of size %d, split_dim %d", what,
                  w.rank, w.size, w.split_dim)
        return None
    return w


def parse_target(obj, what: str) -> "tuple[str, list | None] | None":
    """``(mode, axes or None)`` of a ``ReadTarget`` (None: as_stored, no parallelism);
    None (logged) when invalid. The axes are not yet checked (:func:`parse_axes` with
    the checks is applied where the mode needs them)."""
    if obj is None:
        return "as_stored", None
    if not (hasattr(obj, "mode") and hasattr(obj, "parallelism")):
        log.error("%s: ReadTarget must provide mode and parallelism", what)
        return None
    try:
        mode = _mode(obj.mode)
    except TypeError as e:
        log.error("%s: %s", what, e)
        return None
    if mode is None:
        return None
    return mode, obj.parallelism


def canonical(axes) -> list:
    """The axes in Mooncake's canonical order: DP, TP, EP, PP."""
    return sorted(axes, key=lambda a: a.kind)


def tp_axis(axes) -> "Axis | None":
    return next((a for a in axes if a.kind == AXIS_TP), None)


def with_tp(axes, rank: int, size: "int | None" = None) -> list:
    """``axes`` with the TP axis's rank (and size) replaced."""
    return [a._replace(rank=rank, size=a.size if size is None else size)
            if a.kind == AXIS_TP else a for a in axes]


def axes_key(key: str, axes) -> str:
    """Mooncake's ``get_parallelism_key_name``: ``f"{key}_tp_{rank}"`` for one TP axis,
    else ``key`` plus an ``__{kind}_{rank}of{size}[_sd..][_eid..][_sid..]`` part per
    axis in canonical order."""
    if len(axes) == 1 and axes[0].kind == AXIS_TP:
        return f"{key}_tp_{axes[0].rank}"
    out = key
    for a in canonical(axes):
        out += f"__{_NAME_OF[a.kind]}_{a.rank}of{a.size}"
        for tag, v in (("sd", a.split_dim), ("eid", a.expert_id), ("sid", a.stage_id)):
            if v is not None:
                out += f"_{tag}{v}"
    return out


def writer_key(key: str, w: Writer) -> str:
    return f"{key}__writer_{w.rank}of{w.size}_sd{w.split_dim}"


def writer_manifest_key(key: str) -> str:
    return key + "__writer_manifest"


def parallelism_manifest_key(key: str) -> str:
    return key + "__parallelism_manifest"


def layout_axes(axes, local_shape) -> list:
    """``pack_header``'s axis tuples for ``axes`` (in the order given, as Mooncake's
    ``build_shard_metadata_from_shapes``): ``reserved0`` the EP axis's ``expert_id`` or
    the PP axis's ``stage_id``, ``reserved1`` the local extent along ``split_dim``."""
    out = []
    for a in axes:
        r0 = (a.expert_id if a.kind == AXIS_EP else a.stage_id if a.kind == AXIS_PP
              else None) or 0
        sd = -1 if a.split_dim is None else a.split_dim
        out.append((a.kind, a.rank, a.size, sd, r0,
                    0 if a.split_dim is None else local_shape[a.split_dim]))
    return out


def axes_of_header(h: dict) -> "list | None":
    """The parallelism a SHARD header records (canonical order), None for FULL."""
    if h["layout_kind"] != LAYOUT_SHARD:
        return None
    out = []
    for kind, _, rank, count, sd, r0, _ in h["axes"]:
        if kind not in _NAME_OF:
            return None
        out.append(Axis(kind, rank, count, None if sd < 0 else sd,
                        r0 if kind == AXIS_EP else None, r0 if kind == AXIS_PP else None))
    return canonical(out)


def matches(axes, h: dict) -> bool:
    """The header records exactly this parallelism (any axis order)."""
    return axes_of_header(h) == canonical(axes)


def tp_compatible(axes, h: dict, size: int) -> bool:
    """A header whose parallelism is ``axes`` but for the TP rank, with TP size
    ``size`` (Mooncake's ``resolve_tp_compatible_parallelism_from_metadata`` plus
    ``parallelism_specs_equal_by_kind`` allowing a TP rank mismatch)."""
    stored = axes_of_header(h)
    if stored is None or len(stored) != len(axes):
        return False
    for want, got in zip(canonical(axes), stored):
        if want.kind == AXIS_TP:
            if got.kind != AXIS_TP or got.size != size or \
                    (want.split_dim, want.expert_id, want.stage_id) != \
                    (got.split_dim, got.expert_id, got.stage_id):
                return False
        elif want != got:
            return False
    return True


def pack_manifest(dtype: int, global_shape, split_dim: int, shard_count: int) -> bytes:
    shape = list(global_shape) + [-1] * (8 - len(global_shape))
    return MANIFEST.pack(MANIFEST_MAGIC, 1, MANIFEST.size, dtype, len(global_shape),
                         split_dim, shard_count, 0, *shape)


def parse_manifest(buf) -> "dict | None":
    """A manifest's fields, None when ``buf`` is not a valid one (Mooncake's
    ``parse_writer_shard_manifest`` checks)."""
    if buf is None:
        return None
    b = bytes(buf[:MANIFEST.size]) if isinstance(buf, (bytes, bytearray)) else \
        np.asarray(buf).view(np.uint8).reshape(-1)[:MANIFEST.size].tobytes()
    if len(b) < MANIFEST.size:
        return None
    f = MANIFEST.unpack_from(b, 0)
    magic, version, hsize, dtype, ndim, split_dim, count = f[:7]
    if magic != MANIFEST_MAGIC or version != 1 or hsize != MANIFEST.size or \
            not 0 <= ndim <= 8 or count <= 0 or not 0 <= split_dim < ndim:
        return None
    shape = tuple(f[8:8 + ndim])
    if any(d < 0 for d in shape):
        return None
    return {"dtype": dtype, "global_shape": shape, "split_dim": split_dim,
            "shard_count": count}


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def assemble(sources, global_shape, split_dim: int, start: int, extent: int,
             what: str) -> "np.ndarray | None":
    """The bytes of ``global_shape``'s slice ``[start, start + extent)`` along
    ``split_dim``, copied out of ``sources`` (``(key, object array, header)`` of TP
    shards, each placed by its header's TP rank); None (logged) when a source does not
    fit or the slice is not covered (Mooncake's
    ``build_reconstructed_tensor_into_plan_from_sources``)."""
    dtypes = {h["dtype"] for _, _, h in sources}
    if len(dtypes) != 1:
        log.error("%s: the shards' dtypes differ (%s)", what, sorted(dtypes))
        return None
    esize = DTYPES[dtypes.pop()][1]
    before = _prod(global_shape[:split_dim])
    row = _prod(global_shape[split_dim + 1:]) * esize
    dim = global_shape[split_dim]
    out = np.empty((before, extent, row), np.uint8)
    covered = np.zeros(extent, bool)
    for key, arr, h in sources:
        local = h["local_shape"]
        tp = next((a for a in h["axes"] if a[0] == AXIS_TP), None)
        if len(local) != len(global_shape) or any(
                d != g for i, (d, g) in enumerate(zip(local, global_shape)) if i != split_dim):
            log.error("%s: shard shape %s of %r does not fit %s", what, local, key,
                      tuple(global_shape))
            return None
        if h["layout_kind"] != LAYOUT_SHARD or tp is None or tp[4] != split_dim or \
                tp[3] <= 0 or dim % tp[3]:
            log.error("%s: %r holds no TP shard along dimension %d of an even split", what,
                      key, split_dim)
            return None
        s0 = dim * tp[2] // tp[3]
        n = dim * (tp[2] + 1) // tp[3] - s0
        if local[split_dim] != n:
            log.error("%s: shard extent mismatch for %r (%d, expected %d)", what, key,
                      local[split_dim], n)
            return None
        lo, hi = max(s0, start), min(s0 + n, start + extent)
        if hi <= lo:
            continue
        off = h["data_offset"]
        src = arr[off:off + h["data_bytes"]].reshape(before, n, row)
        out[:, lo - start:hi - start] = src[:, lo - s0:hi - s0]
        covered[lo - start:hi - start] = True
    if not covered.all():
        log.error("%s: the shards do not cover the reassembled dimension", what)
        return None
    return out.reshape(-1)


def _object(head: bytes, data: np.ndarray) -> np.ndarray:
    out = np.empty(HEADER_SIZE + data.nbytes, np.uint8)
    out[:HEADER_SIZE] = np.frombuffer(head, np.uint8)
    out[HEADER_SIZE:] = data
    return out


# --- the calls ------------------------------------------------------------------------
class ParallelismCalls:
    """The ``*_with_parallelism`` calls, mixed into ``MooncakeDistributedStore`` beside
    :class:`~.tensor.TensorCalls` (whose byte-level helpers they use). The module
    docstring says what each request stores and reads."""

    # requests -------------------------------------------------------------------------
    @staticmethod
    def _write_request(parallelism, writer_partition, what: str):
        """``("direct",)``, ``("writer", Writer)``, ``("axes", axes)``, or None."""
        if writer_partition is not None:
            if parallelism is not None:
                log.error("%s: writer_partition cannot be combined with parallelism", what)
                return None
            w = parse_writer(writer_partition, what)
            return None if w is None else ("writer", w)
        if parallelism is None:
            return ("direct",)
        axes = parse_axes(parallelism, what)
        return None if axes is None else ("axes", axes)

    @staticmethod
    def _request_list(value, n: int, name: str, what: str) -> "list | None":
        if not isinstance(value, list):
            log.error("%s: %s must be a list or None", what, name)
            return None
        if len(value) != n:
            log.error("%s: keys and %s must have the same length (%d, %d)", what, name, n,
                      len(value))
            return None
        return value

    # writes -------------------------------------------------------------------------------
    def _write_objects(self, keys, blobs, config, replace: bool) -> int:
        st: Any = self
        for c in st._tensor_write(list(keys), list(blobs), config, replace):
            if c != OK:
                return c
        return OK

    def _write_manifest(self, key: str, dtype: int, global_shape, split_dim: int,
                        count: int, config, replace: bool) -> int:
        blob = np.frombuffer(pack_manifest(dtype, global_shape, split_dim, count), np.uint8)
        return self._write_objects([key], [blob], config, replace)

    def _par_put(self, key, tensor, request, config, replace: bool, what: str) -> int:
        """One tensor written as ``request`` asks (a put of the tensor itself)."""
        st: Any = self
        if request is None:
            return INVALID_PARAMS
        if request[0] == "direct":
            return st._tensor_put([key], [tensor], config, replace, what)[0]
        torch = torch_module()
        h = _host(torch, tensor, f"{what} {key!r}")
        if h is None:
            return INVALID_PARAMS
        t, code = h
        shape = tuple(t.shape)
        if request[0] == "writer":
            w = request[1]
            if not self._even(shape, w.split_dim, w.size, what):
                return INVALID_PARAMS
            part = _part(t, w.split_dim, w.rank, w.size)
            blob = encode(torch, part, what, global_shape=shape,
                          axes=[(AXIS_TP, w.rank, w.size, w.split_dim, 0,
                                 part.shape[w.split_dim])])
            rc = self._write_objects([writer_key(key, w)], [blob], config, replace)
            return rc if rc != OK else self._write_manifest(
                writer_manifest_key(key), code, shape, w.split_dim, w.size, config, replace)
        axes = request[1]
        tp = tp_axis(axes)
        if tp is None:                       # DP / EP / PP only: the tensor as it is
            blob = encode(torch, t, what, axes=layout_axes(axes, shape))
            return self._write_objects([axes_key(key, axes)], [blob], config, replace)
        assert tp.split_dim is not None
        sd = tp.split_dim
        if not 0 <= sd < len(shape):
            log.error("%s %r: split_dim %d out of range for a tensor of %d dimensions",
                      what, key, sd, len(shape))
            return INVALID_PARAMS
        if len(axes) == 1:                   # one TP axis: the tensor is rank's shard
            part, full = t, shape[:sd] + (shape[sd] * tp.size,) + shape[sd + 1:]
        else:                                # with other axes: the whole tensor
            if not self._even(shape, sd, tp.size, what):
                return INVALID_PARAMS
            part, full = _part(t, sd, tp.rank, tp.size), shape
        blob = encode(torch, part, what, global_shape=full,
                      axes=layout_axes(axes, tuple(part.shape)))
        rc = self._write_objects([axes_key(key, axes)], [blob], config, replace)
        return rc if rc != OK else self._write_manifest(
            parallelism_manifest_key(key), code, full, sd, tp.size, config, replace)

    def _par_put_from(self, key, ptr, size, request, config, replace: bool,
                      what: str) -> int:
        """One tensor object in a registered buffer written as ``request`` asks."""
        st: Any = self
        if request is None:
            return INVALID_PARAMS
        if request[0] == "direct":
            return st._tensor_put_from([key], [ptr], [size], config, replace, what)[0]
        t = st._tensor_from_buffer(ptr, size, f"{what} {key!r}")
        if t is None:
            return INVALID_PARAMS
        if request[0] == "writer":
            return self._par_put(key, t, request, config, replace, what)
        axes = request[1]
        tp = tp_axis(axes)
        torch = torch_module()
        if tp is None:                       # as stored in the buffer, axes added
            h = parse_header(view_at(int(ptr), int(size)), int(size))
            assert h is not None             # _tensor_from_buffer checked it
            blob = encode(torch, t, what, global_shape=h["global_shape"],
                          axes=layout_axes(axes, tuple(t.shape)))
            return self._write_objects([axes_key(key, axes)], [blob], config, replace)
        # a TP axis: the buffer holds the whole tensor; every rank's shard is stored
        assert tp.split_dim is not None
        shape = tuple(t.shape)
        if not self._even(shape, tp.split_dim, tp.size, what):
            return INVALID_PARAMS
        keys, blobs = [], []
        for r in range(tp.size):
            ax = with_tp(axes, r)
            part = _part(t, tp.split_dim, r, tp.size)
            keys.append(axes_key(key, ax))
            blobs.append(encode(torch, part, what, global_shape=shape,
                                axes=layout_axes(ax, tuple(part.shape))))
        return self._write_objects(keys, blobs, config, replace)

    @staticmethod
    def _even(shape, split_dim: int, count: int, what: str) -> bool:
        if not 0 <= split_dim < len(shape) or count <= 0:
            log.error("%s: invalid shard parameters (split_dim %d, %d shards, shape %s)",
                      what, split_dim, count, shape)
            return False
        if shape[split_dim] % count:
            log.error("%s: only uniform sharding is supported (dimension %d is %d, not a "
                      "multiple of %d)", what, split_dim, shape[split_dim], count)
            return False
        return True

    def _par_put_one(self, key, value, parallelism, writer_partition, config,
                     replace: bool, what: str, from_buffer=None) -> int:
        request = self._write_request(parallelism, writer_partition, what)
        if from_buffer is not None:
            return self._par_put_from(key, value, from_buffer, request, config, replace,
                                      what)
        return self._par_put(key, value, request, config, replace, what)

    def _par_put_batch(self, keys, values, sizes, parallelisms, writer_partitions,
                       config, replace: bool, what: str) -> list:
        st: Any = self
        keys = list(keys)
        values = list(values)
        n = len(keys)
        if parallelisms is not None and writer_partitions is not None:
            log.error("%s: writer_partitions cannot be combined with parallelisms", what)
            return [INVALID_PARAMS] * n
        if len(values) != n or (sizes is not None and len(sizes) != n):
            log.error("%s: values and keys must have the same length", what)
            return [INVALID_PARAMS] * n
        if parallelisms is None and writer_partitions is None:
            if sizes is not None:
                return st._tensor_put_from(keys, values, sizes, config, replace, what)
            return st._tensor_put(keys, values, config, replace, what)
        name = "parallelisms" if parallelisms is not None else "writer_partitions"
        reqs = self._request_list(parallelisms if parallelisms is not None
                                  else writer_partitions, n, name, what)
        if reqs is None:
            return [INVALID_PARAMS] * n
        out = []
        for i, k in enumerate(keys):
            p, w = (reqs[i], None) if parallelisms is not None else (None, reqs[i])
            out.append(self._par_put_one(k, values[i], p, w, config, replace, what,
                                         None if sizes is None else sizes[i]))
        return out

    def put_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None,
                                    writer_partition=None) -> int:
        """Store ``tensor`` as ``parallelism`` (a :class:`TensorParallelism`) or
        ``writer_partition`` (rank, size, split_dim) say (the module docstring: a single
        TP axis takes rank's shard, more axes or a writer partition the whole tensor);
        neither: :meth:`put_tensor` with ``config``. 0, or -600 for a bad request (both
        given, rank >= size, split_dim out of range, a dimension not dividing evenly)."""
        return self._par_put_one(key, tensor, parallelism, writer_partition, config,
                                 False, "put_tensor_with_parallelism")

    def batch_put_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None,
                                          config=None, writer_partitions=None) -> list:
        """:meth:`put_tensor_with_parallelism` per key; ``parallelisms`` /
        ``writer_partitions`` a list (one per key) or None. Both given, or a list of
        another length: -600 for every key."""
        return self._par_put_batch(keys, tensors_list, None, parallelisms,
                                   writer_partitions, config, False,
                                   "batch_put_tensor_with_parallelism")

    def upsert_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None,
                                       writer_partition=None) -> int:
        return self._par_put_one(key, tensor, parallelism, writer_partition, config, True,
                                 "upsert_tensor_with_parallelism")

    def batch_upsert_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None,
                                             config=None, writer_partitions=None) -> list:
        return self._par_put_batch(keys, tensors_list, None, parallelisms,
                                   writer_partitions, config, True,
                                   "batch_upsert_tensor_with_parallelism")

    def put_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None,
                                         config=None, writer_partition=None) -> int:
        """The tensor object in the registered buffer (``[header][data]``) stored as
        ``parallelism`` / ``writer_partition`` say; with a TP axis the buffer holds the
        whole tensor and every rank's shard is stored (Mooncake's ``_from`` route)."""
        return self._par_put_one(key, buffer_ptr, parallelism, writer_partition, config,
                                 False, "put_tensor_with_parallelism_from", size)

    def batch_put_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes,
                                               parallelisms=None, config=None,
                                               writer_partitions=None) -> list:
        return self._par_put_batch(keys, buffer_ptrs, list(sizes), parallelisms,
                                   writer_partitions, config, False,
                                   "batch_put_tensor_with_parallelism_from")

    def upsert_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None,
                                            config=None, writer_partition=None) -> int:
        return self._par_put_one(key, buffer_ptr, parallelism, writer_partition, config,
                                 True, "upsert_tensor_with_parallelism_from", size)

    def batch_upsert_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes,
                                                  parallelisms=None, config=None,
                                                  writer_partitions=None) -> list:
        return self._par_put_batch(keys, buffer_ptrs, list(sizes), parallelisms,
                                   writer_partitions, config, True,
                                   "batch_upsert_tensor_with_parallelism_from")

    # reads ---------------------------------------------------------------------------------
    def _objects(self, keys) -> list:
        """``(array, header)`` per key, ``(None, None)`` when missing or not a tensor."""
        st: Any = self
        out: list = []
        for h in st.batch_get_buffer(list(keys)):
            if h is None:
                out.append((None, None))
                continue
            arr = np.asarray(h).view(np.uint8).reshape(-1)
            if not arr.flags.writeable:
                arr = arr.copy()
            out.append((arr, parse_header(arr, arr.nbytes)))
        return out

    def _resolve(self, key: str, target, what: str, legacy: bool):
        """What a read returns: ``("key", read_key)`` (the object under it, as stored),
        ``("object", array)`` (an object built here or already read), or None (logged)."""
        t = parse_target(target, what)
        if t is None:
            return None
        mode, parallelism = t
        if parallelism is None and mode == "as_stored":
            return ("key", key)
        if parallelism is None and mode == "full":
            built = self._writer_full(key, what)
            return ("key", key) if built is None else ("object", built)
        axes = parse_axes(parallelism, what)
        if axes is None:
            return None
        tp = tp_axis(axes)
        if mode == "shard":
            arr, h = self._objects([axes_key(key, axes)])[0]
            if h is not None and matches(axes, h):
                return ("object", arr)
            if len(axes) == 1 and tp is not None:     # a writer partition's shard
                w = Writer(tp.rank, tp.size, tp.split_dim or 0)
                arr, h = self._objects([writer_key(key, w)])[0]
                if h is not None and matches(axes, h):
                    return ("object", arr)
            if tp is not None:                        # re-shard the stored shards
                built = self._reassembled(key, axes, tp.rank, tp.size, what)
                if built is not None:
                    return ("object", built)
            if legacy and len(axes) == 1 and tp is not None:
                return ("key", key if tp.size <= 1 else f"{key}_tp_{tp.rank}")
            log.error("%s: parallelism metadata mismatch for key %r (no shard stored for "
                      "%s)", what, key, parallelism)
            return None
        if mode == "full":
            if tp is None:
                log.error("%s: full reconstruction requires a TP axis", what)
                return None
            built = self._reassembled(key, axes, None, None, what)
            return None if built is None else ("object", built)
        log.error("%s: unsupported ReadTarget mode %r with a parallelism (as_stored takes "
                  "none)", what, mode)
        return None

    def _writer_full(self, key: str, what: str) -> "np.ndarray | None":
        """The whole tensor reassembled from writer-partition shards, None when there is
        no (valid) writer manifest or a shard is missing or does not match."""
        st: Any = self
        m = parse_manifest(st.get_buffer(writer_manifest_key(key)))
        if m is None:
            return None
        sd, count, shape = m["split_dim"], m["shard_count"], m["global_shape"]
        keys = [writer_key(key, Writer(r, count, sd)) for r in range(count)]
        sources = []
        for r, (k, (arr, h)) in enumerate(zip(keys, self._objects(keys))):
            stored = None if h is None else axes_of_header(h)
            if stored is None or len(stored) != 1 or \
                    stored[0][:4] != (AXIS_TP, r, count, sd):
                log.error("%s: writer shard metadata mismatch for key %r", what, k)
                return None
            sources.append((k, arr, h))
        return self._build(sources, m["dtype"], shape, sd, None, None, None, what)

    def _reassembled(self, key: str, axes, rank, size, what: str):
        """The whole tensor (``rank`` None) or TP rank ``rank`` of ``size``'s part,
        reassembled from the shards stored for ``axes`` (Mooncake's
        ``load_parallelism_full_reconstruction_sources``: through the parallelism
        manifest, else the shards' own headers); None (logged) when they cannot."""
        st: Any = self
        tp = tp_axis(axes)
        assert tp is not None
        found: "tuple | None" = None
        m = parse_manifest(st.get_buffer(parallelism_manifest_key(key)))
        if m is not None:
            sd, count, shape = m["split_dim"], m["shard_count"], m["global_shape"]
            if tp.split_dim != sd:
                log.error("%s: split_dim mismatch (%s requested, %d stored)", what,
                          tp.split_dim, sd)
            elif shape[sd] % tp.size or shape[sd] % count:
                log.error("%s: only uniform sharding is supported", what)
            else:
                keys = [axes_key(key, with_tp(axes, r, count)) for r in range(count)]
                sources = self._sources(keys, axes, count, what)
                if sources is not None:
                    found = (sources, m["dtype"], shape, sd)
        if found is None:
            found = self._sources_without_manifest(key, axes, tp, what)
        if found is None:
            return None
        sources, dtype, shape, sd = found
        return self._build(sources, dtype, shape, sd, axes, rank, size, what)

    def _sources(self, keys, axes, count: int, what: str) -> "list | None":
        out = []
        for k, (arr, h) in zip(keys, self._objects(keys)):
            if h is None or not tp_compatible(axes, h, count):
                log.error("%s: %s", what, f"no shard under {k!r}" if h is None else
                          f"shard metadata mismatch for {k!r}")
                return None
            out.append((k, arr, h))
        return out

    def _sources_without_manifest(self, key: str, axes, tp: Axis, what: str):
        if len(axes) == 1:                   # the *_with_tp keys: learn the split from rank 0
            first = key if tp.size <= 1 else f"{key}_tp_0"
            _, h = self._objects([first])[0]
            stored = None if h is None else axes_of_header(h)
            stp = None if stored is None else tp_axis(stored)
            if stp is None:
                log.error("%s: no TP shard under %r", what, first)
                return None
            count, sd = stp.size, stp.split_dim
            keys = [key if count <= 1 else f"{key}_tp_{r}" for r in range(count)]
        else:
            count, sd = tp.size, tp.split_dim
            keys = [axes_key(key, with_tp(axes, r)) for r in range(count)]
        if tp.split_dim != sd:
            log.error("%s: split_dim mismatch (%s requested, %s stored)", what, tp.split_dim,
                      sd)
            return None
        sources = self._sources(keys, axes, count, what)
        if sources is None:
            return None
        h = sources[0][2]
        shape = h["global_shape"]
        assert sd is not None
        if shape[sd] % tp.size or shape[sd] % count:
            log.error("%s: only uniform sharding is supported", what)
            return None
        return sources, h["dtype"], shape, sd

    def _build(self, sources, dtype: int, shape, sd: int, axes, rank, size,
               what: str) -> "np.ndarray | None":
        """The object (header + data) of the whole tensor, or of TP ``rank`` of
        ``size``'s part (a SHARD header with ``axes``)."""
        if any(h["dtype"] != dtype for _, _, h in sources):
            log.error("%s: the shards' dtype differs from the manifest's", what)
            return None
        if rank is None:
            start, extent, local = 0, shape[sd], tuple(shape)
        else:
            start = shape[sd] * rank // size
            extent = shape[sd] * (rank + 1) // size - start
            local = tuple(shape[:sd]) + (extent,) + tuple(shape[sd + 1:])
        data = assemble(sources, tuple(shape), sd, start, extent, what)
        if data is None:
            return None
        head = pack_header(dtype, tuple(shape), local, data.nbytes,
                           () if rank is None else layout_axes(axes, local))
        return _object(head, data)

    def get_tensor_with_parallelism(self, key, target=None):
        """The tensor ``target`` (a :class:`ReadTarget`) asks for: ``as_stored`` (None:
        the same) the object under ``key``; ``shard`` the shard stored for the target's
        parallelism, else that TP rank's part re-sharded from the stored shards;
        ``full`` the whole tensor reassembled (no parallelism: from writer-partition
        shards, else ``key``'s object). None when missing or the request is bad."""
        st: Any = self
        what = "get_tensor_with_parallelism"
        r = self._resolve(key, target, what, legacy=True)
        if r is None:
            return None
        if r[0] == "key":
            return st._tensor_get([r[1]])[0]
        return decode(torch_module(), r[1])

    def batch_get_tensor_with_parallelism(self, keys, targets=None) -> list:
        """:meth:`get_tensor_with_parallelism` per key; ``targets`` a list (one per key)
        or None (as stored); a list of another length: None for every key."""
        st: Any = self
        keys = list(keys)
        if targets is None:
            return st.batch_get_tensor(keys)
        targets = self._request_list(targets, len(keys), "targets",
                                     "batch_get_tensor_with_parallelism")
        if targets is None:
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets)]

    def get_tensor_with_parallelism_into(self, key, buffer_ptr, size, target=None):
        """:meth:`get_tensor_with_parallelism` into the buffer: it then holds the
        object ([304-byte header][data]: FULL for a reassembled tensor, SHARD with the
        target's axes for a re-shard) and the tensor returned is a view of it. None when
        missing, the request is bad or the buffer is too small (nothing written)."""
        return self.batch_get_tensor_with_parallelism_into([key], [buffer_ptr], [size],
                                                           [target])[0]

    def batch_get_tensor_with_parallelism_into(self, keys, buffer_ptrs, sizes,
                                               targets=None) -> list:
        st: Any = self
        what = "batch_get_tensor_with_parallelism_into"
        keys = list(keys)
        n = len(keys)
        if not (n == len(buffer_ptrs) == len(sizes)):
            log.error("%s: keys, buffer_ptrs, and sizes must have the same length", what)
            return [None] * n
        if targets is not None:
            targets = self._request_list(targets, n, "targets", what)
            if targets is None:
                return [None] * n
        out: list = [None] * n
        by_key = []
        for i, k in enumerate(keys):
            r = self._resolve(k, None if targets is None else targets[i], what,
                              legacy=False)
            if r is None:
                continue
            if r[0] == "key":
                by_key.append((i, r[1]))
            else:
                out[i] = self._copy_into(k, r[1], int(buffer_ptrs[i]), int(sizes[i]), what)
        if by_key:
            got = st._tensor_get_into([k for _, k in by_key],
                                      [buffer_ptrs[i] for i, _ in by_key],
                                      [sizes[i] for i, _ in by_key], what)
            for (i, _), t in zip(by_key, got):
                out[i] = t
        return out

    def _copy_into(self, key: str, obj: np.ndarray, ptr: int, size: int, what: str):
        """Copy a built object into the caller's buffer (registered, or memory this
        process has mapped writable, as ``get_tensor_into`` takes); its tensor view."""
        st: Any = self
        from ._maps import mapped_rw
        if not ptr or size < obj.nbytes:
            log.error("%s %r: the buffer (%#x, %d bytes) is smaller than the %d-byte "
                      "object; nothing was written", what, key, ptr, size, obj.nbytes)
            return None
        if not (st._tensor_buffer_ok(ptr, obj.nbytes) or mapped_rw(ptr, obj.nbytes)):
            log.error("%s %r: [%#x, +%d) is neither a registered buffer nor memory this "
                      "process has mapped writable", what, key, ptr, obj.nbytes)
            return None
        dst = view_at(ptr, obj.nbytes)
        dst[:] = obj
        return decode(torch_module(), dst)


def _part(t, split_dim: int, rank: int, count: int):
    """Rank ``rank`` of ``count``'s contiguous part of ``t`` along ``split_dim``
    (Mooncake's ``calculate_shard_range``)."""
    dim = t.shape[split_dim]
    start = dim * rank // count
    return t.narrow(split_dim, start, dim * (rank + 1) // count - start).contiguous()

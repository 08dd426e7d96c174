# SPDX-License-Identifier: Apache-2.0
"""Memory intake: one door for user memory, and the MemoryRegion the engine hands back.

Accepted: anything with the buffer protocol (bytearray, numpy, mmap, memoryview),
``__cuda_array_interface__`` (v2/v3), ``__dlpack__``; raw integer addresses only through
:meth:`MemoryRegion.from_address` / ``TransferEngine.register_address``. The exporter is
kept alive for as long as the region is registered (as ucxx's ``Array`` does), and so is
its buffer export: a ``memoryview`` held until unregistering, so the owner cannot resize or
close the memory under the engine (a registered ``bytearray`` refuses ``extend`` with
``BufferError``, an ``mmap`` refuses ``resize``/``close``), as uvloop and ucxx hold a
``Py_buffer`` for the life of an operation (issue #20 item 2).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidArgumentError

ACCESS = ("rw", "r", "local")


@dataclass(frozen=True)
class Intake:
    address: int
    length: int
    device: str          # "cpu" or "cuda:N"
    readonly: bool
    owner: Any
    export: Any = None   # the memoryview pinning the buffer export, released at unregister


def intake(obj) -> Intake:
    """Address, length, device, read-only flag and owner of a user buffer.

    GPU memory is recognised by ``__cuda_array_interface__`` (v2/v3) or ``__dlpack__``
    with a CUDA device, and its device is then read from the driver's pointer attributes
    (:func:`mooncake_te.cuda.pointer_info`), not from the object's own word; a stream the
    exporter names is synchronized before the memory is handed to the engine, whose
    copies run on streams of its own.
    """
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(obj, cai)
    if hasattr(obj, "__dlpack_device__") and not _has_buffer(obj):
        dev_type, dev_id = obj.__dlpack_device__()
        if int(dev_type) != _DL_CPU:
            return _from_dlpack(obj, int(dev_type), int(dev_id))
    try:
        arr = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj
    except (TypeError, ValueError, BufferError) as e:
        if hasattr(obj, "__dlpack__"):
            try:
                arr = np.from_dlpack(obj)
            except Exception:
                raise InvalidArgumentError(f"cannot register {type(obj).__name__}: {e}") from None
        else:
            raise InvalidArgumentError(
                f"cannot register {type(obj).__name__}: it exposes neither the buffer protocol, "
                f"__cuda_array_interface__ nor __dlpack__ ({e}); pass a bytearray, numpy array, "
                f"mmap or tensor, or use register_address() for raw memory") from None
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise InvalidArgumentError(
            f"cannot register a non-contiguous {type(obj).__name__} (strides {arr.strides}); "
            f"register its base array or a contiguous copy (numpy.ascontiguousarray)")
    if arr.nbytes == 0:
        raise InvalidArgumentError(f"cannot register an empty {type(obj).__name__}")
    export = _export(obj)
    readonly = not arr.flags.writeable or (export is not None and export.readonly)
    return Intake(int(arr.ctypes.data), int(arr.nbytes), "cpu", readonly, obj, export)


def _export(obj):
    """A memoryview of obj, held while registered: while a buffer export is alive,
    CPython's bytearray, mmap and array.array (and numpy's resize, through the reference)
    refuse to move or free their memory. None for objects without the buffer protocol
    (DLPack-only host tensors: the object itself is kept alive instead)."""
    try:
        return memoryview(obj)
    except (TypeError, ValueError, BufferError):
        return None


def _has_buffer(obj) -> bool:
    try:
        memoryview(obj).release()
        return True
    except TypeError:
        return False


# --- __cuda_array_interface__ ---------------------------------------------------------
# https://numba.readthedocs.io/en/stable/cuda/cuda_array_interface.html (versions 2, 3)

def parse_cai(cai, what: str = "object") -> "tuple[int, int, bool, int | None]":
    """(address, length, readonly, stream) of a ``__cuda_array_interface__`` dict,
    checked: version 2 or 3, no mask, C-contiguous (``strides`` None or the C strides),
    not empty, and a v3 ``stream`` that is None or a valid handle (0 is forbidden by
    the interface, because it is ambiguous between the legacy and per-thread default
    streams)."""
    if not isinstance(cai, dict):
        raise InvalidArgumentError(f"{what}.__cuda_array_interface__ must be a dict, got "
                                   f"{type(cai).__name__}")
    version = cai.get("version")
    if version not in (2, 3):
        raise InvalidArgumentError(
            f"{what}.__cuda_array_interface__ has version {version!r}; this engine reads "
            f"versions 2 and 3 (upgrade the exporting library)")
    try:
        shape = tuple(int(d) for d in cai["shape"])
        itemsize = np.dtype(cai["typestr"]).itemsize
        address, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{what}.__cuda_array_interface__ is malformed ({e!r}): it "
                                   f"needs 'shape', 'typestr' and 'data': (pointer, read-only)")
    if cai.get("mask") is not None:
        raise InvalidArgumentError(f"cannot register a masked {what}; register its data array")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    length = count * itemsize
    if length == 0:
        raise InvalidArgumentError(f"cannot register an empty {what} (shape {shape})")
    strides = cai.get("strides")
    if strides is not None and count > 1:
        expect, step = [], itemsize
        for dim in reversed(shape):
            expect.insert(0, step)
            step *= dim
        # Dimensions of size 1 may carry any stride (PyTorch gives them arbitrary ones).
        if any(s != e for s, e, d in zip(strides, expect, shape) if d > 1):
            raise InvalidArgumentError(
                f"cannot register a non-contiguous {what} (shape {shape}, strides "
                f"{tuple(strides)}, C-contiguous would be {tuple(expect)}); register the "
                f"contiguous base tensor, or a .contiguous() copy")
    stream = cai.get("stream") if version >= 3 else None
    if stream is not None:
        if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
            raise InvalidArgumentError(f"{what}.__cuda_array_interface__ names stream "
                                       f"{stream!r}; a stream is None or a CUstream handle")
        if stream == 0:
            raise InvalidArgumentError(
                f"wrong stream usage: {what}.__cuda_array_interface__ names stream 0, which "
                f"the CUDA Array Interface v3 forbids (ambiguous between the legacy and the "
                f"per-thread default stream); the exporter must give 1, 2 or a stream handle")
    if not address:
        raise InvalidArgumentError(f"{what}.__cuda_array_interface__ has a null data pointer")
    return int(address), length, bool(readonly), stream


def _gpu_unavailable(what: str, reason: str):
    from .errors import TransportUnavailableError
    return TransportUnavailableError(f"cannot register {what}: it is GPU memory, but {reason}")


def _locate_gpu(what: str, address: int) -> "tuple[bool, int]":
    from . import cuda
    ok, reason = cuda.available()
    if not ok:
        raise _gpu_unavailable(what, reason)
    return cuda.pointer_info(address)


def _from_cai(obj, cai) -> Intake:
    what = type(obj).__name__
    address, length, readonly, stream = parse_cai(cai, what)
    is_dev, ordinal = _locate_gpu(what, address)
    if not is_dev:
        # The driver says host memory (pinned, mapped or unknown to CUDA): the CPU can
        # touch it directly, so it is registered as host memory.
        return Intake(address, length, "cpu", readonly, obj)
    if stream is not None:
        from . import cuda
        try:
            cuda.synchronize_stream(stream, ordinal)
        except cuda.CudaError as e:
            raise InvalidArgumentError(
                f"wrong stream usage: {what}.__cuda_array_interface__ names stream "
                f"{stream:#x}, which cannot be synchronized ({e}); export the array on a "
                f"live stream of its device") from None
    return Intake(address, length, f"cuda:{ordinal}", readonly, obj)


# --- DLPack ---------------------------------------------------------------------------
# dlpack.h (https://github.com/dmlc/dlpack): DLDeviceType and the legacy DLManagedTensor.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def _from_dlpack(obj, dev_type: int, dev_id: int) -> Intake:
    what = type(obj).__name__
    if dev_type not in (_DL_CUDA, _DL_CUDA_MANAGED, _DL_CUDA_HOST):
        raise InvalidArgumentError(f"cannot register {what}: DLPack device type {dev_type} is "
                                   f"neither CPU nor CUDA memory")
    from . import cuda
    ok, reason = cuda.available()
    if not ok:
        raise _gpu_unavailable(what, reason)
    # stream=1: the producer orders its pending work before the legacy default stream
    # (DLPack's __dlpack__ stream semantics for CUDA); waiting for that stream below
    # then covers it, whatever streams the engine copies on later.
    capsule = obj.__dlpack__(stream=cuda.LEGACY_STREAM)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    try:
        t = _DLTensor.from_address(get(capsule, b"dltensor"))
    except ValueError:
        raise InvalidArgumentError(f"cannot register {what}: its __dlpack__ capsule was "
                                   f"already consumed") from None
    shape = [t.shape[i] for i in range(t.ndim)]
    itemsize = t.dtype.bits * t.dtype.lanes // 8
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if t.strides and count > 1:
        expect, step = [], 1
        for dim in reversed(shape):
            expect.insert(0, step)
            step *= dim
        if any(t.strides[i] != expect[i] for i in range(t.ndim) if shape[i] > 1):
            raise InvalidArgumentError(f"cannot register a non-contiguous {what} (shape "
                                       f"{shape}); register a contiguous copy")
    if count * itemsize == 0:
        raise InvalidArgumentError(f"cannot register an empty {what}")
    address = int(t.data or 0) + int(t.byte_offset)
    cuda.synchronize_stream(cuda.LEGACY_STREAM, dev_id if dev_type != _DL_CUDA_HOST else 0)
    is_dev, ordinal = cuda.pointer_info(address)
    # The capsule stays with the region: its deleter frees the producer's reference only
    # when the capsule is collected, so the memory lives while registered.
    return Intake(address, count * itemsize, f"cuda:{ordinal}" if is_dev else "cpu", False,
                  (obj, capsule))


# --- NUMA location of host memory ----------------------------------------------------------
_MPOL_F_NODE, _MPOL_F_ADDR = 1, 2
_SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}.get(os.uname().machine)


def _numa_nodes() -> int:
    try:
        return sum(1 for d in os.listdir("/sys/devices/system/node") if d.startswith("node")
                   and d[4:].isdigit())
    except OSError:
        return 1


def cpu_location(address: int) -> str:
    """``cpu:<numa node>`` of the page at ``address`` (get_mempolicy(2) with MPOL_F_ADDR)."""
    if _numa_nodes() <= 1 or _SYS_GET_MEMPOLICY is None:
        return "cpu:0"
    node = ctypes.c_int(-1)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_SYS_GET_MEMPOLICY, ctypes.byref(node), None, ctypes.c_ulong(0),
                      ctypes.c_void_p(address), ctypes.c_ulong(_MPOL_F_NODE | _MPOL_F_ADDR))
    return f"cpu:{node.value}" if rc == 0 and node.value >= 0 else "cpu:0"


@dataclass(eq=False)
class MemoryRegion:
    """A registered region: where it is, who may touch it, and what keeps it alive."""

    address: int
    length: int
    location: str = "cpu:0"
    access: str = "rw"
    owner: Any = field(default=None, repr=False)
    readonly: bool = field(default=False, repr=False)
    export: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_address(cls, address: int, length: int, owner=None, location: str = "cpu:0",
                     access: str = "rw") -> "MemoryRegion":
        """The one door for raw integer addresses (ints or numpy integers).

        An ``owner`` with the buffer protocol is pinned as :func:`intake` pins a
        registered buffer: a ``memoryview`` of it is held until the region is
        unregistered, so a ``bytearray`` owner refuses ``extend``/``del`` with
        ``BufferError`` and an ``mmap`` refuses ``resize``/``close`` instead of freeing
        memory a peer may still write into (issue 35, item 6)."""
        from .arguments import U64_MAX, integer
        address = integer(address, "address", minimum=1)
        length = integer(length, "length", minimum=1, maximum=U64_MAX + 1 - address)
        export = _export(owner) if owner is not None else None
        return cls(address, length, location, access, owner, export=export)

    def release(self) -> None:
        """Drop the buffer export held while registered (the engine calls it when the
        region is unregistered): the owner may resize or free its memory again."""
        export, self.export = self.export, None
        if export is not None:
            export.release()

    @property
    def end(self) -> int:
        return self.address + self.length

    def contains(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.end

    def __repr__(self) -> str:
        return (f"MemoryRegion(address={self.address:#x}, length={self.length}, "
                f"location={self.location!r}, access={self.access!r})")

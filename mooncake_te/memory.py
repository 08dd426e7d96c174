# SPDX-License-Identifier: Apache-2.0
"""Memory intake: one door for user memory, and the MemoryRegion the engine hands back.

Accepted: anything with the buffer protocol (bytearray, numpy, mmap, memoryview),
``__cuda_array_interface__`` (v2/v3), ``__dlpack__``; raw integer addresses only through
:meth:`MemoryRegion.from_address` / ``TransferEngine.register_address``. The exporter is
kept alive for as long as the region is registered (as ucxx's ``Array`` does).
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


def intake(obj) -> Intake:
    """Address, length, device, read-only flag and owner of a user buffer."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(obj, cai)
    if hasattr(obj, "__dlpack_device__"):
        dev_type, dev_id = obj.__dlpack_device__()
        if int(dev_type) != 1:        # kDLCPU = 1 (dlpack.h DLDeviceType)
            return Intake(_dlpack_address(obj), _nbytes(obj), f"cuda:{dev_id}", False, obj)
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
    return Intake(int(arr.ctypes.data), int(arr.nbytes), "cpu", not arr.flags.writeable, obj)


def _nbytes(obj) -> int:
    n = getattr(obj, "nbytes", None)
    if n is None and hasattr(obj, "numel"):
        n = obj.numel() * obj.element_size()
    if n is None:
        raise InvalidArgumentError(f"cannot tell the size of {type(obj).__name__}")
    return int(n)


def _dlpack_address(obj) -> int:
    ptr = getattr(obj, "data_ptr", None)
    if callable(ptr):
        return int(ptr())
    raise InvalidArgumentError(f"cannot take the address of a device {type(obj).__name__} "
                               f"through DLPack; pass an object with __cuda_array_interface__")


def _from_cai(obj, cai: dict) -> Intake:
    shape, strides = tuple(cai["shape"]), cai.get("strides")
    itemsize = np.dtype(cai["typestr"]).itemsize
    if strides is not None:
        expect, s = [], itemsize
        for dim in reversed(shape):
            expect.insert(0, s)
            s *= dim
        if tuple(strides) != tuple(expect) and int(np.prod(shape)) > 1:
            raise InvalidArgumentError("cannot register non-contiguous GPU memory; register "
                                       "the contiguous base tensor")
    address, readonly = cai["data"]
    length = int(np.prod(shape)) * itemsize
    dev = getattr(obj, "device", None)
    ordinal = getattr(dev, "id", None)
    if ordinal is None:
        ordinal = getattr(dev, "index", None)
    return Intake(int(address), length, f"cuda:{ordinal if ordinal is not None else 0}",
                  bool(readonly), obj)


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

    @classmethod
    def from_address(cls, address: int, length: int, owner=None, location: str = "cpu:0",
                     access: str = "rw") -> "MemoryRegion":
        """The one door for raw integer addresses."""
        if not isinstance(address, int) or address <= 0:
            raise InvalidArgumentError(f"address must be a positive int, got {address!r}")
        if not isinstance(length, int) or length <= 0:
            raise InvalidArgumentError(f"length must be a positive int, got {length!r}")
        return cls(address, length, location, access, owner)

    @property
    def end(self) -> int:
        return self.address + self.length

    def contains(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.end

    def __repr__(self) -> str:
        return (f"MemoryRegion(address={self.address:#x}, length={self.length}, "
                f"location={self.location!r}, access={self.access!r})")

# SPDX-License-Identifier: Apache-2.0
"""CUDA, loaded at run time: what the engine needs of GPUs, and nothing at build time.

Why the driver library through ctypes
-------------------------------------
``libcuda.so.1`` ships with the NVIDIA driver itself, so it is on every machine that can
run CUDA at all, whatever toolkit, runtime or Python GPU package (if any) the user
installed; a CUDA runtime (``libcudart``) or ``cuda-python`` would tie us to one CUDA
major version (CuPy for CUDA 13 and PyTorch built for CUDA 12 can share one process, but
not one cudart), and CuPy would become a dependency of users who only have PyTorch. The
native data path (``src/core/gpu.c``) dlopens the same library for its staging copies,
so both tiers use the same contexts: the devices' *primary* contexts, which cudart, CuPy
and PyTorch use too, so their pointers are valid in ours. ctypes releases the GIL around
every call. On a machine without CUDA, ``available()`` says why and nothing else here is
usable; importing this module never fails.

The one way to learn a GPU pointer's device and owner is :func:`pointer_info` (driver
pointer attributes, not the exporting object's word), used by memory intake, the TCP
transport's staging, CUDA IPC and the RDMA transport's dma-buf registration
(:func:`dmabuf_fd`).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from ctypes import byref

from .. import errors as E
from . import _driver as D
from ._driver import LIBRARY

__all__ = ["LIBRARY", "available", "loaded", "device_count", "pci_bus_ids", "device_names", "pointer_info", "allocation_range",
           "dmabuf_fd", "PinnedBuffer", "Stream", "Event", "memcpy", "memcpy_async",
           "synchronize_stream", "ipc_get_handle", "ipc_open", "ipc_close", "device",
           "can_access_peer", "enable_peer_access", "push_device", "pop_device", "CudaError", "LEGACY_STREAM",
           "PER_THREAD_STREAM"]

# Stream handles with a fixed meaning (cuda.h CU_STREAM_LEGACY, CU_STREAM_PER_THREAD).
LEGACY_STREAM = 1
PER_THREAD_STREAM = 2


class CudaError(E.MooncakeError):
    """A CUDA driver call failed; ``.cu_result`` is the CUresult."""
    default_status = -1010

    def __init__(self, message: str = "", status=None, errno=None, cu_result: int = 0):
        super().__init__(message, status, errno)
        self.cu_result = cu_result

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.status, self.errno, self.cu_result))


def _rebuild(cls, message, status, errno, cu_result):
    return cls(message, status, errno, cu_result)


_lock = threading.Lock()
_state: dict = {}


def _lib():
    """The driver library, or raise TransportUnavailableError saying why not."""
    lib = _state.get("lib")
    if lib is not None:
        return lib
    with _lock:
        if "reason" not in _state:
            _state["lib"], _state["reason"] = D.load()
        if _state["lib"] is None:
            raise E.TransportUnavailableError(f"CUDA is unavailable: {_state['reason']}")
        return _state["lib"]


def loaded() -> bool:
    """Whether the CUDA driver is already loaded in this process (by us, PyTorch, CuPy...).
    Only then is it asked about raw addresses: initialising CUDA in a process that never
    used it would break the CUDA of children it forks later."""
    if _state.get("lib") is not None or _state.get("seen_loaded"):
        return True
    try:
        ctypes.CDLL(LIBRARY, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    _state["seen_loaded"] = True
    return True


def available() -> "tuple[bool, str]":
    """(True, "") when the CUDA driver loads and sees at least one GPU, else (False, why)."""
    try:
        n = device_count()
    except E.MooncakeError as e:
        return False, str(e)
    if n == 0:
        return False, "the CUDA driver sees no GPU (CUDA_VISIBLE_DEVICES may hide them)"
    return True, ""


def missing(*modules: str) -> "str | None":
    """Why this machine cannot run GPU work that also needs ``modules`` (no CUDA GPU, or a
    module not installed), or None: the reason the GPU benchmarks' smoke modes print
    when they skip."""
    import importlib.util
    ok, why = available()
    if not ok:
        return f"no CUDA GPU: {why}"
    for m in modules:
        if importlib.util.find_spec(m) is None:
            return f"{m} is not installed"
    return None


def _name(rc: int) -> str:
    s = ctypes.c_char_p()
    try:
        _lib().cuGetErrorName(rc, byref(s))
    except E.MooncakeError:
        pass
    return (s.value or b"CUDA_ERROR_UNKNOWN").decode()


def _check(rc: int, what: str) -> None:
    """The one status checker, called right after each driver call."""
    if rc != 0:
        raise CudaError(f"{what} failed: {_name(rc)} ({rc})", cu_result=rc)


def device_count() -> int:
    n = ctypes.c_int(0)
    _check(_lib().cuDeviceGetCount(byref(n)), "cuDeviceGetCount")
    return n.value


def _each_device():
    """(library, ordinal, CUdevice) for each device the driver lists."""
    lib = _lib()
    for i in range(device_count()):
        dev = D.CUdevice()
        _check(lib.cuDeviceGet(byref(dev), i), f"cuDeviceGet({i})")
        yield lib, i, dev


def pci_bus_ids() -> "list[str]":
    """PCI bus id of each device, by CUDA ordinal, as sysfs spells it ("0000:1a:00.0").
    The ordinals honour CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, as a ``cuda:N``
    location does; mooncake_te.topology matches sysfs GPUs to ordinals through this."""
    out = []
    for lib, i, dev in _each_device():
        bus = ctypes.create_string_buffer(64)
        _check(lib.cuDeviceGetPCIBusId(bus, 64, dev), f"cuDeviceGetPCIBusId({i})")
        dom, _, rest = bus.value.decode().lower().partition(":")
        out.append(f"{int(dom, 16):04x}:{rest}")     # CUDA may print an 8-digit domain
    return out


def device_names() -> "list[str]":
    """The name of each device (``cuDeviceGetName``), by CUDA ordinal."""
    out = []
    for lib, i, dev in _each_device():
        name = ctypes.create_string_buffer(256)
        _check(lib.cuDeviceGetName(name, 256, dev), f"cuDeviceGetName({i})")
        out.append(name.value.decode(errors="replace"))
    return out


def _primary(ordinal: int):
    ctxs = _state.setdefault("ctx", {})
    c = ctxs.get(ordinal)
    if c is None:
        lib = _lib()
        dev = D.CUdevice()
        _check(lib.cuDeviceGet(byref(dev), ordinal), f"cuDeviceGet({ordinal})")
        c = D.CUcontext()
        _check(lib.cuDevicePrimaryCtxRetain(byref(c), dev), f"cuDevicePrimaryCtxRetain({ordinal})")
        ctxs[ordinal] = c          # retained for the life of the process
    return c


@contextlib.contextmanager
def device(ordinal: int):
    """Make device ``ordinal``'s primary context current on this thread for the block,
    and restore what was current before (pushed and popped, so a caller's own CUDA state,
    PyTorch's current device say, is left as it was)."""
    lib = _lib()
    _check(lib.cuCtxPushCurrent_v2(_primary(int(ordinal))), f"make cuda:{ordinal} current")
    try:
        yield
    finally:
        lib.cuCtxPopCurrent_v2(byref(D.CUcontext()))


def push_device(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context current until :func:`pop_device` (for
    loops that issue many calls; ``with device(n)`` for a block)."""
    _check(_lib().cuCtxPushCurrent_v2(_primary(int(ordinal))), f"make cuda:{ordinal} current")


def pop_device() -> None:
    _lib().cuCtxPopCurrent_v2(byref(D.CUcontext()))


def pointer_info(address: int) -> "tuple[bool, int]":
    """(is_device, ordinal) of ``address`` from the driver's pointer attributes:
    (True, N) for memory of device N (cudaMalloc, CuPy, PyTorch, IPC-opened memory),
    (False, -1) for host memory (pageable, pinned or unknown to CUDA)."""
    lib = _lib()
    kind = ctypes.c_uint(0)
    rc = lib.cuPointerGetAttribute(byref(kind), D.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
    if rc != 0 or kind.value != D.CU_MEMORYTYPE_DEVICE:
        return False, -1       # CUDA_ERROR_INVALID_VALUE: a pointer CUDA never saw
    ordinal = ctypes.c_int(-1)
    _check(lib.cuPointerGetAttribute(byref(ordinal), D.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                     address), f"device ordinal of {address:#x}")
    return True, ordinal.value


def allocation_range(address: int) -> "tuple[int, int]":
    """(base, size) of the device allocation holding ``address``."""
    base, size = D.CUdeviceptr(0), ctypes.c_size_t(0)
    with device(_ordinal_of(address)):
        _check(_lib().cuMemGetAddressRange_v2(byref(base), byref(size), address),
               f"cuMemGetAddressRange({address:#x})")
    return base.value, size.value


def _ordinal_of(address: int) -> int:
    ok, ordinal = pointer_info(address)
    if not ok:
        raise E.InvalidArgumentError(f"{address:#x} is not GPU memory")
    return ordinal


def dmabuf_fd(address: int, length: int) -> int:
    """A dma-buf file descriptor for device memory [address, +length)
    (cuMemGetHandleForAddressRange with CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), for
    ibv_reg_dmabuf_mr. The caller owns (and closes) the fd. The driver wants the range
    aligned to the host page size; CUDA 11.7+ and a kernel with dma-buf support."""
    ok, ordinal = pointer_info(address)
    if not ok:
        raise E.InvalidArgumentError(f"{address:#x} is not GPU memory; dma-buf export is for "
                                     f"device memory (register host memory as it is)")
    fd = ctypes.c_int(-1)
    with device(ordinal):
        rc = _lib().cuMemGetHandleForAddressRange(byref(fd), address, length,
                                                  D.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    if rc != 0:
        raise CudaError(f"cannot export [{address:#x}, +{length}) of cuda:{ordinal} as a "
                        f"dma-buf: {_name(rc)} ({rc}); the range must be page-aligned, and the "
                        f"driver and kernel must support dma-buf (else use nvidia-peermem)",
                        cu_result=rc)
    return fd.value


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc, portable to every context): the fast
    side of host<->device copies. ``address``, ``nbytes``, ``array`` (a numpy uint8
    view); ``close()`` frees it (idempotent; also a context manager)."""

    def __init__(self, nbytes: int, ordinal: int = 0):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise E.InvalidArgumentError(f"nbytes must be a positive int, got {nbytes!r}")
        p = ctypes.c_void_p()
        self.device = int(ordinal)        # whose context allocates it (one is needed)
        with device(self.device):
            _check(_lib().cuMemHostAlloc(byref(p), nbytes, D.CU_MEMHOSTALLOC_PORTABLE),
                   f"cuMemHostAlloc({nbytes})")
        self.address, self.nbytes = p.value, nbytes

    @property
    def array(self):
        import numpy as np
        if not self.address:
            raise E.InvalidArgumentError("the pinned buffer is closed")
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.address))

    def close(self) -> None:
        if self.address:
            with device(self.device):
                _lib().cuMemFreeHost(ctypes.c_void_p(self.address))
            self.address = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:     # interpreter shutdown: the library may be gone
            pass


class Stream:
    """A non-blocking stream of device ``ordinal``'s primary context."""

    def __init__(self, ordinal: int = 0):
        self.device = int(ordinal)
        h = D.CUstream()
        with device(self.device):
            _check(_lib().cuStreamCreate(byref(h), D.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.handle = h.value

    def synchronize(self) -> None:
        _check(_lib().cuStreamSynchronize(self.handle), f"synchronize stream of cuda:{self.device}")

    def close(self) -> None:
        if self.handle:
            _lib().cuStreamDestroy_v2(self.handle)
            self.handle = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Event:
    """An event (no timing) of device ``ordinal``: record on a stream, then wait or poll."""

    def __init__(self, ordinal: int = 0):
        self.device = int(ordinal)
        h = D.CUevent()
        with device(self.device):
            _check(_lib().cuEventCreate(byref(h), D.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self.handle = h.value

    def record(self, stream: Stream) -> None:
        _check(_lib().cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        _check(_lib().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def query(self) -> bool:
        rc = _lib().cuEventQuery(self.handle)
        if rc == D.CUDA_ERROR_NOT_READY:
            return False
        _check(rc, "cuEventQuery")
        return True

    def close(self) -> None:
        if self.handle:
            _lib().cuEventDestroy_v2(self.handle)
            self.handle = 0


def memcpy(dst: int, src: int, nbytes: int) -> None:
    """Synchronous copy between any two addresses (unified addressing)."""
    _check(_lib().cuMemcpy(dst, src, nbytes), f"cuMemcpy({dst:#x} <- {src:#x}, {nbytes})")


def memcpy_async(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Copy on ``stream`` (device to device, peer to peer, or with host memory); the
    caller makes ``stream``'s device current (``with device(stream.device)``)."""
    _check(_lib().cuMemcpyAsync(dst, src, nbytes, stream.handle),
           f"cuMemcpyAsync({dst:#x} <- {src:#x}, {nbytes})")


def host_register(address: int, nbytes: int, ordinal: int = 0) -> bool:
    """Page-lock host memory for the GPU's copy engines (``cuMemHostRegister``, portable
    to every context), so copies with it run at the PCIe limit instead of through the
    driver's own staging. False when it was registered already."""
    with device(ordinal):
        rc = _lib().cuMemHostRegister_v2(address, nbytes, 1)     # CU_MEMHOSTREGISTER_PORTABLE
    if rc == 712:                    # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        return False
    _check(rc, f"cuMemHostRegister({address:#x}, {nbytes})")
    return True


def host_unregister(address: int, ordinal: int = 0) -> None:
    with device(ordinal):
        _check(_lib().cuMemHostUnregister(address), f"cuMemHostUnregister({address:#x})")


def synchronize_stream(handle: int, ordinal: int = 0) -> None:
    """Wait for work on a foreign stream handle (a ``__cuda_array_interface__`` v3
    ``stream``: 1 legacy default, 2 per-thread default, else a CUstream)."""
    with device(ordinal):
        _check(_lib().cuStreamSynchronize(handle), f"synchronize stream {handle:#x}")


def ipc_get_handle(address: int) -> "tuple[bytes, int, int, int]":
    """(handle, offset, base, size): a CUDA IPC handle for the allocation holding
    ``address`` (IPC handles name whole allocations; ``offset`` = address - base)."""
    base, size = allocation_range(address)
    h = D.CUipcMemHandle()
    with device(_ordinal_of(base)):
        rc = _lib().cuIpcGetMemHandle(byref(h), base)
    _check(rc,
           f"cuIpcGetMemHandle({base:#x}) (memory from cudaMallocAsync pools or cuMemCreate "
           f"has no legacy IPC handle)")
    # (h.reserved as an attribute would be cut at the first NUL: read the raw bytes.)
    return ctypes.string_at(ctypes.addressof(h), D.CU_IPC_HANDLE_SIZE), address - base, base, size


def ipc_open(handle: bytes, ordinal: int) -> int:
    """Map a peer process's allocation into this process (in device ``ordinal``'s
    context, enabling peer access lazily when the allocation is on another device);
    returns the base address here. One process may open a handle once; close it with
    :func:`ipc_close`. A process cannot open its own handles."""
    if len(handle) != D.CU_IPC_HANDLE_SIZE:
        raise E.InvalidArgumentError(f"a CUDA IPC handle is {D.CU_IPC_HANDLE_SIZE} bytes, got "
                                     f"{len(handle)}")
    h = D.CUipcMemHandle()
    ctypes.memmove(ctypes.addressof(h), handle, D.CU_IPC_HANDLE_SIZE)
    p = D.CUdeviceptr(0)
    with device(ordinal):
        _check(_lib().cuIpcOpenMemHandle_v2(byref(p), h, D.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
               "cuIpcOpenMemHandle")
    return p.value


def ipc_close(base: int, ordinal: int) -> None:
    with device(ordinal):
        _check(_lib().cuIpcCloseMemHandle(base), f"cuIpcCloseMemHandle({base:#x})")


def can_access_peer(a: int, b: int) -> bool:
    """Whether device ``a`` can read and write device ``b``'s memory directly."""
    if a == b:
        return True
    lib = _lib()
    da, db, ok = D.CUdevice(), D.CUdevice(), ctypes.c_int(0)
    _check(lib.cuDeviceGet(byref(da), a), f"cuDeviceGet({a})")
    _check(lib.cuDeviceGet(byref(db), b), f"cuDeviceGet({b})")
    _check(lib.cuDeviceCanAccessPeer(byref(ok), da, db), "cuDeviceCanAccessPeer")
    return bool(ok.value)


def enable_peer_access(a: int, b: int) -> bool:
    """Let device ``a``'s context reach device ``b``'s memory (copies then go peer to
    peer over NVLink or PCIe instead of through host memory). True when enabled (or
    already), False when the devices cannot."""
    if a == b:
        return True
    if not can_access_peer(a, b):
        return False
    with device(a):
        rc = _lib().cuCtxEnablePeerAccess(_primary(b), 0)
    if rc not in (0, D.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
        _check(rc, f"enable peer access cuda:{a} -> cuda:{b}")
    return True

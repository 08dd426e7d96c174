# SPDX-License-Identifier: Apache-2.0
"""Declarations of the CUDA driver API calls we use (ctypes over ``libcuda.so.1``).

Only declarations live here; ``mooncake_te.cuda`` holds the logic. The library itself is
loaded once per process, by the native core (``src/core/gpu.c``, which the staging copies
use): :func:`load` wraps the core's handle (``core.cuda_driver``), so the name, the
dlopen and ``cuInit`` have one home. Types and
signatures follow the CUDA Driver API reference (``cuda.h``): handles are opaque
pointers, ``CUdeviceptr`` is an unsigned 64-bit integer, ``CUresult`` an int. Where
``cuda.h`` maps a name to a versioned symbol (``cuMemGetAddressRange`` ->
``cuMemGetAddressRange_v2``), the versioned symbol is bound, as the linker would.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_char, c_int, c_size_t, c_uint, c_uint64, c_void_p  # noqa: F401

#: The driver library's name (src/core/gpu.h's MTE_CUDA_LIBRARY; a test checks they agree).
LIBRARY = "libcuda.so.1"

CUresult = c_int
CUdevice = c_int
CUdeviceptr = c_uint64
CUcontext = c_void_p
CUstream = c_void_p
CUevent = c_void_p
CUmodule = c_void_p
CUfunction = c_void_p

# cuda.h enums
CU_POINTER_ATTRIBUTE_CONTEXT = 1
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_MEMORYTYPE_HOST, CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_ARRAY, CU_MEMORYTYPE_UNIFIED = 1, 2, 3, 4
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2
CU_MEMHOSTALLOC_PORTABLE = 1
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_IPC_HANDLE_SIZE = 64
CUDA_ERROR_NOT_READY = 600
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", c_int), ("srcLocHint", CUmemLocation),
                ("dstLocHint", CUmemLocation), ("flags", c_uint)]
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", c_char * CU_IPC_HANDLE_SIZE)]


_SIGNATURES = {
    "cuInit": (c_uint,),
    "cuDriverGetVersion": (POINTER(c_int),),
    "cuDeviceGetCount": (POINTER(c_int),),
    "cuDeviceGet": (POINTER(CUdevice), c_int),
    "cuDeviceGetPCIBusId": (ctypes.c_char_p, c_int, CUdevice),
    "cuDeviceGetName": (ctypes.c_char_p, c_int, CUdevice),
    "cuDeviceCanAccessPeer": (POINTER(c_int), CUdevice, CUdevice),
    "cuDevicePrimaryCtxRetain": (POINTER(CUcontext), CUdevice),
    "cuCtxPushCurrent_v2": (CUcontext,),
    "cuCtxPopCurrent_v2": (POINTER(CUcontext),),
    "cuCtxEnablePeerAccess": (CUcontext, c_uint),
    "cuPointerGetAttribute": (c_void_p, c_int, CUdeviceptr),
    "cuMemGetAddressRange_v2": (POINTER(CUdeviceptr), POINTER(c_size_t), CUdeviceptr),
    "cuMemGetHandleForAddressRange": (c_void_p, CUdeviceptr, c_size_t, c_int, ctypes.c_ulonglong),
    "cuMemHostAlloc": (POINTER(c_void_p), c_size_t, c_uint),
    "cuMemFreeHost": (c_void_p,),
    "cuStreamCreate": (POINTER(CUstream), c_uint),
    "cuStreamDestroy_v2": (CUstream,),
    "cuStreamSynchronize": (CUstream,),
    "cuEventCreate": (POINTER(CUevent), c_uint),
    "cuEventRecord": (CUevent, CUstream),
    "cuEventSynchronize": (CUevent,),
    "cuEventQuery": (CUevent,),
    "cuEventDestroy_v2": (CUevent,),
    "cuMemcpy": (CUdeviceptr, CUdeviceptr, c_size_t),
    "cuMemcpyAsync": (CUdeviceptr, CUdeviceptr, c_size_t, CUstream),
    "cuIpcGetMemHandle": (POINTER(CUipcMemHandle), CUdeviceptr),
    "cuIpcOpenMemHandle_v2": (POINTER(CUdeviceptr), CUipcMemHandle, c_uint),
    "cuIpcCloseMemHandle": (CUdeviceptr,),
    "cuMemHostRegister_v2": (ctypes.c_void_p, c_size_t, c_uint),
    "cuMemHostUnregister": (ctypes.c_void_p,),
    "cuGetErrorName": (c_int, POINTER(ctypes.c_char_p)),
    "cuDeviceGetAttribute": (POINTER(c_int), c_int, CUdevice),
    "cuStreamWaitEvent": (CUstream, CUevent, c_uint),
    "cuMemAlloc_v2": (POINTER(CUdeviceptr), c_size_t),
    "cuMemFree_v2": (CUdeviceptr,),
    "cuModuleLoadData": (POINTER(CUmodule), c_void_p),
    "cuModuleGetFunction": (POINTER(CUfunction), CUmodule, ctypes.c_char_p),
    "cuModuleUnload": (CUmodule,),
    "cuLaunchKernel": (CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
                       CUstream, POINTER(c_void_p), POINTER(c_void_p)),
}

# Calls some drivers lack: bound when present, else None (callers fall back).
# cuMemcpyBatchAsync: CUDA 12.8 (with a failIdx argument); CUDA 13 names the version
# without it cuMemcpyBatchAsync_v2 (cuda.h maps the plain name to it).
_OPTIONAL = {
    "cuMemAllocAsync": (POINTER(CUdeviceptr), c_size_t, CUstream),       # CUDA 11.2
    "cuMemFreeAsync": (CUdeviceptr, CUstream),
    "cuMemcpyHtoDAsync_v2": (CUdeviceptr, c_void_p, c_size_t, CUstream),
    "cuMemcpyBatchAsync_v2": (POINTER(CUdeviceptr), POINTER(CUdeviceptr), POINTER(c_size_t),
                              c_size_t, c_void_p, POINTER(c_size_t), c_size_t, CUstream),
    "cuMemcpyBatchAsync": (POINTER(CUdeviceptr), POINTER(CUdeviceptr), POINTER(c_size_t),
                           c_size_t, c_void_p, POINTER(c_size_t), c_size_t, POINTER(c_size_t),
                           CUstream),
}


def load():
    """(library, None) with every call declared, or (None, reason). The library is the
    core's (loaded and initialised there, once per process)."""
    from ..core import cuda_driver
    handle, libname, why = cuda_driver()
    if not handle:
        return None, why
    lib = ctypes.CDLL(libname, handle=handle)
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None, f"the CUDA driver is too old: {LIBRARY} lacks {name}"
        fn.argtypes = args
        fn.restype = CUresult
    for name, args in _OPTIONAL.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = args
            fn.restype = CUresult
    return lib, None

# SPDX-License-Identifier: Apache-2.0
"""Match sysfs GPUs to CUDA ordinals through the CUDA driver API, when there is one.

Only the driver library (``libcuda.so.1``) is used, through ctypes, so no CUDA toolkit
or Python GPU package is needed. The calls are those of the CUDA Driver API reference:
``cuInit``, ``cuDeviceGetCount``, ``cuDeviceGet``, ``cuDeviceGetPCIBusId`` (bus id as
"0000:1A:00.0", upper case, which we lower-case as Mooncake's ``src/topology.cpp``
does) and ``cuDeviceGetName``. The ordinals honour ``CUDA_VISIBLE_DEVICES`` and
``CUDA_DEVICE_ORDER`` of this process, which is what a buffer's ``cuda:N`` location means.
"""
from __future__ import annotations

import ctypes


def cuda_bus_ids() -> "list[tuple[str, str]] | None":
    """``[(pci bus id, name), ...]`` by CUDA ordinal; None if no usable driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    try:
        if lib.cuInit(0) != 0:
            return None
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return None
        out = []
        for i in range(count.value):
            dev = ctypes.c_int(0)
            if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
                return None
            bus = ctypes.create_string_buffer(64)
            if lib.cuDeviceGetPCIBusId(bus, 64, dev) != 0:
                return None
            name = ctypes.create_string_buffer(256)
            lib.cuDeviceGetName(name, 256, dev)
            out.append((_norm(bus.value.decode()), name.value.decode(errors="replace")))
        return out
    except (AttributeError, OSError):
        return None


def _norm(bus_id: str) -> str:
    # CUDA may print an 8-digit domain ("00000000:1A:00.0"); sysfs uses 4.
    dom, _, rest = bus_id.lower().partition(":")
    return f"{int(dom, 16):04x}:{rest}"


def enrich(gpus) -> bool:
    """Set ``cuda_index`` and ``name`` on NVIDIA GPUs the driver reports.

    Returns True when the driver answered (GPUs it does not list are then invisible to
    this process), False when there is no driver, in which case nothing changes.
    """
    ids = cuda_bus_ids()
    if ids is None:
        return False
    by_bus = {bus: (i, name) for i, (bus, name) in enumerate(ids)}
    for g in gpus:
        if g.kind != "cuda":
            continue
        hit = by_bus.get(g.pci)
        if hit:
            g.cuda_index, g.name = hit
    return True

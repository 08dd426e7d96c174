# SPDX-License-Identifier: Apache-2.0
"""Match sysfs GPUs to CUDA ordinals through the CUDA driver API, when there is one.

The driver is asked through :mod:`mooncake_te.cuda` (whose library is the one the native
core loads: one loader per process). The calls are those of the CUDA Driver API
reference: ``cuDeviceGetPCIBusId`` (bus id as "0000:1A:00.0", upper case, which is
lower-cased as Mooncake's ``src/topology.cpp`` does) and ``cuDeviceGetName``. The
ordinals honour ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` of this process, which
is what a buffer's ``cuda:N`` location means.
"""
from __future__ import annotations

from ..errors import MooncakeError


def cuda_bus_ids() -> "list[tuple[str, str]] | None":
    """``[(pci bus id, name), ...]`` by CUDA ordinal; None if no usable driver."""
    from .. import cuda
    try:
        return list(zip(cuda.pci_bus_ids(), cuda.device_names()))
    except MooncakeError:
        return None


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

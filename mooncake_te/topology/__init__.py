# SPDX-License-Identifier: Apache-2.0
"""Machine topology from sysfs: RDMA devices, GPUs, NVMe, NUMA nodes, PCI distances and
the NIC priority matrix the RDMA transport uses to pick a NIC for each buffer.

>>> from mooncake_te.topology import discover
>>> topo = discover()                      # or discover("tests/data/...") for a fake tree
>>> topo.priority_matrix()                 # {"cpu:0": [[...], [...]], "cuda:0": ...}

Reads only sysfs (and, on the live system, the CUDA driver for GPU ordinals); imports
nothing from the engine, so it works where the native extension is not built.
"""
from __future__ import annotations

from .devices import Gid, Gpu, NumaNode, NvmeController, NvmeNamespace, Port, RdmaDevice
from .discover import Topology, discover, local_priority_matrix, roce_mtu
from .distance import LEGEND, Link, pci_link
from .matrix import (ENV_CUSTOM_TOPO, build_priority_matrix, load_priority_matrix,
                     resolve_priority_matrix, select_nics, validate_priority_matrix)

__all__ = [
    "Topology", "discover", "roce_mtu", "Link", "LEGEND", "pci_link",
    "Gid", "Gpu", "NumaNode", "NvmeController", "NvmeNamespace", "Port", "RdmaDevice",
    "ENV_CUSTOM_TOPO", "build_priority_matrix", "load_priority_matrix",
    "local_priority_matrix", "resolve_priority_matrix", "select_nics",
    "validate_priority_matrix",
]

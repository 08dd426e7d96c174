# SPDX-License-Identifier: Apache-2.0
"""How far apart two devices are on the PCI fabric, in NCCL's and ``nvidia-smi topo -m``'s
words.

=====  ====================================================================================
PIX    at most one PCIe switch between them (both under the same switch)
PXB    several PCIe switches, without crossing the host bridge
PHB    through a PCIe host bridge (the CPU's root complex), same root bus
NODE   between host bridges of one NUMA node
SYS    across the SMP interconnect between NUMA nodes (QPI/UPI, Infinity Fabric)
=====  ====================================================================================

These are the levels ``nvidia-smi topo -m`` prints in its legend and NCCL's
``PATH_PIX``/``PATH_PXB``/``PATH_PHB``/``PATH_SYS`` (``src/graph/topo.h``; NCCL folds NODE
into PHB/SYS). GPUDirect RDMA pays off at PIX and PXB; at PHB and beyond the data crosses
the CPU and NCCL disables GDR by default (``ncclTopoCheckGdr`` in ``src/graph/paths.cc``:
``netGdrLevel = PATH_PXB`` unless ``NCCL_NET_GDR_LEVEL`` says otherwise).
"""
from __future__ import annotations

import enum


class Link(enum.IntEnum):
    """Distance class; smaller is closer, so levels sort and compare."""

    X = 0       # the device itself
    PIX = 1
    PXB = 2
    PHB = 3
    NODE = 4
    SYS = 5

    def __str__(self) -> str:
        return self.name


LEGEND = {
    "X": "self",
    "PIX": "at most a single PCIe switch",
    "PXB": "multiple PCIe switches, not through the host bridge",
    "PHB": "through a PCIe host bridge (the CPU root complex)",
    "NODE": "between PCIe host bridges within one NUMA node",
    "SYS": "across the interconnect between NUMA nodes",
}


def pci_link(a: list[str], b: list[str], numa_a: int, numa_b: int,
             single_node: bool = False) -> tuple[Link, int]:
    """Classify the path between two PCI functions.

    Parameters
    ----------
    a, b : list of str
        PCI chains from :func:`~mooncake_te.topology.sysfs.pci_chain`: host bridge first,
        function last. An empty chain means "not on PCI" (a virtual device).
    numa_a, numa_b : int
        NUMA nodes (-1: unknown).
    single_node : bool
        The machine has one NUMA node, so an unknown node is that node.

    Returns
    -------
    (Link, int)
        The class and the hop count: the number of path components below the common
        ancestor on both sides, which is what Mooncake's ``src/topology.cpp`` compares to
        pick the nearest HCA. Ties at one class are broken by hops.
    """
    if a and b and a == b:
        return Link.X, 0
    same_node = single_node or (numa_a >= 0 and numa_a == numa_b)
    if not a or not b:
        # A device with no PCI path (Soft-RoCE on a veth, a virtual function the VM
        # hides) can only be placed by its NUMA node.
        return (Link.NODE if same_node else Link.SYS), len(a) + len(b)
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    hops = (len(a) - common) + (len(b) - common)
    if common == 0:
        # Different root buses. On Intel Xeon SP and AMD EPYC each PCIe stack/IOHC
        # is its own host bridge, so "same socket, other stack" is NODE, as
        # nvidia-smi prints it.
        return (Link.NODE if same_node else Link.SYS), hops
    if common == 1:
        # Only the host bridge is shared: the path turns around in the root complex.
        return Link.PHB, hops
    # The lowest common ancestor is a PCI bridge. Count the bridges on the path: the
    # ones strictly between each endpoint and the ancestor, plus the ancestor. A
    # single PCIe switch appears as downstream port, upstream port, downstream port,
    # i.e. three bridges; a switch behind another adds two per level.
    bridges = (len(a) - common - 1) + (len(b) - common - 1) + 1
    return (Link.PIX if bridges <= 3 else Link.PXB), hops

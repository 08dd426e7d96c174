# SPDX-License-Identifier: Apache-2.0
"""Discovery: walk a sysfs tree and return a :class:`Topology`.

Nothing here needs RDMA libraries, CUDA or root: everything comes from world-readable
sysfs attributes, so ``mooncake-te topology`` works on a login node, in a container and
on the test data under ``tests/data/sysfs``. When the tree is the live ``/sys`` and a
CUDA driver is present, GPUs are matched to CUDA ordinals (``cuda.py``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Mapping

from ..errors import DeviceNotFoundError
from .devices import (GPU_CLASSES, GPU_VENDORS, Gid, Gpu, NumaNode, NvmeController,
                      NvmeNamespace, Port, RdmaDevice, missing_device_message)
from .distance import Link, pci_link
# matrix.py never imports this module: discovery uses the matrix, not the other way.
from .matrix import ENV_CUSTOM_TOPO, _split_devices, build_priority_matrix, load_priority_matrix
from .sysfs import SysfsTree, parse_cpulist, pci_chain

_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_RATE_RE = re.compile(r"([0-9.]+)\s*Gb/sec")
_NS_RE = re.compile(r"^nvme(\d+)(?:c(\d+))?n(\d+)$")
# RoCE: the IB MTU the port runs at is the largest of 256..4096 that fits in the netdev
# MTU minus the RoCE headers, as iboe_get_mtu() computes it (include/rdma/ib_addr.h):
# GRH 40 + UDP 8 + BTH 12 + XRC ext 4 + AtomicETH 28 + ICRC 4 = 96 bytes.
_ROCE_OVERHEAD = 96
_IB_MTUS = (4096, 2048, 1024, 512, 256)


def roce_mtu(netdev_mtu: "int | None") -> "int | None":
    """Active IB MTU of a RoCE port whose netdev has MTU ``netdev_mtu``."""
    if not netdev_mtu:
        return None
    room = netdev_mtu - _ROCE_OVERHEAD
    for m in _IB_MTUS:
        if m <= room:
            return m
    return None


@dataclass
class Topology:
    """Everything discovery found on one machine.

    Attributes
    ----------
    root : str
        The sysfs root read.
    numa_nodes, nics, gpus, nvme : list
        :class:`NumaNode`, :class:`RdmaDevice`, :class:`Gpu`, :class:`NvmeController`,
        each in a stable order (node id, device name, PCI bus order, controller name).
    """

    root: str = "/sys"
    numa_nodes: list[NumaNode] = field(default_factory=list)
    nics: list[RdmaDevice] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    nvme: list[NvmeController] = field(default_factory=list)
    cuda_enriched: bool = False

    # ---- lookups ---------------------------------------------------------------------
    def nic(self, name: str) -> RdmaDevice:
        """The RDMA device called ``name``; DeviceNotFoundError names the closest."""
        for d in self.nics:
            if d.name == name:
                return d
        raise DeviceNotFoundError(missing_device_message(name, [d.name for d in self.nics]))

    @property
    def nic_names(self) -> list[str]:
        return [d.name for d in self.nics]

    @property
    def single_node(self) -> bool:
        return len(self.numa_nodes) <= 1

    def numa_of(self, dev) -> int:
        """The NUMA node a device is on, -1 if unknown.

        The kernel reports -1 when firmware gives no proximity information (ACPI _PXM),
        which is what one-socket machines and most VMs do; with one node that node is
        the answer.
        """
        if isinstance(dev, NumaNode):
            return dev.id
        n = getattr(dev, "numa_node", -1)
        if n is None or n < 0:
            return self.numa_nodes[0].id if len(self.numa_nodes) == 1 else -1
        return n

    def link(self, a, b) -> tuple[Link, int]:
        """Distance class and hop count between two discovered devices.

        A NUMA node (a CPU socket) to a device is NODE when the device is local to the
        node, else SYS, which is what ``nvidia-smi topo -m`` calls "NUMA affinity".
        """
        na, nb = self.numa_of(a), self.numa_of(b)
        if isinstance(a, NumaNode) or isinstance(b, NumaNode):
            same = self.single_node or (na >= 0 and na == nb)
            return (Link.NODE if same else Link.SYS), 0
        return pci_link(getattr(a, "pci_chain", []), getattr(b, "pci_chain", []), na, nb,
                        self.single_node)

    def sources(self) -> list:
        """Rows of the distance table: NUMA nodes (``cpu:N``) then GPUs."""
        return list(self.numa_nodes) + list(self.gpus)

    def distances(self, nics: "list[RdmaDevice] | None" = None) -> dict[str, dict[str, str]]:
        """``{location: {nic: "PIX"|...}}`` for every CPU node and GPU."""
        nics = self.nics if nics is None else nics
        return {src.location: {n.name: str(self.link(src, n)[0]) for n in nics}
                for src in self.sources()}

    def priority_matrix(self, devices=None, usable_only: bool = True) -> dict:
        """The NIC priority matrix in Mooncake's JSON shape; see :mod:`.matrix`."""
        return build_priority_matrix(self, devices=devices, usable_only=usable_only)

    def to_dict(self) -> dict:
        return {
            "sysfs_root": self.root,
            "numa_nodes": [n.to_dict() for n in self.numa_nodes],
            "gpus": [g.to_dict() for g in self.gpus],
            "nics": [n.to_dict() for n in self.nics],
            "nvme": [c.to_dict() for c in self.nvme],
            "distances": self.distances(),
            "cuda_enriched": self.cuda_enriched,
        }


# ---- discovery -----------------------------------------------------------------------

def discover(sysfs_root: "str | os.PathLike" = "/sys", cuda: "bool | None" = None) -> Topology:
    """Discover NUMA nodes, RDMA devices, GPUs and NVMe controllers.

    Parameters
    ----------
    sysfs_root : path, default "/sys"
        The sysfs tree to read; tests pass a folder.
    cuda : bool, optional
        Match GPUs to CUDA ordinals through the CUDA driver. Default: only when reading
        the live ``/sys`` (a fake tree's GPUs are not this machine's).

    Returns
    -------
    Topology
    """
    tree = SysfsTree(sysfs_root)
    topo = Topology(root=tree.root)
    topo.numa_nodes = _numa_nodes(tree)
    topo.nics = _rdma_devices(tree)
    topo.gpus = _gpus(tree)
    topo.nvme = _nvme(tree)
    if cuda is None:
        cuda = tree.is_live
    if cuda and topo.gpus:
        from .cuda import enrich
        topo.cuda_enriched = enrich(topo.gpus)
    return topo


def _numa_nodes(tree: SysfsTree) -> list[NumaNode]:
    nodes = []
    for entry in tree.listdir("devices", "system", "node"):
        m = re.fullmatch(r"node(\d+)", entry)
        if m:
            cpus = parse_cpulist(tree.read("devices", "system", "node", entry, "cpulist"))
            nodes.append(NumaNode(int(m.group(1)), cpus))
    nodes.sort(key=lambda n: n.id)
    # Memory-only nodes (CXL expanders, HBM in flat mode) have no CPUs and are not a
    # place a buffer's owner runs; Mooncake keys its matrix by CPU node.
    with_cpus = [n for n in nodes if n.cpus]
    if with_cpus:
        return with_cpus
    if nodes:
        return nodes
    # Kernel without CONFIG_NUMA: one implicit node holding every online CPU.
    return [NumaNode(0, parse_cpulist(tree.read("devices", "system", "cpu", "online")))]


def _pci_info(tree: SysfsTree, real: "str | None") -> tuple["str | None", list[str], int]:
    """(PCI function, chain, numa_node) of a resolved device path."""
    if real is None:
        return None, [], -1
    chain = pci_chain(tree.device_components(real))
    if not chain:
        return None, [], -1
    bdf = chain[-1]
    pci_dir = os.path.join(tree.path("devices"), *chain)
    numa = tree.read_int(os.path.relpath(os.path.join(pci_dir, "numa_node"), tree.root),
                         default=-1, base=10)
    return bdf, chain, numa


def _netdev_mtu(tree: SysfsTree, netdev: "str | None") -> "int | None":
    if not netdev:
        return None
    return tree.read_int("class", "net", netdev, "mtu", base=10)


def _rdma_devices(tree: SysfsTree) -> list[RdmaDevice]:
    devices = []
    for name in tree.listdir("class", "infiniband"):
        base = ("class", "infiniband", name)
        dev = RdmaDevice(name=name)
        dev.node_type = tree.read(*base, "node_type")
        dev.fw_ver = tree.read(*base, "fw_ver")
        dev.node_guid = tree.read(*base, "node_guid")
        dev.hca_type = tree.read(*base, "hca_type")
        # A hardware HCA has a ``device`` link to its PCI function; Soft-RoCE (rxe) and
        # siw live under /sys/devices/virtual and name their netdev in ``parent``
        # (drivers/infiniband/sw/rxe/rxe_verbs.c, parent_show).
        dev.pci, dev.pci_chain, dev.numa_node = _pci_info(tree, tree.realpath(*base, "device"))
        netdevs = tree.listdir(*base, "device", "net") if dev.pci else []
        parent = tree.read(*base, "parent")
        if parent and parent not in netdevs:
            netdevs.append(parent)
        dev.virtual = dev.pci is None
        for p in tree.listdir(*base, "ports"):
            if not p.isdigit():
                continue
            port = _port(tree, base + ("ports", p), int(p))
            for g in port.gids:
                if g.netdev and g.netdev not in netdevs:
                    netdevs.append(g.netdev)
            dev.ports.append(port)
        dev.ports.sort(key=lambda p: p.number)
        dev.netdevs = netdevs
        if dev.virtual:
            # Place a software device where its netdev is: rxe over a PCI Ethernet port
            # is as close to a GPU as that port is.
            for nd in netdevs:
                bdf, chain, numa = _pci_info(tree, tree.realpath("class", "net", nd, "device"))
                if bdf:
                    dev.pci_chain, dev.numa_node = chain, numa
                    break
        for port in dev.ports:
            if port.link_layer == "Ethernet" and port.mtu is None:
                nd = next((g.netdev for g in port.gids if g.netdev), None) or \
                    (netdevs[0] if netdevs else None)
                port.mtu = roce_mtu(_netdev_mtu(tree, nd))
        devices.append(dev)
    return devices


def _state(text: "str | None") -> tuple[int, str]:
    # sysfs prints "4: ACTIVE" (drivers/infiniband/core/sysfs.c, state_show).
    if not text:
        return 0, "UNKNOWN"
    code, _, word = text.partition(":")
    try:
        return int(code), word.strip() or "UNKNOWN"
    except ValueError:
        return 0, text.strip()


def _port(tree: SysfsTree, base: tuple, number: int) -> Port:
    code, state = _state(tree.read(*base, "state"))
    phys = tree.read(*base, "phys_state")
    port = Port(number=number, state=state, state_code=code,
                phys_state=phys.partition(":")[2].strip() if phys and ":" in phys else phys,
                link_layer=tree.read(*base, "link_layer"),
                rate=tree.read(*base, "rate"))
    if port.rate:
        m = _RATE_RE.search(port.rate)
        port.rate_gbps = float(m.group(1)) if m else None
    if port.link_layer == "InfiniBand":
        port.lid = tree.read_int(*base, "lid", base=16)
    for entry in tree.listdir(*base, "gids"):
        if not entry.isdigit():
            continue
        gid = tree.read(*base, "gids", entry)
        if not gid or gid == _ZERO_GID:
            continue
        port.gids.append(Gid(index=int(entry), gid=gid,
                             type=tree.read(*base, "gid_attrs", "types", entry),
                             netdev=tree.read(*base, "gid_attrs", "ndevs", entry) or None))
    port.gids.sort(key=lambda g: g.index)
    return port


def _gpus(tree: SysfsTree) -> list[Gpu]:
    found = []
    for bdf in tree.listdir("bus", "pci", "devices"):
        base = ("bus", "pci", "devices", bdf)
        cls = tree.read_int(*base, "class", base=16)
        vendor = tree.read_int(*base, "vendor", base=16)
        if cls is None or vendor not in GPU_VENDORS or (cls >> 8) not in GPU_CLASSES:
            continue
        pci, chain, numa = _pci_info(tree, tree.realpath(*base))
        vname, kind = GPU_VENDORS[vendor]
        found.append(Gpu(index=0, pci=bdf, vendor=vname, kind=kind,
                         device_id=tree.read_int(*base, "device", default=0, base=16),
                         numa_node=numa, pci_chain=chain))
    # Number GPUs of one kind in PCI bus order: the order nvidia-smi uses and the one CUDA
    # uses with CUDA_DEVICE_ORDER=PCI_BUS_ID (on a server of identical GPUs the default
    # FASTEST_FIRST order breaks ties the same way).
    found.sort(key=lambda g: (g.kind, g.pci))
    counters: dict[str, int] = {}
    for g in found:
        g.index = counters.get(g.kind, 0)
        counters[g.kind] = g.index + 1
    return found


def _nvme(tree: SysfsTree) -> list[NvmeController]:
    ctrls = []
    for name in tree.listdir("class", "nvme"):
        if not re.fullmatch(r"nvme\d+", name):
            continue
        base = ("class", "nvme", name)
        c = NvmeController(name=name,
                           transport=tree.read(*base, "transport", default="pcie") or "pcie",
                           address=tree.read(*base, "address"),
                           model=tree.read(*base, "model"), serial=tree.read(*base, "serial"),
                           subsysnqn=tree.read(*base, "subsysnqn"),
                           state=tree.read(*base, "state"))
        if c.transport == "pcie":
            c.pci, c.pci_chain, c.numa_node = _pci_info(tree, tree.realpath(*base, "device"))
            if c.pci is None:
                c.pci, c.pci_chain, c.numa_node = _pci_info(tree, tree.realpath(*base))
        # Namespaces sit in the controller's folder: "nvme0n1", or "nvme0c0n1" (a path of
        # a multipath namespace whose block device is "nvme0n1", named after the
        # subsystem instance).
        for entry in tree.listdir(*base):
            m = _NS_RE.match(entry)
            if not m:
                continue
            subsys, ctrl, nsid = m.groups()
            blk = f"nvme{subsys}n{nsid}"
            sectors = tree.read_int(*base, entry, "size", default=0, base=10)
            # ``size`` is in 512-byte sectors whatever the LBA size (block/genhd.c).
            c.namespaces.append(NvmeNamespace(name=blk, nsid=int(nsid),
                                              size_bytes=sectors * 512))
        c.namespaces.sort(key=lambda n: n.nsid)
        ctrls.append(c)
    ctrls.sort(key=lambda c: int(c.name[4:]))
    return ctrls


def local_priority_matrix(topo=None, devices=None, env: "Mapping[str, str] | None" = None,
                          sysfs_root: str = "/sys") -> dict:
    """The matrix this machine publishes: ``MC_CUSTOM_TOPO_JSON`` if set, else discovered.

    Devices named in a custom file must exist (and be in ``devices``, if given), so a
    typo fails here rather than on the first transfer.
    """
    env = os.environ if env is None else env
    custom = env.get(ENV_CUSTOM_TOPO)
    if topo is None:
        topo = discover(sysfs_root)
    if not custom:
        return build_priority_matrix(topo, devices)
    matrix = load_priority_matrix(custom)
    allowed = _split_devices(devices)
    known = topo.nic_names if allowed is None else allowed
    for loc, (pref, avail) in matrix.items():
        for name in pref + avail:
            if name not in known:
                raise DeviceNotFoundError(f"{custom}: entry {loc!r}: "
                                          + missing_device_message(name, known))
    return matrix

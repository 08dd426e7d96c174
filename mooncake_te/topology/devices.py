# SPDX-License-Identifier: Apache-2.0
"""What discovery finds: NUMA nodes, RDMA devices and their ports, GPUs, NVMe controllers.

Plain dataclasses with ``to_dict()`` so the command line can print them as JSON and the
doctor can reason about them without touching sysfs again.
"""
from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, field

# IB port states (include/rdma/ib_verbs.h, enum ib_port_state); sysfs prints "4: ACTIVE".
PORT_ACTIVE = 4

# PCI vendor ids of GPU makers whose devices a transfer engine can register
# (pci.ids). Display-class devices from other vendors (the ASPEED BMC VGA on nearly every
# server, Matrox on older ones) are not GPUs for our purposes.
GPU_VENDORS = {0x10DE: ("NVIDIA", "cuda"), 0x1002: ("AMD", "hip")}
# PCI class codes (PCI Code and ID Assignment spec, base class 03h): VGA 0300,
# 3D controller 0302 (NVIDIA datacenter parts), display controller 0380 (AMD Instinct).
GPU_CLASSES = (0x0300, 0x0302, 0x0380)


@dataclass
class Gid:
    """One non-zero entry of a port's GID table."""

    index: int
    gid: str                      # as sysfs prints it: eight groups of four hex digits
    type: "str | None" = None     # "IB/RoCE v1" | "RoCE v2"
    netdev: "str | None" = None   # the Ethernet device carrying it (RoCE)

    @property
    def ip(self) -> "str | None":
        """The address the GID encodes: IPv4 for IPv4-mapped GIDs, else IPv6."""
        try:
            addr = ipaddress.IPv6Address(self.gid)
        except ValueError:
            return None
        return str(addr.ipv4_mapped or addr)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ip"] = self.ip
        return d


@dataclass
class Port:
    """One port of an RDMA device (``/sys/class/infiniband/<dev>/ports/<n>``)."""

    number: int
    state: str = "UNKNOWN"        # "ACTIVE", "DOWN", "INIT", ...
    state_code: int = 0
    phys_state: "str | None" = None
    link_layer: "str | None" = None   # "InfiniBand" | "Ethernet"
    rate: "str | None" = None         # "200 Gb/sec (4X HDR)"
    rate_gbps: "float | None" = None
    mtu: "int | None" = None          # active IB MTU in bytes, where sysfs lets us know it
    lid: "int | None" = None
    gids: list[Gid] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state_code == PORT_ACTIVE

    def to_dict(self) -> dict:
        d = asdict(self)
        d["active"] = self.active
        d["gids"] = [g.to_dict() for g in self.gids]
        return d


@dataclass
class RdmaDevice:
    """An RDMA device (HCA, RNIC or software device such as Soft-RoCE ``rxe0``)."""

    name: str
    pci: "str | None" = None          # PCI function, None for virtual devices
    numa_node: int = -1               # as sysfs reports it; -1 means "not known"
    pci_chain: list[str] = field(default_factory=list)
    ports: list[Port] = field(default_factory=list)
    netdevs: list[str] = field(default_factory=list)
    virtual: bool = False
    node_type: "str | None" = None
    fw_ver: "str | None" = None
    node_guid: "str | None" = None
    hca_type: "str | None" = None

    @property
    def active_ports(self) -> list[Port]:
        return [p for p in self.ports if p.active]

    @property
    def usable(self) -> bool:
        """Mooncake's rule (``src/topology.cpp``): some port ACTIVE with a non-empty
        GID table."""
        return any(p.active and p.gids for p in self.ports)

    @property
    def rate_gbps(self) -> "float | None":
        rates = [p.rate_gbps for p in self.active_ports if p.rate_gbps]
        return max(rates) if rates else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ports"] = [p.to_dict() for p in self.ports]
        d["usable"] = self.usable
        return d


@dataclass
class Gpu:
    """A GPU found by PCI class and vendor; ``cuda_index`` once a GPU runtime confirms it."""

    index: int                        # position in PCI bus order among GPUs of its kind
    pci: str
    vendor: str
    kind: str                         # location prefix: "cuda" | "hip"
    device_id: int = 0
    numa_node: int = -1
    pci_chain: list[str] = field(default_factory=list)
    cuda_index: "int | None" = None   # ordinal in the running process, if known
    name: "str | None" = None         # product name, if a runtime told us

    @property
    def location(self) -> str:
        """Location string as Mooncake and our MemoryRegion spell it (``cuda:0``)."""
        idx = self.cuda_index if self.cuda_index is not None else self.index
        return f"{self.kind}:{idx}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["location"] = self.location
        return d


@dataclass
class NvmeNamespace:
    name: str                         # block device name, "nvme0n1"
    nsid: int
    size_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class NvmeController:
    """An NVMe controller: local (``transport == "pcie"``) or fabric-attached."""

    name: str                         # "nvme0"
    transport: str = "pcie"           # "pcie" | "tcp" | "rdma" | "fc" | "loop"
    address: "str | None" = None      # PCI address, or "traddr=...,trsvcid=..."
    pci: "str | None" = None
    numa_node: int = -1
    pci_chain: list[str] = field(default_factory=list)
    model: "str | None" = None
    serial: "str | None" = None
    subsysnqn: "str | None" = None
    state: "str | None" = None
    namespaces: list[NvmeNamespace] = field(default_factory=list)

    @property
    def fabric(self) -> bool:
        return self.transport != "pcie"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fabric"] = self.fabric
        d["namespaces"] = [n.to_dict() for n in self.namespaces]
        return d


@dataclass
class NumaNode:
    id: int
    cpus: list[int] = field(default_factory=list)

    @property
    def location(self) -> str:
        return f"cpu:{self.id}"

    def to_dict(self) -> dict:
        from .sysfs import format_cpulist
        return {"id": self.id, "cpus": format_cpulist(self.cpus), "location": self.location}


def missing_device_message(name: str, found: list[str]) -> str:
    import difflib
    close = difflib.get_close_matches(name, found, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listing = ", ".join(found) if found else "none"
    return (f"no RDMA device named {name!r}{hint} found: {listing} "
            f"(see ibv_devices or ls /sys/class/infiniband)")

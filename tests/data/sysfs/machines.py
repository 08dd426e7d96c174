# SPDX-License-Identifier: Apache-2.0
"""Fake sysfs trees modeled on real machines, built on demand.

Sysfs is mostly symlinks and names with colons, which travel badly through git and
archives, so the trees are described here and materialized into a temporary folder by
the tests (or by hand: ``python tests/data/sysfs/machines.py OUT`` writes all four
under OUT). The layout follows the kernel's: ``/sys/bus/pci/devices/<bdf>`` and
``/sys/class/{infiniband,net,nvme}/<name>`` are relative symlinks into
``/sys/devices/pci<dom>:<bus>/<root port>/.../<function>``; Soft-RoCE devices and
fabric NVMe controllers live under ``/sys/devices/virtual``.

Machines
--------
hgx8
    Two sockets, eight NVIDIA H100 (class 0x0302) and eight RoCE NICs behind four PCIe
    switches (as on HGX boards: each switch feeds two leaf switches, each leaf holds one
    GPU and one NIC, so GPU i pairs with mlx5_i). Socket 0's two switches hang off one
    root bus (pci0000:00, so across them is PHB); socket 1's off two root buses
    (pci0000:80, pci0000:c0: NODE). Plus the ASPEED BMC VGA (not a GPU) and an NVMe SSD.
onebox
    One socket (numa_node -1 everywhere, as one-socket firmware reports), one GPU and
    one InfiniBand HCA on separate root ports (PHB), one NVMe SSD.
vm_rxe
    A VM: virtio-net eth0 with Soft-RoCE rxe0 on it, rxe1 on a veth (no PCI at all),
    an NVMe-oF/TCP controller; numa_node -1.
empty
    Nothing but CPUs: no NUMA folder (CONFIG_NUMA off), no PCI devices of interest.
"""
from __future__ import annotations

import os
import sys

NVIDIA, MELLANOX, ASPEED, SAMSUNG = 0x10DE, 0x15B3, 0x1A03, 0x144D
CLS_BRIDGE, CLS_3D, CLS_VGA, CLS_ETH, CLS_IB, CLS_NVME = (
    0x060400, 0x030200, 0x030000, 0x020000, 0x020700, 0x010802)


class Builder:
    """Writes one fake sysfs tree under ``root``."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    # -- helpers ---------------------------------------------------------------------
    def _write(self, rel: str, text) -> None:
        p = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(f"{text}\n")

    def _link(self, rel: str, target_rel: str) -> None:
        """Symlink root/rel -> root/target_rel, written relative as the kernel does."""
        p = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        if os.path.lexists(p):
            os.unlink(p)
        os.symlink(os.path.relpath(os.path.join(self.root, target_rel), os.path.dirname(p)), p)

    # -- pieces ----------------------------------------------------------------------
    def numa(self, nodes: "dict[int, str] | None", online_cpus: str = "0-1") -> None:
        self._write("devices/system/cpu/online", online_cpus)
        if nodes is None:
            return
        for nid, cpus in nodes.items():
            self._write(f"devices/system/node/node{nid}/cpulist", cpus)
        self._write("devices/system/node/online", ",".join(map(str, sorted(nodes))))

    def pci(self, chain: list[str], cls: int, vendor: int, device: int = 0,
            numa: int = -1) -> str:
        """Create every function on ``chain`` (host bridge first); bridges get class
        0x0604. Returns the devices/ path of the last one."""
        path = f"devices/{chain[0]}"
        for i, bdf in enumerate(chain[1:], 1):
            path += f"/{bdf}"
            last = i == len(chain) - 1
            if not os.path.exists(os.path.join(self.root, path, "class")) or last:
                self._write(f"{path}/class", f"0x{(cls if last else CLS_BRIDGE):06x}")
                self._write(f"{path}/vendor", f"0x{(vendor if last else 0x1000):04x}")
                self._write(f"{path}/device", f"0x{(device if last else 0xc030):04x}")
                self._write(f"{path}/numa_node", numa)
            self._link(f"bus/pci/devices/{bdf}", path)
        return path

    def netdev(self, name: str, parent: "str | None", mtu: int = 1500) -> None:
        """A network interface under a PCI function path (or virtual when None)."""
        path = f"{parent}/net/{name}" if parent else f"devices/virtual/net/{name}"
        self._write(f"{path}/mtu", mtu)
        self._write(f"{path}/operstate", "up")
        if parent:
            self._link(f"{path}/device", parent)
        self._link(f"class/net/{name}", path)

    def ib(self, name: str, parent: "str | None", ports: list[dict],
           rxe_parent: "str | None" = None) -> None:
        """An RDMA device; ``ports``: dicts with state, link_layer, rate, gids
        [(index, gid, type, netdev)], lid."""
        path = f"{parent}/infiniband/{name}" if parent else f"devices/virtual/infiniband/{name}"
        self._write(f"{path}/node_type", "1: CA")
        self._write(f"{path}/node_guid", "b83f:d203:00a1:0001")
        self._write(f"{path}/fw_ver", "28.39.1002" if parent else "0.0.0")
        if parent:
            self._link(f"{path}/device", parent)
            self._write(f"{path}/hca_type", "MT4129")
        if rxe_parent:
            self._write(f"{path}/parent", rxe_parent)
        for n, port in enumerate(ports, 1):
            base = f"{path}/ports/{n}"
            code = {"ACTIVE": 4, "DOWN": 1, "INIT": 2, "ARMED": 3}[port.get("state", "ACTIVE")]
            self._write(f"{base}/state", f"{code}: {port.get('state', 'ACTIVE')}")
            self._write(f"{base}/phys_state", "5: LinkUp" if code == 4 else "3: Disabled")
            self._write(f"{base}/link_layer", port.get("link_layer", "Ethernet"))
            self._write(f"{base}/rate", port.get("rate", "400 Gb/sec (4X NDR)"))
            self._write(f"{base}/lid", port.get("lid", "0x0"))
            gids = port.get("gids", [])
            size = max([g[0] for g in gids] + [3]) + 2
            for i in range(size):   # real tables are mostly zero entries
                self._write(f"{base}/gids/{i}", "0000:0000:0000:0000:0000:0000:0000:0000")
            for idx, gid, gtype, nd in gids:
                self._write(f"{base}/gids/{idx}", gid)
                self._write(f"{base}/gid_attrs/types/{idx}", gtype)
                if nd:
                    self._write(f"{base}/gid_attrs/ndevs/{idx}", nd)
        self._link(f"class/infiniband/{name}", path)

    def nvme(self, name: str, parent: "str | None", transport: str = "pcie",
             address: "str | None" = None, namespaces=((1, 1 << 31),), model="SAMSUNG MZQL23T8HCLS-00A07") -> None:
        if parent:
            path = f"{parent}/nvme/{name}"
            self._link(f"{path}/device", parent)
            address = address or parent.rsplit("/", 1)[1]
        else:
            path = f"devices/virtual/nvme-fabrics/ctl/{name}"
        num = name[4:]
        self._write(f"{path}/transport", transport)
        self._write(f"{path}/address", address)
        self._write(f"{path}/model", model)
        self._write(f"{path}/serial", f"S6{num}NA0T000001")
        self._write(f"{path}/state", "live")
        self._write(f"{path}/subsysnqn", f"nqn.2014-08.org.nvmexpress:uuid:{num}")
        for nsid, sectors in namespaces:
            self._write(f"{path}/{name}n{nsid}/size", sectors)
        self._link(f"class/nvme/{name}", path)


def roce_gids(ip4: str, netdev: str) -> list:
    """The four GIDs a RoCE port with one IPv4 address shows: link-local and
    IPv4-mapped, each as RoCE v1 and v2 (index order as mlx5 fills the table)."""
    a, b, c, d = (int(x) for x in ip4.split("."))
    ll = f"fe80:0000:0000:0000:ba3f:d2ff:fe{a:02x}:{d:04x}"
    mapped = f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"
    return [(0, ll, "IB/RoCE v1", netdev), (1, ll, "RoCE v2", netdev),
            (2, mapped, "IB/RoCE v1", netdev), (3, mapped, "RoCE v2", netdev)]


# ---- the machines ----------------------------------------------------------------------

def build_hgx8(root: str, port_state: str = "ACTIVE") -> str:
    b = Builder(root)
    b.numa({0: "0-55,112-167", 1: "56-111,168-223"}, "0-223")
    # (root bus, root port, first bus number) for each of the four switches.
    switches = [("pci0000:00", "0000:00:01.0", 0x10, 0),
                ("pci0000:00", "0000:00:03.0", 0x20, 0),
                ("pci0000:80", "0000:80:01.0", 0x90, 1),
                ("pci0000:c0", "0000:c0:01.0", 0xd0, 1)]
    for s, (host, rport, bus, node) in enumerate(switches):
        up = f"0000:{bus:02x}:00.0"                         # switch upstream port
        for leaf in range(2):
            i = 2 * s + leaf                                # GPU i and mlx5_i
            down = f"0000:{bus + 1:02x}:{leaf * 8:02x}.0"   # downstream port to the leaf
            lup = f"0000:{bus + 2 + 4 * leaf:02x}:00.0"     # leaf switch upstream port
            gport = f"0000:{bus + 3 + 4 * leaf:02x}:00.0"   # leaf downstream to the GPU
            nport = f"0000:{bus + 3 + 4 * leaf:02x}:01.0"   # leaf downstream to the NIC
            gpu = f"0000:{bus + 4 + 4 * leaf:02x}:00.0"
            nic = f"0000:{bus + 5 + 4 * leaf:02x}:00.0"
            stem = [host, rport, up, down, lup]
            b.pci(stem + [gport, gpu], CLS_3D, NVIDIA, 0x2330, node)
            nic_path = b.pci(stem + [nport, nic], CLS_ETH, MELLANOX, 0x1021, node)
            nd = f"ens{s * 2 + leaf + 1}np0"
            b.netdev(nd, nic_path, mtu=9000)
            b.ib(f"mlx5_{i}", nic_path,
                 [{"state": port_state if i == 0 else "ACTIVE",
                   "gids": roce_gids(f"10.{i}.0.1", nd)}])
    # BMC VGA: display class, but not a GPU anyone registers memory on.
    b.pci(["pci0000:00", "0000:00:1c.0", "0000:03:00.0"], CLS_VGA, ASPEED, 0x2000, 0)
    nvme = b.pci(["pci0000:00", "0000:00:05.0", "0000:04:00.0"], CLS_NVME, SAMSUNG, 0xa80a, 0)
    b.nvme("nvme0", nvme, namespaces=((1, 7501476528),))
    return root


def build_onebox(root: str, port_state: str = "ACTIVE", with_gids: bool = True) -> str:
    b = Builder(root)
    b.numa({0: "0-15"}, "0-15")
    b.pci(["pci0000:00", "0000:00:01.0", "0000:01:00.0"], CLS_VGA, NVIDIA, 0x2684, -1)
    hca = b.pci(["pci0000:00", "0000:00:02.0", "0000:02:00.0"], CLS_IB, MELLANOX, 0x101b, -1)
    b.netdev("ibp2s0", hca, mtu=4092)
    gids = [(0, "fe80:0000:0000:0000:b83f:d203:00a1:0001", "IB/RoCE v1", None)] if with_gids else []
    b.ib("mlx5_0", hca, [{"state": port_state, "link_layer": "InfiniBand",
                          "rate": "200 Gb/sec (4X HDR)", "lid": "0x12", "gids": gids}])
    nvme = b.pci(["pci0000:00", "0000:00:03.0", "0000:03:00.0"], CLS_NVME, SAMSUNG, 0xa80a, -1)
    b.nvme("nvme0", nvme, namespaces=((1, 1875385008),))
    return root


def build_vm_rxe(root: str) -> str:
    b = Builder(root)
    b.numa({0: "0-3"}, "0-3")
    virtio = b.pci(["pci0000:00", "0000:00:03.0"], CLS_ETH, 0x1AF4, 0x1000, -1)
    # virtio-net hangs its netdev under a virtioN child of the PCI function.
    b.netdev("eth0", f"{virtio}/virtio2", mtu=1500)
    b.netdev("veth0", None, mtu=1500)
    b.ib("rxe0", None, [{"rate": "100 Gb/sec (4X EDR)", "gids": roce_gids("192.168.122.10", "eth0")}],
         rxe_parent="eth0")
    b.ib("rxe1", None, [{"rate": "100 Gb/sec (4X EDR)", "gids": roce_gids("10.99.0.1", "veth0")}],
         rxe_parent="veth0")
    b.nvme("nvme1", None, transport="tcp",
           address="traddr=127.0.0.1,trsvcid=4420,src_addr=127.0.0.1",
           namespaces=((1, 16384),), model="Linux")
    return root


def build_empty(root: str) -> str:
    b = Builder(root)
    b.numa(None, "0-1")
    os.makedirs(os.path.join(root, "class", "infiniband"), exist_ok=True)
    return root


MACHINES = {"hgx8": build_hgx8, "onebox": build_onebox, "vm_rxe": build_vm_rxe,
            "empty": build_empty}


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "sysfs-machines"
    for name, build in MACHINES.items():
        print(build(os.path.join(out, name)))

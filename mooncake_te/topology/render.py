# SPDX-License-Identifier: Apache-2.0
"""Plain-text tables for ``mooncake-te topology``, in the spirit of ``nvidia-smi topo -m``.

Plain formatting keeps the command free of extra dependencies and its output greppable.
"""
from __future__ import annotations

from .distance import LEGEND
from .gids import best as best_gid


def table(headers: list[str], rows: list[list], indent: str = "  ") -> str:
    """Left-aligned columns, two spaces apart; ``-`` for empty cells."""
    cells = [[("-" if c is None or c == "" else str(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    line = lambda r: indent + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip()
    return "\n".join([line(headers)] + [line(r) for r in cells])


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n else "-"


def render(topo, matrix: dict, matrix_source: str = "discovered") -> str:
    out: list[str] = [f"sysfs root: {topo.root}"]

    out.append("\nNUMA nodes")
    out.append(table(["NODE", "CPUS"], [[n.location, n.to_dict()["cpus"]]
                                         for n in topo.numa_nodes]))

    out.append("\nGPUs")
    if topo.gpus:
        # CPU affinity as nvidia-smi prints it: the CPUs of the GPU's NUMA node.
        cpus = {n.id: n.to_dict()["cpus"] for n in topo.numa_nodes}
        out.append(table(["GPU", "PCI", "NUMA", "CPU AFFINITY", "VENDOR", "NAME"],
                         [[g.location, g.pci, g.numa_node, cpus.get(topo.numa_of(g)),
                           g.vendor, g.name] for g in topo.gpus]))
    else:
        out.append("  none")

    out.append("\nRDMA devices")
    if topo.nics:
        rows = []
        for d in topo.nics:
            ports = d.ports or [None]
            for p in ports:
                gid = ""
                if p is not None and p.gids:
                    g = best_gid(p.gids)        # the one the RDMA transport would use
                    if g is not None:
                        gid = f"{g.index}:{g.ip or g.gid}" + (f" ({g.type})" if g.type else "")
                rows.append([d.name, d.pci or "virtual", d.numa_node,
                             p.number if p else None, p.state if p else None,
                             p.link_layer if p else None,
                             f"{p.rate_gbps:g} Gb/s" if p and p.rate_gbps else None,
                             p.mtu if p else None, ",".join(d.netdevs), gid])
        out.append(table(["NIC", "PCI", "NUMA", "PORT", "STATE", "LINK", "RATE", "MTU",
                          "NETDEV", "GID"], rows))
    else:
        out.append("  none")

    out.append("\nNVMe")
    if topo.nvme:
        out.append(table(["CTRL", "TRANSPORT", "ADDRESS", "NUMA", "MODEL", "NAMESPACES"],
                         [[c.name, c.transport, c.address, c.numa_node, c.model,
                           ", ".join(f"{n.name} {_gb(n.size_bytes)}" for n in c.namespaces)]
                          for c in topo.nvme]))
    else:
        out.append("  none")

    if topo.nics and topo.sources():
        out.append("\nDistance (GPU/CPU to NIC)")
        dist = topo.distances()
        names = topo.nic_names
        out.append(table([""] + names, [[loc] + [dist[loc][n] for n in names]
                                         for loc in dist]))
        out.append("\nLegend:")
        for k, v in LEGEND.items():
            if k != "X":
                out.append(f"  {k:<5} {v}")

    out.append(f"\nNIC priority matrix ({matrix_source})")
    if matrix:
        out.append(table(["LOCATION", "PREFERRED", "AVAILABLE"],
                         [[loc, ",".join(v[0]), ",".join(v[1])] for loc, v in matrix.items()]))
    else:
        out.append("  empty: no usable RDMA device (ACTIVE port with a GID); "
                   "transfers use TCP")
    return "\n".join(out)

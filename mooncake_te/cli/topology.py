# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te topology``: GPUs, RDMA NICs, NVMe and NUMA nodes found in sysfs, the
GPU/CPU-to-NIC distances and the NIC priority matrix, like ``nvidia-smi topo -m``."""
from __future__ import annotations

import json
import os
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "topology", help="show GPUs, NICs, NVMe, NUMA nodes and the NIC priority matrix",
        description="Discover the machine from sysfs (no CUDA or RDMA libraries needed) and "
                    "print the distance table and the NIC priority matrix the RDMA "
                    "transport uses. MC_CUSTOM_TOPO_JSON, if set, replaces the matrix.")
    p.add_argument("--sysfs-root", default="/sys", metavar="DIR",
                   help="sysfs tree to read (default: /sys)")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="RDMA device allow-list for the matrix, e.g. mlx5_0,mlx5_1 "
                        "(default: MC_TE_FILTERS, else all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--matrix-only", action="store_true",
                   help="print only the priority matrix JSON (the MC_CUSTOM_TOPO_JSON "
                        "format), e.g. to save and edit it")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..errors import MooncakeError
    from ..topology import discover, local_priority_matrix
    if not os.path.isdir(args.sysfs_root):
        print(f"mooncake-te topology: --sysfs-root {args.sysfs_root!r} is not a directory",
              file=sys.stderr)
        return 2
    devices = args.devices or os.environ.get("MC_TE_FILTERS") or None
    topo = discover(args.sysfs_root)
    source = ("MC_CUSTOM_TOPO_JSON " + os.environ["MC_CUSTOM_TOPO_JSON"]
              if os.environ.get("MC_CUSTOM_TOPO_JSON") else "discovered")
    try:
        matrix = local_priority_matrix(topo, devices=devices)
    except MooncakeError as e:
        print(f"mooncake-te topology: {e}", file=sys.stderr)
        return 2
    if args.matrix_only:
        print(json.dumps(matrix, indent=2))
    elif args.json:
        doc = topo.to_dict()
        doc["priority_matrix"] = matrix
        doc["priority_matrix_source"] = source
        print(json.dumps(doc, indent=2))
    else:
        from ..topology.render import render
        print(render(topo, matrix, source))
    return 0

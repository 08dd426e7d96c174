# SPDX-License-Identifier: Apache-2.0
"""The NIC priority matrix, in the JSON shape Mooncake publishes as ``priority_matrix``.

::

    {"cpu:0":  [["mlx5_0", "mlx5_1"], ["mlx5_2", "mlx5_3"]],
     "cuda:0": [["mlx5_0"],           ["mlx5_1", "mlx5_2", "mlx5_3"]]}

Each location (where a registered buffer lives) maps to exactly two lists: the
*preferred* NICs, among which the RDMA transport spreads requests, and the *available*
ones it falls back to (``src/topology.cpp``, ``Topology::parse``/``toJson`` in
kvcache-ai/Mooncake).

How we fill it, following Mooncake's discovery and NCCL's distance classes:

- ``cpu:N``: NICs on NUMA node N are preferred, the others available.
- ``cuda:i``: NICs ranked by (distance class, PCI hops); all NICs at the best rank are
  preferred, the rest available in rank order. On an HGX board that pairs each GPU
  with the NIC under its PCIe switch.

``MC_CUSTOM_TOPO_JSON=<file>`` replaces the discovered matrix with the file's, as in
Mooncake.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

from ..errors import ConfigError

ENV_CUSTOM_TOPO = "MC_CUSTOM_TOPO_JSON"


def _split_devices(devices) -> "list[str] | None":
    if devices is None:
        return None
    if isinstance(devices, str):
        devices = devices.split(",")
    names = [d.strip() for d in devices if d and d.strip()]
    return names or None


def select_nics(topo, devices=None, usable_only: bool = True) -> list:
    """The NICs a matrix is built from: the allow-list (if any) in the order given,
    keeping only those with an ACTIVE port and a GID (Mooncake's rule).

    Raises
    ------
    DeviceNotFoundError
        A name in ``devices`` is not a device on this machine.
    """
    names = _split_devices(devices)
    if names is None:
        nics = list(topo.nics)
    else:
        nics = [topo.nic(n) for n in names]     # raises, naming the closest match
    if usable_only:
        nics = [n for n in nics if n.usable]
    return nics


def build_priority_matrix(topo, devices=None, usable_only: bool = True) -> dict:
    """Build the matrix for a discovered :class:`~.discover.Topology`.

    Parameters
    ----------
    topo : Topology
    devices : list of str or str, optional
        RDMA device allow-list (``["mlx5_0", "mlx5_1"]`` or ``"mlx5_0,mlx5_1"``).
    usable_only : bool, default True
        Leave out devices with no ACTIVE port or an empty GID table.

    Returns
    -------
    dict
        ``{location: [preferred, available]}``; empty when there are no NICs.
    """
    nics = select_nics(topo, devices, usable_only)
    matrix: dict[str, list[list[str]]] = {}
    if not nics:
        return matrix
    for node in topo.numa_nodes:
        local = [n.name for n in nics if topo.link(node, n)[0].name == "NODE"]
        matrix[node.location] = [local, [n.name for n in nics if n.name not in local]]
    for gpu in topo.gpus:
        if topo.cuda_enriched and gpu.cuda_index is None:
            continue            # not visible to this process (CUDA_VISIBLE_DEVICES)
        ranked = sorted(nics, key=lambda n: (topo.link(gpu, n), n.name))
        best = topo.link(gpu, ranked[0])
        preferred = [n.name for n in ranked if topo.link(gpu, n) == best]
        matrix[gpu.location] = [preferred, [n.name for n in ranked if n.name not in preferred]]
    return matrix


def validate_priority_matrix(data, where: str = "<matrix>") -> dict:
    """Check a matrix has Mooncake's shape; return it as ``{str: [[str], [str]]}``.

    Raises
    ------
    ConfigError
        Naming ``where``, the location and what was expected.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: a NIC priority matrix must be a JSON object "
                          f"{{\"cpu:0\": [[preferred...], [available...]], ...}}, "
                          f"got {type(data).__name__}")
    out: dict[str, list[list[str]]] = {}
    for loc, value in data.items():
        ok = (isinstance(value, list) and len(value) == 2
              and all(isinstance(lst, list) and all(isinstance(x, str) for x in lst)
                      for lst in value))
        if not ok:
            raise ConfigError(f"{where}: entry {loc!r} must be exactly "
                              f"[[preferred NICs], [available NICs]] (lists of device "
                              f"names), got {json.dumps(value)}")
        out[str(loc)] = [list(value[0]), list(value[1])]
    return out


def load_priority_matrix(path: "str | os.PathLike") -> dict:
    """Read and validate a matrix file (the format ``MC_CUSTOM_TOPO_JSON`` names)."""
    path = os.fspath(path)
    try:
        with open(path, "r") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{ENV_CUSTOM_TOPO}: topology file {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON at line {e.lineno} column {e.colno}: "
                          f"{e.msg}") from None
    return validate_priority_matrix(data, path)


def resolve_priority_matrix(matrix: Mapping) -> tuple[list[str], dict]:
    """Number the devices as Mooncake's ``Topology::resolve`` does.

    Returns
    -------
    (devices, table)
        ``devices``: every NIC in first-seen order; ``table``: location ->
        ``(preferred indices, available indices)``, plus ``"*"`` listing every device as
        preferred, the entry used for a location the matrix does not name.
    """
    devices: list[str] = []
    index: dict[str, int] = {}

    def ids(names):
        out = []
        for n in names:
            if n not in index:
                index[n] = len(devices)
                devices.append(n)
            out.append(index[n])
        return out

    table = {loc: (ids(v[0]), ids(v[1])) for loc, v in matrix.items()}
    table["*"] = (list(range(len(devices))), [])
    return devices, table

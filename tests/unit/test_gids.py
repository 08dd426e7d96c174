# SPDX-License-Identifier: Apache-2.0
"""topology/gids.py: the one GID chooser (issue 40, item b). The RDMA transport, the
topology view and the lab choose through it."""
from __future__ import annotations

import ast
import ipaddress
from pathlib import Path

import pytest

from mooncake_te import errors as E
from mooncake_te.topology import Gid, gids
from mooncake_te.topology.render import render
from mooncake_te.topology.discover import Topology
from mooncake_te.topology.devices import Port, RdmaDevice

ROOT = Path(__file__).resolve().parents[2]


def _raw(text):
    return ipaddress.IPv6Address(text).packed


def test_choice_prefers_roce_v2_ipv4_on_an_up_netdev():
    entries = [(0, _raw("fe80::1"), "RoCE v1", True),
               (1, _raw("fe80::1"), "RoCE v2", True),
               (2, _raw("::ffff:10.0.0.5"), "RoCE v1", True),
               (3, _raw("::ffff:10.0.0.5"), "RoCE v2", False),
               (4, _raw("2001:db8::5"), "RoCE v2", True),
               (5, _raw("::ffff:10.1.0.5"), "RoCE v2", True)]
    assert gids.select(entries)[0] == 5
    assert gids.select(entries[:5])[0] == 4           # routable IPv6 on an UP netdev
    assert gids.select(entries[:4])[0] == 3
    assert gids.select(entries[:2])[0] == 1
    assert gids.select([]) is None
    assert gids.select(entries, pinned=2)[0] == 2     # MC_GID_INDEX
    with pytest.raises(E.DeviceNotFoundError, match="GID index 9"):
        gids.select(entries, pinned=9)


def test_text_is_sysfs_style():
    assert gids.text(_raw("::ffff:10.99.0.1")) == "0000:0000:0000:0000:0000:ffff:0a63:0001"


def _port():
    # the RoCE v2 IPv4 entry is not the last one: a "last entry" rule picks the IPv6 one
    table = [Gid(0, "fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1", "eth9"),
             Gid(1, "0000:0000:0000:0000:0000:ffff:0a00:0005", "RoCE v2", "eth9"),
             Gid(2, "2001:0db8:0000:0000:0000:0000:0000:0005", "RoCE v1", "eth9")]
    return Port(number=1, state="ACTIVE", state_code=4, link_layer="Ethernet", gids=table)


def test_best_and_for_address_choose_as_the_transport_does():
    p = _port()
    up = lambda netdev: True                                      # noqa: E731
    assert gids.best(p.gids, up).index == 1
    assert gids.for_address(p.gids, "10.0.0.5", up).index == 1
    assert gids.for_address(p.gids, "10.0.0.6", up) is None


def test_topology_view_shows_the_chosen_gid():
    dev = RdmaDevice(name="mlx5_9")
    dev.ports = [_port()]
    out = render(Topology(nics=[dev]), {})
    assert "1:10.0.0.5 (RoCE v2)" in out, out


def test_no_other_module_ranks_gids():
    """The ranking's marks (the RoCE v2 type compared, IPv4-mapped GIDs) appear only in
    topology/gids.py among the package's modules (the lab's filter by address aside)."""
    bad = []
    for path in (ROOT / "mooncake_te").rglob("*.py"):
        if path.name == "gids.py" or path.parent.name == "lab":
            continue
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ("RoCE v2", "RoCE v1")
                    for c in [n.left, *n.comparators]):
                bad.append(f"{path.relative_to(ROOT)}:{n.lineno}")
    assert not bad, bad

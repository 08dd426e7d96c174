# SPDX-License-Identifier: Apache-2.0
"""Which GID of a port to use: the one chooser (issue 40).

The RDMA transport picks the source GID of its queue pairs with :func:`select`;
``mooncake-te topology`` shows the same choice (:func:`best`), and the lab picks the
GID of an address it set (:func:`for_address`) through it too. The ranking is
Mooncake's (``rdma_context.cpp``; its issues #946 and #1593): RoCE v2 IPv4-mapped on an
UP netdev first (what RoCE fabrics route), then routable RoCE v2 IPv6 on an UP netdev,
the same two on a down netdev, RoCE v1, link-local, and IB GIDs last (index 0 on
InfiniBand works).

An entry is ``(index, raw 16 bytes, type, netdev_up, ...)``: the type as the kernel
names it (``"RoCE v2"``, ``"RoCE v1"``, ``"IB/RoCE v1"``); anything after the fourth
field rides along.
"""
from __future__ import annotations

import ipaddress
import socket

# Standard library only at import: the lab's stage 2 (a script run with no package, see
# lab/stage2.py) loads this file by its path.


def rank(raw: bytes, gid_type: str, netdev_up: bool) -> int:
    """Lower is better (see the module docstring)."""
    addr = ipaddress.IPv6Address(raw)
    v4 = addr.ipv4_mapped is not None
    link_local = addr.is_link_local
    if gid_type == "RoCE v2":
        if v4:
            return 0 if netdev_up else 2
        if not link_local:
            return 1 if netdev_up else 3
        return 5
    if gid_type == "RoCE v1":
        return 4 if (v4 or not link_local) else 6
    return 7


def select(entries, pinned: int = -1):
    """The entry to use, or None when there is none; ``pinned`` >= 0 (MC_GID_INDEX)
    picks that index or raises :class:`DeviceNotFoundError` listing the non-empty ones."""
    if pinned >= 0:
        from ..errors import DeviceNotFoundError
        for e in entries:
            if e[0] == pinned:
                return e
        raise DeviceNotFoundError(f"GID index {pinned} (MC_GID_INDEX / rdma_gid_index) is "
                                  f"empty; non-empty indices: "
                                  f"{', '.join(str(e[0]) for e in entries) or 'none'}")
    if not entries:
        return None
    return min(entries, key=lambda e: (rank(e[1], e[2], e[3]), e[0]))


def text(raw: bytes) -> str:
    """16 raw bytes as sysfs prints a GID: eight groups of four hex digits."""
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def netdev_up(name: "str | None") -> bool:
    """Whether the netdev ``name`` is administratively UP (IFF_UP in its sysfs flags)."""
    if not name:
        return False
    try:
        with open(f"/sys/class/net/{name}/flags") as f:
            return bool(int(f.read(), 16) & 0x1)        # IFF_UP
    except (OSError, ValueError):
        return False


def netdev_of(ifindex: int) -> "tuple[str | None, bool]":
    """(name, up) of the netdev with index ``ifindex`` (a GID's ``ndev_ifindex``)."""
    try:
        name = socket.if_indextoname(ifindex) if ifindex else None
    except OSError:
        return None, False
    return name, netdev_up(name)


def _entries(gids, up=netdev_up) -> list:
    out = []
    for g in gids:
        try:
            raw = ipaddress.IPv6Address(g.gid).packed
        except ValueError:
            continue
        out.append((g.index, raw, g.type or "IB", up(g.netdev), g))
    return out


def best(gids, up=netdev_up):
    """The :class:`~mooncake_te.topology.Gid` of ``gids`` (a port's table, as discovery
    reads it) that the RDMA transport would use, or None."""
    e = select(_entries(gids, up))
    return e[4] if e else None


def for_address(gids, ip: str, up=netdev_up):
    """The GID of ``gids`` the transport would use among those that carry address
    ``ip`` (IPv4 as the mapped form), or None."""
    e = select([x for x in _entries(gids, up) if x[4].ip == ip])
    return e[4] if e else None


__all__ = ["rank", "select", "text", "best", "for_address", "netdev_up", "netdev_of"]

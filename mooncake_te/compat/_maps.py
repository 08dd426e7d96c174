# SPDX-License-Identifier: Apache-2.0
"""This process's memory map (/proc/self/maps): whether a span can be copied into
without a fault (the store and its tensor calls both ask)."""
from __future__ import annotations


def mapped_rw(address: int, length: int) -> bool:
    """Whether [address, address + length) is covered by mappings of this process that
    are readable and writable (/proc/self/maps), so copying there cannot fault."""
    end, at = address + length, address
    try:
        with open("/proc/self/maps") as f:
            spans = []
            for line in f:
                bounds, perms = line.split(None, 2)[:2]
                lo, hi = (int(x, 16) for x in bounds.split("-"))
                if hi > at and lo < end:
                    spans.append((lo, hi, perms))
    except OSError:
        return True                  # no procfs: nothing to check against
    for lo, hi, perms in sorted(spans):
        if lo > at:
            return False             # a hole
        if not perms.startswith("rw"):
            return False
        at = max(at, hi)
        if at >= end:
            return True
    return at >= end

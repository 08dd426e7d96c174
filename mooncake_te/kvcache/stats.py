# SPDX-License-Identifier: Apache-2.0
"""Accounting: hits and misses by tier, hit rates, bytes per tier, evictions, promotions.

Two kinds of counts, kept apart so neither is counted twice:

* **lookups** (``KVCache.lookup``): how much of each request's prefix was cached and in
  which tier, by blocks and by tokens. These give the *hit rate*, the number the
  deployment guide tells users to grep for (``kv cache hit rate``), defined as in the
  trace simulator: longest cached prefix over blocks (tokens) asked for.
* **reads** (``KVCache.get``): blocks and bytes served from DRAM, SSD and peers, and the
  time spent, which give GB/s per tier.
"""
from __future__ import annotations

from .tiers import names as tier_names
from .tiers import registered
from ..units import format_binary

# Counters that name no tier. Each registered tier adds ``hit_blocks_<tier>`` (lookups),
# ``served_<tier>``, ``served_<tier>_bytes`` and the timer ``<tier>_read_s`` (reads); each
# local one ``evictions_<tier>``; one that takes demotions the timer ``<tier>_write_s``.
COUNTERS = (
    # lookups
    "lookups", "lookup_blocks", "hit_blocks", "lookup_tokens", "hit_tokens",
    # reads
    "get_blocks", "get_misses", "remote_failed",
    # writes and movement
    "put_blocks", "put_bytes", "put_existing",
    "demotions", "demoted_bytes", "demotions_skipped", "dropped", "promotions",
    "corrupt_dropped",
)


def new_counters(tiers=None) -> dict:
    """Zeroed counters for a cache of ``tiers``, tier classes in registry order (default:
    the registered ones)."""
    tiers = registered() if tiers is None else tiers
    d = dict.fromkeys(COUNTERS, 0)
    for t in tiers:
        d.update(dict.fromkeys((f"hit_blocks_{t.name}", f"served_{t.name}",
                                f"served_{t.name}_bytes"), 0))
        d[f"{t.name}_read_s"] = 0.0
        if t.local:
            d[f"evictions_{t.name}"] = 0
        if t.demotions:
            d[f"{t.name}_write_s"] = 0.0
    return d


def derive(c: dict, tiers=None) -> dict:
    """Add the rates to a snapshot of the counters."""
    tiers = tier_names() if tiers is None else tiers
    d = dict(c)
    qb, qt = c["lookup_blocks"], c["lookup_tokens"]
    d["miss_blocks"] = qb - c["hit_blocks"]
    d["block_hit_rate"] = c["hit_blocks"] / qb if qb else 0.0
    d["token_hit_rate"] = c["hit_tokens"] / qt if qt else 0.0
    for tier in tiers:
        d[f"block_hit_rate_{tier}"] = c.get(f"hit_blocks_{tier}", 0) / qb if qb else 0.0
    for tier in tiers:
        secs = c.get(f"{tier}_read_s", 0.0)
        d[f"{tier}_read_gbps"] = c.get(f"served_{tier}_bytes", 0) / secs / 1e9 \
            if secs else 0.0
    for tier in tiers:
        secs = c.get(f"{tier}_write_s")
        if secs is not None:
            d[f"{tier}_write_gbps"] = c["demoted_bytes"] / secs / 1e9 if secs else 0.0
    return d


def human(n: float) -> str:
    """Bytes in the largest binary unit (up to GiB) that keeps the number at or above 1."""
    return format_binary(n, 2, "GiB")


def log_line(s: dict) -> str:
    """The one line logged periodically; starts with ``kv cache hit rate``. The tiers
    are ``s["tiers"]`` (hit rates of each; occupancy of those with a capacity)."""
    tiers = s.get("tiers") or tier_names()
    rates = ", ".join(f"{t} {s.get(f'block_hit_rate_{t}', 0.0):.1%}" for t in tiers)
    held = ", ".join(f"{t} {human(s[f'{t}_bytes'])} of {human(s[f'{t}_capacity_bytes'])} "
                     f"({s[f'{t}_blocks']} blocks)" for t in tiers
                     if f"{t}_capacity_bytes" in s)
    return (f"kv cache hit rate {s['block_hit_rate']:.1%} of blocks, "
            f"{s['token_hit_rate']:.1%} of tokens ({rates}) over {s['lookup_blocks']} "
            f"blocks in {s['lookups']} lookups; {held}; evictions {s['evictions_dram']}, "
            f"demotions {s['demotions']}, promotions {s['promotions']}, corrupt dropped "
            f"{s['corrupt_dropped']}")

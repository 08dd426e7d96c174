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

COUNTERS = (
    # lookups
    "lookups", "lookup_blocks", "hit_blocks", "hit_blocks_dram", "hit_blocks_ssd",
    "hit_blocks_remote", "lookup_tokens", "hit_tokens",
    # reads
    "get_blocks", "get_misses", "served_dram", "served_dram_bytes", "served_ssd",
    "served_ssd_bytes", "served_remote", "served_remote_bytes", "remote_failed",
    # writes and movement
    "put_blocks", "put_bytes", "put_existing", "evictions_dram", "evictions_ssd",
    "demotions", "demoted_bytes", "demotions_skipped", "dropped", "promotions",
    "corrupt_dropped",
)
TIMERS = ("dram_read_s", "ssd_read_s", "ssd_write_s", "remote_read_s")


def new_counters() -> dict:
    d = dict.fromkeys(COUNTERS, 0)
    d.update(dict.fromkeys(TIMERS, 0.0))
    return d


def derive(c: dict) -> dict:
    """Add the rates to a snapshot of the counters."""
    d = dict(c)
    qb, qt = c["lookup_blocks"], c["lookup_tokens"]
    d["miss_blocks"] = qb - c["hit_blocks"]
    d["block_hit_rate"] = c["hit_blocks"] / qb if qb else 0.0
    d["token_hit_rate"] = c["hit_tokens"] / qt if qt else 0.0
    for tier in ("dram", "ssd", "remote"):
        d[f"block_hit_rate_{tier}"] = c[f"hit_blocks_{tier}"] / qb if qb else 0.0
    d["dram_read_gbps"] = c["served_dram_bytes"] / c["dram_read_s"] / 1e9 \
        if c["dram_read_s"] else 0.0
    d["ssd_read_gbps"] = c["served_ssd_bytes"] / c["ssd_read_s"] / 1e9 \
        if c["ssd_read_s"] else 0.0
    d["ssd_write_gbps"] = c["demoted_bytes"] / c["ssd_write_s"] / 1e9 \
        if c["ssd_write_s"] else 0.0
    d["remote_read_gbps"] = c["served_remote_bytes"] / c["remote_read_s"] / 1e9 \
        if c["remote_read_s"] else 0.0
    return d


def human(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0
    return f"{n:.2f} TiB"


def log_line(s: dict) -> str:
    """The one line logged periodically; starts with ``kv cache hit rate``."""
    return (f"kv cache hit rate {s['block_hit_rate']:.1%} of blocks, "
            f"{s['token_hit_rate']:.1%} of tokens "
            f"(dram {s['block_hit_rate_dram']:.1%}, ssd {s['block_hit_rate_ssd']:.1%}, "
            f"remote {s['block_hit_rate_remote']:.1%}) over {s['lookup_blocks']} blocks in "
            f"{s['lookups']} lookups; dram {human(s['dram_bytes'])} of "
            f"{human(s['dram_capacity_bytes'])} ({s['dram_blocks']} blocks), "
            f"ssd {human(s['ssd_bytes'])} of {human(s['ssd_capacity_bytes'])} "
            f"({s['ssd_blocks']} blocks); evictions {s['evictions_dram']}, demotions "
            f"{s['demotions']}, promotions {s['promotions']}, corrupt dropped "
            f"{s['corrupt_dropped']}")

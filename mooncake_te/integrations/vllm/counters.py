# SPDX-License-Identifier: Apache-2.0
"""The connector's counters without vLLM: what a worker reports each step, the hit rates
derived from them, and the ``kv cache hit rate: ...`` line (:mod:`.stats` puts them into
vLLM's statistics interface).

Every value is a count or a sum over the interval (never a rate), so aggregating is
adding; :data:`GAUGES` are the pool's occupancy, where the latest value wins.
"""
from __future__ import annotations

import threading
import time

#: Summed across workers and intervals.
SUMS = ("lookups", "lookup_blocks", "vllm_hit_blocks", "hit_dram", "hit_ssd", "hit_remote",
        "blocks_saved", "bytes_saved", "blocks_save_skipped", "blocks_dropped", "save_s",
        "blocks_loaded", "bytes_loaded", "load_s", "loads", "failed_loads", "failed_blocks",
        "pd_loads", "pd_bytes", "pd_transfer_s", "pd_failed_loads")
#: Latest value (gauges): the pool's occupancy.
GAUGES = ("dram_blocks", "ssd_blocks", "ssd_bytes", "dram_capacity_blocks",
          "ssd_capacity_blocks", "corrupt_dropped")


def take_worker_stats(worker) -> dict:
    """Counters since the last call from a :class:`~.worker.WorkerSide` (pool and P/D)."""
    out = worker.take_pool_stats()
    s = worker.stats
    last = getattr(worker, "_stats_mark", None) or {}
    pd = {"pd_loads": s["loads"], "pd_bytes": s["bytes_read"],
          "pd_transfer_s": s["transfer_s"], "pd_failed_loads": s["load_failures"]}
    worker._stats_mark = dict(pd)
    for k, v in pd.items():
        out[k] = v - last.get(k, 0)
    if not any(out.get(k) for k in SUMS):
        return {}
    return {k: out.get(k, 0) for k in SUMS + GAUGES}


def hit_rates(d: dict) -> dict:
    """Fractions of the prompt blocks asked for: vLLM's own prefix cache, the pool's tiers,
    and the rest (computed)."""
    asked = d.get("lookup_blocks", 0)
    if not asked:
        return {}
    r = {k: d.get(k, 0) / asked for k in ("vllm_hit_blocks", "hit_dram", "hit_ssd",
                                           "hit_remote")}
    pool = r["hit_dram"] + r["hit_ssd"] + r["hit_remote"]
    return {"vllm": r["vllm_hit_blocks"], "dram": r["hit_dram"], "ssd": r["hit_ssd"],
            "remote": r["hit_remote"], "pool": pool,
            "total": r["vllm_hit_blocks"] + pool, "miss": 1.0 - r["vllm_hit_blocks"] - pool}


def hit_rate_line(d: dict) -> str:
    """``kv cache hit rate: ...``: what the seed's users grep for."""
    r = hit_rates(d) or dict.fromkeys(("vllm", "dram", "ssd", "remote", "pool", "total",
                                       "miss"), 0.0)
    return (f"kv cache hit rate: {r['total']:.1%} of {d.get('lookup_blocks', 0)} prompt "
            f"blocks in {d.get('lookups', 0)} requests (vllm {r['vllm']:.1%}, dram "
            f"{r['dram']:.1%}, ssd {r['ssd']:.1%}, remote {r['remote']:.1%}, miss "
            f"{r['miss']:.1%}); blocks stored {d.get('blocks_saved', 0)}, loaded "
            f"{d.get('blocks_loaded', 0)}, dropped {d.get('blocks_dropped', 0)}, failed loads "
            f"{d.get('failed_loads', 0)}; pool dram {d.get('dram_blocks', 0)}/"
            f"{d.get('dram_capacity_blocks', 0)} blocks, ssd {d.get('ssd_blocks', 0)}/"
            f"{d.get('ssd_capacity_blocks', 0)} blocks ({d.get('ssd_bytes', 0) >> 20} MiB "
            f"on disk)")


class HitRateLogger:
    """Logs :func:`hit_rate_line` every ``interval`` seconds when something changed,
    cumulative since start (the worker side; vLLM's own log interval needs its stat
    logger, which ``LLM(...)`` leaves off)."""

    def __init__(self, log, interval: float):
        self.log, self.interval = log, float(interval)
        self.total: dict = {}
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._dirty = False

    def add(self, d: dict) -> None:
        with self._lock:
            for k, v in d.items():
                if k in GAUGES:
                    self.total[k] = v
                else:
                    self.total[k] = self.total.get(k, 0) + v
            self._dirty = True

    def maybe_log(self, force: bool = False) -> "str | None":
        now = time.monotonic()
        with self._lock:
            if not self._dirty or (not force and now - self._last < self.interval):
                return None
            self._last, self._dirty = now, False
            line = hit_rate_line(self.total)
        self.log.info("%s", line)
        return line

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

from ...kvcache.tiers import registered

# The per-tier names (hit_<tier>, loaded_<tier>, <tier>_blocks, ...) come from the KV
# cache's tier registry (kvcache/tiers.py), read when asked: a tier registered after this
# module was imported is counted too.
_SUMS_HEAD = ("lookups", "lookup_blocks", "vllm_hit_blocks")
_SUMS_TAIL = ("blocks_saved", "bytes_saved", "blocks_save_skipped", "blocks_dropped",
              "save_s", "blocks_loaded", "bytes_loaded", "load_s", "loads", "failed_loads",
              "failed_blocks", "pd_loads", "pd_bytes", "pd_transfer_s", "pd_failed_loads")


def sums() -> tuple:
    """Summed across workers and intervals: ``lookups``, ``lookup_blocks``,
    ``vllm_hit_blocks``, ``hit_<tier>`` per registered tier, then the save, load and P/D
    counts."""
    return _SUMS_HEAD + tuple(f"hit_{t.name}" for t in registered()) + _SUMS_TAIL


def gauges() -> tuple:
    """Latest value (gauges): the pool's occupancy, ``<tier>_blocks`` and
    ``<tier>_capacity_blocks`` of each local tier (``<tier>_bytes``, bytes on disk, of a
    disk tier), and ``corrupt_dropped``."""
    local = [t for t in registered() if t.local]
    return (tuple(f"{t.name}_blocks" for t in local)
            + tuple(f"{t.name}_bytes" for t in local if t.disk)
            + tuple(f"{t.name}_capacity_blocks" for t in local) + ("corrupt_dropped",))


def __getattr__(name: str):
    # SUMS and GAUGES as module constants, computed when read (see sums(), gauges()).
    if name == "SUMS":
        return sums()
    if name == "GAUGES":
        return gauges()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    keys = sums()
    if not any(out.get(k) for k in keys):
        return {}
    return {k: out.get(k, 0) for k in keys + gauges()}


def hit_rates(d: dict) -> dict:
    """Fractions of the prompt blocks asked for: vLLM's own prefix cache (``vllm``), each
    of the pool's tiers (by name), the pool together (``pool``), both (``total``) and
    the rest (``miss``: computed)."""
    asked = d.get("lookup_blocks", 0)
    if not asked:
        return {}
    r = {"vllm": d.get("vllm_hit_blocks", 0) / asked}
    for t in registered():
        r[t.name] = d.get(f"hit_{t.name}", 0) / asked
    pool = sum(r[t.name] for t in registered())
    r.update(pool=pool, total=r["vllm"] + pool, miss=1.0 - r["vllm"] - pool)
    return r


def hit_rate_line(d: dict) -> str:
    """``kv cache hit rate: ...``: what the seed's users grep for. The tiers appear in
    registry order (``dram``, ``ssd``, ``remote``, then any registered tier), each local
    one's occupancy at the end."""
    tiers = registered()
    r = hit_rates(d) or dict.fromkeys(("vllm", "pool", "total", "miss") +
                                      tuple(t.name for t in tiers), 0.0)
    rates = "".join(f", {t.name} {r[t.name]:.1%}" for t in tiers)
    held = ", ".join(f"{t.name} {d.get(f'{t.name}_blocks', 0)}/"
                     f"{d.get(f'{t.name}_capacity_blocks', 0)} blocks"
                     + (f" ({d.get(f'{t.name}_bytes', 0) >> 20} MiB on disk)" if t.disk else "")
                     for t in tiers if t.local)
    return (f"kv cache hit rate: {r['total']:.1%} of {d.get('lookup_blocks', 0)} prompt "
            f"blocks in {d.get('lookups', 0)} requests (vllm {r['vllm']:.1%}{rates}, miss "
            f"{r['miss']:.1%}); blocks stored {d.get('blocks_saved', 0)}, loaded "
            f"{d.get('blocks_loaded', 0)}, dropped {d.get('blocks_dropped', 0)}, failed loads "
            f"{d.get('failed_loads', 0)}; pool {held}")


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
        keep = gauges()
        with self._lock:
            for k, v in d.items():
                if k in keep:
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

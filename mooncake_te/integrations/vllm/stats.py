# SPDX-License-Identifier: Apache-2.0
"""The connector's statistics in vLLM's interface: a ``KVConnectorStats`` the workers fill
(``get_kv_connector_stats``), vLLM aggregates across workers and logs every log interval
(``KV Transfer metrics: ...``), and a ``KVConnectorPromMetrics`` that exports the same
counts on ``vllm serve``'s ``/metrics``; plus the ``kv cache hit rate: ...`` line the
worker logs itself, so the line is there with ``LLM(...)`` (no stat logger) too.

Every value is a count or a sum over the interval (never a rate), so aggregating is
adding and the Prometheus counters take increments.
"""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics, KVConnectorStats)

from ...kvcache.tiers import registered
from .counters import gauges, hit_rates, sums


class MooncakeTEStats(KVConnectorStats):
    """Counts since the last report (``data``: :func:`~.counters.sums` and
    :func:`~.counters.gauges`)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        od = getattr(other, "data", None) or {}
        if not self.data:
            self.data = dict(od)
            return self
        keep = gauges()
        for k, v in od.items():
            if k in keep:
                # Occupancy: the latest report wins (per worker; TP ranks hold equal
                # shards of the same blocks).
                self.data[k] = v
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict:
        d = self.data
        r = hit_rates(d)
        out = {"kv cache hit rate": round(r.get("total", 0.0), 4),
               "pool hit rate": round(r.get("pool", 0.0), 4)}
        for t in registered():                  # dram, ssd, remote, ...: the registry's
            out[t.name] = round(r.get(t.name, 0.0), 4)
        out.update({"blocks stored": d.get("blocks_saved", 0),
               "blocks loaded": d.get("blocks_loaded", 0),
               "blocks dropped": d.get("blocks_dropped", 0),
               "failed loads": d.get("failed_loads", 0) + d.get("pd_failed_loads", 0)})
        if d.get("load_s"):
            out["pool load GB/s"] = round(d.get("bytes_loaded", 0) / d["load_s"] / 1e9, 3)
        if d.get("pd_transfer_s"):
            out["P/D load GB/s"] = round(d.get("pd_bytes", 0) / d["pd_transfer_s"] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in sums())


_PROM = {
    # name suffix, data key, documentation
    "lookup_blocks": ("lookup_blocks", "Prompt blocks of new requests looked up"),
    "vllm_hit_blocks": ("vllm_hit_blocks", "Prompt blocks vLLM's own prefix cache held"),
    "blocks_stored": ("blocks_saved", "Blocks copied into the pool"),
    "bytes_stored": ("bytes_saved", "Bytes copied into the pool"),
    "blocks_dropped": ("blocks_dropped", "Blocks not stored because the save queue was full"),
    "blocks_loaded": ("blocks_loaded", "Blocks loaded from the pool into vLLM's KV cache"),
    "bytes_loaded": ("bytes_loaded", "Bytes loaded from the pool"),
    "load_seconds": ("load_s", "Seconds spent loading from the pool"),
    "store_seconds": ("save_s", "Seconds spent storing into the pool (saver thread)"),
    "failed_loads": ("failed_loads", "Pool loads that failed and were recomputed"),
    "pd_bytes_read": ("pd_bytes", "KV bytes read from P/D producers"),
    "pd_transfer_seconds": ("pd_transfer_s", "Seconds spent reading from P/D producers"),
    "pd_failed_loads": ("pd_failed_loads", "P/D loads that failed and were recomputed"),
}


def _prom_tiers() -> "tuple[dict, dict]":
    """The per-tier counters and gauges, from the KV cache's tier registry: hits of every
    tier, occupancy of the local ones (``vllm:mooncake_te_pool_hit_blocks_dram``,
    ``..._pool_ssd_blocks``, ``..._pool_ssd_bytes``)."""
    counters, gauges_ = {}, {}
    for t in registered():
        where = t.description or f"the pool's {t.name} tier"
        counters[f"pool_hit_blocks_{t.name}"] = (f"hit_{t.name}",
                                                 f"Prompt blocks found in {where}")
        if t.local:
            gauges_[f"pool_{t.name}_blocks"] = (f"{t.name}_blocks", f"Blocks in {where}")
        if t.local and t.disk:
            gauges_[f"pool_{t.name}_bytes"] = (f"{t.name}_bytes",
                                               f"Bytes {where} takes on disk")
    return counters, gauges_


class MooncakeTEPromMetrics(KVConnectorPromMetrics):
    """``vllm:mooncake_te_*`` counters (and pool occupancy gauges) per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        tier_counters, tier_gauges = _prom_tiers()
        self._counters = {}
        for name, (key, doc) in dict(_PROM, **tier_counters).items():
            c = self._counter_cls(name=f"vllm:mooncake_te_{name}", documentation=doc,
                                  labelnames=labelnames)
            self._counters[key] = self._per_engine(c)
        self._gauges = {}
        for name, (key, doc) in tier_gauges.items():
            g = self._gauge_cls(name=f"vllm:mooncake_te_{name}", documentation=doc,
                                labelnames=labelnames)
            self._gauges[key] = self._per_engine(g)

    def _per_engine(self, metric) -> dict:
        return {idx: metric.labels(*values)
                for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        for key, per_engine in self._counters.items():
            v = transfer_stats_data.get(key, 0)
            if v:
                per_engine[engine_idx].inc(v)
        for key, per_engine in self._gauges.items():
            if key in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[key])

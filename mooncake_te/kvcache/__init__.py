# SPDX-License-Identifier: Apache-2.0
"""Tiered KV cache: DRAM (a registered memory pool peers read over the transfer engine)
and SSD (checksummed block records under ``cache_dir``), keyed by prefix hashes, with
LRU/LFU eviction, demotion and promotion, hit-rate accounting and a remote ``get``. The
tiers are plug-ins of one interface, DRAM the hub they all read into and write from
(:mod:`.tiers`).

The trace simulator behind ``mooncake-te trace`` lives in :mod:`.trace` (one cache) and
:mod:`.engine_model` (vLLM's prefix cache in front of the pool); the guide is
``docs/kvcache.md``.
"""
from __future__ import annotations

from .engine_model import EngineResult, simulate_engine
from .keys import as_key, prefix_hashes
from .policy import LFU, LRU, make_policy
from .store import KVCache
from .trace import SimResult, Trace, load_trace, simulate, sweep, trace_stats

__all__ = ["KVCache", "as_key", "prefix_hashes", "LRU", "LFU", "make_policy", "Trace",
           "load_trace", "SimResult", "simulate", "sweep", "trace_stats", "simulate_engine",
           "EngineResult"]

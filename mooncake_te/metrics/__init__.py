# SPDX-License-Identifier: Apache-2.0
"""Observability: the engine's transfer counters, Prometheus exposition, ``mooncake-te top``.

- :class:`TransferMetrics` (``cells.py``): per (peer, transport, op) counters and latency
  histograms the native batch updates without locks; ``eng.metrics()`` reads them.
- :func:`track` / :func:`serve` (``prometheus.py``): engines, KV caches, P2P stores and
  the HTTP metadata server export through one registry; ``metrics_port`` in
  ``[transfer_engine]`` (``MC_METRICS_PORT``) serves it at ``/metrics`` on loopback.

docs/observability.md lists every metric.
"""
from .cells import TransferMetrics, quantile
from .prometheus import (Collector, MetricsServer, exposition, install, registry, serve,
                         track, untrack)

__all__ = ["TransferMetrics", "quantile", "Collector", "MetricsServer", "exposition",
           "install", "registry", "serve", "track", "untrack"]

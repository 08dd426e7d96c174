# SPDX-License-Identifier: Apache-2.0
"""``TransferEngine.metrics()``: every counter of an engine as one dict, read on demand."""
from __future__ import annotations

import logging

from ..errors import MooncakeError

log = logging.getLogger("mooncake_te")


def engine_metrics(eng) -> dict:
    """The metrics of engine ``eng`` (see docs/observability.md for every key).

    Returns
    -------
    dict
        ``engine``: its name; ``enabled``: whether transfers are counted
        (``[transfer_engine] metrics`` / ``MC_METRICS``); ``transfers``: one dict per
        (peer, transport, op) with ``requests``, ``bytes`` (of completed requests),
        ``failures``, ``failures_by_status`` ({status code: count}), ``batches`` and the
        histograms ``request_latency`` / ``batch_latency`` (``count``, ``sum_s``,
        ``buckets`` [(upper bound in seconds, cumulative count)]); ``connections``
        (``open``, ``accepted``: data connections peers made to us); ``auth_failures``
        (``rpc``, ``data``); ``notifications`` (``received``, ``dropped``);
        ``queue_depth`` ({peer: slices queued, not yet on a TCP lane});
        ``registered_bytes`` ({location: bytes}, e.g. ``cpu:0``, ``cuda:1``);
        ``regions``; ``rdma`` ({device: slices, bytes, completions, errors, retries}).
    """
    tm = getattr(eng, "_tmetrics", None)
    out = {"engine": eng.name, "enabled": tm is not None,
           "transfers": tm.snapshot() if tm is not None else []}
    tcp = eng._transports.get("tcp")
    c = tcp.counters() if tcp is not None else {}
    out["connections"] = {"open": int(c.get("connections", 0)),
                          "accepted": int(c.get("connections_accepted", 0)),
                          "refused": int(c.get("connections_refused", 0))}
    out["auth_failures"] = {"rpc": int(eng._rpc.auth_failures),
                            "data": int(c.get("auth_failures", 0))}
    out["notifications"] = {"received": int(c.get("notifications_received", 0)),
                            "dropped": int(c.get("notifications_dropped", 0))}
    out["queue_depth"] = {k: int(v) for k, v in c.get("queued", {}).items()}
    by_loc: dict = {}
    regions = eng.regions
    for r in regions:
        loc = str(r.location)
        by_loc[loc] = by_loc.get(loc, 0) + int(r.length)
    out["registered_bytes"] = by_loc
    out["regions"] = len(regions)
    rdma = eng._transports.get("rdma")
    out["rdma"] = {}
    if rdma is not None and hasattr(rdma, "stats"):
        try:
            out["rdma"] = {dev: {k: int(v) for k, v in s.items()}
                           for dev, s in rdma.stats().items()}
        except Exception:           # a closing transport must not break a scrape
            log.debug("rdma stats unavailable", exc_info=True)
    return out


def attach(eng, te: dict) -> None:
    """Set up an engine's metrics from its ``[transfer_engine]`` settings: the transfer
    counters (``metrics``, on by default), export through the registry, and the /metrics
    listener (``metrics_port``, 0: none)."""
    from .cells import TransferMetrics
    eng._tmetrics = TransferMetrics() if te.get("metrics", True) else None
    eng._metrics_server = None
    try:
        from . import prometheus
        prometheus.track("engine", eng)
    except ModuleNotFoundError:          # pragma: no cover - part of the package
        return
    port = int(te.get("metrics_port", 0) or 0)
    if port:
        # Asked for and impossible: an error (the engine is closed), not a warning in a
        # log nobody reads while /metrics serves nothing.
        prometheus._require(f"metrics_port = {port} (/metrics)")
        try:
            eng._metrics_server = prometheus.serve(port, "127.0.0.1",
                                                   getattr(eng, "_token", None))
        except MooncakeError as e:
            # Metrics must not stop an engine from moving bytes; a busy port is common
            # when processes inherit MC_METRICS_PORT (bench targets, vLLM workers).
            log.warning("engine %s: %s", eng.name, e)
            return
        log.info("metrics of %s at %s", eng.name, eng._metrics_server.url)


def set_enabled(eng, on: bool) -> None:
    """Turn the counting of ``eng``'s transfers on or off while it runs (batches already
    submitted keep their cells); what was counted stays readable. For A/B measurements
    of the overhead in one process (benchmarks/metrics_overhead.py)."""
    from .cells import TransferMetrics
    keep = getattr(eng, "_tmetrics_kept", None) or getattr(eng, "_tmetrics", None) \
        or TransferMetrics()
    eng._tmetrics_kept = keep
    eng._tmetrics = keep if on else None


def detach(eng) -> None:
    """Stop exporting ``eng`` (its counters stay readable)."""
    from . import prometheus
    prometheus.untrack(eng)
    server = getattr(eng, "_metrics_server", None)
    if server is not None:
        eng._metrics_server = None
        server.release()

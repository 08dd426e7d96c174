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
        ``regions``; and per transport that declares device counters
        (``Transport.device_counter_defs``), under its name, {device: {counter: value}}
        (``rdma``: slices, bytes, completions, errors, retries).
    """
    core = eng.internal
    tm = core.transfer_metrics
    out = {"engine": eng.name, "enabled": tm is not None,
           "transfers": tm.snapshot() if tm is not None else []}
    running = core.transports()
    c = transport_counters(running)
    out["connections"] = {"open": int(c.get("connections", 0)),
                          "accepted": int(c.get("connections_accepted", 0)),
                          "refused": int(c.get("connections_refused", 0))}
    out["auth_failures"] = {"rpc": core.rpc_auth_failures,
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
    for t in running:
        if not t.device_counter_defs:
            continue
        try:
            out[t.name] = {dev: {k: int(v) for k, v in s.items()}
                           for dev, s in t.device_counters().items()}
        except Exception:           # a closing transport must not break a scrape
            log.debug("%s device counters unavailable", t.name, exc_info=True)
            out[t.name] = {}
    return out


def transport_counters(transports) -> dict:
    """The engine-wide counters of every transport (``Transport.counters()``) added up:
    numbers summed, dicts of numbers (``queued``: {peer: slices}) merged and summed."""
    total: dict = {}
    for t in transports:
        for k, v in t.counters().items():
            if isinstance(v, dict):
                d = total.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
            else:
                total[k] = total.get(k, 0) + v
    return total


def attach(eng, te: dict, token: "bytes | None" = None):
    """Export an engine's metrics through the registry and start the /metrics listener
    of its ``[transfer_engine]`` settings (``metrics_port``, 0: none; ``token``: the
    engine's auth token, which the listener asks scrapers for); returns that listener
    (or None), which :func:`detach` stops."""
    try:
        from . import prometheus
        prometheus.track("engine", eng)
    except ModuleNotFoundError:          # pragma: no cover - part of the package
        return None
    port = int(te.get("metrics_port", 0) or 0)
    if not port:
        return None
    # Asked for and impossible: an error (the engine is closed), not a warning in a
    # log nobody reads while /metrics serves nothing.
    prometheus.require(f"metrics_port = {port} (/metrics)")
    try:
        server = prometheus.serve(port, "127.0.0.1", token)
    except MooncakeError as e:
        # Metrics must not stop an engine from moving bytes; a busy port is common
        # when processes inherit MC_METRICS_PORT (bench targets, vLLM workers).
        log.warning("engine %s: %s", eng.name, e)
        return None
    log.info("metrics of %s at %s", eng.name, server.url)
    return server


def set_enabled(eng, on: bool) -> None:
    """Turn the counting of ``eng``'s transfers on or off while it runs (batches already
    submitted keep their cells); what was counted stays readable. For A/B measurements
    of the overhead in one process (benchmarks/metrics_overhead.py)."""
    eng.internal.count_transfers(on)


def detach(eng, server=None) -> None:
    """Stop exporting ``eng`` (its counters stay readable) and release ``server`` (what
    :func:`attach` returned)."""
    from . import prometheus
    prometheus.untrack(eng)
    if server is not None:
        server.release()

# SPDX-License-Identifier: Apache-2.0
"""Prometheus exposition: one collector reads every tracked component at scrape time.

Components (engines, KV caches, P2P stores, metadata servers) are *tracked* weakly with
:func:`track`; nothing is counted twice or kept alive by the registry. A scrape asks each
one for its counters (``eng.metrics()``, ``cache.stats()``, ...), so metrics cost nothing
between scrapes. Names follow Prometheus conventions: ``mooncake_te_`` prefix, base units
(bytes, seconds), ``_total`` for counters; docs/observability.md lists them all.
"""
from __future__ import annotations

import logging
import threading
import weakref

from .. import errors as E

log = logging.getLogger("mooncake_te")

_sources: list = []                  # [(kind, weakref)]


class _FinalizerSafeLock:
    """A lock that a finalizer may reach while its own thread holds it.

    The cyclic garbage collector runs finalizers (an unclosed engine's or store's
    ``__del__``, which untracks it) at any allocation, so also inside :func:`track`
    while it holds the lock. A plain lock then deadlocks the thread on itself; a bare
    ``RLock`` would let the finalizer edit the list the outer section is rebuilding.
    Here a section entered again by the same thread (``busy``) queues its work, which
    the outer section runs when it ends; other threads wait as for any lock."""

    def __init__(self):
        self._lock = threading.RLock()
        self._busy = 0
        self._later: list = []

    def run(self, fn, defer_ok: bool = True):
        """``fn()`` under the lock; when this thread is inside a section already (a
        finalizer), queued to run at its end (``defer_ok``) and None returned."""
        with self._lock:
            if self._busy and defer_ok:
                self._later.append(fn)
                return None
            self._busy += 1
            try:
                return fn()
            finally:
                # Queued work runs before the lock is let go, with the section still
                # marked busy (it may queue more; the loop takes that too).
                try:
                    while self._later and self._busy == 1:
                        self._later.pop(0)()
                finally:
                    self._busy -= 1


_sources_lock = _FinalizerSafeLock()


def track(kind: str, obj) -> None:
    """Export ``obj`` (``kind``: ``"engine"``, ``"kvcache"``, ``"p2p_store"``,
    ``"metadata_server"``) through the registry until it is garbage-collected or
    :func:`untrack`-ed."""
    if kind not in _EXPORTERS:
        raise E.InvalidArgumentError(f"unknown metrics source kind {kind!r}; use one of "
                                     f"{', '.join(_EXPORTERS)}")
    def add():
        _sources[:] = [(k, r) for k, r in _sources if r() is not None]
        if not any(r() is obj for _, r in _sources):
            _sources.append((kind, weakref.ref(obj)))
    _sources_lock.run(add, defer_ok=False)


def untrack(obj) -> None:
    """Stop exporting ``obj``. Safe from a finalizer (see :class:`_FinalizerSafeLock`):
    run inside another section of this thread, it takes effect when that one ends."""
    ref = weakref.ref(obj)

    def drop():
        _sources[:] = [(k, r) for k, r in _sources if r() is not None and r() is not ref()]
    _sources_lock.run(drop)


def _live() -> list:
    return _sources_lock.run(
        lambda: [(k, o) for k, o in ((k, r()) for k, r in _sources) if o is not None],
        defer_ok=False)


# --- families --------------------------------------------------------------------------
class _Families:
    """Samples grouped by metric name, so several engines share one family."""

    def __init__(self):
        self.fams: dict = {}

    def _fam(self, kind, name, doc, labels):
        f = self.fams.get(name)
        if f is None:
            f = self.fams[name] = (kind, doc, tuple(labels), [])
        return f

    def counter(self, name, doc, labels: dict, value):
        self._fam("counter", name, doc, labels)[3].append((labels, value))

    def gauge(self, name, doc, labels: dict, value):
        self._fam("gauge", name, doc, labels)[3].append((labels, value))

    def histogram(self, name, doc, labels: dict, hist: dict):
        self._fam("histogram", name, doc, labels)[3].append((labels, hist))

    def build(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        from prometheus_client.utils import floatToGoString
        for name, (kind, doc, labels, samples) in self.fams.items():
            if kind == "counter":
                f = CounterMetricFamily(name, doc, labels=labels)
                for lab, v in samples:
                    f.add_metric([str(lab[k]) for k in labels], v)
            elif kind == "gauge":
                f = GaugeMetricFamily(name, doc, labels=labels)
                for lab, v in samples:
                    f.add_metric([str(lab[k]) for k in labels], v)
            else:
                f = HistogramMetricFamily(name, doc, labels=labels)
                for lab, h in samples:
                    f.add_metric([str(lab[k]) for k in labels],
                                 [(floatToGoString(b), c) for b, c in h["buckets"]],
                                 h["sum_s"])
            yield f


def _merge_hist(a: dict | None, b: dict) -> dict:
    if a is None:
        return {"count": b["count"], "sum_s": b["sum_s"], "buckets": list(b["buckets"])}
    a["count"] += b["count"]
    a["sum_s"] += b["sum_s"]
    a["buckets"] = [(bound, x + y) for (bound, x), (_, y) in zip(a["buckets"], b["buckets"])]
    return a


# --- exporters, one per kind of component ---------------------------------------------
def _export_engine(f: _Families, eng) -> None:
    if eng.internal.closed:
        return
    m = eng.metrics()
    e = {"engine": m["engine"]}
    f.gauge("mooncake_te_metrics_enabled", "1 when this engine counts transfers "
            "([transfer_engine] metrics / MC_METRICS)", e, 1 if m["enabled"] else 0)
    req_h: dict = {}
    batch_h: dict = {}
    for t in m["transfers"]:
        lab = dict(e, peer=t["peer"], transport=t["transport"], op=t["op"])
        f.counter("mooncake_te_transfer_bytes", "Bytes moved by completed requests",
                  lab, t["bytes"])
        f.counter("mooncake_te_transfer_requests", "Requests completed successfully",
                  lab, t["requests"])
        f.counter("mooncake_te_transfer_batches", "Batches finished (the transport and "
                  "peer of their first request)", lab, t["batches"])
        for code, n in t["failures_by_status"].items():
            f.counter("mooncake_te_transfer_failures", "Requests that failed, by status "
                      "code (batch.py error_for says what each means)",
                      dict(lab, status=code), n)
        k = (t["transport"], t["op"])
        req_h[k] = _merge_hist(req_h.get(k), t["request_latency"])
        batch_h[t["transport"]] = _merge_hist(batch_h.get(t["transport"]), t["batch_latency"])
    for (transport, op), h in req_h.items():
        f.histogram("mooncake_te_transfer_request_duration_seconds", "Per request, submit to "
                    "complete", dict(e, transport=transport, op=op), h)
    for transport, h in batch_h.items():
        f.histogram("mooncake_te_transfer_batch_duration_seconds", "Per batch, submit to "
                    "the last request (and notification) done", dict(e, transport=transport), h)
    f.gauge("mooncake_te_connections", "Data connections peers hold to this engine", e,
            m["connections"]["open"])
    f.counter("mooncake_te_connections_accepted", "Data connections peers made to this "
              "engine", e, m["connections"]["accepted"])
    f.counter("mooncake_te_connections_refused", "Data connections closed by the data "
              "port's limits (over the connection limits, hello deadline, idle)", e,
              m["connections"].get("refused", 0))
    for channel, n in m["auth_failures"].items():
        f.counter("mooncake_te_auth_failures", "Peers refused because they could not "
                  "prove the auth token", dict(e, channel=channel), n)
    f.counter("mooncake_te_notifications_received", "Notifications delivered to this "
              "engine", e, m["notifications"]["received"])
    f.counter("mooncake_te_notifications_dropped", "Notifications refused (over 1 MiB, "
              "or out of memory)", e, m["notifications"]["dropped"])
    for peer, n in m["queue_depth"].items():
        f.gauge("mooncake_te_queue_depth", "Slices queued to a peer, not yet on a lane",
                dict(e, peer=peer), n)
    for loc, n in m["registered_bytes"].items():
        f.gauge("mooncake_te_registered_bytes", "Bytes of registered memory, by location",
                dict(e, location=loc), n)
    f.gauge("mooncake_te_registered_regions", "Registered memory regions", e, m["regions"])
    for t in eng.internal.transports():      # the per-device counters each declares
        for dev, s in m.get(t.name, {}).items():
            lab = dict(e, device=dev)
            for d in t.device_counter_defs:
                f.counter(f"mooncake_te_{t.name}_{d.metric}", d.help, lab, s.get(d.key, 0))

# (key in KVCache.stats() = metric name, help) of the KV cache's plain counters.
_KV_COUNTERS = (
    ("miss_blocks", "Blocks of looked-up prefixes not found"),
    ("lookup_blocks", "Blocks asked for by lookups"),
    ("lookup_tokens", "Tokens asked for by lookups"),
    ("hit_tokens", "Tokens of looked-up prefixes found"),
    ("get_misses", "get() calls for blocks held nowhere"),
    ("put_bytes", "Bytes stored by put()"),
    ("demoted_bytes", "Bytes demoted from DRAM to SSD"),
    ("demotions", "Blocks demoted from DRAM to SSD"),
    ("promotions", "Blocks promoted from SSD to DRAM"),
    ("promoted_bytes", "Bytes promoted from SSD to DRAM"),
    ("corrupt_dropped", "Blocks dropped because their checksum did not "
                                           "match"),
    ("remote_failed", "Reads from peers that failed"),
    ("remote_rejected_records", "Owner-index records refused: malformed, or without a "
                                "valid MAC (issue 35)"),
)


def _export_kvcache(f: _Families, cache) -> None:
    s = cache.stats()
    c = {"cache": str(getattr(cache, "namespace", "") or "default")}
    # The tiers are data: KVCache.stats() names them, in its registry's order
    # (kvcache/tiers.py); a tier with a capacity has occupancy gauges.
    tiers = s.get("tiers") or ("dram", "ssd", "remote")
    for tier in tiers:
        f.counter("mooncake_te_kvcache_hit_blocks", "Blocks of looked-up prefixes found, by "
                  "tier", dict(c, tier=tier), s.get(f"hit_blocks_{tier}", 0))
    for key, doc in _KV_COUNTERS:
        if key in s:                  # promoted_bytes: once the cache counts it
            f.counter(f"mooncake_te_kvcache_{key}", doc, c, s[key])
    for tier in tiers:
        f.counter("mooncake_te_kvcache_served_bytes", "Bytes served by get(), by tier",
                  dict(c, tier=tier), s.get(f"served_{tier}_bytes", 0))
    for tier in tiers:
        if f"evictions_{tier}" in s:
            f.counter("mooncake_te_kvcache_evictions", "Blocks evicted, by tier",
                      dict(c, tier=tier), s[f"evictions_{tier}"])
    for tier in tiers:
        if f"{tier}_capacity_bytes" not in s:
            continue
        f.gauge("mooncake_te_kvcache_bytes", "Bytes held, by tier", dict(c, tier=tier),
                s.get(f"{tier}_bytes", 0))
        f.gauge("mooncake_te_kvcache_capacity_bytes", "Capacity, by tier", dict(c, tier=tier),
                s.get(f"{tier}_capacity_bytes", 0))
        f.gauge("mooncake_te_kvcache_blocks", "Blocks held, by tier", dict(c, tier=tier),
                s.get(f"{tier}_blocks", 0))


def _export_p2p_store(f: _Families, store) -> None:
    s = store.stats()
    st = {"store": str(getattr(store, "name", "") or "p2p_store")}
    for key, doc in (("bytes_uploaded", "Bytes of chunks peers fetched from this store"),
                     ("bytes_downloaded", "Bytes of chunks this store fetched"),
                     ("chunks_uploaded", "Chunks peers fetched from this store"),
                     ("chunks_downloaded", "Chunks this store fetched"),
                     ("corrupt_chunks", "Chunks received with a bad checksum and refused"),
                     ("repaired_chunks", "Corrupt local chunks fetched again")):
        f.counter(f"mooncake_te_p2p_{key}", doc, st, s.get(key, 0))
    for holder, n in s.get("chunks_from", {}).items():
        f.counter("mooncake_te_p2p_holder_chunks", "Chunks fetched from each holder",
                  dict(st, holder=holder), n)
    for holder, n in s.get("bytes_from", {}).items():
        f.counter("mooncake_te_p2p_holder_bytes", "Bytes fetched from each holder",
                  dict(st, holder=holder), n)
    for getter, n in s.get("chunks_to", {}).items():
        f.counter("mooncake_te_p2p_getter_chunks", "Chunks each getter fetched from us",
                  dict(st, getter=getter), n)
    f.gauge("mooncake_te_p2p_objects", "Objects this store holds or fetched", st,
            len(s.get("objects", {})))


def _export_metadata_server(f: _Families, server) -> None:
    s = server.stats()
    lab = {"server": s.get("url", "")}
    f.gauge("mooncake_te_metadata_keys", "Keys the metadata server holds", lab, s["keys"])
    for (method, code), n in s["requests"].items():
        f.counter("mooncake_te_metadata_requests", "HTTP requests served, by method and "
                  "status", dict(lab, method=method, code=code), n)
    f.histogram("mooncake_te_metadata_persist_duration_seconds", "Writing the persistence "
                "file (snapshot, fsync, rename)", lab, s["persist"])


_EXPORTERS = {"engine": _export_engine, "kvcache": _export_kvcache,
              "p2p_store": _export_p2p_store, "metadata_server": _export_metadata_server}


class Collector:
    """A prometheus_client collector of every tracked component."""

    def collect(self):
        f = _Families()
        for kind, obj in _live():
            try:
                _EXPORTERS[kind](f, obj)
            except Exception:         # one broken component must not hide the others
                log.warning("metrics: cannot read %s %r", kind, obj, exc_info=True)
        yield from f.build()

    def describe(self):
        return []                     # unchecked collector: families vary with traffic


_registry = None
_collector = Collector()


def registry():
    """The registry /metrics serves (created on first use; needs prometheus-client)."""
    global _registry
    require()
    if _registry is None:
        from prometheus_client import CollectorRegistry
        reg = CollectorRegistry(auto_describe=False)
        reg.register(_collector)
        _registry = reg
    return _registry


def install(target=None) -> None:
    """Also export through ``target`` (default prometheus_client's global REGISTRY), e.g.
    so a process that already serves /metrics (vLLM) shows ours beside its own."""
    require()
    if target is None:
        from prometheus_client import REGISTRY as target
    try:
        target.register(_collector)
    except ValueError:
        pass                          # already installed there


def exposition() -> bytes:
    """The text format of every tracked component (what /metrics answers)."""
    from prometheus_client import generate_latest
    return generate_latest(registry())


MISSING = ("prometheus-client is not installed (a dependency of mooncake_te that this "
           "environment lacks, e.g. after pip install --no-deps): pip install "
           "'prometheus-client>=0.20', or pip install '.[metrics]' in a mooncake_te clone")


def require(what: str = "Prometheus metrics") -> None:
    try:
        import prometheus_client  # noqa: F401
    except ModuleNotFoundError:
        raise E.MooncakeError(f"{what} need(s) {MISSING}") from None


# --- the /metrics server ---------------------------------------------------------------
_servers: dict = {}                   # (host, port) -> [server, thread, users]
_servers_lock = _FinalizerSafeLock()      # release() runs in engines' finalizers


class MetricsServer:
    """A handle on the process's /metrics listener at ``(host, port)``; shared by every
    engine asking for the same port, stopped when the last one releases it."""

    def __init__(self, host: str, port: int):
        self.key = (host, port)
        self.host, self.port = host, port
        self._released = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def release(self) -> None:
        if self._released:
            return
        self._released = True

        def drop():
            entry = _servers.get(self.key)
            if entry is None:
                return
            entry[2] -= 1
            if entry[2] > 0:
                return
            del _servers[self.key]
            entry[0].shutdown()
            entry[0].server_close()
        _servers_lock.run(drop)

    def __repr__(self) -> str:
        return f"<MetricsServer {self.url}>"


def serve(port: int, host: str = "127.0.0.1", token: bytes | None = None) -> MetricsServer:
    """Serve /metrics on ``host:port`` (port 0 picks a free one; loopback by default:
    anyone who can reach it learns peer names and traffic). With ``token`` (the engine's
    ``auth_token``) a scrape must send ``Authorization: Bearer <credential>``
    (:func:`~mooncake_te.metadata.framing.metrics_credential`). The listener is the
    shared control-plane accept loop (metrics/http.py), not prometheus_client's
    thread-per-connection server."""
    registry()
    from .http import HttpMetricsServer

    def acquire():
        nonlocal port
        entry = _servers.get((host, port)) if port else None
        if entry is None:
            try:
                server = HttpMetricsServer(host, port, exposition, token)
            except OSError as e:
                raise E.MooncakeError(f"cannot serve /metrics on {host}:{port}: "
                                      f"{e.strerror or e}; pick another metrics_port "
                                      f"(MC_METRICS_PORT) or 0 for none") from None
            port = server.server_address[1]
            entry = _servers[(host, port)] = [server, None, 0]
        entry[2] += 1
    _servers_lock.run(acquire, defer_ok=False)
    return MetricsServer(host, port)

# SPDX-License-Identifier: Apache-2.0
"""What the three stores share: liveness by lease/TTL and errors that say what to do.

Mooncake's stores keep a segment's keys until someone deletes them, so an engine that
dies leaves its descriptor behind and peers keep writing to addresses that no longer
exist (``../reference/mooncake-te.md`` §9; Mooncake issue #2762). Here every key an
engine publishes is tied to a lifetime of ``ttl`` seconds (an etcd lease, a redis
``EX``, our HTTP server's per-key TTL) that a background thread renews every
``ttl / 3`` seconds; a SIGKILLed engine stops renewing and its keys vanish within
``ttl``. Renewal re-puts the current values, so a store that lost its data (a redis or
metadata server restarted without persistence) gets them back within one period.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from abc import abstractmethod
from urllib.parse import parse_qsl

from ...errors import MetadataError, SegmentNotFoundError, ERR_MALFORMED_JSON
from ..base import KeyValueBackend, ram_key, rpc_meta_key
from ..descriptor import SegmentDescriptor

log = logging.getLogger("mooncake_te.metadata")

#: default lifetime of published keys, seconds (``MC_METADATA_TTL`` or ``?ttl=`` override)
DEFAULT_TTL = 10.0

# Default ports of each kind of server, used only to guess a likely mistake in errors
# (reference §10 item 4: Mooncake issues #16 and #391 are an etcd port given to the wrong
# backend). 2379: etcd client port; 6379: redis; 8080: Mooncake's HTTP metadata server.
_DEFAULT_PORTS = {2379: "etcd", 2380: "etcd (peer port)", 6379: "redis", 8080: "http"}


def split_options(rest: str) -> tuple[str, dict]:
    """``"h:2379?ttl=3"`` -> (``"h:2379"``, ``{"ttl": "3"}``)."""
    base, sep, query = rest.partition("?")
    return base, (dict(parse_qsl(query, keep_blank_values=True)) if sep else {})


def ttl_from(options: dict) -> float:
    raw = options.pop("ttl", None) or os.environ.get("MC_METADATA_TTL") or DEFAULT_TTL
    try:
        ttl = float(raw)
    except ValueError:
        raise MetadataError(f"metadata TTL {raw!r} is not a number of seconds "
                            f"(from '?ttl=' or MC_METADATA_TTL)") from None
    if ttl < 1:
        raise MetadataError(f"metadata TTL {ttl} s is too short; use at least 1 s "
                            f"(peers must renew it three times per TTL)")
    return ttl


def port_hint(kind: str, port: int | None) -> str:
    """A sentence naming the likely mistake when ``port`` is another server's default."""
    other = _DEFAULT_PORTS.get(port or 0)
    if other is None or other.startswith(kind):
        return ""
    scheme = other.split()[0]
    if scheme == "etcd" and other != "etcd":
        return f" Port {port} is etcd's peer port; clients use 2379."
    return (f" Port {port} is {other}'s default port: did you mean "
            f"metadata='{scheme}://HOST:{port}{'/metadata' if scheme == 'http' else ''}' "
            f"(config.toml [metadata] server_type = \"{scheme}\")?")


def identify_http(host: str, port: int, timeout: float = 1.0) -> str:
    """What HTTP server, if any, answers at ``host:port``: a hint sentence or ``""``.

    Used after a protocol failure (the redis client reading garbage, the connection
    closed at once) to name what the user actually pointed at: etcd answers
    ``GET /version`` with ``{"etcdserver": ...}``, our metadata server answers
    ``GET /health``.
    """
    import http.client
    for path in ("/version", "/health"):
        try:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                conn.request("GET", path)
                r = conn.getresponse()
                body = r.read(200).decode(errors="replace")
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):
            return ""
        if path == "/version" and r.status == 200 and "etcdserver" in body:
            return (f" {host}:{port} is an etcd server: use metadata='etcd://{host}:{port}' "
                    f"(server_type = \"etcd\").")
        if path == "/health" and r.status == 200:
            return (f" {host}:{port} is an HTTP metadata server: use "
                    f"metadata='http://{host}:{port}/metadata' (server_type = \"http\").")
    return f" {host}:{port} answers HTTP: an HTTP metadata server? use http://{host}:{port}/metadata."


_GARBAGE = object()


def is_rpc_meta(key: str) -> bool:
    """Whether ``key`` is a ``mooncake/[<cluster>/]rpc_meta/<name>`` key."""
    return "/rpc_meta/" in key


def _instance_of(raw: bytes | None):
    """The ``instance_id`` in a stored descriptor; None if missing, _GARBAGE if unreadable."""
    if raw is None:
        return None
    try:
        return str(json.loads(raw).get("instance_id", ""))
    except (ValueError, AttributeError):
        return _GARBAGE


class LeasedStore(KeyValueBackend):
    """A :class:`KeyValueBackend` whose published keys live only while it renews them.

    Subclasses implement ``get``/``put``/``delete`` plus :meth:`_put_leased` (put with
    the lifetime attached), :meth:`_renew` (extend or re-create every owned key) and
    :meth:`_release` (end the lifetime at close).

    Parameters
    ----------
    address : str
        What the user gave, shown in every error.
    ttl : float
        Seconds a key outlives its last renewal.
    """

    def __init__(self, address: str, ttl: float, cluster_id: str | None = None):
        super().__init__(cluster_id)
        self.address = address
        self.ttl = float(ttl)
        self._lock = threading.RLock()          # one request at a time per client
        self._owned: dict[str, dict[str, bytes]] = {}   # segment name -> {key: value}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False
        self._failing = False                   # renewal failing: log once per outage
        #: ``callable(name, instance_id or None)``: set it to hear that a fetched peer
        #: restarted (new instance id) or vanished (None); see :meth:`_check_peers`
        self.on_change = None
        self._seen: dict[str, str] = {}        # watched peer -> instance id last seen
        self._rpc_written: dict[str, bytes] = {}   # rpc_meta key -> value the store has
        self._watch_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address!r} ttl={self.ttl:g}s>"

    # -- the lifetime hooks -------------------------------------------------------------
    @abstractmethod
    def _put_leased(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` so that it expires ``ttl`` after the last renewal."""

    @abstractmethod
    def _renew(self, records: dict[str, bytes]) -> None:
        """Extend the lifetime of every owned key, re-creating any the store lost."""

    def _release(self) -> None:
        """End the lifetime (etcd: revoke the lease). Keys are deleted before this."""

    # -- MetadataBackend ----------------------------------------------------------------
    def publish(self, desc: SegmentDescriptor) -> None:
        records = dict(self.records(desc))
        with self._lock:
            if self._closed:
                raise MetadataError(f"{self.kind} metadata backend {self.address!r} is closed")
            # Own the records first: if the store is down now, the renewer publishes
            # them as soon as it is back.
            first = desc.name not in self._owned
            self._owned[desc.name] = records
            try:
                for key, value in records.items():
                    if is_rpc_meta(key):
                        self._publish_rpc_meta(key, value)
                    else:
                        self._put_leased(key, value)
            except MetadataError:
                if first:   # nothing stored yet: nothing to renew, nothing to withdraw
                    del self._owned[desc.name]
                raise
        self._start_renewer()

    def _publish_rpc_meta(self, key: str, value: bytes) -> None:
        """Write ``rpc_meta`` once, and again only when it changes, as Mooncake's engine
        does (it writes the key at init and deletes it at shutdown): Mooncake's HTTP
        metadata server refuses a second PUT of an rpc_meta key, so re-writing it on
        every descriptor publish broke every registration after the first."""
        old = self._rpc_written.get(key)
        if old == value:
            return
        if old is not None:
            self.delete(key)         # changed: Mooncake's server refuses an overwrite
            self._rpc_written.pop(key, None)
        self._put_leased(key, value)
        self._rpc_written[key] = value

    def unpublish(self, name: str) -> None:
        with self._lock:
            records = self._owned.pop(name, None)
            keys = list(records) if records else [ram_key(name, self.cluster_id),
                                                    rpc_meta_key(name, self.cluster_id)]
            for key in keys:
                self._rpc_written.pop(key, None)
                self.delete(key)

    def fetch(self, name: str, timeout: float) -> SegmentDescriptor:
        key = ram_key(name, self.cluster_id)
        raw = self.get(key)
        if raw is None:
            raise SegmentNotFoundError(
                f"no segment named {name!r} in the {self.kind} metadata store {self.address} "
                f"(key {key!r}); is the peer running, and does it use the same metadata "
                f"server and MC_METADATA_CLUSTER_ID?")
        try:
            desc = SegmentDescriptor.decode(raw)
        except MetadataError as e:
            preview = bytes(raw[:40])
            raise MetadataError(
                f"{self.kind} metadata store {self.address!r}: key {key!r} holds "
                f"{len(raw)} bytes that are not a segment descriptor ({e}; starts with "
                f"{preview!r}); something other than a mooncake engine wrote it. Delete the "
                f"key or use another MC_METADATA_CLUSTER_ID.", status=ERR_MALFORMED_JSON) from None
        if desc.name != name:
            # Another engine's descriptor under this name (copied there by mistake or by
            # someone who can write the store): using it would send A's bytes to B.
            raise MetadataError(
                f"{self.kind} metadata store {self.address!r}: the key for segment {name!r} "
                f"({key!r}) holds the descriptor of segment {desc.name!r} (instance "
                f"{desc.instance_id}); refusing to use it. The key is stale or forged: "
                f"delete it, and set an auth_token so the data handshake checks identities")
        if self.on_change is not None:
            with self._watch_lock:
                self._seen[name] = desc.instance_id
            self._start_renewer()
        return desc

    # -- watching peers -----------------------------------------------------------------
    def forget(self, name: str) -> None:
        """Stop watching ``name`` (the caller no longer cares whether it restarts)."""
        with self._watch_lock:
            self._seen.pop(name, None)

    def _check_peers(self) -> None:
        """Report peers whose instance changed or vanished since they were fetched.

        Polled every TTL/3 with the renewals, so a restarted peer is noticed (and its
        cached descriptor dropped by the callback) before the next transfer that comes
        later than that, instead of that transfer failing on the dead instance. A
        watch (etcd) would be quicker; polling works the same on all three stores.
        """
        with self._watch_lock:
            seen = dict(self._seen)
        if not seen or self.on_change is None:
            return
        names = list(seen)
        raws = self.get_many([ram_key(n, self.cluster_id) for n in names])
        for name, raw in zip(names, raws):
            inst = _instance_of(raw)
            if inst == seen[name] or inst is _GARBAGE:
                continue
            with self._watch_lock:
                if self._seen.get(name) != seen[name]:
                    continue        # fetched again meanwhile: that fetch is newer
                if inst is None:
                    self._seen.pop(name, None)
                else:
                    self._seen[name] = inst
            try:
                self.on_change(name, inst)
            except Exception:
                log.exception("on_change(%r, %r) failed", name, inst)

    def close(self) -> None:
        """Stop renewing, delete every key this backend still owns, end the lease."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if os.getpid() != self._pid:
            return          # a forked child does not own the parent's keys
        try:
            with self._lock:
                for name in list(self._owned):
                    records = self._owned.pop(name)
                    for key in records:
                        self._rpc_written.pop(key, None)
                        self.delete(key)
                self._release()
        except MetadataError as e:
            # The store is unreachable; the keys expire with their TTL anyway.
            log.warning("could not remove this engine's keys from %s: %s", self.address, e)
        finally:
            self._close_client()

    def _close_client(self) -> None:
        pass

    # -- the renewer --------------------------------------------------------------------
    def _start_renewer(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name=f"mte-{self.kind}-lease")
        self._thread.start()

    def _renew_loop(self) -> None:
        # Three renewals per TTL: one lost or slow renewal never lets the keys expire.
        period = self.ttl / 3.0
        while not self._stop.wait(period):
            t0 = time.monotonic()
            try:
                with self._lock:
                    if self._closed:
                        return
                    records = {k: v for recs in self._owned.values() for k, v in recs.items()}
                    if records:
                        self._renew(records)
                self._check_peers()
            except MetadataError as e:
                if not self._failing:
                    log.warning("cannot renew this engine's metadata in %s (%s); peers will "
                                "stop seeing it after %g s; retrying", self.address, e, self.ttl)
                self._failing = True
                continue
            except Exception:       # never let the renewer die silently
                log.exception("metadata renewal in %s failed", self.address)
                continue
            if self._failing:
                log.warning("metadata store %s reachable again; keys republished", self.address)
                self._failing = False
            log.debug("renewed %s in %.1f ms", self.address, (time.monotonic() - t0) * 1e3)

# SPDX-License-Identifier: Apache-2.0
"""The TransferEngine facade: registration, segments, transfers, notifications.

The work is done elsewhere, one job per module: ``routing`` (which transports run and
which carries a group), ``regions`` (registered memory and where it lives),
``segments`` (our descriptor, peers' descriptors), ``submit`` (requests checked and
grouped), ``auth`` (the token), ``netif`` (this host's address).
"""
from __future__ import annotations

import logging
import os
import secrets
import time
import warnings
from typing import Iterable, Sequence

from numpy.typing import ArrayLike

from . import errors as E
from . import submit as S
from .auth import check_token, derive_key, warn_unauthenticated
from .batch import Batch, Notification, Op, TransferRequest, error_for
from .config import Config
from .memory import MemoryRegion
from .metadata import SegmentDescriptor, open_backend
from .metadata.rpc import RpcServer
from .metadata.url import from_config as _metadata_from_config, parse as parse_metadata_url
from .metrics.cells import TransferMetrics
from .metrics.engine import attach as _attach_metrics, detach as _detach_metrics, engine_metrics
from .netif import default_host
from .regions import RegionBook
from .routing import Transports, probe_transports
from .segments import Peers, Segment, describe, target_name

log = logging.getLogger("mooncake_te")

__all__ = ["TransferEngine", "Segment", "default_host"]

_WRITE, _READ = int(Op.WRITE), int(Op.READ)
_U64 = (1 << 64) - 1
_getpid = os.getpid
_monotonic_ns = time.monotonic_ns


class TransferEngine:
    """Moves bytes between this process's registered memory and peers'.

    Parameters
    ----------
    name : str, optional
        Segment name peers use. With ``metadata="p2p"`` the name is always
        ``"<host>:<rpc port>"`` (peers find us by it), as in Mooncake's P2PHANDSHAKE mode.
    metadata : str
        ``"p2p"`` (default, no server), ``"etcd://h:2379"``, ``"redis://h:6379"``,
        ``"http://h:8080/metadata"``.
    protocol : str
        ``"auto"`` | ``"tcp"`` | ``"shm"`` | ``"rdma"``.
    devices : list of str or str, optional
        RDMA device allow-list.
    host : str, optional
        Address peers reach us at; default ``MC_TCP_BIND_ADDRESS``, else the first UP
        non-loopback interface, else 127.0.0.1.
    port : int
        RPC (handshake) port; 0 picks a free one.
    config : str or Config, optional
        A ``config.toml`` path or a :class:`Config`.
    auth_token : str or bytes, optional
        Shared secret (1-256 bytes; also ``[transfer_engine] auth_token`` or
        ``MC_AUTH_TOKEN``). Every RPC request and every data connection then runs a mutual
        HMAC-SHA256 challenge-response with fresh nonces; peers without the same token are
        refused (``AuthenticationError``) and nothing they send is applied.

    Examples
    --------
    >>> with TransferEngine(host="127.0.0.1") as eng:          # doctest: +SKIP
    ...     buf = bytearray(1 << 20); r = eng.register(buf)
    """

    def __init__(self, name: str | None = None, metadata: str | None = None,
                 protocol: str | None = None, devices: "str | Sequence[str] | None" = None,
                 host: str | None = None, port: int | None = None,
                 config: "str | os.PathLike | Config | None" = None,
                 auth_token: "str | bytes | None" = None):
        self._closed = True
        self._pid = os.getpid()
        self.config = cfg = Config.load(config)
        te = cfg["transfer_engine"]
        if metadata is None:
            metadata = _metadata_from_config(cfg["metadata"]["server_type"],
                                             cfg["metadata"]["server_address"])
        protocol = (protocol or te["protocol"] or "auto").lower()
        if isinstance(devices, str):
            devices = [d.strip() for d in devices.split(",") if d.strip()]
        self.devices = list(devices if devices is not None else te["device_names"])
        self._token = (check_token(te["auth_token"]) if auth_token is None
                       else check_token(auth_token, empty_ok=False))
        self.timeout = cfg.timeout_s
        self.host = host or te["host"] or default_host()
        port = te["port"] if port is None else port
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise E.InvalidArgumentError(f"port must be an int in 0..65535, got {port!r}")

        self.available_transports = probe_transports()
        self._tx = Transports(self.available_transports, protocol)

        self._book = RegionBook()
        self._regions = self._book.table
        self._tx.book = self._book
        self._instance = secrets.randbits(63) | 1
        self._rpc = RpcServer(self.host, port, self._describe_bytes, self._on_rpc_notify,
                              token=self._token, max_connections=te["rpc_max_connections"],
                              max_per_peer=te["rpc_max_per_peer"],
                              request_timeout=te["rpc_request_timeout_s"])
        if not self._token:
            warn_unauthenticated(self.host)
        self._p2p = parse_metadata_url(metadata).is_p2p
        own = f"{self.host}:{self._rpc.port}"
        if self._p2p and name and name != own:
            log.warning("metadata='p2p': the segment name is the RPC address %s, not %r", own, name)
        self.name = own if (self._p2p or not name) else name
        self._transports = self._tx.running      # name -> Transport, by priority
        self._peers = None
        self._tmetrics = self._tmetrics_kept = self._metrics_server = None
        self.internal = EngineInternal(self)
        self._sync_routes: dict = {}    # (name, op) -> _sync_route's entry
        try:
            self._tx.start(self._tx.context(
                regions=self._regions, host=self.host, name=self.name,
                instance=self._instance, config=te, token=self._token or b"",
                devices=self.devices, rpc=self._rpc, refresh_peer=self._refresh_peer))
            self._book.transports = list(self._transports.values())
            self._notifier = self._tx.notifier     # serves peers, carries notifications
            self._backend = open_backend(metadata, local_descriptor=self._describe_bytes,
                                         token=self._token)
            self._peers = Peers(self._backend, self._tx.forget, self.timeout)
            self._closed = False
            # Transfer counters (``metrics``, on by default), then export: eng.metrics(),
            # /metrics on metrics_port.
            self._tmetrics = TransferMetrics() if te.get("metrics", True) else None
            self._tmetrics_kept = self._tmetrics
            self._metrics_server = _attach_metrics(self, te, self._token)
            self._publish()
            self._published = True       # from now on close() withdraws the descriptor
        except BaseException:
            self._closed = False
            self.close()
            raise

    @property
    def authenticated(self) -> bool:
        """Whether this engine has an auth token (every peer it talks to proved it)."""
        return self._token is not None

    def derive_key(self, label: str) -> "bytes | None":
        """A key derived from the auth token for ``label`` (one purpose: a component's
        MACs, such as the KV cache's index records); None without a token. The token
        itself is never handed out."""
        return derive_key(self._token, label)

    @property
    def protocol(self) -> str:
        """The protocol this engine publishes (``"auto"`` resolved to the best started)."""
        return self._tx.protocol

    # --- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving, drop connections, withdraw the descriptor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            # A forked child's copy: the sockets, threads and published keys are the
            # parent's; tearing them down here would break the parent (pyzmq does the same).
            return
        _detach_metrics(self, self._metrics_server)
        self._metrics_server = None
        backend = getattr(self, "_backend", None)
        if backend is not None:
            try:
                if getattr(self, "_published", False):
                    backend.unpublish(self.name)
            except E.MooncakeError as e:
                log.warning("could not withdraw %s from metadata: %s", self.name, e)
            backend.close()
        if getattr(self, "_tx", None) is not None:
            self._tx.close()
        self._rpc.close()
        if getattr(self, "_book", None) is not None:
            for mr in self._book.all():
                mr.release()  # no I/O once the transports are closed: owners may resize

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            warnings.warn(f"TransferEngine {self.name} was not closed", ResourceWarning,
                          stacklevel=2)
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return (f"<TransferEngine {self.name} protocol={self.protocol} "
                f"regions={len(self._book)}{' closed' if self._closed else ''}>")

    def _check_open(self) -> None:
        if self._closed:
            raise E.ClosedError("the engine is closed; create a new TransferEngine")
        if os.getpid() != self._pid:
            # The connections (and, same-host, the pid peers copy into) are the parent's.
            raise E.InvalidArgumentError("this engine belongs to the parent process; create "
                                         "a new TransferEngine after fork()")

    # --- metadata ----------------------------------------------------------------------
    def descriptor(self) -> SegmentDescriptor:
        return describe(self.name, self.protocol, self.host, self._rpc.port, self._instance,
                        self.devices, self._book.published(), list(self._transports.values()))

    @property
    def metadata(self):
        """The metadata backend this engine publishes to (a ``MetadataBackend``; store
        backends are ``KeyValueBackend`` with get/put/delete), for components that keep
        their own keys beside the segment descriptors (kvcache index, P2P store)."""
        return self._backend

    def _describe_bytes(self) -> bytes:
        return self.descriptor().encode()

    def _publish(self) -> None:
        # p2p: peers ask our RPC port, which describes the live state; building the
        # descriptor here would make registering n regions cost O(n^2) for nothing.
        if not self._p2p:
            self._backend.publish(self.descriptor())

    def _on_rpc_notify(self, sender: str, message: bytes) -> None:
        self._notifier.deliver_notification(sender, message)

    def _refresh_peer(self, name: str) -> SegmentDescriptor:
        if self._peers is None:
            raise E.SegmentNotFoundError(f"{name}: the engine is starting")
        return self._peers.refresh(name)

    def _resolve(self, name: str) -> SegmentDescriptor:
        """The descriptor of ``name`` (``"<engine>/<storage>"``: a storage segment)."""
        return self._peers.resolve(name)

    def open_segment(self, name: "str | Segment", refresh: bool = False) -> Segment:
        """Resolve a peer's segment (cached; ``refresh=True`` asks again)."""
        self._check_open()
        if isinstance(name, Segment):
            name = name.name
        if not isinstance(name, str) or not name:
            raise E.InvalidArgumentError(f"segment name must be a non-empty str, got {name!r}")
        if "/" in name:                              # maybe a storage segment
            if refresh:
                self._peers.invalidate(name.rpartition("/")[0])
            return Segment(self._peers.resolve(name))
        return Segment(self._peers.get(name, refresh=refresh))

    # --- storage segments --------------------------------------------------------------
    def register_storage(self, name: str, path: str | None = None, nqn: str | None = None,
                         nsid: int = 1, size: int | None = None, transport: str | None = None,
                         address: str | None = None, service_id=None):
        """Publish a namespace or file as storage segment ``"<self.name>/<name>"``.

        Peers that connected to the subsystem (``mooncake-te nvmeof connect``), and this
        host itself, then move bytes between their registered memory and it with
        ``read``/``write``/``submit``: the target address is a byte offset.

        Parameters
        ----------
        name : str
            Storage name (no '/').
        path : str, optional
            Backing block device or file on this host (default: found from ``nqn``).
        nqn : str, optional
            The NVMe-oF subsystem serving it: one this host exports (configfs gives the
            path and the port) or is connected to.
        nsid : int
            Namespace id within the subsystem.
        size : int, optional
            Bytes peers may address (default: the whole device or file).
        transport, address, service_id : optional
            How peers connect (default: the subsystem's first port).

        Returns
        -------
        mooncake_te.transports.nvmeof.StorageSegment
        """
        self._check_open()
        t = self._tx.with_capability("storage")
        if t is None:
            why = "; ".join(f"{n}: {c.reason}" for n, c in self.available_transports.items()
                            if not getattr(c, "available", True))
            raise E.TransportUnavailableError(
                f"no storage (NVMe-oF) transport is running in this engine"
                f"{' (' + why + ')' if why else ''}")
        seg = t.add_storage(name, path=path, nqn=nqn, nsid=nsid, size=size,
                            transport=transport, address=address, service_id=service_id)
        self._peers.invalidate(self.name)          # our own storage resolves afresh
        self._publish()
        return seg

    def unregister_storage(self, storage) -> None:
        """Withdraw a storage segment (a StorageSegment or its storage name)."""
        self._check_open()
        name = getattr(storage, "storage", storage)
        t = self._tx.with_capability("storage")
        if t is None:
            raise E.SegmentNotFoundError(f"no storage named {name!r} registered")
        t.remove_storage(name)
        self._peers.invalidate(self.name)
        self._publish()

    @property
    def storage(self) -> list:
        """The storage segments this engine publishes."""
        t = self._tx.with_capability("storage")
        return t.storage() if t is not None else []

    # --- memory ------------------------------------------------------------------------
    @property
    def regions(self) -> list:
        return self._book.all()

    def register(self, obj: object, location: str = "auto", access: str = "rw") -> MemoryRegion:
        """Register a buffer (buffer protocol, ``__cuda_array_interface__``, ``__dlpack__``)."""
        self._check_open()
        mr = self._book.add(self._book.intake(obj, location, access), known=True)
        if mr.access != "local":
            self._publish()
        return mr

    def register_many(self, objs: Iterable[object], location: str = "auto",
                      access: str = "rw") -> "list[MemoryRegion]":
        """Register several buffers and publish the descriptor once (with a store
        backend every ``register`` is a network write; KV caches register one tensor per
        layer). All or nothing: on an error, the ones already added are removed."""
        self._check_open()
        added = []
        try:
            for obj in objs:
                added.append(self._book.add(self._book.intake(obj, location, access),
                                            known=True))
        except BaseException:
            for mr in added:
                self._book.remove(mr)
            raise
        if any(mr.access != "local" for mr in added):
            self._publish()
        return added

    def register_address(self, address: int, length: int, location: str = "auto",
                         access: str = "rw", owner=None) -> MemoryRegion:
        """Register raw memory you own and keep alive (the one door for integer addresses)."""
        self._check_open()
        mr = self._book.add(MemoryRegion.from_address(address, length, owner, location, access))
        if mr.access != "local":
            self._publish()
        return mr

    def unregister(self, region: "MemoryRegion | int") -> None:
        """Remove a region; waits for I/O in flight on it, then peers can no longer touch it."""
        self._check_open()
        addr = region.address if isinstance(region, MemoryRegion) else int(region)
        mr = self._book.get(addr)
        if mr is None:
            raise E.AddressNotRegisteredError(f"no region registered at {addr:#x}")
        self._book.remove(mr)
        if mr.access != "local":
            self._publish()

    # --- transfers ---------------------------------------------------------------------
    def write(self, target: "str | Segment", source_address: int, target_address: int, length: int,
              timeout: float | None = None) -> None:
        """Copy ``length`` local bytes at ``source_address`` to ``target_address`` of
        ``target``; returns once the peer applied them."""
        self._sync(_WRITE, target, source_address, target_address, length, timeout)

    def read(self, target: "str | Segment", source_address: int, target_address: int, length: int,
             timeout: float | None = None) -> None:
        """Copy ``length`` bytes at ``target_address`` of ``target`` into local
        ``source_address``."""
        self._sync(_READ, target, source_address, target_address, length, timeout)

    def _sync(self, op: int, target, src, dst, length, timeout):
        # The one-request fast path: no arrays, no Batch object; the request is carried
        # on this thread by a transport with a sync path (same checks and errors as
        # submit()). What cannot change between calls is not redone: plain ints pass
        # without the general integer checks, and the route to a peer is cached
        # (_sync_route) while its descriptor, our regions and the metrics stay the same.
        if self._closed or _getpid() != self._pid:
            self._check_open()
        name = target if type(target) is str and target else target_name(target)
        if not (type(src) is int and type(dst) is int and type(length) is int
                and 0 <= src <= _U64 and 0 <= dst <= _U64 and 0 <= length <= _U64):
            src, dst, length = S.check_one(src, dst, length)
        if length == 0 or self._regions.check(src, length, 0) != 0:
            S.check_local(self._regions, src, length)       # raises the reason
        tm = self._tmetrics
        e = self._sync_routes.get((name, op))
        if (e is None or e[0] is not self._peers.cache.entries.get(name)
                or e[1] != self._book.version or e[2] is not tm):
            e = self._sync_route(name, op, src, dst, tm)
        desc, t, cell = e[0], e[3], e[4]
        if t is None:           # no sync path (or metrics need a batch): one-request batch
            self._start(S.one(name, op, src, dst, length), 1, None, timeout,
                        nbytes=length, checked=True).wait()
            return
        if timeout is None:
            deadline = _monotonic_ns() + int(self.timeout * 1e9) + length
        else:
            deadline = S.deadline(self.timeout, length, timeout)
        if cell:
            _, code = t.transfer_sync(desc, op, src, dst, length, deadline, cell)
        else:
            _, code = t.transfer_sync(desc, op, src, dst, length, deadline)
        if code != 0:
            if code in (-1006, -102):
                self._peers.lost(name)     # re-resolve the peer before its next use
                self._sync_routes.pop((name, op), None)
            raise error_for(code, name, 0, op, src, dst, length)

    def _sync_route(self, name: str, op: int, src: int, dst: int, tm) -> tuple:
        """(descriptor, regions version, metrics, transport with a sync path or None for
        a one-request batch, metrics cell or 0) for a synchronous request to ``name``;
        kept in ``_sync_routes`` when no transport routes the peer by address. The
        versions are read before the route is worked out, so a change racing with it
        leaves a stale entry that the next call recomputes."""
        version = self._book.version
        desc = self._peers.resolve(name)
        t, route = self._tx.pick(desc, op, src, dst)
        # With metrics on, only a transport whose transfer_sync counts in a metrics cell
        # carries the request itself; the others go through a batch (which counts).
        caps = t.capabilities
        sync = caps.sync and (tm is None or caps.sync_metrics)
        e = (desc, version, tm, t if sync else None,
             tm.cell(name, route, op) if sync and tm is not None else 0)
        if self._tx.cacheable(desc, t):
            if len(self._sync_routes) >= 4096:          # peers come and go: stay bounded
                self._sync_routes.clear()
            self._sync_routes[(name, op)] = e
        return e

    def submit(self, requests: Iterable[TransferRequest], notify: bytes | None = None,
               timeout: float | None = None) -> Batch:
        """Start a batch; requests may name different targets and directions."""
        groups, n, nbytes = S.group(requests)
        return self._start(groups, n, notify, timeout, nbytes=nbytes)

    def submit_arrays(self, op: "Op | int", target: "str | Segment", sources: ArrayLike,
                      target_addresses: ArrayLike, lengths: "ArrayLike | int",
                      notify: bytes | None = None, timeout: float | None = None) -> Batch:
        """The fast path for many descriptors: numpy uint64 arrays (``lengths`` may be an int)."""
        groups, n, nbytes = S.arrays(op, target, sources, target_addresses, lengths)
        return self._start(groups, n, notify, timeout, nbytes=nbytes)

    def prepare(self, target, local, remote, block_size) -> "PreparedTransfer":
        """Check block tables once, then post transfers by block index (NIXL's
        ``prep_xfer_dlist``/``make_prepped_xfer``; :mod:`mooncake_te.prepared`).

        Parameters
        ----------
        target : str or Segment
            The peer.
        local, remote : numpy.ndarray of uint64
            Block start addresses: 1-D (one per block slot) or 2-D ``[regions, blocks]``
            (both the same number of regions).
        block_size : int or sequence of int
            Bytes per block, or one value per region.

        Returns
        -------
        PreparedTransfer
            ``post(op, local_ids, remote_ids, notify=None, timeout=None)`` -> Batch.

        Raises
        ------
        AddressNotRegisteredError
            A local block outside our regions, or a remote one outside the peer's
            published buffers.
        InvalidArgumentError
            Tables of the wrong shape, or a block size that is not positive.
        """
        self._check_open()
        from .prepared import PreparedTransfer
        return PreparedTransfer(self, target, local, remote, block_size)

    def _submit_group(self, tr, route, desc, op, src, dst, lens, n, nbytes, notify,
                      timeout) -> Batch:
        """One group, already checked and routed (PreparedTransfer.post): queued as
        ``submit.queue`` does, without its generality (one group, no caller order)."""
        if self._closed or _getpid() != self._pid:
            self._check_open()
        if timeout is None:
            deadline = _monotonic_ns() + int(self.timeout * 1e9) + nbytes
        else:
            deadline = S.deadline(self.timeout, nbytes, timeout)
        if notify is not None:          # the general path carries notifications
            S.check_notify(notify)
            plan = [(desc.name, op, None, src, dst, lens, desc, tr, route)]
            return S.queue(plan, n, notify, deadline, self._tx.new_batch, self._notifier,
                           self._peers, self.protocol, self._tmetrics)
        native = self._tx.new_batch(n, deadline)
        tm = self._tmetrics
        try:
            if tm is not None:          # counted when they finish (src/core/metrics.h)
                native.tag(0, n, tm.cell(desc.name, route, op))
            taken = tr.submit(native, desc, op, src, dst, lens, 0, False)
        except BaseException:
            # Nothing or part queued: stop it, count the rest canceled, let it finish.
            native.cancel()
            native.abandon(0, n)
            native.seal()
            raise
        native.seal()
        return Batch(native, taken or self.protocol, deadline,
                     [(desc.name, 0, src, dst, lens, op)], self._peers.lost)

    def _start(self, groups: dict, n: int, notify, timeout, nbytes=0,
               checked: bool = False) -> Batch:
        """Check every group, then queue them all in one native batch. ``checked``: the
        caller ran the same checks already (a sync request)."""
        self._check_open()
        S.check_notify(notify)
        if n == 0 and notify is None:
            raise E.InvalidArgumentError("empty batch: give at least one request")
        plan = S.plan(groups, self._regions, self._peers.resolve, self._tx.pick, checked)
        deadline = S.deadline(self.timeout, nbytes, timeout)
        return S.queue(plan, n, notify, deadline, self._tx.new_batch, self._notifier,
                       self._peers, self.protocol, self._tmetrics)

    def metrics(self) -> dict:
        """Transfer counters and latency histograms per (peer, transport, op), failures
        by status code, connections, auth refusals, notifications, queue depths and
        registered bytes per location, read now (docs/observability.md lists every key).
        """
        return engine_metrics(self)

    def stats(self) -> dict:
        """Counters: refused peers (auth), notifications refused (queue full, too big,
        out of memory), regions, transports."""
        dropped = int(self._notifier.counters().get("notifications_dropped", 0))
        return {"auth_failures": self._rpc.auth_failures + self._tx.auth_failures(),
                "notifications_dropped": dropped,
                "regions": len(self._book), "transports": list(self._transports)}

    # --- notifications -----------------------------------------------------------------
    def send_notification(self, target: "str | Segment", message: bytes, timeout: float | None = None) -> None:
        """Deliver ``message`` to ``target``'s ``notifications()``."""
        if not isinstance(message, (bytes, bytearray, memoryview)):
            raise E.InvalidArgumentError(f"message must be bytes, got {type(message).__name__}")
        self._start(S.notice(target_name(target)), 0, bytes(message), timeout).wait()

    def notifications(self, timeout: float = 0.0) -> list:
        """Notifications received since the last call (drained). With ``timeout`` > 0
        and none queued, first wait up to ``timeout`` seconds for one (GIL released; it
        returns as soon as one arrives, or empty when the time is up or the engine is
        closed), instead of polling in a loop."""
        self._check_open()
        if timeout:
            if not timeout > 0:
                raise E.InvalidArgumentError(f"timeout must be >= 0 seconds, got {timeout!r}")
            self._notifier.wait_notifications(float(timeout))
        return [Notification(s, m) for s, m in self._notifier.notifications()]


class EngineInternal:
    """The engine's workings that this package's own layers build on (prepared
    transfers, metrics, the Mooncake compatibility layer): one narrow door instead of
    private fields. ``TransferEngine.internal``; not public API, it may change.
    """

    __slots__ = ("_e",)

    def __init__(self, engine: TransferEngine):
        self._e = engine

    @property
    def closed(self) -> bool:
        return self._e._closed

    @property
    def regions(self):
        """The native region table every transport checks requests against."""
        return self._e._regions

    @property
    def pid(self) -> int:
        """The process the engine was made in (a forked child may not use it)."""
        return self._e._pid

    def check_open(self) -> None:
        """Raise the engine's error for a closed engine or a forked child."""
        self._e._check_open()

    def register_address(self, address: int, length: int, location: str = "auto",
                         access: str = "rw", owner=None) -> MemoryRegion:
        """``register_address``, all or nothing: the region is added, then the
        descriptor published; when the publish fails (the metadata store refused it or is
        down) the region is taken out again and the publish's error raised, so a failed
        call leaves nothing registered (Mooncake's ``registerLocalMemory`` rolls back)."""
        e = self._e
        e._check_open()
        mr = e._book.add(MemoryRegion.from_address(address, length, owner, location, access))
        if mr.access == "local":
            return mr
        try:
            e._publish()
        except BaseException:
            e._book.remove(mr)
            try:                 # the store that refused the first publish may refuse this
                e._publish()
            except E.MooncakeError as again:
                log.warning("rolled back the registration of %#x locally; the metadata "
                            "store was not updated: %s", mr.address, again)
            raise
        return mr

    @property
    def timeout(self) -> float:
        """The engine's transfer timeout in seconds."""
        return self._e.timeout

    @property
    def lost_peers(self):
        """The peers whose connection was lost (what a Batch checks on a timeout)."""
        return self._e._peers.lost

    def resolve(self, name: str) -> SegmentDescriptor:
        """The descriptor of peer ``name`` (cached; a storage segment with a '/')."""
        return self._e._peers.resolve(name)

    def cached(self, name: str) -> "SegmentDescriptor | None":
        """The descriptor of ``name`` the cache holds now (None: dropped, e.g. the peer
        failed or restarted), without asking anyone."""
        return self._e._peers.cache.entries.get(name)

    def pick(self, desc, op: int, local, remote) -> tuple:
        """(transport, route) that carries ``op`` requests to ``desc``."""
        return self._e._tx.pick(desc, op, local, remote)

    def submit_group(self, tr, route, desc, op, src, dst, lens, n, nbytes, notify,
                     timeout) -> Batch:
        """Queue one group already checked and routed (by :meth:`pick`)."""
        return self._e._submit_group(tr, route, desc, op, src, dst, lens, n, nbytes,
                                     notify, timeout)

    def transports(self) -> list:
        """The running transports, by priority."""
        return list(self._e._transports.values())

    @property
    def rpc_auth_failures(self) -> int:
        """Peers the RPC port refused because they could not prove the token."""
        return int(self._e._rpc.auth_failures)

    @property
    def transfer_metrics(self) -> "TransferMetrics | None":
        """The transfer counters, or None while transfers are not counted."""
        return self._e._tmetrics

    def count_transfers(self, on: bool) -> None:
        """Turn the counting of transfers on or off while the engine runs (batches
        already submitted keep their cells); what was counted stays readable."""
        e = self._e
        if e._tmetrics_kept is None:
            e._tmetrics_kept = TransferMetrics()
        e._tmetrics = e._tmetrics_kept if on else None

    @property
    def counted(self) -> "TransferMetrics | None":
        """The counters, also while counting is off (None if never on)."""
        return self._e._tmetrics_kept

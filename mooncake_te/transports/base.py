# SPDX-License-Identifier: Apache-2.0
"""The one contract every transport implements, and the stand-in for a missing one.

A transport moves bytes between this engine's registered memory and a peer's. The
engine owns the region table (every transport checks requests against it) and the batch
(one native batch object whose requests any transport may finish:
``batch.begin(i, slices)`` / ``batch.finish(i, nbytes, err)`` from Python, or the
``mte_batch_ops_t`` table from C). A transport adds what it needs on top (RDMA: memory
registrations and rkeys; CUDA IPC: memory handles).

The contract goes both ways and through this module only: a transport sees the engine
through the services of its :class:`TransportContext` (never the engine object), and
the engine learns what a transport can do from its :class:`Capabilities` (never by
probing methods or by its name). Transports never import one another.

How the engine uses transports
------------------------------
* Every available transport whose ``serves`` names the engine's protocol is constructed
  with a :class:`TransportContext` and lives as long as the engine; the transport with
  ``notifications`` always runs (it serves peers and carries notifications).
* ``register`` / ``unregister`` are called on every transport for every region.
* ``describe()`` of every transport is merged into the segment descriptor's ``extra``
  fields (``devices`` and ``priority_matrix`` go to the descriptor's own fields), and
  ``protocols()`` into its ``protocols`` list; ``buffer_keys(region)`` gives each
  published buffer its ``rkey``/``lkey`` lists (RDMA).
* For each (peer, op) group of a batch the engine asks the transports, in order of
  ``priority``, ``route(desc, ...)``; the first that answers a route name carries the
  group with ``submit``; that name is what ``Batch.transport`` reports.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do, declared by the transport (as NIXL backends declare
    theirs: ``supportsNotif``, ``getSupportedMems``); the engine reads these."""
    sync: bool = False           # transfer_sync(): one request carried on the calling thread
    sync_metrics: bool = False   # transfer_sync(..., cell) counts in a metrics cell (else,
    #                              with metrics on, single requests go through a batch)
    notifications: bool = False  # add_notify() / notifications() / deliver_notification()
    storage: bool = False        # storage segments: add_storage / remove_storage / storage
    gpu_memory: bool = False     # moves GPU memory (directly or staged); selection never
    #                              hands a group with local GPU memory to one without it
    same_host: bool = False      # reaches peers of this host only
    wants_keys: bool = False     # publishes per-buffer rkey/lkey lists (buffer_keys)
    prepared: bool = False       # post_prepared(): a prepared transfer's post in one native
    #                              call (else prepared posts gather addresses into a batch)


@dataclass(frozen=True)
class DeviceCounter:
    """One per-device counter a transport reports (``Transport.device_counter_defs``):
    ``key`` in its ``device_counters()`` dicts, exported to Prometheus as
    ``mooncake_te_<transport>_<metric>_total`` with ``help``."""
    key: str
    metric: str
    help: str


@dataclass
class TransportContext:
    """What an engine hands each of its transports: data and services, not itself."""
    regions: object              # the engine's Regions table (mooncake_te.core)
    host: str                    # address peers reach this engine at
    name: str                    # this engine's segment name
    instance: int                # this engine's instance id (a restart changes it)
    config: dict                 # the [transfer_engine] section of the engine's Config
    token: bytes = b""           # auth token (b"": none)
    protocol: str = "auto"       # what the user asked for ("auto", "tcp", "shm", "rdma", ...)
    devices: list = field(default_factory=list)   # RDMA device allow-list ([]: all)
    rpc: object = None           # the engine's RpcServer (add_handler: a transport's handshake)
    host_id: str = ""            # boot id / pid ns / net ns: equal means the same host
    # Services of the engine's core (callables, so no transport holds the engine):
    new_batch: object = None     # (n, deadline_ns) -> a native batch (large sync requests)
    refresh_peer: object = None  # (name) -> SegmentDescriptor fetched afresh


class Transport(ABC):
    name = "?"
    available = True
    reason = ""
    #: What the engine may ask of this transport (see :class:`Capabilities`).
    capabilities = Capabilities()
    #: Values of ``protocol=`` for which this transport carries data ("*": all).
    serves: tuple = ("auto",)
    #: Order in which the engine asks transports for a route: lower first.
    priority = 100
    #: Its own ``[transfer_engine]`` keys (``config.Setting`` each, with their ``MC_*``
    #: variables); ``mooncake_te.transports`` declares them to the configuration, so
    #: config.toml, ``MC_*`` and the vLLM connector accept them with no other edit. The
    #: new ``protocol=`` names in :attr:`serves` are declared the same way.
    settings: tuple = ()
    #: Other projects' protocol names for ours (Mooncake's name -> one of :attr:`serves`).
    protocol_aliases: dict = {}
    #: Variables that force a protocol when true (``MC_FORCE_TCP`` -> "tcp").
    force_env: dict = {}

    def describe(self) -> dict:
        """Fields this transport adds to the segment descriptor (JSON-able)."""
        return {}

    def protocols(self) -> list:
        """Names this transport adds to the descriptor's ``protocols``."""
        return [self.name]

    def buffer_keys(self, region) -> tuple:
        """(rkeys, lkeys) to publish for a region (one per device, RDMA), or ((), ())."""
        return (), ()

    def register(self, region) -> None:
        """Called after a region entered the table (a MemoryRegion)."""

    def unregister(self, region) -> None:
        """Called before a region leaves the table; in-flight I/O has been waited for."""

    @abstractmethod
    def route(self, desc, op: int, local, remote) -> str | None:
        """The route this transport would take to peer ``desc`` (a SegmentDescriptor)
        for a group of ``op`` requests between local addresses ``local`` and the peer's
        ``remote`` addresses (numpy uint64 arrays; look their regions up to learn where
        the memory is), or None if it cannot carry them."""

    def no_route_reason(self, desc) -> str:
        """Why :meth:`route` answers None for ``desc`` when that is this engine's
        settings rather than the peer (``protocol="shm"`` and a peer elsewhere): the
        error then says it; "" for no such reason."""
        return ""

    def route_by_address(self, desc) -> bool:
        """Whether :meth:`route` to ``desc`` may answer differently for other local or
        remote addresses (GPU memory, regions a NIC could not take). False lets the
        engine reuse the answer for every request to ``desc`` until its descriptor, the
        registered regions or the metrics change (the synchronous path's route cache)."""
        return False

    @abstractmethod
    def submit(self, batch, desc, op, local, remote, lens, first: int, run_inline: bool) -> str:
        """Queue requests [first, first+len(local)) of ``batch`` (a NativeBatch) to the
        peer ``desc``; return the route taken. Raise (nothing queued) or queue all."""

    def add_notify(self, batch, desc, message: bytes) -> None:
        """Deliver ``message`` to ``desc`` once the batch's data has landed (TCP's job)."""
        raise NotImplementedError

    def forget_peer(self, name: str) -> None:
        """Drop connections to a peer (it restarted or went away)."""

    def notifications(self) -> list:
        """Notifications received since the last call, as (sender, message) pairs."""
        return []

    def wait_notifications(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds, without the GIL, until a notification is
        queued; True if one is (transports with ``notifications``)."""
        return False

    def deliver_notification(self, sender: str, message: bytes) -> None:
        """Queue a notification that arrived another way (the RPC port) for
        :meth:`notifications` (transports with ``notifications``)."""
        raise NotImplementedError

    def transfer_sync(self, desc, op: int, local: int, remote: int, length: int,
                      deadline_ns: int) -> tuple:
        """One request carried on the calling thread (transports with ``sync``):
        (route, 0 or a status code). Transports with ``sync_metrics`` also take a last
        argument ``cell``: the address of the metrics cell (src/core/metrics.h) the
        request counts in."""
        raise NotImplementedError

    def post_prepared(self, desc, table, op: int, lids, rids, deadline_ns: int, cell: int = 0,
                      notify=None) -> tuple:
        """One post of a prepared transfer (transports with ``prepared``): ``table`` a
        ``core.PreparedTable``, ``lids``/``rids`` block indices; (native batch, route)."""
        raise NotImplementedError

    #: The per-device counters :meth:`device_counters` reports (DeviceCounter each);
    #: ``engine.metrics()`` lists them under the transport's name.
    device_counter_defs: tuple = ()

    def counters(self) -> dict:
        """Engine-wide counters for metrics, read on demand; ``engine.metrics()`` adds up
        every transport's. Keys: ``connections``, ``connections_accepted``,
        ``connections_refused``, ``auth_failures``, ``notifications_received``,
        ``notifications_dropped`` (ints) and ``queued`` ({peer: slices}); transports
        without any return {}."""
        return {}

    def device_counters(self) -> dict:
        """{device: {key: value}} of :attr:`device_counter_defs`, read on demand."""
        return {}

    @property
    def auth_failures(self) -> int:
        """Peers this transport refused because they could not prove the token."""
        return 0

    @abstractmethod
    def close(self) -> None: ...


class UnavailableTransport:
    """A transport this build or machine cannot offer, and why (CuPy's _UnavailableModule)."""

    available = False
    capabilities = Capabilities()
    serves: tuple = ()
    priority = 100

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason

    def __repr__(self) -> str:
        return f"<transport {self.name}: unavailable ({self.reason})>"

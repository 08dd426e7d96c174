# SPDX-License-Identifier: Apache-2.0
"""The TransferEngine facade: registration, segments, transfers, notifications."""
from __future__ import annotations

import errno as _errno
import fcntl
import logging
import os
import secrets
import socket
import struct
import threading
import time
import warnings
import weakref
from collections import defaultdict
from typing import Iterable

import numpy as np

from . import errors as E
from .batch import Batch, Notification, Op, TransferRequest, error_for
from .config import Config
from .core._regions import Regions, READ as ACC_READ, WRITE as ACC_WRITE
from .memory import ACCESS, MemoryRegion, cpu_location, intake
from .metadata import BufferInfo, SegmentCache, SegmentDescriptor, open_backend
from .metadata.rpc import RpcServer
from .transports import probe as probe_transports
from .transports.base import Transport, TransportContext

log = logging.getLogger("mooncake_te")

_ACCESS_BITS = {"rw": ACC_READ | ACC_WRITE, "r": ACC_READ, "local": 0}


def default_host() -> str:
    """First UP non-loopback IPv4 interface address, else 127.0.0.1 (Mooncake's rule)."""
    for _, ifname in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{ifname}/flags") as f:
                flags = int(f.read(), 16)
        except OSError:
            continue
        if not flags & 0x1 or flags & 0x8:          # IFF_UP, IFF_LOOPBACK (linux/if.h)
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                # SIOCGIFADDR (linux/sockios.h): the interface's IPv4 address.
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
            return socket.inet_ntoa(res[20:24])
        except OSError:
            continue
    return "127.0.0.1"


class Segment:
    """A peer's segment as it published it."""

    def __init__(self, desc: SegmentDescriptor):
        self._desc = desc

    name = property(lambda self: self._desc.name)
    protocol = property(lambda self: self._desc.protocol)
    buffers = property(lambda self: list(self._desc.buffers))
    instance_id = property(lambda self: self._desc.instance_id)
    descriptor = property(lambda self: self._desc)

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, protocol={self.protocol!r}, buffers={len(self.buffers)})"


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
                 protocol: str | None = None, devices=None, host: str | None = None,
                 port: int | None = None, config=None, auth_token=None):
        self._closed = True
        self._pid = os.getpid()
        self.config = cfg = Config.load(config)
        te = cfg["transfer_engine"]
        if metadata is None:
            metadata = _metadata_from_config(cfg["metadata"])
        protocol = (protocol or te["protocol"] or "auto").lower()
        if isinstance(devices, str):
            devices = [d.strip() for d in devices.split(",") if d.strip()]
        self.devices = list(devices if devices is not None else te["device_names"])
        self._token = _token(auth_token if auth_token is not None else te["auth_token"])
        self.timeout = cfg.timeout_s
        self.host = host or te["host"] or default_host()
        port = te["port"] if port is None else port
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise E.InvalidArgumentError(f"port must be an int in 0..65535, got {port!r}")

        self.available_transports = probe_transports()
        self.protocol = self._choose_protocol(protocol)

        self._lock = threading.RLock()
        self._regions = Regions()
        self._mrs: dict[int, MemoryRegion] = {}     # by address, in registration order
        self._instance = secrets.randbits(63) | 1
        self._rpc = RpcServer(self.host, port, self._describe_bytes, self._on_rpc_notify,
                              token=self._token)
        if not self._token and not _is_loopback(self.host):
            _warn_unauthenticated(self.host)
        self._p2p = str(metadata).strip().lower() in ("p2p", "p2phandshake")
        own = f"{self.host}:{self._rpc.port}"
        if self._p2p and name and name != own:
            log.warning("metadata='p2p': the segment name is the RPC address %s, not %r", own, name)
        self.name = own if (self._p2p or not name) else name
        self._transports: dict = {}      # name -> Transport, in order of preference
        try:
            self._start_transports(protocol, te)
            if self.protocol not in self._transports and protocol == "auto":
                self.protocol = "tcp"      # the best one could not start here
            self._transport = self._transports["tcp"]   # server, notifications
            self._backend = open_backend(metadata, local_descriptor=self._describe_bytes,
                                         token=self._token)
            self._cache = SegmentCache(self._backend)
            if hasattr(self._backend, "on_change"):
                # Store backends poll the peers we fetched; a restarted (new instance id)
                # or vanished peer drops out of the cache before our next transfer to it.
                # Weak, so the backend's renewal thread does not keep the engine alive.
                ref = weakref.WeakMethod(self._on_peer_change)
                self._backend.on_change = lambda name, inst: (ref() or (lambda *a: None))(
                    name, inst)
            self._closed = False
            self._publish()
        except BaseException:
            self._closed = False
            self.close()
            raise

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
        backend = getattr(self, "_backend", None)
        if backend is not None:
            try:
                backend.unpublish(self.name)
            except E.MooncakeError as e:
                log.warning("could not withdraw %s from metadata: %s", self.name, e)
            backend.close()
        for transport in reversed(list(getattr(self, "_transports", {}).values())):
            transport.close()
        self._rpc.close()

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
                f"regions={len(self._mrs)}{' closed' if self._closed else ''}>")

    def _check_open(self) -> None:
        if self._closed:
            raise E.InvalidArgumentError("the engine is closed")
        if os.getpid() != self._pid:
            # The connections (and, same-host, the pid peers copy into) are the parent's.
            raise E.InvalidArgumentError("this engine belongs to the parent process; create "
                                         "a new TransferEngine after fork()")

    def _choose_protocol(self, protocol: str) -> str:
        known = self.available_transports
        if protocol == "auto":
            # The best this machine has; TCP always works.
            return next(p for p in ("rdma", "tcp") if getattr(known.get(p), "available", False))
        if protocol not in known:
            raise E.InvalidArgumentError(f"unknown protocol {protocol!r}; use one of "
                                         f"auto, {', '.join(known)}")
        t = known[protocol]
        if getattr(t, "available", True) is False:
            raise E.TransportUnavailableError(f"transport {protocol!r} is unavailable: "
                                              f"{t.reason}; use protocol='tcp' or 'auto'")
        return protocol

    # Which transports an engine runs for each protocol, in order of preference. TCP
    # always runs (it carries notifications and serves peers that have nothing better);
    # for protocol="rdma" it is not used to move data.
    _PREFERENCE = ("nvmeof", "cuda_ipc", "rdma", "tcp")
    _ROUTES = {"auto": _PREFERENCE, "tcp": ("nvmeof", "tcp"),
               "shm": ("nvmeof", "cuda_ipc", "tcp"), "rdma": ("nvmeof", "rdma")}

    def _start_transports(self, protocol: str, te: dict) -> None:
        ctx = TransportContext(regions=self._regions, host=self.host, name=self.name,
                               instance=self._instance, config=te, token=self._token or b"",
                               protocol=protocol, devices=self.devices,
                               engine=weakref.proxy(self), rpc=self._rpc)
        routes = self._ROUTES.get(protocol, (protocol, "tcp"))
        self._routing = []
        for name in self._PREFERENCE:
            cls = self.available_transports.get(name)
            if name != "tcp" and name not in routes:
                continue
            if not getattr(cls, "available", False):
                if name == protocol:       # asked for by name: never fall back silently
                    raise E.TransportUnavailableError(
                        f"transport {name!r} is unavailable: {cls.reason}; use "
                        f"protocol='tcp' or 'auto'")
                continue
            try:
                t = cls(ctx)
            except E.MooncakeError:
                if name == protocol or name == "tcp":
                    raise
                log.info("transport %s not started", name, exc_info=True)
                continue
            self._transports[name] = t
            if name in routes:
                self._routing.append(t)

    def _pick(self, desc, op: int, local, remote):
        """(transport, route) that carries ``op`` requests to ``desc``."""
        for t in self._routing:
            r = t.route(desc, op, local, remote)
            if r:
                return t, r
        if self.protocol == "shm":
            raise E.TransportUnavailableError(
                f"protocol='shm' reaches peers on this host only; {desc.name} is elsewhere "
                f"(or serves no same-host listener): use protocol='auto'")
        names = ", ".join(t.name for t in self._routing)
        raise E.TransportUnavailableError(
            f"no transport of this engine ({names}) reaches {desc.name}, which serves "
            f"{', '.join(desc.protocols) or 'nothing'}; use protocol='auto' on both engines")

    # --- metadata ----------------------------------------------------------------------
    def descriptor(self) -> SegmentDescriptor:
        keyed = [t for t in self._transports.values()
                 if type(t).buffer_keys is not Transport.buffer_keys]
        with self._lock:
            mrs = [r for r in self._mrs.values() if r.access != "local"]
        buffers = []
        for r in mrs:
            rkeys, lkeys = (), ()
            for t in keyed:
                rkeys, lkeys = t.buffer_keys(r)
            buffers.append(BufferInfo(r.address, r.length, r.location, r.access,
                                      tuple(rkeys), tuple(lkeys)))
        extra, protocols = {}, []
        for t in self._transports.values():
            extra.update(t.describe())
            protocols += [p for p in t.protocols() if p not in protocols]
        d = SegmentDescriptor(name=self.name, protocol=self.protocol, host=self.host,
                              rpc_port=self._rpc.port, instance_id=f"{self._instance:016x}",
                              buffers=buffers, protocols=protocols,
                              devices=[{"name": d} for d in self.devices])
        d.extra.update(extra)
        d.tcp_data_port = d.extra.pop("tcp_data_port", 0)
        # The RDMA transport publishes its NICs (name, GID, LID, MTU) and the NIC
        # priority matrix in Mooncake's own fields.
        d.devices = d.extra.pop("devices", d.devices)
        d.priority_matrix = d.extra.pop("priority_matrix", d.priority_matrix)
        return d

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
        self._transport.server.push_notification(sender, message)

    def _on_peer_change(self, name: str, instance_id) -> None:
        if self._cache.invalidate(name, instance_id):
            self._forget(name)

    def _peer_restarted(self, name: str) -> None:
        self._cache.invalidate(name)
        self._forget(name)

    def _forget(self, name: str) -> None:
        for t in self._transports.values():
            t.forget_peer(name)

    def open_segment(self, name, refresh: bool = False) -> Segment:
        """Resolve a peer's segment (cached; ``refresh=True`` asks again)."""
        self._check_open()
        if isinstance(name, Segment):
            name = name.name
        if not isinstance(name, str) or not name:
            raise E.InvalidArgumentError(f"segment name must be a non-empty str, got {name!r}")
        if "/" in name:                              # maybe a storage segment
            if refresh:
                self._cache.invalidate(name.rpartition("/")[0])
            return Segment(self._resolve(name))
        return Segment(self._cache.get(name, timeout=min(self.timeout, 5.0), refresh=refresh))

    # --- storage segments (NVMe-oF) ----------------------------------------------------
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
        t = self._transports.get("nvmeof")
        if t is None:
            raise E.TransportUnavailableError(
                f"the NVMe-oF transport is not running in this engine: "
                f"{getattr(self.available_transports.get('nvmeof'), 'reason', 'not started')}")
        from .nvmeof.segment import storage_entry
        from .transports.tcp import HOST_ID
        entry = storage_entry(name, path, nqn, nsid, size, transport, address, service_id)
        entry["host_id"] = HOST_ID
        seg = t.add_storage(entry)
        self._cache.invalidate(self.name)          # our own storage resolves afresh
        self._publish()
        return seg

    def unregister_storage(self, storage) -> None:
        """Withdraw a storage segment (a StorageSegment or its storage name)."""
        self._check_open()
        name = getattr(storage, "storage", storage)
        t = self._transports.get("nvmeof")
        if t is None:
            raise E.SegmentNotFoundError(f"no storage named {name!r} registered")
        t.remove_storage(name)
        self._cache.invalidate(self.name)
        self._publish()

    @property
    def storage(self) -> list:
        """The storage segments this engine publishes."""
        t = self._transports.get("nvmeof")
        return t.storage() if t is not None else []

    # --- memory ------------------------------------------------------------------------
    @property
    def regions(self) -> list:
        with self._lock:
            return list(self._mrs.values())

    def register(self, obj, location: str = "auto", access: str = "rw") -> MemoryRegion:
        """Register a buffer (buffer protocol, ``__cuda_array_interface__``, ``__dlpack__``)."""
        self._check_open()
        mr = self._add(self._intake(obj, location, access), known=True)
        if mr.access != "local":
            self._publish()
        return mr

    def register_many(self, objs, location: str = "auto", access: str = "rw") -> list:
        """Register several buffers and publish the descriptor once (with a store
        backend every ``register`` is a network write; KV caches register one tensor per
        layer). All or nothing: on an error, the ones already added are removed."""
        self._check_open()
        added = []
        try:
            for obj in objs:
                added.append(self._add(self._intake(obj, location, access), known=True))
        except BaseException:
            for mr in added:
                self._remove(mr)
            raise
        if any(mr.access != "local" for mr in added):
            self._publish()
        return added

    def _intake(self, obj, location, access) -> MemoryRegion:
        it = intake(obj)
        if it.readonly and access == "rw":
            raise E.InvalidArgumentError(
                f"{type(obj).__name__} is read-only, so peers cannot write it; register it with "
                f"access='r' (peers may read) or 'local'")
        if it.device != "cpu":
            # GPU memory: its device is what the driver says (memory.intake); a location
            # given by the caller must agree.
            if location not in ("auto", "*", None) and location != it.device:
                raise E.InvalidArgumentError(
                    f"location {location!r}, but the driver places this {type(obj).__name__} "
                    f"on {it.device}; pass location='auto' or {it.device!r}")
            location = it.device
        return MemoryRegion(it.address, it.length, location, access, it.owner, it.readonly)

    def register_address(self, address: int, length: int, location: str = "auto",
                         access: str = "rw", owner=None) -> MemoryRegion:
        """Register raw memory you own and keep alive (the one door for integer addresses)."""
        self._check_open()
        mr = self._add(MemoryRegion.from_address(address, length, owner, location, access))
        if mr.access != "local":
            self._publish()
        return mr

    def _add(self, mr: MemoryRegion, known: bool = False) -> MemoryRegion:
        # known: the memory came through intake, which already asked the driver where it
        # lives; raw addresses (register_address) are located here.
        if mr.access not in ACCESS:
            raise E.InvalidArgumentError(f"access must be one of {', '.join(ACCESS)}, "
                                         f"got {mr.access!r}")
        mr.location, device = _locate(mr, known)
        rc = self._regions.add(mr.address, mr.length, _ACCESS_BITS[mr.access], device)
        if rc == -_errno.EEXIST:
            raise E.AddressOverlappedError(
                f"[{mr.address:#x}, {mr.end:#x}) overlaps a region already registered; "
                f"unregister it first or register the union once")
        if rc != 0:
            raise E.InvalidArgumentError(f"cannot register [{mr.address:#x}, +{mr.length}): "
                                         f"{os.strerror(-rc)}")
        with self._lock:
            self._mrs[mr.address] = mr
        try:
            for t in self._transports.values():
                t.register(mr)
        except BaseException:
            self._remove(mr)
            raise
        return mr

    def unregister(self, region) -> None:
        """Remove a region; waits for I/O in flight on it, then peers can no longer touch it."""
        self._check_open()
        addr = region.address if isinstance(region, MemoryRegion) else int(region)
        with self._lock:
            mr = self._mrs.get(addr)
        if mr is None:
            raise E.AddressNotRegisteredError(f"no region registered at {addr:#x}")
        self._remove(mr)
        if mr.access != "local":
            self._publish()

    def _remove(self, mr: MemoryRegion) -> None:
        # The table first: remove() waits for I/O in flight on the region and refuses new
        # I/O, so no transport touches it once its own unregister runs.
        self._regions.remove(mr.address)
        for t in self._transports.values():
            t.unregister(mr)
        with self._lock:
            del self._mrs[mr.address]

    # --- transfers ---------------------------------------------------------------------
    def _target_name(self, target) -> str:
        if isinstance(target, Segment):
            return target.name
        if isinstance(target, str) and target:
            return target
        raise E.InvalidArgumentError(f"target must be a segment name or Segment, got {target!r}")

    def _deadline(self, nbytes: int, timeout: float | None) -> int:
        t = self.timeout if timeout is None else float(timeout)
        if t <= 0:
            raise E.InvalidArgumentError(f"timeout must be positive, got {timeout!r}")
        # Like Mooncake's Python wrapper: the timeout plus 1 ns per byte for huge batches.
        return time.monotonic_ns() + int(t * 1e9) + int(nbytes)

    def write(self, target, source_address: int, target_address: int, length: int,
              timeout: float | None = None) -> None:
        """Copy ``length`` local bytes at ``source_address`` to ``target_address`` of
        ``target``; returns once the peer applied them."""
        self._sync(Op.WRITE, target, source_address, target_address, length, timeout)

    def read(self, target, source_address: int, target_address: int, length: int,
             timeout: float | None = None) -> None:
        """Copy ``length`` bytes at ``target_address`` of ``target`` into local
        ``source_address``."""
        self._sync(Op.READ, target, source_address, target_address, length, timeout)

    def _sync(self, op, target, src, dst, length, timeout):
        # The one-request fast path: no arrays, no Batch object; the request is carried
        # on this thread when a lane is idle (same checks and errors as submit()).
        self._check_open()
        name = self._target_name(target)
        for what, v in (("source_address", src), ("target_address", dst), ("length", length)):
            if not isinstance(v, int) or v < 0:
                raise E.InvalidArgumentError(f"{what} must be a non-negative int, got {v!r}")
        if length == 0:
            raise E.InvalidArgumentError("request 0: length must be positive, got 0")
        if self._regions.check(src, length, 0) != 0:
            raise E.AddressNotRegisteredError(
                f"request 0: local [{src:#x}, +{length}) is not inside a region registered "
                f"with this engine; register the buffer first (eng.register(...)), or check "
                f"the address and length")
        desc = self._resolve(name)
        t, _ = self._pick(desc, int(op), src, dst)
        if not hasattr(t, "transfer_sync"):
            one = lambda v: np.array([v], dtype=np.uint64)     # noqa: E731
            self._submit_groups({(name, int(op)): (None, one(src), one(dst), one(length))},
                                1, None, timeout, nbytes=length).wait()
            return
        _, code = t.transfer_sync(desc, int(op), src, dst, length,
                                  self._deadline(length, timeout))
        if code != 0:
            if code in (-1006, -102):
                self._peer_restarted(name)     # re-resolve the peer before its next use
            raise error_for(code, name, 0, int(op), src, dst, length)

    def _resolve(self, name: str):
        """The descriptor of ``name`` (``"<engine>/<storage>"``: a storage segment)."""
        if "/" in name:
            from .transports.nvmeof import resolve
            return resolve(self._cache, name, timeout=min(self.timeout, 5.0))
        return self._cache.get(name, timeout=min(self.timeout, 5.0))

    def submit(self, requests: Iterable[TransferRequest], notify: bytes | None = None,
               timeout: float | None = None) -> Batch:
        """Start a batch; requests may name different targets and directions."""
        reqs = list(requests)
        groups: dict = defaultdict(lambda: ([], [], [], []))
        nbytes = 0
        for i, r in enumerate(reqs):
            if not isinstance(r, TransferRequest):
                r = TransferRequest(*r)
            try:
                op = Op(r.op)
            except ValueError:
                raise E.InvalidArgumentError(f"request {i}: op must be mte.READ or mte.WRITE, "
                                             f"got {r.op!r}") from None
            g = groups[(self._target_name(r.target), int(op))]
            g[0].append(i)
            g[1].append(r.source)
            g[2].append(r.target_address)
            g[3].append(r.length)
            nbytes += int(r.length) if isinstance(r.length, int) else 0
        arrays = {}
        for key, (idx, src, dst, lens) in groups.items():
            arrays[key] = (idx, _u64(src, "source"), _u64(dst, "target_address"),
                           _u64(lens, "length"))
        return self._submit_groups(arrays, len(reqs), notify, timeout, nbytes=nbytes)

    def submit_arrays(self, op, target, sources, target_addresses, lengths,
                      notify: bytes | None = None, timeout: float | None = None) -> Batch:
        """The fast path for many descriptors: numpy uint64 arrays (``lengths`` may be an int)."""
        try:
            op = Op(op)
        except ValueError:
            raise E.InvalidArgumentError(f"op must be mte.READ or mte.WRITE, got {op!r}") from None
        src = _u64(sources, "sources")
        dst = _u64(target_addresses, "target_addresses")
        lens = _u64([lengths] if np.isscalar(lengths) else lengths, "lengths")
        if len(dst) != len(src) or len(lens) not in (1, len(src)):
            raise E.InvalidArgumentError(
                f"sources ({len(src)}), target_addresses ({len(dst)}) and lengths ({len(lens)}) "
                f"must have the same length (lengths may be one int)")
        nbytes = int(lens[0]) * len(src) if len(lens) == 1 else int(lens.sum())
        return self._submit_groups({(self._target_name(target), int(op)): (None, src, dst, lens)},
                                   len(src), notify, timeout, nbytes=nbytes)

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

    def _submit_prepared(self, tr, route, desc, op, src, dst, lens, n, nbytes, notify,
                         timeout) -> Batch:
        """One group, already checked and routed (PreparedTransfer.post)."""
        self._check_open()
        if notify is not None and (not isinstance(notify, (bytes, bytearray, memoryview))
                                   or len(notify) > 1 << 20):
            raise E.InvalidArgumentError("notify must be bytes of at most 1 MiB")
        from .transports.tcp import NativeBatch
        deadline = self._deadline(nbytes, timeout)
        native = NativeBatch(n, deadline)
        try:
            route = tr.submit(native, desc, op, src, dst, lens, 0, False) if n else route
            if notify is not None:
                self._transport.add_notify(native, desc, bytes(notify))
        except BaseException:
            native.cancel()
            native.abandon(0, n)
            native.seal()
            raise
        native.seal()
        return Batch(native, route, deadline, [(desc.name, 0, src, dst, lens, op)], self)

    def _submit_groups(self, groups: dict, n: int, notify, timeout, nbytes=0) -> Batch:
        self._check_open()
        if notify is not None and not isinstance(notify, (bytes, bytearray, memoryview)):
            raise E.InvalidArgumentError(f"notify must be bytes, got {type(notify).__name__}")
        if notify is not None and len(notify) > 1 << 20:
            raise E.InvalidArgumentError(f"notify is {len(notify)} bytes; at most 1 MiB")
        if n == 0 and notify is None:
            raise E.InvalidArgumentError("empty batch: give at least one request")
        tcp = self._transport
        from .transports.tcp import NativeBatch  # every transport finishes these
        # Validate everything before anything is queued.
        plan = []
        for (name, op), (idx, src, dst, lens) in groups.items():
            caller = (lambda k: k) if idx is None else (lambda k: idx[k])   # caller's index
            if len(lens) and not lens.all():
                k = caller(int(np.argmin(lens)))
                raise E.InvalidArgumentError(f"request {k}: length must be positive, got 0")
            bad, why = self._regions.check_many(src, lens, 0)
            if bad >= 0:
                length = int(lens[bad] if len(lens) > 1 else lens[0])
                raise E.AddressNotRegisteredError(
                    f"request {caller(bad)}: local [{int(src[bad]):#x}, +{length}) is not inside "
                    f"a region registered with this engine; register the buffer first "
                    f"(eng.register(...)), or check the address and length")
            desc = self._resolve(name)
            plan.append((name, op, idx, src, dst, lens, desc,
                         self._pick(desc, op, src, dst)[0]))
        deadline = self._deadline(nbytes, timeout)
        native = NativeBatch(n, deadline)
        parts = []
        routes = set()
        order = np.empty(n, dtype=np.int64) if any(p[2] is not None for p in plan) else None
        first = 0
        try:
            for name, op, idx, src, dst, lens, desc, tr in plan:
                if order is not None:
                    # submit(): requests are carried grouped by (target, op); remember where
                    # each one came from so status() and errors use the caller's indices.
                    order[idx] = np.arange(first, first + len(src))
                routes.add(tr.submit(native, desc, op, src, dst, lens, first, False))
                parts.append((name, first, src, dst, lens, op))
                first += len(src)
            if notify is not None:
                for name in dict.fromkeys(p[0] for p in plan):
                    tcp.add_notify(native, self._cache.get(name, timeout=5.0), bytes(notify))
        except BaseException:
            # Part of the batch may be queued already: stop what has not started, count
            # what was never queued, and let the batch finish so nothing waits on it.
            native.cancel()
            native.abandon(first, n - first)
            native.seal()
            raise
        native.seal()
        return Batch(native, ",".join(sorted(routes)) or self.protocol, deadline, parts, self,
                     order)

    def stats(self) -> dict:
        """Counters: refused peers (auth), regions, peers."""
        return {"auth_failures": self._rpc.auth_failures + self._transport.server.auth_failures,
                "regions": len(self._mrs), "transports": list(self._transports)}

    # --- notifications -----------------------------------------------------------------
    def send_notification(self, target, message: bytes, timeout: float | None = None) -> None:
        """Deliver ``message`` to ``target``'s ``notifications()``."""
        if not isinstance(message, (bytes, bytearray, memoryview)):
            raise E.InvalidArgumentError(f"message must be bytes, got {type(message).__name__}")
        self._submit_groups({(self._target_name(target), int(Op.WRITE)):
                             ([], np.empty(0, np.uint64), np.empty(0, np.uint64),
                              np.empty(0, np.uint64))}, 0, bytes(message), timeout).wait()

    def notifications(self) -> list:
        """Notifications received since the last call (drained)."""
        self._check_open()
        return [Notification(s, m) for s, m in self._transport.notifications()]


def _locate(mr: MemoryRegion, known: bool = False) -> "tuple[str, int]":
    """(location, CUDA ordinal or -1) of a region about to be registered. GPU memory is
    told by the driver's pointer attributes; raw addresses are only asked about when this
    process already uses CUDA (mooncake_te.cuda.loaded)."""
    from . import cuda
    loc = mr.location
    if known:                 # memory.intake asked the driver already
        if isinstance(loc, str) and loc.startswith("cuda:"):
            return loc, int(loc[5:])
        if loc in ("auto", "*", None):
            return cpu_location(mr.address), -1
    if loc in ("auto", "*", None):
        if cuda.loaded() and cuda.available()[0]:
            is_dev, ordinal = cuda.pointer_info(mr.address)
            if is_dev:
                return f"cuda:{ordinal}", ordinal
        return cpu_location(mr.address), -1
    if isinstance(loc, str) and loc.startswith("cpu"):
        if cuda.loaded() and cuda.available()[0] and cuda.pointer_info(mr.address)[0]:
            raise E.InvalidArgumentError(
                f"location {loc!r}, but [{mr.address:#x}, +{mr.length}) is GPU memory of "
                f"{'cuda:%d' % cuda.pointer_info(mr.address)[1]}; pass location='auto'")
        return loc, -1
    if isinstance(loc, str) and loc.startswith("cuda:") and loc[5:].isdigit():
        ok, reason = cuda.available()
        if not ok:
            # Nothing at this address can be memory of a GPU this process cannot see.
            raise E.InvalidArgumentError(f"cannot register {loc} memory: {reason}; register "
                                         f"host memory with location='auto' or 'cpu:<node>'")
        is_dev, ordinal = cuda.pointer_info(mr.address)
        if not is_dev or ordinal != int(loc[5:]):
            where = f"cuda:{ordinal}" if is_dev else "host memory"
            raise E.InvalidArgumentError(
                f"location {loc!r}, but the driver says [{mr.address:#x}, +{mr.length}) is "
                f"{where}; pass location='auto'")
        return loc, ordinal
    raise E.InvalidArgumentError(f"location {loc!r}: use 'auto', 'cpu:<numa node>' or "
                                 f"'cuda:<ordinal>'")


def _metadata_from_config(md: dict) -> str:
    if md["server_type"] in ("p2p", "p2phandshake"):
        return "p2p"
    from .metadata.stores import spec_from_config
    return spec_from_config(md["server_type"], md["server_address"])


def _token(token) -> bytes | None:
    """The auth token as bytes (None: no authentication), validated."""
    if token is None or token == "" or token == b"":
        return None
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, (bytes, bytearray)):
        raise E.InvalidArgumentError(f"auth_token must be str or bytes, got "
                                     f"{type(token).__name__}")
    if not 1 <= len(token) <= 256:
        raise E.InvalidArgumentError("auth_token must be 1 to 256 bytes long")
    return bytes(token)


_warned_hosts: set = set()


def _is_loopback(host: str) -> bool:
    try:
        import ipaddress
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _warn_unauthenticated(host: str) -> None:
    """Once per address: anyone who reaches it can read and write registered memory."""
    if host in _warned_hosts:
        return
    _warned_hosts.add(host)
    log.warning("listening on %s without an auth_token: anyone who can reach this address can "
                "read and write registered memory; set auth_token (or MC_AUTH_TOKEN) on every "
                "engine", host)


def _u64(values, what: str) -> np.ndarray:
    try:
        a = np.ascontiguousarray(values, dtype=np.uint64)
    except (TypeError, ValueError, OverflowError):
        raise E.InvalidArgumentError(f"{what} must be non-negative integers, got "
                                     f"{values!r:.80}") from None
    if isinstance(values, np.ndarray) and values.dtype.kind == "i" and (values < 0).any():
        raise E.InvalidArgumentError(f"{what} must be non-negative")
    if a.ndim != 1:
        a = a.reshape(-1)
    return a

# SPDX-License-Identifier: Apache-2.0
"""The P2PStore facade: publish named objects, fetch them from every holder."""
from __future__ import annotations

import logging
import os
import random
import secrets
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError, MetadataError, MooncakeError
from ..memory import MemoryRegion
from ..metadata import KeyValueBackend, MetadataBackend, open_backend
from ..metrics.prometheus import track as _track_metrics
from .control import ControlClient, ControlServer
from .directory import Directory, SeedDirectory, StoreDirectory
from .errors import ObjectExistsError, ObjectNotFoundError
from .fetch import Fetch, pack_bits
from .manifest import DEFAULT_CHUNK_SIZE, MAX_FIELD, MIN_CHUNK_SIZE, HolderRef, Manifest

log = logging.getLogger("mooncake_te.p2p_store")


@dataclass(frozen=True)
class ObjectInfo:
    """An object as :meth:`P2PStore.list` reports it.

    ``held`` says what this store has of it: ``"origin"`` (published here),
    ``"replica"`` (fetched completely), ``"partial"`` (a get in progress) or ``None``.
    """

    name: str
    size: int
    chunk_size: int
    chunks: int
    origin: str
    object_id: str
    held: str | None = None


class _Local:
    """An object this store holds (all of it, or the chunks a get has verified so far)."""

    def __init__(self, manifest: Manifest, pieces, role: str, owned=(), complete=False):
        self.manifest = manifest
        self.pieces = pieces
        self.role = role                    # "origin" | "replica"
        self.complete = complete
        n = manifest.chunks
        self.bits = np.ones(n, dtype=bool) if complete else np.zeros(n, dtype=bool)
        self.have = n if complete else 0
        self.owned = list(owned)            # regions this store registered, to unregister
        self.known: dict[str, HolderRef] = {}
        self.active = 0                     # chunk reads by others in progress
        self.uploaded = 0
        self.chunks_uploaded = 0
        self.uploads_to: dict[str, int] = {}
        self.corrupt_local = 0
        self.scrub = False                  # a chunk was found corrupt: check them all
        self.summary: dict = {}

    @property
    def held(self) -> str:
        return self.role if self.complete else "partial"



#: holders an object's store remembers from announcements and gossip (issue #35 item 8:
#: fake announcements grew the list past a frame, and every getter failed)
MAX_KNOWN = 128
#: getters counted by name in the upload statistics; the rest under OTHERS
MAX_STATS_PEERS = 256
OTHERS = "(others)"


def _remember(known: dict, ref: HolderRef) -> None:
    """Add ``ref`` to ``known``; when full, it takes the place of a random entry (a flood
    of fake holders cannot pin the list, and real ones keep coming back by gossip)."""
    if ref.key not in known and len(known) >= MAX_KNOWN:
        known.pop(random.choice(list(known)))
    known[ref.key] = ref


def _count_to(counts: dict, by: str) -> None:
    """One more chunk uploaded to ``by``, at most MAX_STATS_PEERS names."""
    if by not in counts and len(counts) >= MAX_STATS_PEERS:
        by = OTHERS
    counts[by] = counts.get(by, 0) + 1


def _inside(regions, obj):
    """``(address, length, access)`` of ``obj``'s memory when a registered region holds
    all of it, else None."""
    from ..memory import intake
    try:
        it = intake(obj)
    except MooncakeError:
        return None          # not memory we can read: register() says why
    for r in regions:
        if r.contains(it.address, it.length):
            return it.address, it.length, r.access
    return None

class P2PStore:
    """Distribute large named objects (checkpoints, shared KV) between engines.

    An object is one or more registered buffers, split into fixed-size chunks with a
    CRC-32 each. A getter fetches chunks in parallel from every holder, verifies each,
    and serves it onward at once, so a thousand getters do not all read from the
    publisher. Holder lists live in the metadata store; with ``metadata="p2p"`` the
    publisher's address is given to getters as a seed.

    Parameters
    ----------
    engine : TransferEngine
        Moves the chunks (one-sided reads from holders' registered memory).
    metadata : str or MetadataBackend, optional
        Where manifests and holder lists live: ``"etcd://h:2379"``, ``"redis://h:6379"``,
        ``"http://h:8080/metadata"`` or ``"p2p"`` (no store; give getters ``seeds``).
        Default: ``[p2p_store] metadata_server/metadata_address`` of the engine's config
        when set, else the engine's own metadata store, else ``"p2p"``.
    seeds : list of str, optional
        With ``metadata="p2p"``: ``host:port`` of stores that publish or hold the objects
        (their :attr:`address`).
    decentralized : bool, optional
        ``True`` (default, or ``[p2p_store] decentralized``): fetch from every holder and
        serve onward. ``False``: fetch everything from the publisher and do not serve.
    name : str, optional
        This store's name in holder lists and stats; default the engine's segment name.
    host : str, optional
        Address of the control port; default the engine's host.
    port : int
        Control port; 0 picks a free one.
    chunk_size : int
        Default chunk size of objects this store publishes (4 MiB).
    parallelism : int
        Chunk reads a get keeps in flight.
    refresh_interval : float
        Seconds between checks that this store is still listed for what it holds, and
        that objects it replicates are still published.
    control_timeout : float
        Seconds to connect to another store's control port or wait for its answer.
    transfer_timeout : float, optional
        Seconds one chunk read may take (default: the engine's ``timeout_ms``).
    stall_timeout : float
        A get fails with :class:`NoHolderError` when no chunk arrived and none was in
        flight for this long (no holder can supply the rest).

    Notes
    -----
    Close the store before its engine: closing withdraws what it published through
    the engine's metadata client (when shared) and unregisters memory.

    Examples
    --------
    >>> store = P2PStore(eng, metadata="etcd://127.0.0.1:2379")        # doctest: +SKIP
    >>> store.register("ckpt", [r1, r2])                                # doctest: +SKIP
    >>> data = other_store.get("ckpt")                                  # doctest: +SKIP
    """

    def __init__(self, engine, metadata=None, *, seeds=None, decentralized: bool | None = None,
                 name: str | None = None, host: str | None = None, port: int = 0,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, parallelism: int = 4,
                 refresh_interval: float = 1.0,
                 control_timeout: float = 5.0, transfer_timeout: float | None = None,
                 stall_timeout: float = 10.0):
        self._closed = True
        self._pid = os.getpid()
        self.engine = engine
        cfg = getattr(engine, "config", None)
        section = cfg["p2p_store"] if cfg is not None else {}
        self.decentralized = bool(section.get("decentralized", True)
                                  if decentralized is None else decentralized)
        self.chunk_size = _check_chunk_size(chunk_size)
        self.parallelism = int(parallelism)
        if self.parallelism < 1:
            raise InvalidArgumentError(f"parallelism must be at least 1, got {parallelism!r}")
        self.refresh_interval = float(refresh_interval)
        self.control_timeout = float(control_timeout)
        self.transfer_timeout = transfer_timeout
        self.stall_timeout = float(stall_timeout)
        self.directory = self._open_directory(metadata, section, seeds)
        self._lock = threading.RLock()
        self._objects: dict[str, _Local] = {}
        self._stats = {"bytes_uploaded": 0, "bytes_downloaded": 0, "chunks_uploaded": 0,
                       "chunks_downloaded": 0, "corrupt_chunks": 0, "corrupt_local": 0,
                       "repaired_chunks": 0}
        self._chunks_from: dict[str, int] = {}
        self._bytes_from: dict[str, int] = {}
        self._chunks_to: dict[str, int] = {}
        self._failed: dict[str, str] = {}
        self._gets: dict[str, dict] = {}
        _track_metrics("p2p_store", self)       # /metrics (docs/observability.md)
        self._fetches: set = set()               # gets and repairs in progress
        try:
            token = getattr(engine, "_token", None)      # the engine's auth_token (#20.9)
            self.directory.token = token
            self._server = ControlServer(host or engine.host, port, self._handle, self._release,
                                         token=token)
        except BaseException:
            self.directory.close()
            raise
        self.address = self._server.address
        self.name = name or engine.name
        self.ref = HolderRef(self.name, self.address, engine.name, secrets.token_hex(6))
        self._closed = False
        self._stop = threading.Event()
        # The thread holds the store weakly, so an unclosed store can still be collected
        # (and warn, and close) instead of living for ever.
        self._thread = threading.Thread(target=_maintain, daemon=True,
                                        args=(weakref.ref(self), self._stop,
                                              self.refresh_interval),
                                        name=f"mte-p2p-refresh-{self._server.port}")
        self._thread.start()

    def _open_directory(self, metadata, section, seeds) -> Directory:
        if metadata is None and section.get("metadata_server", "p2p") not in ("", "p2p"):
            from ..metadata.url import from_config
            metadata = from_config(section["metadata_server"],
                                   section.get("metadata_address", ""))
        if metadata is None:
            backend = getattr(self.engine, "metadata", None)
            if isinstance(backend, KeyValueBackend):
                return StoreDirectory(backend, owned=False)     # share the engine's client
            metadata = "p2p"
        if isinstance(metadata, MetadataBackend):
            if isinstance(metadata, KeyValueBackend):
                return StoreDirectory(metadata, owned=False)
            return SeedDirectory(seeds, self.control_timeout)
        if not isinstance(metadata, str):
            raise InvalidArgumentError(f"metadata must be a string like 'etcd://host:2379' or "
                                       f"'p2p', or a metadata backend; got {metadata!r}")
        from ..metadata.url import parse
        if parse(metadata).is_p2p:
            return SeedDirectory(seeds, self.control_timeout)
        if seeds:
            raise InvalidArgumentError("seeds= is only for metadata='p2p'; with a metadata "
                                       "store the holders are listed there")
        backend = open_backend(metadata)
        if not isinstance(backend, KeyValueBackend):
            backend.close()
            raise InvalidArgumentError(f"metadata={metadata!r} is not a key-value store")
        return StoreDirectory(backend, owned=True)

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving: withdraw what this store published, leave holder lists,
        unregister the memory it registered itself. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if os.getpid() != self._pid:
            # A forked child's copy: the threads did not survive the fork, and the objects
            # and holder entries are the parent's to withdraw (pyzmq does the same).
            return
        with self._lock:
            fetches = list(self._fetches)
        for f in fetches:
            # Reads land in memory that is about to be unregistered: stop them first.
            f.cancel(InvalidArgumentError(f"the P2P store {self.name} was closed during "
                                          f"the get of {f.m.name!r}"))
        for f in fetches:
            f.finished.wait(10.0)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._lock:
            names = list(self._objects)
        for name in names:
            try:
                self.unregister(name)
            except MooncakeError as e:
                log.warning("could not withdraw %r cleanly: %s", name, e)
        self._server.close()
        self.directory.close()

    def __enter__(self) -> "P2PStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            warnings.warn(f"P2PStore {self.name} was not closed", ResourceWarning, stacklevel=2)
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return (f"<P2PStore {self.name} at {self.address} via {self.directory.kind} "
                f"objects={len(self._objects)}{' closed' if self._closed else ''}>")

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the P2P store is closed")

    # -- memory --------------------------------------------------------------------------
    def _pieces(self, buffers, what: str, serve: bool):
        """``(pieces, regions we registered)`` for user buffers in object order."""
        if buffers is None:
            raise InvalidArgumentError(f"{what}: give one or more buffers")
        items = buffers if isinstance(buffers, (list, tuple)) else [buffers]
        if not items:
            raise InvalidArgumentError(f"{what}: give one or more buffers")
        regions = {r.address: r for r in self.engine.regions}
        pieces, owned = [], []
        try:
            for i, obj in enumerate(items):
                if isinstance(obj, MemoryRegion):
                    mr = regions.get(obj.address)
                    if mr is None or mr.length < obj.length:
                        raise InvalidArgumentError(
                            f"{what}: buffer {i} ({obj!r}) is not registered with this store's "
                            f"engine; register it with engine.register() first, or pass the "
                            f"array itself")
                    if serve and obj.access == "local":
                        raise InvalidArgumentError(
                            f"{what}: buffer {i} is registered with access='local', so peers "
                            f"cannot read chunks from it; register it with access='r'")
                    pieces.append((obj.address, obj.length))
                elif (inside := _inside(self.engine.regions, obj)) is not None:
                    # Memory the caller registered already (the whole array, or a region
                    # around it): use it as it is; registering again would overlap.
                    if serve and inside[2] == "local":
                        raise InvalidArgumentError(
                            f"{what}: buffer {i} lies in a region registered with "
                            f"access='local', so peers cannot read chunks from it; register "
                            f"it with access='r'")
                    pieces.append(inside[:2])
                else:
                    mr = self.engine.register(obj, access="r")
                    owned.append(mr)
                    pieces.append((mr.address, mr.length))
        except BaseException:
            for mr in owned:
                self.engine.unregister(mr)
            raise
        return pieces, owned

    # -- publish -------------------------------------------------------------------------
    def register(self, name: str, buffers, chunk_size: int | None = None,
                 progress=None) -> Manifest:
        """Publish ``buffers`` as the object ``name``.

        Parameters
        ----------
        name : str
            Cluster-wide name of the object.
        buffers : MemoryRegion, buffer object, or a list of them
            The object's bytes, in order. Regions must be registered with this store's
            engine (not ``access="local"``); other objects (numpy arrays, mmaps) are
            registered read-only here and unregistered by :meth:`unregister`. Keep the
            memory unchanged while published: getters verify every chunk and refuse a
            changed one.
        chunk_size : int, optional
            Bytes per chunk (default: the store's ``chunk_size``).
        progress : callable(done_bytes, total_bytes), optional
            Called while checksums are computed.

        Returns
        -------
        Manifest
        """
        self._check_open()
        _check_name(name)
        cs = self.chunk_size if chunk_size is None else _check_chunk_size(chunk_size)
        with self._lock:
            if name in self._objects:
                raise ObjectExistsError(f"this store already holds an object named {name!r}; "
                                        f"unregister it first")
        pieces, owned = self._pieces(buffers, f"register({name!r})", serve=True)
        try:
            manifest = Manifest.build(name, pieces, cs, self.ref, progress,
                                      token=self.directory.token)
            local = _Local(manifest, pieces, "origin", owned, complete=True)
            with self._lock:
                if name in self._objects:
                    raise ObjectExistsError(f"this store already holds {name!r}")
                self._objects[name] = local
            try:
                self.directory.publish(manifest)
            except BaseException:
                with self._lock:
                    self._objects.pop(name, None)
                raise
        except BaseException:
            for mr in owned:
                self.engine.unregister(mr)
            raise
        log.info("published %r: %d bytes in %d chunks", name, manifest.size, manifest.chunks)
        return manifest

    def unregister(self, name: str) -> None:
        """Stop holding ``name``; if this store published it, withdraw it everywhere
        (getters in progress fail with :class:`ObjectUnregisteredError`, replicas stop
        serving it at their next refresh)."""
        with self._lock:
            local = self._objects.pop(name, None)
        if local is None:
            raise ObjectNotFoundError(f"this store holds no object named {name!r}; it holds: "
                                      f"{', '.join(sorted(self._objects)) or 'nothing'}")
        try:
            if local.role == "origin":
                self.directory.withdraw(local.manifest)
            else:
                self.directory.remove_holder(local.manifest, self.ref)
                if isinstance(self.directory, StoreDirectory) and not self._closed:
                    threading.Thread(target=self._quietly, daemon=True, name="mte-p2p-unlist",
                                     args=(self._unlist_again, local.manifest)).start()
        finally:
            self._drop_memory(local)

    def _unlist_again(self, m: Manifest) -> None:
        """Remove our holder entry again if another holder's concurrent update (the
        stores have no compare-and-swap) wrote it back after our removal."""
        for delay in (0.2, 1.0, 3.0):
            if self._stop.wait(delay):
                return
            with self._lock:
                again = self._objects.get(m.name)
            if again is not None and again.manifest.object_id == m.object_id:
                return          # fetched again meanwhile: the entry is right
            if any(h.key == self.ref.key for h in self.directory.holders(m.name, m.object_id)):
                self.directory.remove_holder(m, self.ref)

    def _drop_memory(self, local: _Local) -> None:
        for mr in local.owned:
            try:
                self.engine.unregister(mr)
            except MooncakeError:
                pass        # the engine was closed first: nothing left to release

    # -- fetch ---------------------------------------------------------------------------
    def get(self, name: str, into=None, *, progress=None, timeout: float | None = None,
            decentralized: bool | None = None):
        """Fetch the object ``name`` into ``into``; afterwards this store holds it.

        Parameters
        ----------
        name : str
        into : MemoryRegion, buffer object, list of them, or None
            Where the bytes go, in order; at least the object's size in total. Regions
            must be registered with this store's engine; other objects are registered
            here. ``None``: a new ``numpy.uint8`` array is allocated and returned.
        progress : callable(done_bytes, total_bytes), optional
            Called (from worker threads) after each verified chunk.
        timeout : float, optional
            Give up after this many seconds (default: only when no holder can supply
            the missing chunks for ``stall_timeout`` seconds).
        decentralized : bool, optional
            Override the store's setting for this get.

        Returns
        -------
        ``into``, or the new array.

        Raises
        ------
        ObjectNotFoundError
            No object of that name is published.
        ObjectUnregisteredError
            Its publisher unregistered it during the get.
        NoHolderError
            No holder could supply some chunks (all failed or served corrupt data).
        """
        self._check_open()
        _check_name(name)
        decentral = self.decentralized if decentralized is None else bool(decentralized)
        manifest = self.directory.manifest(name)
        if manifest is not None:
            # With a token: only a manifest sealed with it (issue #35 item 8).
            manifest.check_sealed(self.directory.token)
        if manifest is None:
            where = self.directory.describe()
            try:
                known = self.directory.names()
            except MetadataError:
                known = []
            raise ObjectNotFoundError(
                f"no object named {name!r} is published in {where}; published: "
                f"{', '.join(known[:20]) or 'none'}"
                + (" (with metadata='p2p', pass seeds=['host:port'] of the publisher's store)"
                   if isinstance(self.directory, SeedDirectory) and not self.directory.seeds
                   else ""))
        result = None
        if into is None:
            result = np.empty(manifest.size, dtype=np.uint8)
            into = result
        pieces, owned = self._pieces(into, f"get({name!r})", serve=decentral)
        total = sum(n for _, n in pieces)
        if total < manifest.size:
            for mr in owned:
                self.engine.unregister(mr)
            raise InvalidArgumentError(f"get({name!r}): the buffers hold {total} bytes but the "
                                       f"object has {manifest.size}")
        local = _Local(manifest, pieces, "replica", owned)
        with self._lock:
            if name in self._objects:
                for mr in owned:
                    self.engine.unregister(mr)
                raise ObjectExistsError(f"this store already holds {name!r} "
                                        f"({self._objects[name].held}); unregister it first")
            self._objects[name] = local
        fetch = Fetch(self, manifest, pieces, local, decentralized=decentral,
                      parallelism=self.parallelism, progress=progress, timeout=timeout,
                      stall_timeout=self.stall_timeout)
        t0 = time.monotonic()
        with self._lock:
            self._fetches.add(fetch)
        try:
            self._check_open()
            fetch.run()
        except BaseException:
            with self._lock:
                if self._objects.get(name) is local:
                    del self._objects[name]
            local.summary = fetch.summary()
            local.summary["error"] = str(sys.exc_info()[1])
            with self._lock:
                self._gets[name] = local.summary
            if decentral:
                self._quietly(self.directory.remove_holder, manifest, self.ref)
            self._drop_memory(local)
            raise
        finally:
            with self._lock:
                self._fetches.discard(fetch)
        with self._lock:
            local.complete = True
            local.summary = fetch.summary()
            local.summary["seconds"] = time.monotonic() - t0
            self._gets[name] = local.summary
            if not decentral:
                # Centralized: a plain copy, not a holder others are sent to.
                self._objects.pop(name, None)
        if not decentral:
            self._drop_memory(local)
        return into if result is None else result

    # -- catalogue and stats -------------------------------------------------------------
    def list(self) -> list[ObjectInfo]:
        """The objects published (in the directory) and those this store holds."""
        self._check_open()
        out: dict[str, ObjectInfo] = {}
        with self._lock:
            local = {n: (o.manifest, o.held) for n, o in self._objects.items()}
        names = self.directory.names()
        # Manifests of objects we do not hold: one batch lookup in a metadata store.
        missing = [n for n in names if n not in local]
        fetched = dict(zip(missing, self.directory.manifests(missing)))
        for name in names:
            held = local.get(name)
            m = held[0] if held else fetched.get(name)
            if m is not None:
                out[name] = _info(m, held[1] if held else None)
        for name, (m, held) in local.items():
            out.setdefault(name, _info(m, held))
        return sorted(out.values(), key=lambda o: o.name)

    def stats(self) -> dict:
        """Counters since this store started.

        Keys: ``bytes_uploaded``, ``bytes_downloaded``, ``chunks_uploaded``,
        ``chunks_downloaded``, ``corrupt_chunks`` (received and refused),
        ``corrupt_local`` (found in our own copies), ``repaired_chunks`` (of those,
        fetched again from other holders), ``chunks_from`` / ``bytes_from``
        (per holder name: what we fetched from it), ``chunks_to`` (per getter: what it
        fetched from us), ``failed_holders`` (name: why), and ``objects`` (per object:
        ``held``, ``chunks_have``, ``bytes_uploaded`` and, for fetched ones, the get's
        per-holder ``chunks_from``, ``seconds``), ``gets`` (per name, the last get's
        ``chunks_from``, ``failed_holders``, ``corrupt_chunks``, ``seconds`` or ``error``).
        """
        with self._lock:
            s = dict(self._stats)
            s["chunks_from"] = dict(self._chunks_from)
            s["bytes_from"] = dict(self._bytes_from)
            s["chunks_to"] = dict(self._chunks_to)
            s["failed_holders"] = dict(self._failed)
            s["objects"] = {n: {"held": o.held, "size": o.manifest.size,
                                "chunks": o.manifest.chunks, "chunks_have": o.have,
                                "bytes_uploaded": o.uploaded,
                                "chunks_uploaded": o.chunks_uploaded,
                                "uploads_to": dict(o.uploads_to), **o.summary}
                            for n, o in self._objects.items()}
            s["gets"] = {n: dict(g) for n, g in self._gets.items()}
        return s

    # -- called by Fetch -----------------------------------------------------------------
    def _chunk_arrived(self, local: _Local, c: int, length: int, source: HolderRef) -> None:
        with self._lock:
            local.bits[c] = True
            local.have += 1
            self._stats["bytes_downloaded"] += length
            self._stats["chunks_downloaded"] += 1
            self._chunks_from[source.name] = self._chunks_from.get(source.name, 0) + 1
            self._bytes_from[source.name] = self._bytes_from.get(source.name, 0) + length

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _announce_later(self, local: _Local) -> None:
        # Off the data path: a store round trip must not hold up a worker.
        threading.Thread(target=self._quietly, daemon=True, name="mte-p2p-announce",
                         args=(self._list_self, local)).start()

    def _current(self, local: _Local) -> bool:
        with self._lock:
            return self._objects.get(local.manifest.name) is local

    def _list_self(self, local: _Local) -> None:
        """Add this store to the holders of ``local`` unless it stopped holding it; an
        unregister that raced with the addition is redone after it."""
        if not self._current(local):
            return
        self.directory.add_holder(local.manifest, self.ref)
        if not self._current(local):
            self.directory.remove_holder(local.manifest, self.ref)

    def _holder_failed(self, manifest: Manifest, ref: HolderRef, why) -> None:
        with self._lock:
            self._failed[ref.name] = str(why)
            for o in self._objects.values():
                o.known.pop(ref.key, None)
        threading.Thread(target=self._quietly, daemon=True, name="mte-p2p-prune",
                         args=(self.directory.holder_gone, manifest, ref)).start()

    def _prune_later(self, manifest: Manifest, ref: HolderRef) -> None:
        if isinstance(self.directory, StoreDirectory):
            threading.Thread(target=self._quietly, daemon=True, name="mte-p2p-prune",
                             args=(self.directory.remove_holder, manifest, ref)).start()

    def _current_manifest(self, m: Manifest) -> Manifest | None:
        if isinstance(self.directory, SeedDirectory) and m.origin.key != self.ref.key:
            # No store: the publisher is the authority. Unreachable is not "withdrawn"
            # (replicas keep serving when the publisher dies).
            c = ControlClient(m.origin.address, min(self.control_timeout, 2.0),
                              self.directory.token)
            try:
                reply = c.call({"op": "manifest", "name": m.name})
            except MetadataError:
                return m
            finally:
                c.close()
            cur = Manifest.from_json(reply["manifest"]) if reply.get("ok") else None
        else:
            cur = self.directory.manifest(m.name)
        if cur is not None and self.directory.token:
            try:
                cur.check_sealed(self.directory.token)
            except MooncakeError:
                return m                # a forged replacement is no withdrawal
        return cur

    def _quietly(self, fn, *args) -> None:
        try:
            fn(*args)
        except MooncakeError as e:
            log.debug("%s failed: %s", getattr(fn, "__name__", fn), e)

    # -- the control port ----------------------------------------------------------------
    def _handle(self, req: dict, session: dict) -> dict:
        op = req.get("op")
        if op == "hello":
            return {"ok": True, "ref": self.ref.to_json()}
        if op == "list":
            with self._lock:
                objs = [o.manifest.to_json() for o in self._objects.values()]
            return {"ok": True, "objects": objs}
        name = req.get("name")
        with self._lock:
            local = self._objects.get(name)
        if op == "manifest":
            if local is None:
                return {"ok": False, "error": "not_found"}
            return {"ok": True, "manifest": local.manifest.to_json()}
        oid = req.get("object_id")
        if local is None or local.manifest.object_id != oid or \
                req.get("instance", self.ref.instance) != self.ref.instance:
            return {"ok": False, "error": "not_found",
                    "message": f"{self.name} does not hold object {name!r} ({oid})"}
        if op == "bitmap":
            return self._bitmap(local, True)
        if op == "start":
            return self._start(local, req, session)
        if op == "done":
            return self._done(local, req, session)
        if op == "holders":
            with self._lock:
                refs = [r.to_json() for r in local.known.values()]
                if local.have:
                    refs.append(self.ref.to_json())
            return {"ok": True, "holders": refs}
        if op in ("announce", "withdraw"):
            ref = HolderRef.from_json(req["holder"])
            with self._lock:
                if op == "announce":
                    _remember(local.known, ref)
                else:
                    local.known.pop(ref.key, None)
            return {"ok": True}
        return {"ok": False, "error": "bad_request", "message": f"unknown op {op!r}"}

    def _bitmap(self, local: _Local, with_layout: bool) -> dict:
        with self._lock:
            r = {"ok": True, "have": local.have, "load": local.active,
                 "known": len(local.known)}     # getters ask for the list when it grows
            if local.have == local.manifest.chunks:
                r["complete"] = True
            else:
                r["bitmap"] = pack_bits(local.bits)
        if with_layout:
            r["layout"] = local.pieces
        return r

    def _start(self, local: _Local, req: dict, session: dict) -> dict:
        """A getter starts reading a chunk from us (it waits for no answer)."""
        if "from" in req and self.decentralized:
            ref = HolderRef.from_json(req["from"])
            with self._lock:
                _remember(local.known, ref)
        with self._lock:
            local.active += 1
            grants = session.setdefault("grants", {})
            grants[local] = grants.get(local, 0) + 1
        return {"ok": True}

    def _done(self, local: _Local, req: dict, session: dict) -> dict:
        c = int(req.get("chunk", -1))
        result = req.get("result")
        # A report counts at most the chunk's own size (a peer's number is not trusted).
        size = local.manifest.chunk_range(c)[1] if 0 <= c < local.manifest.chunks else 0
        n = max(0, min(int(req.get("bytes", 0)), size))
        by = str(req.get("by", "?"))[:MAX_FIELD]
        with self._lock:
            grants = session.get("grants", {})
            if grants.get(local, 0) > 0:
                grants[local] -= 1
                local.active -= 1
            if result == "ok":
                local.uploaded += n
                local.chunks_uploaded += 1
                _count_to(local.uploads_to, by)
                self._stats["bytes_uploaded"] += n
                self._stats["chunks_uploaded"] += 1
                _count_to(self._chunks_to, by)
        if result == "corrupt" and 0 <= c < local.manifest.chunks:
            self._check_own_chunk(local, c)
        return {"ok": True}

    def _check_own_chunk(self, local: _Local, c: int) -> None:
        """A getter says our chunk ``c`` is corrupt: check, and stop serving it if so."""
        m = local.manifest
        if m.chunk_ok(local.pieces, c, self.directory.token):
            return      # it was damaged on the way, or the getter is wrong
        self._drop_chunk(local, c)
        # Memory that changed under one chunk (a buffer reused too early) has likely
        # changed elsewhere too: the refresh thread checks every chunk, then repairs.
        local.scrub = True
        log.warning("our copy of chunk %d of %r is corrupt (the memory changed after it was "
                    "verified); no longer serving it", c, m.name)

    def _drop_chunk(self, local: _Local, c: int) -> None:
        with self._lock:
            if local.bits[c]:
                local.bits[c] = False
                local.have -= 1
                local.corrupt_local += 1
                self._stats["corrupt_local"] += 1

    def _scrub(self, local: _Local) -> None:
        local.scrub = False
        m = local.manifest
        for c in np.flatnonzero(local.bits):
            if not m.chunk_ok(local.pieces, int(c), self.directory.token):
                self._drop_chunk(local, int(c))

    def _release(self, session: dict) -> None:
        with self._lock:
            for local, k in session.get("grants", {}).items():
                local.active = max(0, local.active - k)

    # -- background ----------------------------------------------------------------------
    def _maintain_once(self) -> None:
        with self._lock:
            items = list(self._objects.items())
        for name, local in items:
            if self._stop.is_set():
                return
            try:
                self._refresh(name, local)
            except MooncakeError as e:
                log.debug("refresh of %r failed: %s", name, e)
            except Exception:
                log.exception("refresh of %r failed", name)

    def _refresh(self, name: str, local: _Local) -> None:
        m = local.manifest
        if local.role == "replica" and local.complete:
            cur = self._current_manifest(m)
            if cur is None or cur.object_id != m.object_id:
                with self._lock:
                    if self._objects.get(name) is local:
                        del self._objects[name]
                    else:
                        return
                log.info("%r was withdrawn by its publisher; no longer serving it", name)
                self._drop_memory(local)
                return
        if local.scrub:
            self._scrub(local)
        if local.complete and local.have < m.chunks and self.decentralized:
            self._repair(local)
        if isinstance(self.directory, StoreDirectory) and local.have and \
                (local.role == "origin" or self.decentralized):
            # Re-add ourselves if a concurrent writer's update dropped us.
            if all(h.key != self.ref.key for h in self.directory.holders(name, m.object_id)):
                self._list_self(local)


    def _repair(self, local: _Local) -> None:
        """Fetch again the chunks found corrupt in our own copy (from the other holders)."""
        m = local.manifest
        with self._lock:
            missing = m.chunks - local.have
            fetch = Fetch(self, m, local.pieces, local, decentralized=True, parallelism=2,
                          progress=None, timeout=None, stall_timeout=self.stall_timeout,
                          have=local.bits.copy())
            self._fetches.add(fetch)
        try:
            fetch.run()
            with self._lock:
                self._stats["repaired_chunks"] += missing
            log.info("repaired %d corrupt chunks of %r from other holders", missing, m.name)
        finally:
            with self._lock:
                self._fetches.discard(fetch)


def _maintain(ref, stop: threading.Event, interval: float) -> None:
    """The refresh loop (see :meth:`P2PStore._refresh`), holding the store weakly."""
    while not stop.wait(interval):
        store = ref()
        if store is None:
            return
        store._maintain_once()
        del store


def _info(m: Manifest, held) -> ObjectInfo:
    return ObjectInfo(m.name, m.size, m.chunk_size, m.chunks, m.origin.name, m.object_id, held)


def _check_name(name) -> None:
    if not isinstance(name, str) or not name or len(name) > 512 or \
            any(ch in name for ch in "\x00\n\r"):
        raise InvalidArgumentError(f"object name must be a non-empty str of at most 512 "
                                   f"characters without NUL or newlines, got {name!r}")


def _check_chunk_size(cs) -> int:
    if not isinstance(cs, int) or cs < MIN_CHUNK_SIZE:
        raise InvalidArgumentError(f"chunk_size must be an int of at least {MIN_CHUNK_SIZE} "
                                   f"bytes, got {cs!r}")
    return cs

# SPDX-License-Identifier: Apache-2.0
"""One ``get``: chunks fetched in parallel from every holder, verified, served onward.

Worker threads each loop: pick a (holder, chunk) pair from the holders' bitmaps, tell
the holder (no answer awaited), read the chunk one-sided through the transfer engine
into the caller's memory and verify its CRC-32 against the manifest (the object
directory's verified READ, :func:`mooncake_te.objdir.read_verified`), tell the holder the
outcome, and mark the chunk held, which is the moment other getters may fetch it from
us. The calling thread meanwhile keeps the picture fresh: new holders from the
directory and from gossip, bitmaps of holders still downloading, every holder's load,
the manifest still published.

Choice, as BitTorrent does it (rarest first spreads chunks so that getters have
something to trade soonest): the least-loaded holder with a free slot goes first
(load = our reads in flight to it plus the reads by everyone it last reported), and from
it the chunk held by the fewest holders, ties broken at random so that getters starting
together ask the publisher for different chunks. A holder that fails a read or
is unreachable is dropped for the rest of the get; one that serves a corrupt chunk is
not asked for that chunk again, and after ``CORRUPT_LIMIT`` corrupt chunks not at all.
"""
from __future__ import annotations

import base64
import logging
import random
import threading
import time

import numpy as np

from ..errors import MetadataError, MooncakeError
from ..objdir import read_verified
from .control import ControlClient
from .errors import NoHolderError, ObjectUnregisteredError
from .manifest import HolderRef, Manifest, transfer_plan

log = logging.getLogger("mooncake_te.p2p_store")

#: corrupt chunks after which a holder is not asked again in this get
CORRUPT_LIMIT = 3
#: seconds between bitmap refreshes of a holder that is itself still downloading, and
#: between load refreshes of one that holds everything
BITMAP_PERIOD = 0.1
LOAD_PERIOD = 0.1
#: seconds between directory (holder list) refreshes (sooner when a holder reports that
#: it heard of new ones), and between manifest checks
HOLDERS_PERIOD = 0.25
MANIFEST_PERIOD = 0.5


def pack_bits(bits: np.ndarray) -> str:
    return base64.b64encode(np.packbits(bits).tobytes()).decode()


def unpack_bits(text: str, n: int) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(text), dtype=np.uint8)
    return np.unpackbits(raw, count=n).astype(bool)


class _Peer:
    """A holder as this get sees it."""

    def __init__(self, ref: HolderRef, client: ControlClient, n: int):
        self.ref = ref
        self.client = client
        self.layout = None              # [(address, length)] of its copy, in object order
        self.bits = np.zeros(n, dtype=bool)
        self.have = -1
        self.complete = False
        self.inflight = 0
        self.load = 0
        self.chunks = 0
        self.bytes = 0
        self.failures = 0
        self.corrupt = 0
        self.dead: str | None = None
        self.bad = np.zeros(n, dtype=bool)
        self.refreshed = 0.0
        self.known = 0                  # holders it knows, as it last reported
        self.known_asked = 0            # ... when we last asked it for them

    def update(self, reply: dict, n: int) -> None:
        if "load" in reply:
            self.load = int(reply["load"])
        if reply.get("complete"):
            self.complete = True
            self.bits[:] = True
            self.have = n
        elif "bitmap" in reply:
            self.bits = unpack_bits(reply["bitmap"], n)
            self.have = int(reply.get("have", self.bits.sum()))
        self.refreshed = time.monotonic()


class Fetch:
    """Fill ``pieces`` with the object ``manifest`` describes (see the module doc)."""

    def __init__(self, store, manifest: Manifest, pieces, local, *, decentralized: bool,
                 parallelism: int, progress, timeout: float | None, stall_timeout: float,
                 have=None):
        self.store = store
        self.engine = store.engine
        self.m = manifest
        self.pieces = pieces
        self.local = local                      # the store's entry: bits we serve onward
        self.decentralized = decentralized
        self.parallelism = max(1, int(parallelism))
        self.progress = progress
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.stall_timeout = stall_timeout
        n = manifest.chunks
        self.n = n
        # ``have``: chunks already in place (a repair fetches only the others)
        self.have = np.zeros(n, dtype=bool) if have is None else np.array(have, dtype=bool)
        self.inflight = np.zeros(n, dtype=bool)
        self.peers: dict[str, _Peer] = {}
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.error: BaseException | None = None
        self.done_bytes = 0
        self.last_progress = time.monotonic()
        self.corrupt_seen = 0
        self.rng = random.Random()
        self._announced = False
        self._discover = threading.Event()     # a holder knows of more holders: ask
        self._ignored: dict[str, float] = {}    # holders that said "not mine": until when
        self.finished = threading.Event()

    # -- the calling thread ----------------------------------------------------------------
    def run(self) -> None:
        workers = [threading.Thread(target=self._worker, daemon=True,
                                    name=f"mte-p2p-get-{i}") for i in range(self.parallelism)]
        next_holders = time.monotonic() + HOLDERS_PERIOD
        next_manifest = time.monotonic() + MANIFEST_PERIOD
        try:
            try:
                self._refresh_holders()
            except MooncakeError as e:
                self._fail(e)
            for w in workers:
                w.start()
            while True:
                with self.lock:
                    if self.error is not None or self.have.all():
                        break
                    self.cond.wait(0.02)
                    if self.error is not None or self.have.all():
                        break
                now = time.monotonic()
                try:
                    if now >= next_holders or self._discover.is_set():
                        self._discover.clear()
                        self._refresh_holders()
                        next_holders = now + HOLDERS_PERIOD
                    self._refresh_bitmaps(now)
                    if now >= next_manifest:
                        self._check_manifest()
                        next_manifest = now + MANIFEST_PERIOD
                    self._check_stall(now)
                except MooncakeError as e:
                    self._fail(e)
        finally:
            with self.lock:
                if self.error is None and not self.have.all():
                    self.error = NoHolderError("the get was interrupted")
                self.cond.notify_all()
            for w in workers:
                if w.is_alive() or w.ident is not None:
                    w.join()
            for p in self.peers.values():
                p.client.close()
            self.finished.set()
        if self.error is not None:
            raise self.error

    def cancel(self, e: BaseException) -> None:
        """End the get with ``e`` (its thread raises it once reads in flight are done)."""
        self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = e
            self.cond.notify_all()

    def _candidates(self) -> list[HolderRef]:
        if not self.decentralized:
            return [self.m.origin]
        refs = {r.key: r for r in self.store.directory.holders(self.m.name, self.m.object_id)}
        refs.setdefault(self.m.origin.key, self.m.origin)
        # Gossip: a holder knows the getters that read chunks from it before the
        # directory (whose read-modify-write may lose updates) lists them; ask those
        # that reported knowing more than we last heard.
        for p in list(self.peers.values()):
            if p.dead is None and p.known > p.known_asked:
                p.known_asked = p.known
                try:
                    reply = p.client.call({"op": "holders", "name": self.m.name,
                                           "object_id": self.m.object_id})
                except MetadataError:
                    continue
                for h in list(reply.get("holders", ()) if reply.get("ok") else ())[:256]:
                    try:
                        ref = HolderRef.from_json(h)
                    except (KeyError, TypeError, ValueError):
                        continue            # a malformed or oversized entry
                    refs.setdefault(ref.key, ref)
        return list(refs.values())

    def _refresh_holders(self) -> None:
        now = time.monotonic()
        for ref in self._candidates():
            if ref.key in self.peers or ref.key == self.store.ref.key or \
                    self._ignored.get(ref.key, 0) > now:
                continue
            peer = _Peer(ref, ControlClient(ref.address, self.store.control_timeout,
                                            self.store.directory.token), self.n)
            try:
                reply = peer.client.call({"op": "bitmap", "name": self.m.name,
                                          "object_id": self.m.object_id,
                                          "instance": ref.instance})
            except MetadataError as e:
                peer.dead = f"unreachable: {e}"
                peer.failures += 1
                self._holder_failed(peer)
                with self.lock:
                    self.peers[ref.key] = peer
                continue
            if not reply.get("ok"):
                peer.client.close()
                # Does not hold it (any more): not worth a connection per round; and a
                # listed store that says so is a stale entry (lost in a concurrent update
                # of the list, or an earlier instance): prune it.
                self._ignored[ref.key] = now + 2.0
                if reply.get("error") == "not_found" and ref.key != self.m.origin.key:
                    self.store._prune_later(self.m, ref)
                continue
            peer.layout = [(int(a), int(n)) for a, n in reply["layout"]]
            peer.update(reply, self.n)
            with self.lock:
                self.peers[ref.key] = peer
                self.cond.notify_all()

    def _refresh_bitmaps(self, now: float) -> None:
        for p in list(self.peers.values()):
            if p.dead is not None or \
                    now - p.refreshed < (LOAD_PERIOD if p.complete else BITMAP_PERIOD):
                continue
            try:
                reply = p.client.call({"op": "bitmap", "name": self.m.name,
                                       "object_id": self.m.object_id})
            except MetadataError as e:
                self._peer_failed(p, f"unreachable: {e}")
                continue
            if not reply.get("ok"):
                self._peer_failed(p, "no longer holds the object")
                continue
            with self.lock:
                p.update(reply, self.n)
                if reply.get("known", 0) > p.known:
                    p.known = reply["known"]
                    self._discover.set()
                self.cond.notify_all()

    def _check_manifest(self) -> None:
        try:
            cur = self.store._current_manifest(self.m)
        except MetadataError as e:
            log.debug("manifest check of %r failed: %s", self.m.name, e)
            return
        if cur is None or cur.object_id != self.m.object_id:
            raise ObjectUnregisteredError(
                f"object {self.m.name!r} was unregistered by its publisher "
                f"{self.m.origin.name} while being fetched ({self.done_bytes} of "
                f"{self.m.size} bytes had arrived)"
                + ("; a new object of that name is published now: get it again" if cur else ""))

    def _check_stall(self, now: float) -> None:
        if self.deadline is not None and now > self.deadline:
            raise NoHolderError(f"get of {self.m.name!r} timed out with {self.done_bytes} of "
                                f"{self.m.size} bytes ({self._why()})")
        with self.lock:
            busy = self.inflight.any()
        if not busy and now - self.last_progress > self.stall_timeout:
            raise NoHolderError(
                f"no holder could supply the remaining {int((~self.have).sum())} of {self.n} "
                f"chunks of {self.m.name!r} for {self.stall_timeout:g} s ({self._why()})")

    def _why(self) -> str:
        parts = []
        for p in self.peers.values():
            if p.dead:
                parts.append(f"{p.ref.name}: {p.dead}")
            else:
                parts.append(f"{p.ref.name}: has {max(p.have, 0)}/{self.n} chunks")
        return "; ".join(parts) or "no holders found"

    # -- workers ---------------------------------------------------------------------------
    def _pick(self):
        need = ~(self.have | self.inflight)
        if not need.any():
            return None
        live = [p for p in self.peers.values() if p.dead is None and p.layout is not None]
        if not live:
            return None
        avail = np.zeros(self.n, dtype=np.int32)
        for p in live:
            avail += p.bits & ~p.bad
        order = sorted((p for p in live if p.inflight < self.parallelism),
                       key=lambda p: (p.inflight + p.load, self.rng.random()))
        for p in order:
            cand = need & p.bits & ~p.bad
            if not cand.any():
                continue
            idx = np.flatnonzero(cand)
            a = avail[idx]
            rarest = idx[a == a.min()]
            return p, int(rarest[self.rng.randrange(len(rarest))])
        return None

    def _worker(self) -> None:
        while True:
            with self.lock:
                while True:
                    if self.error is not None or self.have.all():
                        return
                    choice = self._pick()
                    if choice is not None:
                        break
                    self.cond.wait(0.02)
                peer, c = choice
                self.inflight[c] = True
                peer.inflight += 1
            try:
                self._fetch_one(peer, c)
            except BaseException as e:      # never leave a worker dead silently
                log.exception("P2P get worker failed")
                self._fail(e)
            finally:
                with self.lock:
                    self.inflight[c] = False
                    peer.inflight -= 1
                    self.cond.notify_all()

    def _fetch_one(self, peer: _Peer, c: int) -> None:
        m = self.m
        start = {"op": "start", "name": m.name, "object_id": m.object_id, "chunk": c}
        if self.decentralized and self.local is not None:
            start["from"] = self.store.ref.to_json()        # gossip: we hold chunks too
        try:
            # Told, not asked: the holder's Python may be busy with its own get, and
            # waiting for its answer cost more than the chunk itself (2-5 ms against
            # ~1 ms for 4 MiB, measured with 4 getters on 2 cores). Its bitmap already
            # says it has the chunk, and the checksum catches a copy that changed since.
            peer.client.send(start)
        except MetadataError as e:
            self._peer_failed(peer, f"unreachable: {e}")
            return
        off, length = m.chunk_range(c)
        result = "ok"
        seg = peer.ref.segment
        errors: dict = {}
        # The object directory's verified READ: the chunk lands only in our copy's
        # pieces; its CRC (with a token, its keyed tag too: a CRC a lying holder can
        # match) is checked before anyone may use it.
        ok = read_verified(self.engine, [[(seg, a, r, n) for a, r, n in zip(*transfer_plan(
            self.pieces, peer.layout, off, length))]],
            lambda _: m.chunk_ok(self.pieces, c, self.store.directory.token),
            "p2p_store", self.store.transfer_timeout, errors, log)[0]
        if errors:
            result = "failed"
            self._report(peer, c, result, length)
            self._peer_failed(peer, f"read failed: {errors[0]}")
            return
        if not ok:
            result = "corrupt"
        self._report(peer, c, result, length)
        if result == "corrupt":
            self.store._count("corrupt_chunks")
        with self.lock:
            if result == "corrupt":
                peer.corrupt += 1
                peer.bad[c] = True
                self.corrupt_seen += 1
                if peer.corrupt >= CORRUPT_LIMIT:
                    peer.dead = f"served {peer.corrupt} corrupt chunks"
                log.warning("chunk %d of %r from %s failed its checksum; fetching it elsewhere",
                            c, m.name, peer.ref.name)
                return
            self.have[c] = True
            peer.chunks += 1
            peer.bytes += length
            self.done_bytes += length
            self.last_progress = time.monotonic()
            done = self.done_bytes
        # Verified: from now on others may fetch this chunk from us.
        self.store._chunk_arrived(self.local, c, length, peer.ref)
        if self.decentralized and not self._announced:
            self._announced = True
            self.store._announce_later(self.local)
        if self.progress is not None:
            self.progress(done, m.size)

    def _report(self, peer: _Peer, c: int, result: str, length: int) -> None:
        try:
            peer.client.send({"op": "done", "name": self.m.name, "object_id": self.m.object_id,
                              "chunk": c, "result": result, "bytes": length,
                              "by": self.store.name})
        except MetadataError:
            pass        # the read itself says whether the holder is alive

    def _peer_failed(self, peer: _Peer, why: str) -> None:
        with self.lock:
            if peer.dead is not None:
                return
            peer.dead = why
            peer.failures += 1
        log.info("holder %s of %r failed (%s); fetching from the others",
                 peer.ref.name, self.m.name, why)
        self._holder_failed(peer)

    def _holder_failed(self, peer: _Peer) -> None:
        self.store._holder_failed(self.m, peer.ref, peer.dead)

    # -- results ---------------------------------------------------------------------------
    def summary(self) -> dict:
        with self.lock:
            return {
                "chunks_from": {p.ref.name: p.chunks for p in self.peers.values() if p.chunks},
                "bytes_from": {p.ref.name: p.bytes for p in self.peers.values() if p.bytes},
                "failed_holders": {p.ref.name: p.dead for p in self.peers.values() if p.dead},
                "corrupt_chunks": self.corrupt_seen,
                "corrupt_from": {p.ref.name: p.corrupt for p in self.peers.values()
                                 if p.corrupt},
            }

# SPDX-License-Identifier: Apache-2.0
"""The SSD tier: block records in one slab file under ``cache_dir``, several I/Os in flight.

Layout of ``cache_dir``::

    kvcache.json   manifest: format, slot size, namespace (a mismatch is a ConfigError)
    kvcache.slab   slot i at offset i * slot_size, each a record (:mod:`.record`)
    kvcache.lock   flock(2)ed while a process uses the directory

The file grows (sparsely) as blocks are demoted, so ``du -sh cache_dir`` shows what the
tier holds. I/O is ``O_DIRECT`` (open(2): bypasses the page cache, so the DRAM tier is not
duplicated in page cache and a read measures the device) with buffers, offsets and
lengths aligned to 4 KiB. Where the file system refuses ``O_DIRECT`` (tmpfs, some
overlay set-ups answer EINVAL) the tier falls back to buffered I/O and ``fdatasync``s after
each batch of writes, and says so in a warning and in ``stats()["ssd_io"]``.

Crash safety: every record carries checksums of its header and data. On start the slot
headers are scanned and the index rebuilt (the newest ``seq`` wins for a key found
twice); a record whose header does not check out is skipped, and one whose data does not
check out is dropped when it is read, never returned. The index lives in memory only, so
there is no journal to tear.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from ..errors import ConfigError
from .policy import make_policy
from .record import ALIGN, HEADER_SIZE, crc32_held, parse_header, round_up

log = logging.getLogger("mooncake_te.kvcache")

FORMAT = "mooncake_te.kvcache/1"
SLAB, MANIFEST, LOCK = "kvcache.slab", "kvcache.json", "kvcache.lock"


def _writable_dir(path: str) -> None:
    """Create ``path`` if needed and prove a file can be written there."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"[kvcache] cache_dir = {path!r} is not a writable directory "
                          f"({e.strerror or e}); point cache_dir at a directory on a local SSD "
                          f"that this user can write, or set ssd_cache_gb = 0 for DRAM "
                          f"only") from None


class SSDTier:
    """Block records on a local file system.

    Parameters
    ----------
    cache_dir : str
    capacity_bytes : int
        Bytes of slots; the tier holds ``capacity_bytes // slot_size`` blocks.
    slot_size : int
        Bytes per slot, a multiple of 4096 (:func:`record.slot_size_for`).
    policy : {"lru", "lfu"}
    namespace : str
        What the keys mean (e.g. the model name); a ``cache_dir`` written under another
        namespace or slot size is refused rather than served.
    io_depth : int
        I/Os in flight (threads; ``os.pread``/``os.pwrite`` release the GIL).
    o_direct : bool
        Try ``O_DIRECT`` first.
    """

    def __init__(self, cache_dir: str, capacity_bytes: int, slot_size: int,
                 policy: str = "lru", namespace: str = "default", io_depth: int = 4,
                 o_direct: bool = True):
        if slot_size % ALIGN:
            raise ValueError(f"slot_size must be a multiple of {ALIGN}")
        self.dir = os.path.abspath(os.fspath(cache_dir))
        self.slot_size = slot_size
        self.nslots = int(capacity_bytes) // slot_size
        self.namespace = namespace
        self.policy = make_policy(policy)
        self.index: dict = {}            # key -> (slot, length, seq)
        self._free: list = []
        self._next = 0                   # slots below this have been used at least once
        self._fd = self._lockfd = -1
        self.corrupt = 0                 # records dropped for a bad checksum
        _writable_dir(self.dir)
        self._lock_dir()
        try:
            self._check_manifest()
            self._open(o_direct)
            self._pool = ThreadPoolExecutor(max_workers=max(1, io_depth),
                                            thread_name_prefix="kvcache-ssd")
            self.recovered = self._rebuild()
        except BaseException:
            self.close()
            raise

    # --- set-up -------------------------------------------------------------------------
    def _lock_dir(self) -> None:
        path = os.path.join(self.dir, LOCK)
        self._lockfd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(f"[kvcache] cache_dir = {self.dir!r} is in use by another "
                                  f"process (flock on {LOCK}); give each cache its own "
                                  f"cache_dir") from None
            raise

    def _check_manifest(self) -> None:
        path = os.path.join(self.dir, MANIFEST)
        want = {"format": FORMAT, "slot_size": self.slot_size, "namespace": self.namespace}
        try:
            with open(path) as f:
                have = json.load(f)
        except FileNotFoundError:
            have = None
        except (OSError, ValueError):
            have = {}
        if have is not None and {k: have.get(k) for k in want} != want:
            raise ConfigError(
                f"[kvcache] cache_dir = {self.dir!r} holds a cache written with "
                f"{ {k: have.get(k) for k in want} }, not {want}; use another cache_dir, or "
                f"delete {SLAB} and {MANIFEST} there to start empty")
        if have is None:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(want, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)       # atomic: a crash leaves the old or the new file

    def _open(self, o_direct: bool) -> None:
        path = os.path.join(self.dir, SLAB)
        flags = os.O_RDWR | os.O_CREAT
        self.direct = False
        if o_direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.warning("kvcache: %s does not support O_DIRECT; using buffered I/O with "
                            "fdatasync after each batch of writes", self.dir)
        if self._fd < 0:
            self._fd = os.open(path, flags, 0o644)

    def _rebuild(self) -> int:
        """Index the valid records already in the slab; returns how many."""
        size = os.fstat(self._fd).st_size
        # Records are written only as far as their data reaches, so the last slot may end
        # short of a whole slot: count it.
        used = min(-(-size // self.slot_size), self.nslots)
        if size > self.nslots * self.slot_size:
            # The tier shrank since last time: slots past the end are gone.
            os.ftruncate(self._fd, self.nslots * self.slot_size)
        found: dict = {}
        if used:
            import mmap
            # Headers only: the data checksum is checked when a block is read, so a start
            # reads 4 KiB per slot instead of the whole tier.
            buf = mmap.mmap(-1, ALIGN)
            mv = memoryview(buf)
            for slot in range(used):
                n = os.preadv(self._fd, [mv], slot * self.slot_size)
                h = parse_header(mv) if n >= HEADER_SIZE else None
                if h is None or HEADER_SIZE + h.length > self.slot_size:
                    if n >= HEADER_SIZE and bytes(mv[:4]) != bytes(4):
                        self.corrupt += 1
                    self._free.append(slot)
                    continue
                old = found.get(h.key)
                if old is not None:
                    if old[2] >= h.seq:
                        self._free.append(slot)
                        continue
                    self._free.append(old[0])
                found[h.key] = (slot, h.length, h.seq)
            mv.release()
            buf.close()
        self._next = used
        # Oldest first, so LRU order (and LFU's recency tie-break) survives a restart.
        for key, ent in sorted(found.items(), key=lambda kv: kv[1][2]):
            self.index[key] = ent
            self.policy.insert(key)
        self.max_seq = max((e[2] for e in found.values()), default=0)
        return len(found)

    # --- index --------------------------------------------------------------------------
    def __contains__(self, key) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def bytes_used(self) -> int:
        return sum(e[1] for e in self.index.values())

    def disk_bytes(self) -> int:
        """Bytes the slab takes on disk (what ``du`` counts)."""
        try:
            return os.fstat(self._fd).st_blocks * 512
        except OSError:
            return 0

    def touch(self, key) -> None:
        self.policy.touch(key)

    def remove(self, key) -> None:
        ent = self.index.pop(key, None)
        if ent is not None:
            self.policy.remove(key)
            self._free.append(ent[0])

    def assign(self, key, length: int, seq: int, pinned=(), freq: int = 1):
        """Make room for ``key`` and return ``(slot, evicted keys)``; the caller writes it."""
        evicted = []
        if self._free:
            slot = self._free.pop()
        elif self._next < self.nslots:
            slot = self._next
            self._next += 1
        else:
            victim = self.policy.victim(pinned) if pinned else self.policy.victim()
            if victim is None:
                return None, evicted
            slot = self.index.pop(victim)[0]
            self.policy.remove(victim)
            evicted.append(victim)
        self.index[key] = (slot, length, seq)
        self.policy.insert(key, freq)
        return slot, evicted

    # --- I/O ----------------------------------------------------------------------------
    def write_many(self, items) -> None:
        """Write records: ``items`` is ``[(slot, memoryview of the record image)]``; each
        view's address is 4 KiB aligned and its length a multiple of 4 KiB."""
        if not items:
            return
        fd, ss = self._fd, self.slot_size
        futs = [self._pool.submit(os.pwrite, fd, mv, slot * ss) for slot, mv in items]
        for f in futs:
            f.result()
        if not self.direct:
            os.fdatasync(fd)

    def read_many(self, items) -> list:
        """Read records into ``[(key, slot, length, memoryview)]`` destinations (aligned
        as for :meth:`write_many`); returns one bool per item, False where the header or
        data checksum does not match (the record is then dropped from the index)."""
        if not items:
            return []
        fd, ss = self._fd, self.slot_size
        futs = [self._pool.submit(_read_verify, fd, mv, slot * ss,
                                  round_up(HEADER_SIZE + length), key, length)
                for key, slot, length, mv in items]
        ok = [f.result() for f in futs]
        for good, (key, *_rest) in zip(ok, items):
            if not good:
                self.corrupt += 1
                log.warning("kvcache: dropped a corrupt or torn SSD block (key %s) in %s",
                            key.hex(), self.dir)
                self.remove(key)
        return ok

    def sync(self) -> None:
        if self._fd >= 0:
            os.fdatasync(self._fd)

    def close(self) -> None:
        """Flush and release the directory. Idempotent."""
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
            self._pool = None
        if self._fd >= 0:
            try:
                os.fdatasync(self._fd)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = -1
        if self._lockfd >= 0:
            os.close(self._lockfd)      # drops the flock
            self._lockfd = -1


def _read_verify(fd, mv, offset, nbytes, key, length) -> bool:
    # Runs on an I/O thread: the read releases the GIL.
    n = os.preadv(fd, [mv[:nbytes]], offset)
    if n < HEADER_SIZE + length:
        return False
    h = parse_header(mv)
    if h is None or h.key != key or h.length != length:
        return False
    return crc32_held(mv[HEADER_SIZE:HEADER_SIZE + length]) == h.crc

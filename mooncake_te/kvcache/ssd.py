# SPDX-License-Identifier: Apache-2.0
"""The SSD tier: block records in one slab file under ``cache_dir``, several I/Os in flight.

Layout of ``cache_dir``::

    kvcache.json   manifest: format, slot size, namespace (a mismatch is a ConfigError)
    kvcache.slab   slot i at offset i * slot_size, each a record (:mod:`.record`)
    kvcache.lock   flock(2)ed while a process uses the directory
    instance-<i>/  the same, for the i-th process sharing ``cache_dir`` (``share=True``)

With ``share=True`` (the vLLM connector's pool) several processes may be given one
``cache_dir``: each takes the first of ``cache_dir``, ``cache_dir/instance-1``, ... that
no other process holds (its ``flock``) and whose manifest is its own layout or absent,
so a second vLLM instance on the host starts without set-up and a restarted one finds
a directory of its own layout again (issue 35, item 9).

The file grows (sparsely) as blocks are demoted, so ``du -sh cache_dir`` shows what the
tier holds. The slots of one batch that lie side by side are read or written with one
``preadv``/``pwritev``. I/O is ``O_DIRECT`` (open(2): bypasses the page cache, so the DRAM
tier is not duplicated in page cache and a read measures the device) with buffers, offsets
and lengths aligned to 4 KiB. Where the file system refuses ``O_DIRECT`` (tmpfs, some
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

from ..errors import ConfigError
from .cache_dir import problem
from .policy import make_policy
from .record import ALIGN, HEADER_SIZE, crc32_held, parse_header, round_up
from .tiers import Tier

log = logging.getLogger("mooncake_te.kvcache")

FORMAT = "mooncake_te.kvcache/1"
SLAB, MANIFEST, LOCK = "kvcache.slab", "kvcache.json", "kvcache.lock"
#: most processes that share one cache_dir (share=True): cache_dir and instance-1..63
MAX_SHARERS = 64
# Buffers one preadv(2)/pwritev(2) takes (IOV_MAX, 1024 on Linux).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def _check_owner(path: str) -> None:
    """Refuse a ``cache_dir`` another user controls: whoever can write it can plant
    records this cache serves as KV (or a manifest naming our namespace). Issue 35."""
    st = os.stat(path)
    uid = os.geteuid()
    if st.st_uid != uid:
        raise ConfigError(
            f"[kvcache] cache_dir = {path!r} belongs to uid {st.st_uid}, not to this "
            f"process's uid {uid}: blocks another user can write there would be served as "
            f"KV; use a directory this user created (mkdir as the engine's user), or chown "
            f"{uid} {path}")
    if st.st_mode & 0o002:
        # Sticky or not: another user could create the slab or manifest before us.
        raise ConfigError(
            f"[kvcache] cache_dir = {path!r} is writable by every user (mode "
            f"{st.st_mode & 0o7777:o}): another user could plant the cache's files; use a "
            f"directory of its own (for example {os.path.join(path, 'mooncake-kv')}), or "
            f"chmod o-w {path}")


def _writable_dir(path: str) -> None:
    """Create ``path`` if only its last level is missing, check this user owns it, and
    prove a file can be written there (the rules and messages ``mooncake-te doctor``
    gives too: :mod:`.cache_dir`)."""
    why = problem(path, create=True)
    if why:
        _code, message, fix = why
        raise ConfigError(f"{message}; {fix} (or set ssd_cache_gb = 0 for DRAM only)")
    _check_owner(path)


class _DirInUse(ConfigError):
    """cache_dir is flock()ed by another process."""


class _DirOfAnotherLayout(ConfigError):
    """cache_dir holds a cache of another format, slot size or namespace."""


class SSDTier(Tier):
    """Block records on a local file system: the tier below the DRAM hub, which takes its
    demotions (:class:`~.tiers.Tier`, ``local``).

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
        Accepted for compatibility and unused: a batch's adjacent slots are one
        ``preadv``/``pwritev`` on the caller's thread (see :meth:`read_many`).
    o_direct : bool
        Try ``O_DIRECT`` first.
    share : bool
        Other processes may be given the same ``cache_dir``: take the first free
        directory of this layout among ``cache_dir`` and its ``instance-<i>``
        subdirectories (see the module's docstring) instead of refusing a busy one.
    """

    name = "ssd"
    description = "the pool's SSD tier"
    local = True
    disk = True
    failed_counter = "corrupt_dropped"
    demotions = True

    @classmethod
    def open(cls, cache, args: dict) -> "SSDTier | None":
        """The tier of ``KVCache(ssd_bytes=..., cache_dir=...)``; None for ``ssd_bytes=0``."""
        ssd_bytes = args.get("ssd_bytes") or 0
        if ssd_bytes <= 0:
            return None
        if not args.get("cache_dir"):
            raise ConfigError("[kvcache] ssd_cache_gb > 0 needs cache_dir, a directory "
                              "on a local SSD")
        tier = cls(args["cache_dir"], int(ssd_bytes), cache.slot_size, cache.policy_name,
                   cache.namespace, args.get("io_depth", 4), args.get("o_direct", True),
                   share=bool(args.get("share", False)))
        if tier.nslots < 1:
            tier.close()
            raise ConfigError(f"[kvcache] ssd_cache_gb = {ssd_bytes / (1 << 30):g} holds "
                              f"no block of {cache.slot_size} bytes; make it larger or "
                              f"0 for DRAM only")
        return tier

    @classmethod
    def blank_stats(cls) -> dict:
        d: dict = dict.fromkeys(("blocks", "bytes", "capacity_blocks", "capacity_bytes",
                                 "disk_bytes", "recovered_blocks", "corrupt_records"), 0)
        d["io"] = None
        return d

    def __init__(self, cache_dir: str, capacity_bytes: int, slot_size: int,
                 policy: str = "lru", namespace: str = "default", io_depth: int = 4,
                 o_direct: bool = True, share: bool = False):
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
        self._claim_dir(share)
        try:
            self._open(o_direct)
            self.recovered = self._rebuild()
        except BaseException:
            self.close()
            raise

    # --- set-up -------------------------------------------------------------------------
    def _claim_dir(self, share: bool) -> None:
        """Lock ``self.dir`` and check its manifest; with ``share``, move on to the next
        ``instance-<i>`` subdirectory while the directory is held by another process or
        holds another layout."""
        base = self.dir
        skipped: list = []
        for i in range(MAX_SHARERS if share else 1):
            self.dir = base if i == 0 else os.path.join(base, f"instance-{i}")
            _writable_dir(self.dir)
            try:
                self._lock_dir()
                self._check_manifest()
            except (_DirInUse, _DirOfAnotherLayout) as e:
                self.close()
                if not share:
                    raise
                why = "in use" if isinstance(e, _DirInUse) else "another layout"
                skipped.append(f"{self.dir} ({why})")
                continue
            if skipped:
                log.info("kvcache: cache_dir %s is shared; this process uses %s (skipped: "
                         "%s)", base, self.dir, ", ".join(skipped))
            return
        raise ConfigError(f"[kvcache] cache_dir = {base!r} is shared by {MAX_SHARERS} "
                          f"processes already (all of it and its instance-<i> "
                          f"subdirectories are in use or hold another layout); give this "
                          f"one another cache_dir")

    def _lock_dir(self) -> None:
        path = os.path.join(self.dir, LOCK)
        self._lockfd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise _DirInUse(f"[kvcache] cache_dir = {self.dir!r} is in use by another "
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
            raise _DirOfAnotherLayout(
                f"[kvcache] cache_dir = {self.dir!r} holds a cache written with "
                f"{ {k: have.get(k) for k in want} }, not {want}; use another cache_dir, or "
                f"delete {SLAB} and {MANIFEST} there to start empty")
        if have is None:
            # No manifest: nothing says what the slab's records mean (they may be another
            # namespace's, the manifest deleted), so they are not served: start empty.
            slab = os.path.join(self.dir, SLAB)
            if os.path.exists(slab) and os.path.getsize(slab):
                log.warning("kvcache: %s has a %s but no %s; its blocks cannot be told "
                            "apart from another cache's, so the tier starts empty",
                            self.dir, SLAB, MANIFEST)
                os.truncate(slab, 0)
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
        uid = os.fstat(self._fd).st_uid
        if uid != os.geteuid():
            raise ConfigError(f"[kvcache] {path} belongs to uid {uid}, not to this process's "
                              f"uid {os.geteuid()}; its records are not trusted: delete it "
                              f"(or use another cache_dir)")

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

    # --- the Tier interface (the cache's view) ---------------------------------------------
    def holds(self, key) -> bool:
        return key in self.index

    def length(self, key) -> "int | None":
        ent = self.index.get(key)
        return None if ent is None else ent[1]

    def keys(self) -> list:
        return list(self.index)

    def frequency(self, key) -> int:
        return self.policy.frequency(key)

    def accept(self, key, length: int, seq: int, pinned=(), freq: int = 1):
        return self.assign(key, length, seq, pinned, freq)

    def write_from(self, items) -> None:
        self.write_many(items)

    def read_into(self, items) -> list:
        """Promotions: :meth:`read_many` into the hub slots of ``items``
        (:class:`~.tiers.Tier`); a bad record is dropped and counted."""
        return self.read_many([(k, self.index[k][0], n, view) for k, _, n, view, _ in items])

    def stats(self) -> dict:
        return {"blocks": len(self), "bytes": self.bytes_used,
                "capacity_blocks": self.nslots, "capacity_bytes": self.nslots * self.slot_size,
                "disk_bytes": self.disk_bytes(),
                "io": "o_direct" if self.direct else "buffered+fdatasync",
                "recovered_blocks": self.recovered, "corrupt_records": self.corrupt}

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
    # A batch's slots are sorted and adjacent ones joined into runs, each one preadv(2) /
    # pwritev(2) on the caller's thread. A thread pool looked better on paper: beside a
    # busy Python thread (vLLM's engine loop) every hand-off to and from a worker costs a
    # switch interval (5 ms); a 61-block SSD hit in vLLM took 150 ms. One large O_DIRECT
    # request still keeps the device busy: the block layer splits it into many in flight.
    def _runs(self, items, nbytes):
        """Group ``items`` (sorted by slot, ``item[0]`` the slot) into runs of adjacent
        slots whose every record but the last fills its slot, at most IOV_MAX each."""
        run, ss = [], self.slot_size
        for it in items:
            if run and (it[0] != run[-1][0] + 1 or nbytes(run[-1]) != ss
                        or len(run) >= _IOV_MAX):
                yield run
                run = []
            run.append(it)
        if run:
            yield run

    def write_many(self, items) -> None:
        """Write records: ``items`` is ``[(slot, memoryview of the record image)]``; each
        view's address is 4 KiB aligned and its length a multiple of 4 KiB."""
        if not items:
            return
        fd, ss = self._fd, self.slot_size
        for run in self._runs(sorted(items, key=lambda it: it[0]), lambda it: it[1].nbytes):
            bufs = [mv for _, mv in run]
            want = sum(mv.nbytes for mv in bufs)
            if _rw_full(os.pwritev, fd, bufs, run[0][0] * ss) != want:
                raise OSError(errno.EIO, f"short write to {SLAB} in {self.dir}")
        if not self.direct:
            os.fdatasync(fd)

    def read_many(self, items) -> list:
        """Read records into ``[(key, slot, length, memoryview)]`` destinations (aligned
        as for :meth:`write_many`); returns one bool per item, False where the header or
        data checksum does not match (the record is then dropped from the index)."""
        if not items:
            return []
        fd, ss = self._fd, self.slot_size
        ok = [False] * len(items)
        order = sorted(range(len(items)), key=lambda i: items[i][1])
        todo = [(items[i][1], i) for i in order]
        size = lambda it: round_up(HEADER_SIZE + items[it[1]][2])      # noqa: E731
        for run in self._runs(todo, size):
            bufs = [items[i][3][:size((s, i))] for s, i in run]
            got = _rw_full(os.preadv, fd, bufs, run[0][0] * ss)
            for (s, i), mv in zip(run, bufs):
                key, _slot, length, _ = items[i]
                # What this record's slot received (a file ending inside it reads short).
                have = min(mv.nbytes, max(0, got))
                got -= mv.nbytes
                ok[i] = have >= HEADER_SIZE + length and _verify(mv, key, length)
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


def _rw_full(call, fd, bufs, offset) -> int:
    """``call`` (``os.preadv``/``os.pwritev``) until every buffer is done or the file
    ends (a read returning 0); returns the bytes moved. A regular file moves it all in
    one call but for a signal or a full disk; the loop keeps a short answer honest."""
    total, want = 0, sum(mv.nbytes for mv in bufs)
    while total < want:
        n = call(fd, bufs, offset + total)
        if n <= 0:
            break
        total += n
        while bufs and n >= bufs[0].nbytes:          # drop the buffers already done
            n -= bufs[0].nbytes
            bufs = bufs[1:]
        if n:
            bufs = [bufs[0][n:]] + bufs[1:]
    return total


def _verify(mv, key, length) -> bool:
    h = parse_header(mv)
    if h is None or h.key != key or h.length != length:
        return False
    return crc32_held(mv[HEADER_SIZE:HEADER_SIZE + length]) == h.crc

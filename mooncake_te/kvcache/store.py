# SPDX-License-Identifier: Apache-2.0
"""``KVCache``: a tiered block store keyed by prefix hashes: a DRAM pool (the hub) and the
tiers of :mod:`.tiers` (SSD; other instances' pools through the owner index; any tier
registered there), every one of which moves blocks only into and out of the hub's slots.

How an operation runs. Every call first walks its keys in order and updates the index and
the eviction policy exactly as the trace simulator does (a hit is touched; a new block is
given a DRAM slot, evicting the policy's victim, which is demoted to SSD), recording the
data movement this implies without doing it. The movement then runs in four steps, each
with many I/Os in flight: (1) write demoted blocks from their DRAM slots to SSD, (2) read
promoted blocks from SSD (and remote blocks from peers) into their new DRAM slots, (3)
copy new blocks from the caller into their slots, (4) copy promoted blocks out to the
caller. Steps (1) and (2) walk the tiers: (1) goes to the one that takes demotions
(``ssd``), (2) asks each tier, in registry order, for the blocks found there
(:meth:`.tiers.Tier.read_into`). A slot is never both emptied and refilled inside one
round: if the walk is about to evict a block that was itself placed earlier in the same
round (LFU evicts a fresh block first when everything else is hotter), the round's
movement is run first. So the index the simulator predicts is the index the store has,
and a DRAM-only cache reproduces the simulator's hit rates exactly (tested).

Tiers are inclusive after a promotion: the SSD copy of a promoted block stays (blocks are
immutable: a key names its content), so demoting it again costs no write.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
import warnings

import numpy as np

from ..config import Config
from ..errors import ConfigError, InvalidArgumentError, MooncakeError
from ..metrics.prometheus import track as _track_metrics
from .keys import as_key
from .policy import make_policy
from .record import (HEADER_SIZE, crc32_held, crc32_many, pack_header, parse_header,
                     slot_size_for)
from .stats import derive, log_line, new_counters
from .tiers import HUB, registered

log = logging.getLogger("mooncake_te.kvcache")

_GIB = 1 << 30


class KVCache:
    """Blocks of KV bytes in DRAM and on SSD, found by prefix-hash keys.

    Parameters
    ----------
    block_bytes : int
        Largest block, in bytes (a full block of ``block_tokens`` tokens of one layer
        group, however the caller lays KV out). Shorter blocks are fine.
    dram_bytes : int
        Size of the DRAM pool; it holds ``dram_bytes // slot_size`` blocks, where
        ``slot_size`` is ``block_bytes`` plus a 64-byte header rounded up to 4 KiB.
    ssd_bytes : int
        Size of the SSD tier (0: DRAM only).
    cache_dir : str, optional
        Directory of the SSD tier; needed when ``ssd_bytes > 0``.
    policy : {"lru", "lfu"}
    engine : TransferEngine, optional
        Registers the DRAM pool with it (peers may read it) and enables remote ``get``.
    index : KeyValueBackend or str, optional
        Where the key -> owner index lives: a metadata store or its URL
        (``"redis://127.0.0.1:6379"``). Default: the engine's metadata store, if it uses
        one (``p2p`` has no store, so remote get then needs ``index``).
    namespace : str
        What the keys mean (say, the model name); caches of other namespaces never share
        blocks, on SSD or through the index.
    block_tokens : int
        Tokens per block (``[kvcache] block_size``), for token-weighted hit rates.
    share_without_token : bool, optional
        Share blocks with other instances through the owner index although ``engine``
        has no ``auth_token`` (nothing then authenticates a record or a block; blocks
        read from peers are served but never re-published). Default: ``[kvcache]
        share_without_token`` of the engine's config (``MC_KVCACHE_SHARE_WITHOUT_TOKEN``),
        false: without a token the cache does not share (docs/kvcache.md).
    tiers : dict, optional
        ``{tier name: {option: value}}`` for tiers registered in :mod:`.tiers` beyond the
        built-in ones (each tier's ``open`` reads its entry).
    io_depth : int
        SSD I/Os in flight.
    o_direct : bool
        Use ``O_DIRECT`` on the SSD tier where the file system allows it.
    log_interval_s : float
        Log the ``kv cache hit rate`` line this often (0: never; :meth:`log_stats` on
        demand).
    prefault : bool
        Touch every page of the pool up front, so the first blocks stored or read into it
        do not pay a page fault per 4 KiB (the pool is otherwise backed lazily).
    prefault_restart : bool
        When the SSD tier holds blocks at start (a restart), populate in the background
        (thread ``kvcache-prefault``, lowest CPU priority, stopped by :meth:`close`) the
        DRAM slots their promotions take first, as many as the SSD tier holds or the pool
        has, so the first hits after a restart do not fault those pages in while the
        O_DIRECT read lands (about half of a cold 30 MiB promotion here).

    Examples
    --------
    >>> with KVCache(block_bytes=4096, dram_bytes=1 << 20) as c:     # doctest: +SKIP
    ...     c.put([b"k" * 16], [b"\\x01" * 4096])
    ...     c.lookup([b"k" * 16]), bytes(c.get([b"k" * 16])[0][:1])
    """

    _fill_fn = None                     # put(fill=)'s callback during that put
    #: Publish a block read from a peer as held here too (the KV pool's sharing); the
    #: object store keeps index records on the processes an object was put in.
    publish_reads = True
    _where = None                       # get(where=)'s list during that get

    def __init__(self, block_bytes: int, dram_bytes: int, ssd_bytes: int = 0,
                 cache_dir: "str | None" = None, policy: str = "lru", engine=None,
                 index=None, namespace: str = "default", block_tokens: int = 16,
                 io_depth: int = 4, o_direct: bool = True, log_interval_s: float = 60.0,
                 prefault: bool = False, prefault_restart: bool = True,
                 tiers: "dict | None" = None, share_without_token: "bool | None" = None):
        self._closed = True
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise InvalidArgumentError(f"block_bytes must be a positive int, got {block_bytes!r}")
        self.block_bytes = block_bytes
        self.slot_size = slot_size_for(block_bytes)
        self.block_tokens = int(block_tokens)
        self.policy_name = str(policy).lower()
        self.namespace = namespace
        self.engine = engine
        ndram = int(dram_bytes) // self.slot_size
        if ndram < 1:
            raise ConfigError(
                f"[kvcache] dram_cache_gb = {dram_bytes / _GIB:g} holds no block of "
                f"{block_bytes} bytes ({self.slot_size} bytes with header and alignment); "
                f"give the DRAM tier at least one block (the SSD tier reads and writes "
                f"through it)")
        self.dram_slots = ndram
        self._dpol = make_policy(self.policy_name)
        self._lock = threading.RLock()
        self._tier_classes = registered()
        self._tier_names = tuple(t.name for t in self._tier_classes)
        self._c = new_counters(self._tier_classes)
        _track_metrics("kvcache", self)         # /metrics (docs/observability.md)
        self._dram: dict = {}                      # key -> (slot, length)
        self._free = list(range(ndram - 1, -1, -1))
        # One anonymous mapping: page-aligned (O_DIRECT needs 4 KiB alignment) and lazily
        # backed, so a large pool costs memory only as it fills.
        self._mm = mmap.mmap(-1, ndram * self.slot_size)
        self._np = np.frombuffer(self._mm, dtype=np.uint8)
        self._mv = memoryview(self._mm)
        self.base = self._np.ctypes.data
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Transparent huge pages where the kernel allows them for anonymous memory
            # (madvise(2)): fewer faults and TLB misses over a pool of gigabytes.
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        if prefault:
            self._np[::4096] = 0
        self.region = None
        self.ssd = None                # the "ssd" tier, when open (also in self._tiers)
        self._index = None             # the owner index the hub publishes to (remote tier)
        self._tiers: list = []         # the open tiers, hub first, in registry order
        self._lower: list = []         # open local tiers below the hub
        self._far: list = []           # open tiers that are not local (remote=True)
        self._demote = None            # the tier that takes the hub's demotions
        self._seq = 0
        self._reset_round()
        self._pinned: set = set()      # lower-tier keys a get is reading: not to be evicted
        # Keys of blocks read from a tier that could not authenticate them (sharing
        # without a token): never published to the owner index as ours.
        self._unverified: set = set()
        #: Why sharing with other instances is off, when a tier refused to open for it.
        self.sharing_off: "str | None" = None
        args = dict(ssd_bytes=ssd_bytes, cache_dir=cache_dir, io_depth=io_depth,
                    o_direct=o_direct, index=index, share_without_token=share_without_token)
        try:
            if engine is not None:
                # Peers only read the pool: a remote write could corrupt a slot under us.
                self.region = engine.register(self._np, access="r")
            for cls in self._tier_classes:
                opts = dict(args, **(tiers or {}).get(cls.name, {}))
                t = cls.open(self, opts)
                if t is None:
                    continue
                self._tiers.append(t)
                if t.name == HUB:
                    continue
                (self._lower if t.local else self._far).append(t)
                if t.local and t.demotions and self._demote is None:
                    self._demote = t
                self._seq = max(self._seq, getattr(t, "max_seq", 0))
                if t.name == "ssd":
                    self.ssd = t
                self._index = t.owner_index or self._index
        except BaseException:
            self._closed = False
            self.close()
            raise
        self._closed = False
        self._stop = threading.Event()
        self._prefaulter = None
        recovered = getattr(self._demote, "recovered", 0)     # blocks found at start
        if prefault_restart and not prefault and recovered:
            # Free slots are handed out from 0 up (self._free pops its end).
            nbytes = min(ndram, recovered) * self.slot_size
            self._prefaulter = threading.Thread(target=self._prefault_loop, args=(nbytes,),
                                                name="kvcache-prefault", daemon=True)
            self._prefaulter.start()
        self._logger = None
        self._last_logged = None
        if log_interval_s and log_interval_s > 0:
            self._logger = threading.Thread(target=self._log_loop, args=(float(log_interval_s),),
                                            name="kvcache-stats", daemon=True)
            self._logger.start()

    # --- construction from config.toml ------------------------------------------------------
    @classmethod
    def from_config(cls, config=None, block_bytes: int = 0, engine=None, **kwargs) -> "KVCache":
        """A cache sized by ``[kvcache]`` of ``config`` (a path, a :class:`Config`, or None
        for the engine's config or the defaults). ``dram_cache_gb`` and ``ssd_cache_gb``
        are GiB (2**30 bytes); ``block_size`` is tokens per block."""
        if config is None and engine is not None:
            config = getattr(engine, "config", None)
        cfg = Config.load(config)
        k = cfg["kvcache"]
        args = dict(dram_bytes=int(k["dram_cache_gb"] * _GIB),
                    ssd_bytes=int(k["ssd_cache_gb"] * _GIB),
                    cache_dir=k["cache_dir"] or None, policy=k["eviction_policy"],
                    block_tokens=k["block_size"], engine=engine)
        args.update(kwargs)
        return cls(block_bytes, **args)

    @property
    def tier_names(self) -> tuple:
        """The registered tiers this cache counts by, hub first (:mod:`.tiers`); the keys
        of :meth:`lookup_tiers`."""
        return self._tier_names

    @property
    def can_remote(self) -> bool:
        """``remote=True`` has a tier to ask (the owner index, or another tier that is
        not local)."""
        return bool(self._far)

    def _need_index(self) -> None:
        if not self._far and self.sharing_off:
            raise InvalidArgumentError(f"remote=True: {self.sharing_off}")
        if not self._far:
            raise InvalidArgumentError(
                "remote lookups need the key -> owner index, which lives in a metadata store: "
                "create the cache with engine= an engine using etcd/redis/http metadata, or "
                "pass index='redis://host:6379' (p2p metadata has no store to hold it)")

    def flush_index(self, timeout: float = 10.0) -> bool:
        """Wait until this cache's index updates reached the metadata store."""
        return self._index.flush(timeout) if self._index is not None else True

    def persist(self) -> int:
        """Write every DRAM block that has no SSD copy to the SSD tier (oldest first, so
        the recency order survives a restart); returns how many were written. ``close``
        does this when ``persist=True``, so a clean restart finds the DRAM blocks too."""
        self._check_open()
        d = self._demote
        if d is None:
            return 0
        with self._lock:
            todo = [k for k in self._dpol if not d.holds(k)]
            pinned = set(todo)
            writes = {}
            for k in todo:
                slot, n = self._dram[k]
                self._seq += 1
                sslot, evicted = d.accept(k, n, self._seq, pinned, self._dpol.frequency(k))
                self._c[f"evictions_{d.name}"] += len(evicted)
                if self._index is not None:
                    for e in evicted:
                        if e not in self._dram:          # its SSD-tier record goes
                            self._index.withdraw(e)
                if sslot is None:
                    break
                # Record the new seq in the header that goes to disk.
                off = slot * self.slot_size
                h = parse_header(self._mv[off:off + HEADER_SIZE])
                self._mv[off:off + HEADER_SIZE] = pack_header(k, n, self._seq, h.crc)
                writes[sslot] = self._mv[off:off + _round4k(HEADER_SIZE + n)]
            t = time.perf_counter()
            d.write_from(sorted(writes.items()))
            self._c[f"{d.name}_write_s"] += time.perf_counter() - t
            self._c["demoted_bytes"] += sum(self._dram[k][1] for k in todo[:len(writes)])
            return len(writes)

    # --- lifetime -----------------------------------------------------------------------
    def close(self, persist: bool = False) -> None:
        """Withdraw this cache's index records, flush the SSD tier, unregister the pool.
        Idempotent. The SSD tier's blocks stay in ``cache_dir`` for the next start; with
        ``persist=True`` the DRAM blocks are written there first (:meth:`persist`)."""
        if self._closed:
            return
        if persist and self._demote is not None:
            self.persist()
        self._closed = True
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        pre = getattr(self, "_prefaulter", None)
        if pre is not None:
            pre.join(timeout=5)        # it stops at its next 64 MiB step
        # The tiers that are not local first (the remote tier withdraws the hub's index
        # records while the pool is still registered), then the pool, then local tiers.
        for t in self._far:
            t.close()
        if self.region is not None and not getattr(self.engine, "_closed", True):
            try:
                self.engine.unregister(self.region)
            except MooncakeError as e:
                log.warning("kvcache: could not unregister the DRAM pool: %s", e)
        self.region = None
        for t in self._lower:
            t.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            warnings.warn(f"{self!r} was not closed", ResourceWarning, stacklevel=2)
            try:
                self.close()
            except Exception:           # never raise from a finalizer
                pass

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        held = " ".join(f"{t.name} {len(t)}/{t.stats().get('capacity_blocks', 0)}"
                        for t in self._tiers if t.local)
        return (f"<KVCache {self.policy_name} {held} blocks of {self.block_bytes} B"
                f"{' closed' if self._closed else ''}>")

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the KV cache is closed")

    # --- queries ------------------------------------------------------------------------
    def tier(self, key) -> "str | None":
        """The name of the first local tier (``"dram"``, ``"ssd"``, ...) holding ``key``,
        or None."""
        k = as_key(key)
        with self._lock:
            return self._local_tier(k)

    def _local_tier(self, k) -> "str | None":
        if k in self._dram:
            return HUB
        for t in self._lower:
            if t.holds(k):
                return t.name
        return None

    def __contains__(self, key) -> bool:
        return self.tier(key) is not None

    def __len__(self) -> int:
        """Distinct blocks held (a block in several tiers counts once)."""
        return len(self.keys())

    def lookup(self, keys, num_tokens: "int | None" = None, remote: bool = False) -> int:
        """Length of the longest prefix of ``keys`` this cache (and, with ``remote=True``,
        a peer in the owner index) holds. Counts toward the hit rate; touches nothing.

        Parameters
        ----------
        keys : sequence
            Prefix-hash keys of one request, in order.
        num_tokens : int, optional
            The request's prompt length, for the token-weighted rate (block ``i`` weighs
            ``min(block_tokens, num_tokens - block_tokens * i)``); default: full blocks.
        remote : bool
            Extend the prefix with blocks peers hold (one index query for them all), and
            with any other tier that is not local (:mod:`.tiers`).
        """
        return sum(self.lookup_tiers(keys, num_tokens, remote).values())

    def lookup_tiers(self, keys, num_tokens: "int | None" = None,
                     remote: bool = False) -> dict:
        """:meth:`lookup` by tier: ``{tier name: blocks}`` of the longest prefix held, one
        entry per registered tier, in registry order (``{"dram": 3, "ssd": 2,
        "remote": 0}``). The prefix is walked key by key through the local tiers (a key
        counts for the first that holds it), then extended by each tier that is not local
        with one query for the rest (only with ``remote=True``). Counts toward the hit
        rate as :meth:`lookup` does."""
        self._check_open()
        if remote:
            self._need_index()
        ks = [as_key(k) for k in keys]
        n = len(ks)
        counts = dict.fromkeys(self._tier_names, 0)
        hit = 0
        with self._lock:
            for k in ks:
                name = self._local_tier(k)
                if name is None:
                    break
                counts[name] += 1
                hit += 1
        if remote:
            for t in self._far:
                if hit >= n:
                    break
                got = t.lookup_prefix(ks[hit:])
                counts[t.name] += got
                hit += got
        bt = self.block_tokens
        tokens = bt * n if num_tokens is None else int(num_tokens)
        with self._lock:
            c = self._c
            c["lookups"] += 1
            c["lookup_blocks"] += n
            c["hit_blocks"] += hit
            for name, got in counts.items():
                c[f"hit_blocks_{name}"] += got
            c["lookup_tokens"] += max(0, min(tokens, bt * n))
            c["hit_tokens"] += max(0, min(tokens, bt * hit))
        return counts

    # --- put ----------------------------------------------------------------------------
    def put(self, keys, blocks=None, *, fill=None, lengths=None) -> int:
        """Store blocks (``blocks[i]`` under ``keys[i]``); returns how many were new.

        A key already held is touched, not rewritten (a key names its content).
        ``blocks`` is a sequence of bytes-like objects of at most ``block_bytes`` each, or
        a 2-D numpy array with one block per row.

        With ``fill`` instead of ``blocks``, the cache hands out the slots and the caller
        writes the bytes: ``fill(items)`` is called once per round of data movement with
        ``items`` a list of ``(i, view)``, ``view`` the writable numpy ``uint8`` payload
        area of key ``i``'s slot (``lengths[i]`` bytes, default ``block_bytes``); when it
        returns, every view must hold its block (the cache then checksums and publishes
        them). This is how a GPU copier moves a batch of blocks into the pool with one
        batched DMA and no intermediate host image. An exception from ``fill`` drops
        every block of that round (nothing half-written is served).
        """
        self._check_open()
        ks = [as_key(k) for k in keys]
        if fill is not None:
            if blocks is not None:
                raise InvalidArgumentError("put: pass blocks or fill=, not both")
            lens = [self.block_bytes] * len(ks) if lengths is None else list(lengths)
            if len(lens) != len(ks):
                raise InvalidArgumentError(f"put: {len(ks)} keys but {len(lens)} lengths")
            blocks = range(len(ks))
        elif blocks is None:
            raise InvalidArgumentError("put: pass blocks (or fill=)")
        if len(ks) != len(blocks):
            raise InvalidArgumentError(f"put: {len(ks)} keys but {len(blocks)} blocks")
        new = 0
        with self._lock:
            c = self._c
            self._fill_fn = fill
            for k, blk in zip(ks, blocks):
                if k in self._dram:
                    self._dpol.touch(k)
                    c["put_existing"] += 1
                    continue
                if fill is not None:
                    mv, n = blk, int(lens[blk])
                else:
                    mv = _as_bytes_view(blk)
                    n = mv.nbytes
                if not 0 < n <= self.block_bytes:
                    raise InvalidArgumentError(f"put: a block is {n} bytes; blocks must be "
                                               f"1 to block_bytes={self.block_bytes} bytes")
                freq = 1
                low = self._lower_holding(k)
                if low is not None:
                    # Held below already: take the caller's bytes into DRAM instead of a read.
                    low.touch(k)
                    freq = low.frequency(k) or 1
                    c["put_existing"] += 1
                else:
                    new += 1
                    c["put_blocks"] += 1
                    c["put_bytes"] += n
                slot = self._place(k, n, freq)
                self._fills[slot] = (k, mv, n)
            try:
                self._run_round()
            finally:
                self._fill_fn = None
            self._end_op()
        return new

    # --- get ----------------------------------------------------------------------------
    def get(self, keys, out=None, remote: bool = False, copy=None,
            where: "list | None" = None) -> list:
        """Read blocks: DRAM hits are copied out, SSD hits promoted to DRAM (then copied),
        misses are None. With ``remote=True``, blocks missing here are read from the peer
        the owner index names (zero-copy into this cache's pool, checked, then kept).

        Parameters
        ----------
        keys : sequence
        out : sequence of writable buffers, optional
            Copy block ``i`` into ``out[i]`` (at least the block's length) instead of
            returning new arrays; the list then holds each block's length or None.
        remote : bool
        copy : callable, optional
            ``copy(i, block)`` is called once per block found, with ``block`` a read-only
            numpy ``uint8`` view of its bytes in the DRAM pool (an SSD or remote block
            after it was read there and checked), valid only during the call: the caller
            copies it where it belongs, with no intermediate image. The list then holds
            each block's length or None, as with ``out`` (not both). An exception from
            ``copy`` propagates (blocks of this round not yet served stay cached). If
            ``copy`` has a ``flush()`` method, it is called after each batch of blocks,
            before the cache lets go of its lock: a sink may queue its copies (a GPU
            copier's batched DMA) and finish them there, while the views stay valid.
        where : list, optional
            Filled with one entry per key: the name of the tier the block was served
            from (``"dram"``, ``"ssd"``, ``"remote"``, ...), None for a miss.

        Returns
        -------
        list
            One numpy ``uint8`` array (or length, with ``out`` or ``copy``) per key, None
            for a miss.
        """
        self._check_open()
        if remote:
            self._need_index()
        ks = [as_key(k) for k in keys]
        if out is not None and copy is not None:
            raise InvalidArgumentError("get: pass out= or copy=, not both")
        if out is not None and len(out) != len(ks):
            raise InvalidArgumentError(f"get: {len(ks)} keys but {len(out)} output buffers")
        if copy is not None:
            outs = _CopyTo(copy, len(ks))
        else:
            outs = [None] * len(ks) if out is None else [_as_bytes_view(o, writable=True)
                                                          for o in out]
        res: list = [None] * len(ks)
        if where is not None:
            where[:] = [None] * len(ks)
        missing = []
        served: set = set()       # indices copied out before the walk
        with self._lock:
            c = self._c
            c["get_blocks"] += len(ks)
            self._outs, self._res = outs, res
            self._where = where
            if self._lower:
                # Every lower-tier block this call asks for stays there until the call is
                # done, or demotions made room for earlier blocks could evict later ones
                # (a lookup's prefix must still be there when it is read).
                self._pinned = {k for k in ks if k not in self._dram and
                                self._lower_holding(k) is not None}
                # And every DRAM block it asks for is copied out first: promoting the blocks
                # before it can demote it (a DRAM tier smaller than the call), and then it
                # would be looked for on SSD, where it may not be (yet, or any more).
                for i, k in enumerate(ks):
                    ent = self._dram.get(k)
                    if ent is not None:
                        self._copy_out(i, ent[0], ent[1], outs, res, HUB)
                        served.add(i)
                # Before a promotion below can evict a block just handed to the sink.
                self._flush_outs(outs)
            for i, k in enumerate(ks):
                ent = self._dram.get(k)
                if i in served:
                    if ent is not None:
                        self._dpol.touch(k)
                    continue
                if ent is not None:
                    self._dpol.touch(k)
                    slot, n = ent
                    if slot in self._assigned:         # placed earlier in this round
                        self._copyouts.append((i, slot, n, HUB, k))
                    else:
                        self._copy_out(i, slot, n, outs, res, HUB)
                else:
                    low = self._lower_holding(k)
                    if low is None:
                        missing.append(i)
                        continue
                    low.touch(k)
                    n = low.length(k)
                    slot = self._place(k, n, low.frequency(k) or 1)
                    self._reads.append((low, k, slot, n, i, None))
            self._flush_outs(outs)
            self._run_round()
            self._end_op()
        # Then each tier that is not local, for what is still missing (one query each).
        for t in self._far if remote else ():
            if not missing:
                break
            found = list(zip(missing, t.locate([ks[i] for i in missing])))
            missing = []
            with self._lock:
                for i, loc in found:
                    if ks[i] in self._dram:
                        continue
                    if loc is None or loc[0] > self.block_bytes:
                        missing.append(i)
                        continue
                    slot = self._place(ks[i], loc[0], 1)
                    self._reads.append((t, ks[i], slot, loc[0], i, loc[1]))
                self._outs, self._res = outs, res
                self._where = where
                self._run_round()
                self._end_op()
        with self._lock:
            self._c["get_misses"] += sum(1 for r in res if r is None)
        return res

    # --- object-store helpers (used by mooncake_te.compat.store) -------------------------
    def size_of(self, key, remote: bool = False) -> "int | None":
        """Payload bytes of ``key`` held here (or, with ``remote=True``, by a peer in the
        owner index); None when nobody holds it. Touches nothing, counts nothing."""
        self._check_open()
        k = as_key(key)
        with self._lock:
            for t in self._tiers:
                if t.local and t.holds(k):
                    return t.length(k)
        for t in self._far if remote else ():
            loc = t.locate([k])[0]
            if loc is not None:
                return loc[0]
        return None

    def remove(self, keys, index: bool = True) -> int:
        """Drop blocks from every local tier; returns how many this cache held. The
        slot's header is cleared first, so a peer reading it meanwhile sees no record.
        With ``index=True`` the tiers that are not local forget them too (the owner-index
        record of each key is deleted, whoever owns it, so no cache finds the block
        through the index any more)."""
        self._check_open()
        n = 0
        with self._lock:
            for k in (as_key(x) for x in keys):
                held = False
                ent = self._dram.get(k)
                if ent is not None:
                    off = ent[0] * self.slot_size
                    self._mv[off:off + 4] = b"\0\0\0\0"
                    self._drop_dram(k, ent[0])
                    held = True
                for t in self._lower:
                    if t.holds(k):
                        t.remove(k)
                        held = True
                n += held
                for t in self._far if index else ():
                    t.remove(k)
        return n

    def keys(self) -> list:
        """Every key this cache holds (in any local tier, once), as 16-byte keys."""
        with self._lock:
            ks = list(self._dram)
            seen = self._dram.keys()
            for t in self._lower:
                more = [k for k in t.keys() if k not in seen]
                ks += more
                if len(self._lower) > 1:
                    seen = set(ks)
            return ks

    def _lower_holding(self, k):
        """The first local tier below the hub that holds ``k``, or None."""
        for t in self._lower:
            if t.holds(k):
                return t
        return None

    # --- the round machinery ------------------------------------------------------------
    def _reset_round(self) -> None:
        self._assigned: set = set()
        self._writes: dict = {}        # ssd slot -> (dram slot or bounce view, length, key)
        self._reads: list = []         # (tier, key, dram slot, length, out index, handle)
        self._fills: dict = {}         # dram slot -> (key, source view, length)
        self._bounce: list = []        # aligned copies of blocks demoted before their fill
        self._copyouts: list = []      # (out index, dram slot, length, tier name, key)
        self._outs = self._res = None

    def _place(self, key: bytes, length: int, freq: int) -> int:
        """Give ``key`` a DRAM slot, evicting the policy's victim (demoted to SSD)."""
        c = self._c
        while not self._free:
            victim = self._dpol.victim()
            vslot, vlen = self._dram[victim]
            bounce = None
            if vslot in self._assigned:
                # The victim was placed in this round and its bytes are not in the slot yet.
                fill = self._fills.get(vslot)
                if fill is None or fill[0] != victim:
                    # A promotion or remote read still to land there: do the round first.
                    self._run_round()
                    continue
                if isinstance(fill[1], int):
                    # put(fill=): the bytes are the caller's to write (say, from a GPU);
                    # land this round's blocks first, then evict as usual.
                    self._run_round()
                    continue
                # Its bytes are the caller's: the fill is cancelled and, if the block goes
                # to SSD, written from an aligned copy. LFU does this on every insertion
                # once the pool is full of hotter blocks (a new block is the coldest), so
                # running the round here would serialise those puts one write at a time.
                del self._fills[vslot]
                self._assigned.discard(vslot)
                if self._demote is not None and not self._demote.holds(victim):
                    bounce = self._bounce_copy(victim, fill[1], fill[2])
            vfreq = self._dpol.frequency(victim)
            self._dpol.remove(victim)
            del self._dram[victim]
            self._free.append(vslot)
            c[f"evictions_{HUB}"] += 1
            # The demotion tier (SSD) takes the block now (so a later key of this call
            # finds it there); its bytes are written in step (1) of the round, before the
            # DRAM slot is refilled. The owner index keeps a record of a block that went
            # to SSD, saying so (routers see it: issue 37); one that went nowhere, or
            # left the SSD tier to make room, is withdrawn.
            d = self._demote
            on_ssd = False
            if d is None:
                c["dropped"] += 1
            elif d.holds(victim):
                c["demotions_skipped"] += 1       # its SSD copy is still there
                on_ssd = True
            else:
                sslot, evicted = d.accept(victim, vlen, bounce[1] if bounce else
                                          self._next_seq(), self._pinned, vfreq)
                c[f"evictions_{d.name}"] += len(evicted)
                if self._index is not None:
                    for k in evicted:
                        if k not in self._dram:
                            self._index.withdraw(k)
                if sslot is None:
                    c["dropped"] += 1
                else:
                    on_ssd = True
                    # A reused SSD slot: the last block assigned to it wins.
                    self._writes[sslot] = (bounce[0] if bounce else vslot, vlen, victim)
                    c["demotions"] += 1
            if self._index is not None:
                if on_ssd and victim not in self._unverified:
                    h = None if bounce else parse_header(self._slot_view(vslot))
                    self._index.demote(victim, vlen,
                                       h.crc if h is not None and h.key == victim else 0)
                else:
                    self._index.withdraw(victim)
        slot = self._free.pop()
        self._dram[key] = (slot, length)
        self._dpol.insert(key, freq)
        self._assigned.add(slot)
        return slot

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _bounce_copy(self, key, src, n):
        """An aligned record image of a block not yet in its slot: ``(view, seq)``."""
        size = _round4k(HEADER_SIZE + n)
        mm = mmap.mmap(-1, size)
        mv = memoryview(mm)
        mv[HEADER_SIZE:HEADER_SIZE + n] = src
        seq = self._next_seq()
        mv[:HEADER_SIZE] = pack_header(key, n, seq, crc32_held(mv[HEADER_SIZE:HEADER_SIZE + n]))
        self._bounce.append(mm)
        return mv, seq

    def _run_round(self) -> None:
        """Do the data movement the walk decided, then start a new round."""
        try:
            self._move()
        except BaseException:
            self._abort_round()
            raise

    def _abort_round(self) -> None:
        """After a failed round (an I/O error): forget every block whose bytes may not
        have landed, so nothing half-written is ever served, then start afresh."""
        for key, (slot, _) in list(self._dram.items()):
            if slot in self._assigned:
                self._drop_dram(key, slot)
        if self._demote is not None:
            for _, _, key in self._writes.values():
                self._demote.remove(key)
        log.error("kvcache: a round of data movement failed; dropped %d DRAM and %d SSD "
                  "blocks it was moving", len(self._assigned), len(self._writes))
        self._reset_round()
        self._end_op()

    def _move(self) -> None:
        outs, res = self._outs, self._res
        c = self._c
        # (1) demotions: DRAM slot image -> SSD, several writes in flight.
        if self._writes:
            items, nbytes = [], 0
            for sslot, (src, n, _) in sorted(self._writes.items()):
                if isinstance(src, memoryview):             # a bounce copy
                    items.append((sslot, src))
                    nbytes += n
                    continue
                dslot = src
                off = dslot * self.slot_size
                items.append((sslot, self._mv[off:off + _round4k(HEADER_SIZE + n)]))
                nbytes += n
            t = time.perf_counter()
            self._demote.write_from(items)
            c[f"{self._demote.name}_write_s"] += time.perf_counter() - t
            c["demoted_bytes"] += nbytes
        # (2) blocks found in the other tiers -> their DRAM slots, checked: promotions
        # from local tiers (SSD), then reads from the tiers that are not local (peers).
        if self._reads:
            self._read_tiers()
        # (3) new blocks from the caller (or, with put(fill=), written by the caller).
        if self._fills and self._fill_fn is not None:
            self._fill_slots()
        else:
            for slot, (key, src, n) in self._fills.items():
                self._write_slot(slot, key, src, n)
        # (4) promoted and deferred blocks out to the caller.
        if self._copyouts and outs is not None:
            for i, slot, n, tier, key in self._copyouts:
                if self._dram.get(key, (None,))[0] == slot:   # not dropped meanwhile
                    self._copy_out(i, slot, n, outs, res, tier)
            self._flush_outs(outs)
        self._reset_round()
        self._outs, self._res = outs, res

    def _end_op(self) -> None:
        self._outs = self._res = self._where = None
        self._pinned = set()

    def _slot_view(self, slot: int) -> memoryview:
        off = slot * self.slot_size
        return self._mv[off:off + self.slot_size]

    def _drop_dram(self, key, slot) -> None:
        if self._dram.get(key, (None,))[0] == slot:
            del self._dram[key]
            self._dpol.remove(key)
            self._free.append(slot)

    def _write_slot(self, slot: int, key: bytes, src, n: int) -> None:
        off = slot * self.slot_size
        mv = self._mv
        # Invalidate the header first: a peer reading this slot meanwhile sees no record.
        mv[off:off + 4] = b"\0\0\0\0"
        mv[off + HEADER_SIZE:off + HEADER_SIZE + n] = src
        self._seq += 1
        crc = crc32_held(mv[off + HEADER_SIZE:off + HEADER_SIZE + n])
        mv[off:off + HEADER_SIZE] = pack_header(key, n, self._seq, crc)
        self._unverified.discard(key)          # our own bytes from now on
        self._publish(key, off, n, crc)

    def _fill_slots(self) -> None:
        """Step (3) for ``put(fill=)``: one call of the caller's ``fill`` for every slot
        of the round, then each slot checksummed, stamped and published."""
        mv, items = self._mv, []
        for slot, (key, i, n) in self._fills.items():
            off = slot * self.slot_size
            mv[off:off + 4] = b"\0\0\0\0"      # no record until the bytes are there
            items.append((i, self._np[off + HEADER_SIZE:off + HEADER_SIZE + n]))
        self._fill_fn(items)
        crcs = crc32_many([v for _, v in items])
        for (slot, (key, _, n)), crc in zip(self._fills.items(), crcs):
            off = slot * self.slot_size
            self._seq += 1
            mv[off:off + HEADER_SIZE] = pack_header(key, n, self._seq, crc)
            self._unverified.discard(key)
            self._publish(key, off, n, crc)

    def _publish(self, key: bytes, off: int, n: int, crc: int) -> None:
        """Tell the owner index the block at pool offset ``off`` is ours (unless it came
        from a source that could not be authenticated: never re-published)."""
        if self._index is not None and key not in self._unverified:
            self._index.publish(key, self.base + off, n, crc)

    def _taint(self, key: bytes) -> None:
        """Remember that ``key``'s bytes came from an unauthenticated peer. Bounded: past
        a few times what the tiers hold, keys no tier holds any more are forgotten."""
        self._unverified.add(key)
        if len(self._unverified) > 4 * (self.dram_slots + sum(
                getattr(t, "nslots", 0) for t in self._lower)) + 64:
            self._unverified = {k for k in self._unverified
                                if k in self._dram or self._lower_holding(k) is not None}

    def _flush_outs(self, outs) -> None:
        """Let a ``get(copy=)`` sink finish what it queued (before the lock is let go:
        the slots it reads may be refilled after that)."""
        flush = getattr(getattr(outs, "fn", None), "flush", None)
        if flush is not None:
            flush()

    def _copy_out(self, i, slot, n, outs, res, tier) -> None:
        off = slot * self.slot_size + HEADER_SIZE
        t = time.perf_counter()
        fn = getattr(outs, "fn", None)
        if fn is not None:
            view = self._np[off:off + n]
            view.flags.writeable = False
            fn(i, view)
            res[i] = n
        elif outs[i] is None:
            res[i] = self._np[off:off + n].copy()
        else:
            dst = outs[i]
            if dst.nbytes < n:
                raise InvalidArgumentError(f"get: out[{i}] has {dst.nbytes} bytes, the block "
                                           f"{n}")
            dst[:n] = self._mv[off:off + n]
            res[i] = n
        if self._where is not None:
            self._where[i] = tier
        if tier == HUB:
            c = self._c
            c["dram_read_s"] += time.perf_counter() - t
            c["served_dram"] += 1
            c["served_dram_bytes"] += n

    def _read_tiers(self) -> None:
        """Step (2): each tier reads its blocks of the round into their slots (every
        item in flight at once, as the tier sees fit), then each block is served or its
        slot freed."""
        c = self._c
        by_tier: dict = {}
        for ent in self._reads:
            by_tier.setdefault(ent[0], []).append(ent)
        for t in self._tiers:
            ents = by_tier.get(t)
            if not ents:
                continue
            items = [(k, handle, n, self._slot_view(slot), self.base + slot * self.slot_size)
                     for _, k, slot, n, _, handle in ents]
            start = time.perf_counter()
            ok = t.read_into(items)
            c[f"{t.name}_read_s"] += time.perf_counter() - start
            for good, (_, k, slot, n, i, _) in zip(ok, ents):
                if good:
                    if t.local:
                        c["promotions"] += 1
                    c[f"served_{t.name}"] += 1
                    c[f"served_{t.name}_bytes"] += n
                    if not t.verified:
                        self._taint(k)
                    # A block read from another instance is served, not re-published as
                    # ours unless publish_reads (the store keeps the holder's record).
                    if (self._index is not None and k not in self._unverified
                            and (t.local or self.publish_reads)):
                        h = parse_header(self._slot_view(slot))
                        if h is not None:
                            self._publish(k, slot * self.slot_size, n, h.crc)
                    self._copyouts.append((i, slot, n, t.name, k))
                else:
                    failed = t.failed_counter or f"{t.name}_failed"
                    c[failed] = c.get(failed, 0) + 1
                    self._drop_dram(k, slot)

    # --- accounting ---------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters, hit rates, GB/s per tier and the bytes each tier holds, as a dict;
        ``tiers`` names the registered tiers in order (the per-tier keys are
        ``hit_blocks_<tier>``, ``served_<tier>_bytes``, ``<tier>_blocks`` and so on)."""
        with self._lock:
            s = derive(self._c, self._tier_names)
            s.update(policy=self.policy_name, block_bytes=self.block_bytes,
                     slot_size=self.slot_size, tiers=list(self._tier_names))
            opened = {t.name: t for t in self._tiers}
            for cls in self._tier_classes:
                t = opened.get(cls.name)
                st = t.stats() if t is not None else cls.blank_stats()
                s.update((f"{cls.name}_{k}", v) for k, v in st.items())
        return s

    def reset_stats(self) -> None:
        """Zero the counters (capacities and contents stay)."""
        with self._lock:
            self._c = new_counters(self._tier_classes)

    def log_stats(self, level: int = logging.INFO) -> str:
        """Log (and return) the ``kv cache hit rate`` line."""
        line = log_line(self.stats())
        log.log(level, "%s", line)
        return line

    def _prefault_loop(self, nbytes: int) -> None:
        # MADV_POPULATE_WRITE (madvise(2), Linux 5.14) faults the pages in, writable,
        # without touching their contents: a slot filled meanwhile is not disturbed, so
        # no lock is needed. The call lets go of the GIL (ctypes.CDLL); this thread runs at
        # nice 19 (setpriority(2) on a thread id sets that thread's).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        t = time.perf_counter()
        step = 64 << 20
        for off in range(0, nbytes, step):
            if self._stop.is_set():
                return
            if _madvise(self.base + off, min(step, nbytes - off), _MADV_POPULATE_WRITE):
                log.debug("kvcache: MADV_POPULATE_WRITE refused (errno %d); the pool's pages "
                          "fault in as blocks land", ctypes.get_errno())
                return
        log.debug("kvcache: populated %d MiB of the DRAM pool for promotions in %.2f s",
                  nbytes >> 20, time.perf_counter() - t)

    def _log_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock:
                mark = (self._c["lookups"], self._c["get_blocks"], self._c["put_blocks"])
            if mark != self._last_logged:
                self._last_logged = mark
                try:
                    self.log_stats()
                except Exception:            # never let a log line kill the thread
                    log.exception("kvcache: stats logging failed")


class _CopyTo(list):
    """The ``outs`` of ``get(copy=fn)``: no buffers (every entry None), and ``fn``, which
    each block found is handed to. It travels with ``outs`` through the rounds."""

    def __init__(self, fn, n: int):
        super().__init__([None] * n)
        self.fn = fn


_MADV_POPULATE_WRITE = 23              # <linux/mman.h> (asm-generic/mman-common.h)
_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _round4k(n: int) -> int:
    return -(-n // 4096) * 4096


def _as_bytes_view(obj, writable: bool = False) -> memoryview:
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            if writable:
                raise InvalidArgumentError("get: out buffers must be C-contiguous")
            obj = np.ascontiguousarray(obj)
        mv = memoryview(obj.reshape(-1).view(np.uint8))
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise InvalidArgumentError(f"a block must support the buffer protocol, got "
                                       f"{type(obj).__name__}") from None
        if not mv.c_contiguous:
            raise InvalidArgumentError("a block must be C-contiguous memory")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if writable and mv.readonly:
        raise InvalidArgumentError("get: out buffers must be writable")
    return mv

# SPDX-License-Identifier: Apache-2.0
"""A model of the two-level cache a vLLM instance with the connector's pool has: vLLM's
own prefix cache (its KV block pool) in front of the pool (:class:`~.store.KVCache`,
DRAM and optionally SSD), for ``mooncake-te trace replay --engine-cache-blocks``.

The single-cache simulation of :mod:`.trace` answers "how much would one LRU of C blocks
hit". vLLM plus the pool is not that: vLLM keeps its own blocks in an order of its own,
the pool sees every block vLLM computes and is asked only for what vLLM lacks. With the
same trace and capacities, the hit rates the benchmark measures inside vLLM
(``benchmarks/vllm_ttft.py``) come out of this model block for block, per level. What is
modelled, and where it comes from:

vLLM's block pool (vLLM 0.32, ``vllm/v1/core/``):

* ``E`` usable blocks: ``num_gpu_blocks - 1``, block 0 being the null block
  (``BlockPool.__init__`` pops it from the free queue).
* Free blocks form one queue (``kv_cache_utils.FreeKVCacheBlockQueue``); a new block is
  taken from its head, and a block taken there that held a cached hash loses it
  (``BlockPool.get_new_blocks``, ``_maybe_evict_cached_block``): eviction is LRU over
  *freed* blocks. Blocks of a running request are not in the queue, so never evicted.
* A finished request's blocks are freed in reverse order
  (``SingleTypeKVCacheManager.free``): cached ones are appended at the tail, last block
  first, so a prefix's tail is evicted before its head; blocks without a hash (a partial
  last block) go to the head (``BlockPool.free_blocks``).
* A hit takes the block out of the queue (``BlockPool.touch``). The hit is the longest run
  of the prompt's full blocks found in the cache, at most ``num_tokens - 1`` tokens
  (``KVCacheManager.get_computed_blocks``): with a block-aligned prompt the last block is
  always recomputed. Only full blocks are cached, under their hash, and a hash may name
  several blocks (a recomputed last block is cached beside the old copy; the hit takes the
  oldest, ``BlockHashToBlockMap``).

The connector's pool (``mooncake_te/integrations/vllm/scheduler.py``, ``pool/``):

* After vLLM's hit of ``k`` blocks, the pool is asked for blocks ``k .. last - 1`` with
  ``last = (num_tokens - 1) // T`` (the same last-token rule); the hit is the run of them
  held in DRAM or on SSD, each counted in the tier it is in.
* Those blocks are read with one ``KVCache.get``: a DRAM block is touched, an SSD block is
  touched on SSD and promoted into DRAM, whose victim is demoted to SSD (skipped if its
  SSD copy is still there: the tiers are inclusive after a promotion), evicting there the
  policy's victim other than this call's SSD blocks. A DRAM block of the call that the
  promotions before it demoted is not touched again (the store read it first).
* When the request finishes, every full block it computed or loaded (all ``L // T`` of
  them) is saved: those already in DRAM are skipped (and not touched), the others
  ``put`` in order (an SSD-held block is touched there and placed in DRAM).

Requests run one at a time, each to its end, as the benchmark runs them (one output
token: the partial block it would start is never cached).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgumentError
from .policy import make_policy

__all__ = ["EngineCacheModel", "PoolModel", "EngineResult", "simulate_engine"]


class EngineCacheModel:
    """vLLM's prefix cache over ``blocks`` usable KV blocks (``num_gpu_blocks - 1``).

    Block ids are ``0 .. blocks-1`` (the null block is not modelled). The free queue is
    an insertion-ordered dict, head first.
    """

    def __init__(self, blocks: int):
        self.capacity = int(blocks)
        self.free: OrderedDict = OrderedDict((b, None) for b in range(self.capacity))
        self.hash_of: dict = {}            # block -> hash it is cached under
        self.blocks_of: dict = {}          # hash -> {block: None}, oldest first
        self.evictions = 0

    def __contains__(self, h) -> bool:
        return h in self.blocks_of

    def hit(self, hashes, max_blocks: int) -> list:
        """Blocks of the longest cached prefix of ``hashes[:max_blocks]`` (not touched)."""
        out = []
        for h in hashes[:max_blocks]:
            bs = self.blocks_of.get(h)
            if not bs:
                break
            out.append(next(iter(bs)))
        return out

    def touch(self, blocks) -> None:
        for b in blocks:
            self.free.pop(b, None)

    def allocate(self, n: int) -> list:
        """``n`` blocks from the free queue's head, each losing the hash it held."""
        if n > len(self.free):
            raise InvalidArgumentError(
                f"a request needs {n} new KV blocks but vLLM's cache has {len(self.free)} "
                f"free of {self.capacity}; give --engine-cache-blocks at least the longest "
                f"request's blocks")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None:
                bs = self.blocks_of[h]
                del bs[b]
                if not bs:
                    del self.blocks_of[h]
                self.evictions += 1
            out.append(b)
        return out

    def cache(self, block: int, h) -> None:
        if block in self.hash_of:
            return
        self.hash_of[block] = h
        self.blocks_of.setdefault(h, {})[block] = None

    def release(self, blocks) -> None:
        """Free a finished request's blocks (in the request's order): reversed, cached
        ones to the tail, the others to the head."""
        first = []
        for b in reversed(blocks):
            if b in self.hash_of:
                self.free[b] = None
            else:
                first.append(b)
        for b in reversed(first):
            self.free[b] = None
            self.free.move_to_end(b, last=False)


class PoolModel:
    """The index and eviction order of :class:`~.store.KVCache`: ``dram`` blocks in DRAM,
    ``ssd`` on SSD (0: none), one policy per tier."""

    def __init__(self, dram: int, ssd: int = 0, policy: str = "lru"):
        self.dram_capacity = int(dram)
        self.ssd_capacity = int(ssd)
        # Any: the concrete policies (LRU, LFU) have insert/touch/remove/victim, the
        # Policy base class only what the cache's accounting reads.
        self.dram: Any = make_policy(policy)
        self.ssd: Any = make_policy(policy) if self.ssd_capacity > 0 else None
        self.demotions = self.promotions = self.evictions_ssd = self.dropped = 0

    def tier(self, key) -> "str | None":
        if key in self.dram:
            return "dram"
        if self.ssd is not None and key in self.ssd:
            return "ssd"
        return None

    def _assign_ssd(self, key, freq: int, pinned) -> None:
        s = self.ssd
        if len(s) >= self.ssd_capacity:
            victim = s.victim(pinned) if pinned else s.victim()
            if victim is None:
                self.dropped += 1
                return
            s.remove(victim)
            self.evictions_ssd += 1
        s.insert(key, freq)
        self.demotions += 1

    def _place(self, key, freq: int, pinned=()) -> None:
        d = self.dram
        while len(d) >= self.dram_capacity:
            victim = d.victim()
            vfreq = d.frequency(victim)
            d.remove(victim)
            if self.ssd is None:
                self.dropped += 1
            elif victim not in self.ssd:
                self._assign_ssd(victim, vfreq, pinned)
        d.insert(key, freq)

    def get(self, keys) -> None:
        """What ``KVCache.get(keys)`` does to the index: touch, promote, demote. The
        call's SSD blocks are not evicted from SSD while it runs; its DRAM blocks are read
        first, so one demoted by the promotions before it is not looked for again."""
        held = {k for k in keys if k in self.dram}
        pinned = {k for k in keys if k not in held and k in self.ssd} \
            if self.ssd is not None else ()
        for k in keys:
            if k in self.dram:
                self.dram.touch(k)
            elif k in held:
                continue
            elif self.ssd is not None and k in self.ssd:
                self.ssd.touch(k)
                self._place(k, self.ssd.frequency(k) or 1, pinned)
                self.promotions += 1

    def put(self, keys) -> None:
        """What ``KVCache.put(keys, ...)`` does to the index."""
        for k in keys:
            if k in self.dram:
                self.dram.touch(k)
                continue
            freq = 1
            if self.ssd is not None and k in self.ssd:
                self.ssd.touch(k)
                freq = self.ssd.frequency(k) or 1
            self._place(k, freq)

    def save(self, keys) -> None:
        """The connector's save of a finished request's blocks: those in DRAM skipped."""
        self.put([k for k in keys if k not in self.dram])


@dataclass
class EngineResult:
    """Hit blocks per level over the full prompt blocks of all requests (shares of
    ``blocks``); ``per_request`` holds ``(blocks, vllm, dram, ssd)`` for each request."""

    engine_cache_blocks: int
    dram_capacity_blocks: int
    ssd_capacity_blocks: int
    policy: str
    block_tokens: int
    requests: int = 0
    blocks: int = 0
    hit_vllm: int = 0
    hit_dram: int = 0
    hit_ssd: int = 0
    engine_evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions_ssd: int = 0
    dropped: int = 0
    per_request: list = field(default_factory=list, repr=False)

    def rate(self, n: int) -> float:
        return n / self.blocks if self.blocks else 0.0

    @property
    def miss(self) -> int:
        return self.blocks - self.hit_vllm - self.hit_dram - self.hit_ssd

    def to_dict(self, per_request: bool = False) -> dict:
        d = {k: getattr(self, k) for k in (
            "engine_cache_blocks", "dram_capacity_blocks", "ssd_capacity_blocks", "policy",
            "block_tokens", "requests", "blocks", "hit_vllm", "hit_dram", "hit_ssd",
            "engine_evictions", "promotions", "demotions", "evictions_ssd", "dropped")}
        pool = self.hit_dram + self.hit_ssd
        d.update(miss=self.miss, hit_blocks=self.hit_vllm + pool,
                 vllm_hit_rate=self.rate(self.hit_vllm), dram_hit_rate=self.rate(self.hit_dram),
                 ssd_hit_rate=self.rate(self.hit_ssd), pool_hit_rate=self.rate(pool),
                 block_hit_rate=self.rate(self.hit_vllm + pool),
                 miss_rate=self.rate(self.miss))
        if per_request:
            d["per_request"] = [list(r) for r in self.per_request]
        return d


def _positive(name, v, allow_zero=False):
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
        what = "non-negative" if allow_zero else "positive"
        raise InvalidArgumentError(f"{name} must be a {what} number of blocks, got {v!r}")
    return v


def simulate_engine(trace, engine_cache_blocks: int, dram_blocks: int = 0,
                    ssd_blocks: int = 0, policy: str = "lru",
                    block_tokens: "int | None" = None) -> EngineResult:
    """Replay ``trace`` through vLLM's prefix cache of ``engine_cache_blocks`` usable blocks
    in front of a pool of ``dram_blocks`` DRAM and ``ssd_blocks`` SSD blocks (0 DRAM: vLLM
    alone), requests one at a time. See the module docstring for what is modelled.

    Parameters
    ----------
    trace : Trace
        One hash id per engine block (as ``benchmarks/vllm_ttft.py`` builds its requests).
    engine_cache_blocks : int
        vLLM's ``num_gpu_blocks - 1``.
    dram_blocks, ssd_blocks : int
        The pool's slots per tier (``KVCache.stats()["dram_capacity_blocks"]``, ...).
    policy : {"lru", "lfu"}
        The pool's eviction policy (vLLM's own order is fixed).
    block_tokens : int, optional
        Tokens per block (default: the trace's).

    Returns
    -------
    EngineResult
    """
    E = _positive("engine_cache_blocks", engine_cache_blocks)
    D = _positive("dram_blocks", dram_blocks, allow_zero=True)
    S = _positive("ssd_blocks", ssd_blocks, allow_zero=True)
    if S and not D:
        raise InvalidArgumentError("an SSD tier needs a DRAM tier (the pool reads and writes "
                                   "SSD through DRAM): give dram_blocks too")
    T = int(block_tokens or trace.block_tokens)
    if T < 1:
        raise InvalidArgumentError(f"block_tokens must be positive, got {T!r}")
    make_policy(policy)                       # the uniform error for a bad name
    eng = EngineCacheModel(E)
    pool = PoolModel(D, S, policy) if D else None
    res = EngineResult(E, D, S, str(policy).lower(), T)
    for ids, length in zip(trace.hash_ids, trace.input_lengths):
        length = int(length)
        n_full = min(len(ids), length // T)
        max_hit = min(n_full, max(0, length - 1) // T)
        need = -(-length // T)                # blocks holding the prompt's tokens
        hit = eng.hit(ids, max_hit)
        k = len(hit)
        d = s = 0
        if pool is not None and k < max_hit:
            for h in ids[k:max_hit]:
                t = pool.tier(h)
                if t == "dram":
                    d += 1
                elif t == "ssd":
                    s += 1
                else:
                    break
        eng.touch(hit)
        blocks = hit + eng.allocate(need - k)
        if pool is not None and d + s:
            pool.get(ids[k:k + d + s])
        for i in range(k, n_full):
            eng.cache(blocks[i], ids[i])
        if pool is not None:
            pool.save(ids[:n_full])
        eng.release(blocks)
        res.requests += 1
        res.blocks += n_full
        res.hit_vllm += k
        res.hit_dram += d
        res.hit_ssd += s
        res.per_request.append((n_full, k, d, s))
    res.engine_evictions = eng.evictions
    if pool is not None:
        res.promotions, res.demotions = pool.promotions, pool.demotions
        res.evictions_ssd, res.dropped = pool.evictions_ssd, pool.dropped
    return res

# SPDX-License-Identifier: Apache-2.0
"""The scheduler side of the connector: decides which requests load KV from a producer,
which blocks receive it, and which finished prefills keep their blocks under a lease.

Protocol (pull: the consumer READs from the producer), as in vLLM's NIXL connector:

- The proxy sends the prefill request with ``kv_transfer_params={"do_remote_decode":
  True}``. When it finishes, :meth:`request_finished` keeps its blocks (a lease) and
  returns the parameters the proxy forwards to the decode instance.
- The decode request carries them (``do_remote_prefill``). :meth:`get_num_new_matched_tokens`
  reports the prompt as loadable asynchronously; :meth:`update_state_after_alloc` pairs
  the local blocks with the producer's; the worker reads them and tells the producer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...kvcache.keys import ROOT

# Request states vLLM frees normally; only a prefill that ran to its (1-token) length
# hands its blocks to a consumer. An aborted one frees them at once.
_HANDOFF_STATES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


@dataclass
class LoadSpec:
    """Read ``remote_block_ids`` of ``remote_engine`` into ``local_block_ids``."""

    request_id: str
    local_block_ids: list
    remote_block_ids: list
    remote_engine: str
    remote_request_id: str
    lease_deadline: "float | None" = None    # producer's wall clock (time.time())


@dataclass
class Work:
    """Scheduler -> worker, once per step (vLLM's ``KVConnectorMetadata`` carries it)."""

    loads: list = field(default_factory=list)        # [LoadSpec]
    releases: list = field(default_factory=list)     # [(remote_engine, remote_request_id)]
    leases: list = field(default_factory=list)       # [request_id] on the producer
    pool_loads: list = field(default_factory=list)   # [pool.PoolLoadSpec]
    saves: list = field(default_factory=list)        # [pool.SaveSpec]
    # Prompt blocks that become full in this step's forward pass ([pool.SaveSpec]): a
    # worker that can (a GPU KV cache) copies them out layer by layer as they are
    # computed (save_kv_layer); others leave them to the save at the request's end.
    layer_saves: list = field(default_factory=list)
    # One entry per request scheduled for the first time: (prompt blocks asked for,
    # blocks vLLM's own prefix cache had, pool blocks loaded by tier: a TierCounts).
    lookups: list = field(default_factory=list)
    # This step runs no forward pass (every request waits for KV): the worker may wait
    # for its READs instead of returning at once.
    idle: bool = False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerSide:
    """vLLM-independent logic; ``request`` objects are vLLM ``Request``\\ s (duck-typed:
    ``request_id``, ``prompt_token_ids``, ``all_token_ids``, ``num_computed_tokens``,
    ``kv_transfer_params``, ``status``).

    With a pool (``pool`` a :class:`~.pool.PoolLookup`, ``pool_root`` the key root), a new
    request's prompt is looked up beyond what vLLM's own prefix cache holds, and a finished
    request's computed full blocks are handed to the worker to store.
    """

    def __init__(self, *, block_size: int, is_producer: bool, is_consumer: bool,
                 engine_name: str, host: str, port: int, lease_s: float = 120.0,
                 clock=time.time, pool=None, pool_root: "bytes | None" = None):
        self.block_size = int(block_size)
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.engine_name = engine_name
        self.host, self.port = host, int(port)
        self.lease_s = float(lease_s)
        self._clock = clock
        self._work = Work()
        self.pool = pool
        # The key root (model / layout / rank namespace); used only with a pool.
        self.pool_root = pool_root if pool_root is not None else ROOT
        self._looked: dict = {}         # request id -> (first block, TierCounts)
        self._pool_planned: set = set()  # request ids whose pool load was planned
        self._keys: dict = {}           # request id -> keys of its prompt's full blocks
        # Requests running with prompt blocks still to save layer-wise:
        # request id -> [prompt token ids, block ids, prompt blocks already handed out]
        self._layered: dict = {}
        self.layerwise = pool is not None

    # -- pool -----------------------------------------------------------------------------
    def _prompt_keys(self, request) -> list:
        from .pool import block_keys
        keys = self._keys.get(request.request_id)
        if keys is None:
            keys = block_keys(list(request.prompt_token_ids or ()), self.block_size,
                              self.pool_root)
            self._keys[request.request_id] = keys
        return keys

    def _pool_hit(self, request, num_computed_tokens: int) -> int:
        """Blocks after vLLM's own prefix hit that the pool holds (0 without a pool)."""
        if self.pool is None:
            return 0
        if request.request_id in self._pool_planned:
            # Asked again after its pool load was planned: that load failed (vLLM
            # recomputes) or the request was preempted. The index may still name a dead
            # peer's blocks, so loading again could fail the same way, round after round:
            # recompute instead.
            from .pool.lookup import TierCounts
            self._looked[request.request_id] = (num_computed_tokens // self.block_size,
                                                TierCounts.zero())
            return 0
        n_prompt = len(request.prompt_token_ids or ())
        # As vLLM's own prefix cache: at least the prompt's last token is computed, so a
        # block is loadable only if it ends before it.
        last = (n_prompt - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        from .pool.lookup import TierCounts
        if last <= first or num_computed_tokens % self.block_size:
            self._looked[request.request_id] = (first, TierCounts.zero())
            return 0
        tiers = TierCounts(self.pool.lookup(self._prompt_keys(request)[first:last]))
        self._looked[request.request_id] = (first, tiers)
        return sum(tiers)

    def layer_saves(self, out) -> None:
        """Add to this step's work the prompt blocks that this step's forward pass fills
        (from vLLM's ``SchedulerOutput``: new and running requests, their block ids and
        scheduled token counts; the same fields from vLLM 0.26 on), with their keys, for
        saving layer by layer (:attr:`Work.layer_saves`)."""
        if not self.layerwise or out is None:
            return
        from .pool import SaveSpec
        bs = self.block_size
        start: dict = {}
        for nr in getattr(out, "scheduled_new_reqs", None) or ():
            toks = list(nr.prompt_token_ids or ())
            ids = list(nr.block_ids[0]) if nr.block_ids else []
            self._layered[nr.req_id] = [toks, ids, int(nr.num_computed_tokens) // bs]
            start[nr.req_id] = int(nr.num_computed_tokens)
        cached = getattr(out, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", None) or set()
            for i, rid in enumerate(cached.req_ids):
                t = self._layered.get(rid)
                if t is None:
                    continue
                new = cached.new_block_ids[i]
                done = int(cached.num_computed_tokens[i])
                if rid in resumed:               # preempted and back: its block list anew
                    t[1] = list(new[0]) if new else []
                    t[2] = done // bs
                elif new:
                    t[1].extend(new[0])
                start[rid] = done
        for rid, n in (getattr(out, "num_scheduled_tokens", None) or {}).items():
            t = self._layered.get(rid)
            if t is None or rid not in start:
                continue
            toks, ids, done = t
            full = min((start[rid] + int(n)) // bs, len(toks) // bs, len(ids))
            if full <= done:
                continue
            keys = self._keys.get(rid)
            if keys is None:
                from .pool import block_keys
                keys = self._keys[rid] = block_keys(toks, bs, self.pool_root)
            self._work.layer_saves.append(SaveSpec(rid, keys[done:full], ids[done:full]))
            t[2] = full
            if full >= len(toks) // bs:          # the whole prompt handed out
                del self._layered[rid]

    # -- consumer -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        hit = self._pool_hit(request, num_computed_tokens)
        p = request.kv_transfer_params
        if self.is_consumer and p and p.get("do_remote_prefill"):
            # The pool's blocks first, the producer's for the rest (update_state_after_alloc).
            n = min(len(request.prompt_token_ids or ()),
                    int(p.get("remote_num_tokens", 1 << 62))) - num_computed_tokens
            if n > 0:
                return n, True
        if hit:
            return hit * self.block_size, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        looked = self._looked.pop(rid, None)
        p = request.kv_transfer_params
        remote_prefill = bool(self.is_consumer and p and p.get("do_remote_prefill"))
        all_ids: list = []
        fresh: list = []
        if num_external_tokens > 0:
            all_ids = list(blocks.get_block_ids()[0])
            fresh = list(blocks.get_unhashed_block_ids()) if hasattr(
                blocks, "get_unhashed_block_ids") else all_ids
        skip = len(all_ids) - len(fresh)        # vLLM's own hits
        pool_n = 0
        if looked is not None and self.pool is not None:
            first, tiers = looked
            n_prompt = len(request.prompt_token_ids or ())
            if num_external_tokens > 0 and first == skip:
                pool_n = min(sum(tiers), len(fresh), num_external_tokens // self.block_size)
            if pool_n:
                from .pool import PoolLoadSpec
                keys = self._prompt_keys(request)[skip:skip + pool_n]
                self._work.pool_loads.append(PoolLoadSpec(rid, keys, fresh[:pool_n], tiers))
                self._pool_planned.add(rid)
            # Counted once per request, as vLLM counts its own prefix hits.
            self._work.lookups.append((n_prompt // self.block_size, first,
                                       tiers.clip(pool_n)))
        if not remote_prefill:
            return
        p["do_remote_prefill"] = False          # load once, even if called again
        engine, rid_remote = p.get("remote_engine"), p.get("remote_request_id")
        if not engine or rid_remote is None:
            return
        if num_external_tokens <= 0 or pool_n >= len(fresh):
            # Everything local or in the pool, but the producer holds a lease.
            self._work.releases.append((engine, rid_remote))
            return
        # Fewer remote blocks than local ones (a different prompt reached the two
        # instances) must not leave blocks unfilled but counted as computed: the worker's
        # plan() refuses unequal counts and the load is reported failed.
        remote = list(p.get("remote_block_ids") or ())[skip + pool_n:skip + len(fresh)]
        deadline = p.get("remote_lease_deadline")
        self._work.loads.append(LoadSpec(rid, fresh[pool_n:], remote, engine, rid_remote,
                                         float(deadline) if deadline is not None else None))

    # -- producer and pool --------------------------------------------------------------
    def request_finished(self, request, block_ids):
        ids_all = list(block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple))
                       else block_ids or ())
        self._looked.pop(request.request_id, None)
        self._pool_planned.discard(request.request_id)
        self._keys.pop(request.request_id, None)
        self._layered.pop(request.request_id, None)
        save = self._pool_save(request, ids_all)
        p = request.kv_transfer_params
        if not p:
            return save, None
        if p.get("do_remote_prefill") and p.get("remote_engine"):
            # A consumer request aborted before its blocks were allocated: the producer
            # still holds a lease; let it go.
            p["do_remote_prefill"] = False
            self._work.releases.append((p["remote_engine"], p.get("remote_request_id")))
            return save, None
        if not (self.is_producer and p.get("do_remote_decode")):
            return save, None
        status = getattr(request.status, "name", str(request.status))
        n_prompt = len(request.prompt_token_ids or ())
        ids = ids_all[:cdiv(n_prompt, self.block_size)]
        if status not in _HANDOFF_STATES or not ids:
            return save, None
        self._work.leases.append(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine": self.engine_name,
                      "remote_request_id": request.request_id,
                      "remote_block_ids": ids, "remote_num_tokens": n_prompt,
                      # The worker's lease starts a step later, so this is conservative.
                      "remote_lease_deadline": self._clock() + self.lease_s,
                      "remote_host": self.host, "remote_port": self.port}

    def _pool_save(self, request, block_ids: list) -> bool:
        """Queue the request's computed full blocks for the pool; True if the worker now
        holds its blocks until they are copied (vLLM's delay_free)."""
        if self.pool is None or not block_ids:
            return False
        from .pool import SaveSpec, block_keys
        tokens = list(getattr(request, "all_token_ids", None) or request.prompt_token_ids
                      or ())
        computed = min(int(getattr(request, "num_computed_tokens", 0) or 0), len(tokens))
        n = min(computed // self.block_size, len(block_ids))
        if n <= 0:
            return False
        keys = block_keys(tokens, self.block_size, self.pool_root, stop=n)
        self._work.saves.append(SaveSpec(request.request_id, keys, block_ids[:n]))
        return True

    def take_work(self) -> Work:
        w, self._work = self._work, Work()
        return w


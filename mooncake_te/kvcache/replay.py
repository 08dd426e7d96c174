# SPDX-License-Identifier: Apache-2.0
"""``trace replay --real``: a trace's requests through a real :class:`KVCache`.

Each request does what a serving engine would: ``lookup`` its keys (the hit length, as
in the simulation), ``get`` the cached prefix (DRAM hits copied, SSD hits read and
promoted), and ``put`` the rest (blocks already held are touched, new ones written).
The bytes are synthetic and of the right size: block ``i`` of a request carries
``min(512, input_length - 512 i) * bytes_per_token`` bytes, taken from one random buffer at
an offset derived from the key, so ``verify=True`` can check that every block read back
is the one written. The order of touches and insertions is the simulation's, so a DRAM
tier of ``C`` blocks and no SSD gives the simulator's numbers exactly.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import InvalidArgumentError
from .store import KVCache
from .trace import Trace

__all__ = ["replay_real"]



def _offset(h: int, span: int) -> int:
    # Fibonacci hashing (Knuth, TAOCP vol. 3, 6.4) spreads consecutive ids over the noise.
    return ((h * 11400714819323198485) & ((1 << 64) - 1)) % span


def replay_real(trace: Trace, cache: KVCache, bytes_per_token: int, verify: bool = False,
                progress=None) -> dict:
    """Replay ``trace`` through ``cache``; returns the cache's stats plus wall time.

    Parameters
    ----------
    trace : Trace
    cache : KVCache
        Its ``block_bytes`` must hold ``trace.block_tokens * bytes_per_token``.
    bytes_per_token : int
        KV bytes per token (all layers that one block holds).
    verify : bool
        Compare every block read back with what was written.
    progress : callable, optional
        Called as ``progress(requests_done, total)`` every 256 requests.
    """
    bt = trace.block_tokens
    full = bt * bytes_per_token
    if full > cache.block_bytes:
        raise InvalidArgumentError(f"a {bt}-token block of {bytes_per_token} B/token is {full} "
                                   f"bytes, more than the cache's block_bytes "
                                   f"{cache.block_bytes}")
    cache.block_tokens = bt
    span = 1 << 16
    noise = np.random.default_rng(13).integers(0, 256, full + span, dtype=np.uint8)
    nmv = memoryview(noise)
    # One get per request (so the whole prefix is pinned while it is read) into a scratch
    # buffer grown to the longest prefix seen, so no per-block allocation is timed.
    scratch = np.empty((0, full), dtype=np.uint8)
    outs: list = []
    mismatches = 0
    t0 = time.perf_counter()
    total = len(trace)
    for r, (ids, length) in enumerate(zip(trace.hash_ids, trace.input_lengths)):
        lost = []
        k = cache.lookup(ids, num_tokens=length)
        if k:
            if k > len(outs):
                scratch = np.empty((k, full), dtype=np.uint8)
                outs = [scratch[j] for j in range(k)]
            got = cache.get(ids[:k], out=outs[:k])
            lost.extend(j for j, n in enumerate(got) if n is None)
            if verify:
                for j, (h, n) in enumerate(zip(ids[:k], got)):
                    want = _size(j, length, bt, bytes_per_token)
                    off = _offset(h, span)
                    if n is None:
                        continue
                    if n != want or not np.array_equal(scratch[j, :n], noise[off:off + n]):
                        mismatches += 1
        if k < len(ids) or lost:
            # Blocks the get could not return (dropped as corrupt) are inserted again, as
            # the simulation inserts every block it does not find.
            idx = lost + list(range(k, len(ids)))
            rest = [ids[i] for i in idx]
            blocks = []
            for i in idx:
                n = _size(i, length, bt, bytes_per_token)
                off = _offset(ids[i], span)
                blocks.append(nmv[off:off + n])
            cache.put(rest, blocks)
        if progress is not None and (r + 1) % 256 == 0:
            progress(r + 1, total)
    wall = time.perf_counter() - t0
    s = cache.stats()
    s.update(requests=total, wall_s=wall, bytes_per_token=bytes_per_token,
             verify_mismatches=mismatches if verify else None)
    return s


def _size(i: int, length: int, bt: int, bpt: int) -> int:
    return max(1, min(bt, length - bt * i)) * bpt

# SPDX-License-Identifier: Apache-2.0
"""Loads: a prefix the scheduler's lookup found, read from the pool (whatever tier holds
each block: :meth:`KVCache.get` brings it into the hub first) straight into the vLLM
blocks the scheduler allocated for it."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .lookup import TierCounts

log = logging.getLogger("mooncake_te.integrations.vllm")


@dataclass
class PoolLoadSpec:
    """Load the pool blocks ``keys`` into ``block_ids``."""

    request_id: str
    keys: list
    block_ids: list
    #: What the scheduler's lookup saw: blocks by tier (:class:`~.lookup.TierCounts`).
    tiers: tuple = field(default_factory=TierCounts.zero)


class _Sink:
    """``get(copy=)``'s callable: each block image into its vLLM block, checked for size;
    ``flush`` is the copier's, when it has one (a copier that batches its copies)."""

    def __init__(self, copier, block_ids):
        self.copier, self.ids = copier, block_ids
        self.wrong: list = []
        flush = getattr(copier, "flush", None)
        if flush is not None:
            self.flush = flush

    def __call__(self, i, block) -> None:
        # Straight from the pool's slot (an SSD or remote block after it was read there
        # and checked) into vLLM's block: no intermediate image, no GIL hand-off.
        if block.nbytes != self.copier.block_bytes:
            self.wrong.append(block.nbytes)
            return
        self.copier.scatter_held(self.ids[i], block)


def load_blocks(cache, copier, spec: PoolLoadSpec, remote: bool, logger=None) -> "dict | None":
    """Read ``spec``'s blocks from ``cache`` into vLLM's blocks on the calling thread;
    the counts to add (``loads``, ``blocks_loaded``, ``bytes_loaded``, ``load_s`` and
    ``loaded_<tier>`` for the tier each block came from), or None when a block could not
    be loaded (vLLM then recomputes the request's external tokens)."""
    logger = logger or log
    t0 = time.perf_counter()
    keys = spec.keys
    sink = _Sink(copier, spec.block_ids)
    where: list = []
    got = cache.get(keys, copy=sink, remote=remote, where=where)     # lengths
    bad = [i for i, g in enumerate(got) if g is None]
    if bad:
        # A block evicted since the lookup, a corrupt SSD record, a failed peer read:
        # none of it is served; vLLM recomputes the request's external tokens.
        logger.warning("mooncake_te connector: %d of %d pool blocks for request %s could "
                       "not be loaded (evicted, corrupt or unreachable); vLLM recomputes "
                       "them", len(bad), len(keys), spec.request_id)
        return None
    if sink.wrong:
        logger.warning("mooncake_te connector: a pool block for request %s is %d bytes, "
                       "expected %d; recomputing", spec.request_id, sink.wrong[0],
                       copier.block_bytes)
        return None
    c = {"loads": 1, "blocks_loaded": len(keys), "bytes_loaded": len(keys) * copier.block_bytes,
         "load_s": time.perf_counter() - t0}
    for name in where:
        c[f"loaded_{name}"] = c.get(f"loaded_{name}", 0) + 1
    return c

# SPDX-License-Identifier: Apache-2.0
"""KV cache tiering for the connector: vLLM's computed blocks stored in, and prefix hits
loaded back from, :class:`mooncake_te.kvcache.KVCache` (a DRAM pool registered with the
worker's engine, an SSD tier under ``cache_dir``, and through the metadata store's owner
index the DRAM pools of other instances). Nothing here imports vLLM.

One pool block is one vLLM block of every layer: the regions of
:class:`~.layout.KVLayout` one after another (``block_bytes = sum(block_len)``), under a
key chained over the block's tokens and every token before it
(:func:`mooncake_te.kvcache.prefix_hashes`) from a root that names the model and the
block size (:func:`namespace_root`); the cache's ``namespace`` adds the KV layout, dtype,
TP size and rank (the handshake's compatibility hash), so only byte-identical layouts
ever share blocks, in DRAM, on SSD and through the index.

Threads. The scheduler asks :class:`PoolLookup` (an ``AF_UNIX`` socket in the abstract
namespace, so it works whether vLLM runs the worker in the scheduler's process or
another) how long a prefix the pool holds. The worker's :class:`PoolWorker` does saves
and loads on its own threads: a finished request's blocks stay allocated (vLLM's
``delay_free``) until the saver thread has copied them into the pool, so the forward pass
never waits for a save; a load runs while the request waits in WAITING_FOR_REMOTE_KVS.

The package, by job: :mod:`.keys` (block keys), :mod:`.settings` (``[kvcache]`` as the
connector reads it), :mod:`.lookup` (the scheduler's question and the worker's answer,
per tier), :mod:`.save` (the bounded save queue), :mod:`.load` (pool blocks into vLLM's
blocks), :mod:`.copier` (vLLM blocks <-> block images; :func:`.copier.make_copier` picks
one) and :mod:`.worker` (:class:`PoolWorker`, which composes them). The tiers themselves
are the KV cache's (:mod:`mooncake_te.kvcache.tiers`); nothing here names one.
"""
from __future__ import annotations

from .copier import BlockCopier, make_copier
from .keys import KEY_SCHEME, block_keys, namespace_root
from .load import PoolLoadSpec, load_blocks
from .lookup import PoolLookup, TierCounts, _LookupServer, lookup_address
from .save import SaveQueue, SaveSpec, save_blocks
from .settings import PoolSettings, pool_settings
from .worker import PoolWorker, counter_names

__all__ = ["BlockCopier", "make_copier", "KEY_SCHEME", "block_keys", "namespace_root",
           "PoolLoadSpec", "load_blocks", "PoolLookup", "TierCounts", "lookup_address",
           "SaveQueue", "SaveSpec", "save_blocks", "PoolSettings", "pool_settings",
           "PoolWorker", "counter_names", "COUNTER_NAMES", "_LookupServer"]


def __getattr__(name: str):
    if name == "COUNTER_NAMES":         # the registered tiers when asked, not at import
        return counter_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

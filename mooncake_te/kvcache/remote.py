# SPDX-License-Identifier: Apache-2.0
"""The ``remote`` tier: other instances' DRAM hubs, found through the owner index
(:mod:`.index`, in the metadata store) and read with one-sided READs straight into this
cache's hub slots, each record checked (key, length, CRC) before it is served, so a stale
index record costs a wasted read, never wrong bytes.

Not local (:class:`~.tiers.Tier`): a prefix or a batch is one index query, asked only
when the caller passes ``remote=True``. The hub publishes its own blocks to the same
index (:meth:`~.store.KVCache.put` and promotions), which is how peers find them here.
"""
from __future__ import annotations

import logging

import numpy as np

from ..errors import InvalidArgumentError, MooncakeError
from .record import HEADER_SIZE, crc32_held, parse_header
from .tiers import Tier

log = logging.getLogger("mooncake_te.kvcache")


class RemoteTier(Tier):
    """Peers' hubs through ``index`` (an :class:`~.index.OwnerIndex`), read with
    ``engine``."""

    name = "remote"
    description = "other instances' pools"
    local = False
    failed_counter = "remote_failed"

    def __init__(self, cache, index, own_store=None):
        self._cache = cache
        self.index = index
        self.owner_index = index
        self._own_store = own_store

    @classmethod
    def open(cls, cache, args: dict) -> "RemoteTier | None":
        """Where the cache has an engine and an index: ``index=`` (a metadata store or
        its URL) or the engine's metadata store, if it is one."""
        from ..metadata import open_backend
        from ..metadata.base import KeyValueBackend
        from .index import OwnerIndex
        engine, index = cache.engine, args.get("index")
        if engine is None:
            if index is not None:
                raise InvalidArgumentError("index= needs engine= (remote blocks are read "
                                           "through the transfer engine)")
            return None
        own = None
        if isinstance(index, str):
            index = own = open_backend(index)
        if index is None:
            b = getattr(engine, "metadata", None)
            index = b if isinstance(b, KeyValueBackend) else None
        if index is None:
            return None
        if not isinstance(index, KeyValueBackend):
            raise InvalidArgumentError(f"index must be a metadata store (etcd/redis/http) or "
                                       f"its URL, got {type(index).__name__}")
        return cls(cache, OwnerIndex(index, engine.name, cache.namespace), own)

    def lookup_prefix(self, keys) -> int:
        return self.index.lookup_prefix(keys)

    def locate(self, keys) -> list:
        """``(length, (owner, addr, length))`` per key another instance holds."""
        return [None if rec is None else (rec[2], rec)
                for rec in self.index.lookup_many(list(keys))]

    def remove(self, key: bytes) -> None:
        """Delete ``key``'s index record, whoever owns it (the object was removed)."""
        self.index.drop(key)

    def read_into(self, items) -> list:
        """Every owner's READs in flight at once, then each record checked."""
        import mooncake_te as mte
        engine = self._cache.engine
        by_owner: dict = {}
        for j, (_k, rec, _n, _v, _a) in enumerate(items):
            by_owner.setdefault(rec[0], []).append(j)
        batches = []
        for owner, js in by_owner.items():
            local = np.array([items[j][4] for j in js], np.uint64)
            addrs = np.array([items[j][1][1] for j in js], np.uint64)
            lens = np.array([HEADER_SIZE + items[j][2] for j in js], np.uint64)
            try:
                batches.append((owner, js, engine.submit_arrays(mte.READ, owner, local,
                                                                addrs, lens)))
            except MooncakeError as e:
                log.info("kvcache: remote get from %s failed: %s", owner, e)
        ok = [False] * len(items)
        for owner, js, batch in batches:
            try:
                batch.wait()
            except MooncakeError as e:
                log.info("kvcache: remote get from %s failed: %s", owner, e)
                continue
            for j in js:
                k, _, n, view, _ = items[j]
                h = parse_header(view)
                ok[j] = h is not None and h.key == k and h.length == n and \
                    crc32_held(view[HEADER_SIZE:HEADER_SIZE + n]) == h.crc
        return ok

    def stats(self) -> dict:
        return {"index_errors": self.index.errors}

    @classmethod
    def blank_stats(cls) -> dict:
        return {"index_errors": 0}

    def close(self) -> None:
        """Withdraw the hub's records, send what is queued, close an index store this
        tier opened."""
        self.index.close(withdraw_all=list(self._cache._dram))
        if self._own_store is not None:
            self._own_store.close()

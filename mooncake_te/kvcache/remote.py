# SPDX-License-Identifier: Apache-2.0
"""The ``remote`` tier: other instances' DRAM hubs, found through the owner index
(:mod:`.index`, the object directory's owner records in the metadata store) and read
with one-sided READs straight into this cache's hub slots (the object directory's
verified READ, :func:`mooncake_te.objdir.read_verified`), each record checked (key,
length, CRC) before it is served, so a stale index record costs a wasted read, never
wrong bytes.

Not local (:class:`~.tiers.Tier`): a prefix or a batch is one index query, asked only
when the caller passes ``remote=True``. The hub publishes its own blocks to the same
index (:meth:`~.store.KVCache.put` and promotions), which is how peers find them here.

Who is trusted (issue 35, item 1): with an ``auth_token`` on the engine, records carry a
MAC made with a key derived from the token (:mod:`.index`), and blocks are read only
over connections on which the owner proved the token and its segment name. Without a
token nothing can be authenticated (anyone who can write the metadata store could name
a block and serve it), so the tier does not open unless sharing without a token is
enabled explicitly (``share_without_token=True``, ``[kvcache] share_without_token =
true`` or ``MC_KVCACHE_SHARE_WITHOUT_TOKEN=1``); blocks read that way are served but
never re-published as this cache's own (:attr:`RemoteTier.verified`).
"""
from __future__ import annotations

import logging

from ..config import Config
from ..errors import InvalidArgumentError
from ..objdir.read import read_verified
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
        #: Blocks read here were authenticated (records MAC'd with the token's key, owner
        #: proved the token and its name); False when sharing without a token.
        self.verified = index.mac_key is not None

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
            if own is not None:
                own.close()
            raise InvalidArgumentError(f"index must be a metadata store (etcd/redis/http) or "
                                       f"its URL, got {type(index).__name__}")
        mac_key = engine.derive_key(f"kvcache-index/{cache.namespace}") \
            if getattr(engine, "authenticated", False) else None
        if mac_key is None and not share_without_token(engine, args):
            if own is not None:
                own.close()
            cache.sharing_off = NO_TOKEN_REASON
            log.warning("kvcache: %s", NO_TOKEN_REASON)
            return None
        return cls(cache, OwnerIndex(index, engine.name, cache.namespace, mac_key=mac_key,
                                     max_length=cache.block_bytes), own)

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
        """Every owner's READs in flight at once (:func:`~mooncake_te.objdir.read_verified`),
        then each slot's header checked against the record."""
        def check(j: int) -> bool:
            k, rec, n, view, _ = items[j]
            h = parse_header(view)
            # The record's CRC was MAC'd by the publisher (with a token): the block must
            # be the one it published, not just any block with that key.
            return h is not None and h.key == k and h.length == n and h.crc == rec[3] and \
                crc32_held(view[HEADER_SIZE:HEADER_SIZE + n]) == h.crc
        return read_verified(self._cache.engine,
                             [(rec[0], local, rec[1], HEADER_SIZE + n)
                              for _k, rec, n, _v, local in items], check,
                             "kvcache: remote get", logger=log,
                             bounds=[(local, len(view)) for _k, _r, _n, view, local in items])

    def stats(self) -> dict:
        return {"index_errors": self.index.errors, "rejected_records": self.index.rejected}

    @classmethod
    def blank_stats(cls) -> dict:
        return {"index_errors": 0, "rejected_records": 0}

    def close(self) -> None:
        """Withdraw the hub's records, send what is queued, close an index store this
        tier opened."""
        self.index.close(withdraw_all=list(self._cache._dram))
        if self._own_store is not None:
            self._own_store.close()


#: Why the remote tier stays closed on an engine without a token (log, ``get`` errors,
#: ``doctor``'s MTE404).
NO_TOKEN_REASON = (
    "sharing blocks with other instances is off: the engine has no auth_token, so an "
    "owner-index record or a block served by another process could not be authenticated "
    "(anyone who can write the metadata store could make this cache serve forged KV); set "
    "the same auth_token on every engine (MC_AUTH_TOKEN), or, on a network where every "
    "process that can reach the metadata store and the engines is trusted, enable it "
    "without a token: KVCache(share_without_token=True), [kvcache] share_without_token = "
    "true, or MC_KVCACHE_SHARE_WITHOUT_TOKEN=1")


def share_without_token(engine, args: dict) -> bool:
    """``share_without_token`` of ``args`` (the cache's argument), else of the engine's
    config (``[kvcache] share_without_token``, ``MC_KVCACHE_SHARE_WITHOUT_TOKEN``)."""
    v = args.get("share_without_token")
    if v is None:
        cfg = getattr(engine, "config", None)
        v = (cfg if isinstance(cfg, Config) else Config.load(None))["kvcache"][
            "share_without_token"]
    return bool(v)

# SPDX-License-Identifier: Apache-2.0
"""One area of object records in a metadata store (etcd, redis, our HTTP server).

Keys sit beside the engines' descriptors under Mooncake's layout
(``mooncake/[<cluster>/]<area>/<name>``, :func:`~mooncake_te.metadata.base.key_prefix`;
``MC_METADATA_CLUSTER_ID`` applies). Reads and writes of many keys are one round trip
each (the stores' ``get_many``/``put_many``/``delete_many``: redis MGET/MSET/DEL, an etcd
transaction, our HTTP server's batch route).

The stores offer no compare-and-swap, so :meth:`ObjectDirectory.update` (a
read-modify-write of one JSON value) reads back after a random pause and redoes a change
a concurrent writer overwrote; a caller whose records must not be lost keeps re-writing
them (the P2P store's holders do every refresh period).
"""
from __future__ import annotations

import json
import logging
import random
import time

from ..metadata.base import KeyValueBackend, key_prefix

log = logging.getLogger("mooncake_te.objdir")


def area_prefix(store, area: str) -> str:
    """``mooncake/[<cluster>/]<area>/``: the keys of ``area`` in ``store`` (its
    ``cluster_id``, else ``MC_METADATA_CLUSTER_ID``)."""
    return f"{key_prefix(getattr(store, 'cluster_id', None))}{area.strip('/')}/"


class ObjectDirectory:
    """The keys of ``area`` in ``store``.

    Parameters
    ----------
    store : KeyValueBackend
        An open etcd, redis or HTTP metadata store.
    area : str
        What the records are (``"kvcache/<namespace>"``, ``"p2p_store"``): the part of the
        key between the cluster prefix and the record's name.
    """

    def __init__(self, store: KeyValueBackend, area: str):
        self.store = store
        self.area = area.strip("/")
        self.prefix = area_prefix(store, self.area)
        #: failed reads of :meth:`get_many` (the store was out: answered as misses)
        self.errors = 0

    def key(self, name: str) -> str:
        """The store key of the record ``name``."""
        return self.prefix + name

    def get(self, name: str) -> "bytes | None":
        """The raw record ``name``, None where there is none; store errors propagate."""
        return self.store.get(self.key(name))

    def get_many(self, names, hint: bool = True) -> list:
        """The raw records of ``names`` (None where there is none), one round trip. With
        ``hint`` a store outage answers all None (a lookup is a hint: an outage is a
        miss), logged; without, the store's error propagates."""
        keys = [self.prefix + n for n in names]
        if not hint:
            return self.store.get_many(keys) if keys else []
        return self.get_keys(keys)

    def get_keys(self, keys: list) -> list:
        """:meth:`get_many` of full store keys (:meth:`key`)."""
        if not keys:
            return []
        try:
            return self.store.get_many(keys)
        except Exception as e:
            self.errors += 1
            if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                log.warning("%s: lookup in the metadata store failed (%d so far): %s",
                            self.area, self.errors, e)
            return [None] * len(keys)

    def get_json(self, name: str, default):
        """The JSON value of ``name``, ``default`` when there is none or it is not JSON
        (logged); store errors propagate."""
        raw = self.store.get(self.key(name))
        if raw is None:
            return default
        try:
            return json.loads(raw)
        except ValueError:
            log.warning("key %r in the %s metadata store is not JSON; treating it as empty",
                        self.key(name), self.store.kind)
            return default

    def put(self, name: str, value: bytes) -> None:
        self.store.put(self.key(name), value)

    def put_json(self, name: str, value) -> None:
        self.store.put(self.key(name), json.dumps(value, separators=(",", ":")).encode())

    def delete(self, name: str) -> None:
        self.store.delete(self.key(name))

    def put_many(self, items: dict) -> None:
        """``{name: raw}`` in one round trip."""
        if items:
            self.store.put_many({self.prefix + n: v for n, v in items.items()})

    def delete_many(self, names) -> None:
        if names:
            self.store.delete_many([self.prefix + n for n in names])

    def update(self, name: str, change, default, tries: int = 8) -> bool:
        """Apply the idempotent ``change(value) -> value`` to the JSON value of ``name``,
        reading back after a random pause (two writers desynchronise) and redoing it
        when a concurrent writer overwrote it. False if it kept losing (``tries`` times):
        the caller's refresh redoes it."""
        for _ in range(tries):
            cur = self.get_json(name, default)
            new = change(cur)
            if new == cur:
                return True
            self.put_json(name, new)
            time.sleep(random.uniform(0.002, 0.02))
            back = self.get_json(name, default)
            if change(back) == back:
                return True
        log.debug("update of %r kept losing races; the refresh loop will redo it",
                  self.key(name))
        return False

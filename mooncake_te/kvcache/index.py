# SPDX-License-Identifier: Apache-2.0
"""Key -> owner index: which engine holds a block in its DRAM pool, in the metadata store.

One record per block, ``mooncake/[<cluster>/]kvcache/<namespace>/<key hex>`` ->
``{"owner": segment name, "addr": address of the slot in the owner's pool,
"length": payload bytes}``, next to the segment descriptors under Mooncake's key layout
(``metadata/base.py``). A reader resolves the owner's segment, reads header + data of
the slot in one transfer and checks the header's key and CRC, so a stale record (the
owner evicted or reused the slot since) costs one wasted read and counts as a miss,
never returns wrong bytes. That is why records need no lease or lock.

Writes go through a background thread that coalesces (only the last operation on a key
is sent) and sends what is queued in one round trip each for puts and deletes
(``put_many``/``delete_many``: redis MSET/DEL, an etcd transaction, our HTTP server's batch
route), so a put does not wait for a network round trip, and a request's blocks do not
cost one each.
"""
from __future__ import annotations

import json
import logging
import threading

from ..metadata.base import KeyValueBackend, key_prefix

log = logging.getLogger("mooncake_te.kvcache")

_DELETE = object()
_DROP = object()


class OwnerIndex:
    """Publishes this cache's DRAM blocks and finds other caches' blocks.

    Parameters
    ----------
    store : KeyValueBackend
        An etcd, redis or HTTP metadata store (``get``/``put``/``delete`` of bytes).
    owner : str
        This engine's segment name.
    namespace : str
        What the keys mean (the model); caches only see blocks of their own namespace.
    """

    def __init__(self, store: KeyValueBackend, owner: str, namespace: str = "default"):
        self.store = store
        self.owner = owner
        self.prefix = f"{key_prefix(getattr(store, 'cluster_id', None))}kvcache/{namespace}/"
        self._pending: dict = {}
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="kvcache-index", daemon=True)
        self._thread.start()

    def _key(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def publish(self, key: bytes, addr: int, length: int) -> None:
        with self._cv:
            self._pending[key] = (addr, length)
            self._cv.notify()

    def withdraw(self, key: bytes) -> None:
        with self._cv:
            self._pending[key] = _DELETE
            self._cv.notify()

    def drop(self, key: bytes) -> None:
        """Delete ``key``'s record whoever owns it (the object was removed)."""
        with self._cv:
            self._pending[key] = _DROP
            self._cv.notify()

    def lookup(self, key: bytes):
        """``(owner, addr, length)`` of another engine holding ``key``, or None."""
        return self.lookup_many([key])[0]

    def lookup_many(self, keys) -> list:
        """:meth:`lookup` of every key in one query to the store (one round trip on
        redis, etcd and our HTTP server): a prompt's blocks cost one request, not one
        each."""
        if not keys:
            return []
        try:
            raws = self.store.get_many([self._key(k) for k in keys])
        except Exception as e:          # the index is a hint: an outage is a miss
            log.warning("kvcache: owner index lookup failed: %s", e)
            return [None] * len(keys)
        return [self._record(raw) for raw in raws]

    def lookup_prefix(self, keys) -> int:
        """How many of ``keys``, from the first, other engines hold (one query)."""
        n = 0
        for rec in self.lookup_many(keys):
            if rec is None:
                break
            n += 1
        return n

    def _record(self, raw):
        if not raw:
            return None
        try:
            d = json.loads(raw)
            rec = (str(d["owner"]), int(d["addr"]), int(d["length"]))
        except (ValueError, KeyError, TypeError):
            return None
        return None if rec[0] == self.owner else rec

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued record reached the store."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._closed)
                if not self._pending and self._closed:
                    return
                batch, self._pending = self._pending, {}
                self._busy = True
            try:
                self._send(batch)
            except Exception as e:          # a store outage must not end the thread
                self.errors += 1
                if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                    log.warning("kvcache: owner index update failed (%d so far): %s",
                                self.errors, e)
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _send(self, batch: dict) -> None:
        drops = [self._key(k) for k, op in batch.items() if op is _DROP]
        withdraws = [self._key(k) for k, op in batch.items() if op is _DELETE]
        puts = {self._key(k): json.dumps({"owner": self.owner, "addr": op[0],
                                          "length": op[1]}).encode()
                for k, op in batch.items() if op is not _DROP and op is not _DELETE}
        if withdraws:
            # Only our own records: another owner may have published since.
            raws = self.store.get_many(withdraws)
            drops += [k for k, raw in zip(withdraws, raws) if self._owned(raw)]
        if drops:
            self.store.delete_many(drops)
        if puts:
            self.store.put_many(puts)

    def _owned(self, raw) -> bool:
        try:
            return bool(raw) and json.loads(raw).get("owner") == self.owner
        except (ValueError, AttributeError):
            return False

    def close(self, withdraw_all=()) -> None:
        """Withdraw ``withdraw_all`` keys, send what is queued, stop the thread."""
        for key in withdraw_all:
            self.withdraw(key)
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

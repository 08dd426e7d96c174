# SPDX-License-Identifier: Apache-2.0
"""Key -> owner index: which engine holds a block in its DRAM pool, in the metadata store.

One record per block, ``mooncake/[<cluster>/]kvcache/<namespace>/<key hex>`` ->
``{"owner": segment name, "addr": address of the slot in the owner's pool,
"length": payload bytes, "crc": the block's CRC-32, "mac": ...}``, next to the segment
descriptors under Mooncake's key layout (``metadata/base.py``).

Tiers (issue 37). A block the owner demoted from its DRAM pool to its SSD tier keeps its
record, rewritten as ``{"owner", "tier": "ssd", "addr": 0, "length", "crc", "mac"}``
(:meth:`OwnerIndex.demote`), so a router (the conductor) sees that the owner can still
serve it from its SSD; a promotion back to DRAM publishes the DRAM record again, and the
record is withdrawn when the block leaves the SSD tier too. A record without ``tier`` is
a DRAM record (records of older engines). Readers over the network
(:meth:`OwnerIndex.lookup_many`, the ``remote`` tier) take only DRAM records: a peer's SSD
is private, a one-sided READ cannot reach it; :meth:`OwnerIndex.lookup_tiers` gives
``(owner, tier)`` of every record, ours included. A reader resolves the
owner's segment, reads header + data of the slot in one transfer and checks the header's
key, length and CRC against the record, so a stale record (the owner evicted or reused
the slot since) costs one wasted read and counts as a miss, never returns wrong bytes.
That is why records need no lease or lock.

Authentication (issue 35, item 1). A CRC is an integrity check, not an authentication:
anyone who can write the metadata store can write a record. With an ``auth_token`` on
the engine, each record carries ``mac``, HMAC-SHA256 over key, owner, address, length and
CRC with a key derived from the token and the namespace (:func:`mooncake_te.auth.derive_key`);
a record without a valid one is rejected (a miss, counted in :attr:`OwnerIndex.rejected`).
The block is then read from the owner over a connection on which the owner proved the
token *and* its segment name (the handshake's identity binding, docs/security.md), and
its header CRC must equal the record's: a forged record or block is never served. One
HMAC per record, computed on the index thread when publishing, so ``put`` does not pay it.

A record that is malformed (an address or length out of range, a missing field) is
rejected and counted in either mode, never a hit and never an exception for the whole
``get``.

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

from ..auth import mac, mac_ok
from ..metadata.base import KeyValueBackend, key_prefix
from .record import HEADER_SIZE

log = logging.getLogger("mooncake_te.kvcache")

_DELETE = object()
_DROP = object()
_U64 = 1 << 64
_MAX_OWNER = 256            # bytes of a segment name in a record


TIERS = ("dram", "ssd")     # where an owner holds a block (the record's "tier")


def _parts(key: bytes, owner: str, addr: int, length: int, crc: int,
           tier: str = "dram") -> tuple:
    p = (key, owner.encode(), addr.to_bytes(8, "little"), length.to_bytes(8, "little"),
         crc.to_bytes(4, "little"))
    # A DRAM record's MAC is what it always was; another tier is bound into its MAC.
    return p if tier == "dram" else p + (tier.encode(),)


class _Demote(tuple):
    """A queued :meth:`OwnerIndex.demote`: ``(length, crc)``."""


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
    mac_key : bytes, optional
        Key of the records' MACs (derived from the engine's auth token); None: records
        are not authenticated (sharing without a token, enabled explicitly).
    max_length : int, optional
        Largest payload a record may name (the cache's block size).
    """

    def __init__(self, store: KeyValueBackend, owner: str, namespace: str = "default",
                 mac_key: "bytes | None" = None, max_length: "int | None" = None):
        self.store = store
        self.owner = owner
        self.mac_key = mac_key
        self.max_length = max_length
        self.rejected = 0           # records refused: malformed, or a MAC that did not check
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

    def publish(self, key: bytes, addr: int, length: int, crc: int) -> None:
        with self._cv:
            self._pending[key] = (addr, length, crc)
            self._cv.notify()

    def demote(self, key: bytes, length: int, crc: int = 0) -> None:
        """``key`` moved from this engine's DRAM pool to its SSD tier: its record says
        so (``"tier": "ssd"``) instead of going away. Only our own record (or none) is
        rewritten: a peer that published the block since keeps its (readable) record."""
        with self._cv:
            self._pending[key] = _Demote((int(length), int(crc)))
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
        """``(owner, addr, length, crc)`` of another engine holding ``key``, or None."""
        return self.lookup_many([key])[0]

    def lookup_many(self, keys) -> list:
        """:meth:`lookup` of every key in one query to the store (one round trip on
        redis, etcd and our HTTP server): a prompt's blocks cost one request, not one
        each."""
        return [self._record(k, raw) for k, raw in zip(keys, self._raw_many(keys))]

    def _raw_many(self, keys) -> list:
        if not keys:
            return []
        try:
            return self.store.get_many([self._key(k) for k in keys])
        except Exception as e:          # the index is a hint: an outage is a miss
            log.warning("kvcache: owner index lookup failed: %s", e)
            return [None] * len(keys)

    def lookup_tiers(self, keys) -> list:
        """``(owner, tier)`` of each key's record (``tier``: ``"dram"`` or ``"ssd"``),
        ours included, None where there is none or it is malformed or not authenticated
        (one query). For routers; :meth:`lookup_many` gives what can be read."""
        out = []
        for k, raw in zip(keys, self._raw_many(keys)):
            d = self._checked(k, raw)
            out.append(None if d is None else (d["owner"], d.get("tier", "dram")))
        return out

    def lookup_prefix(self, keys) -> int:
        """How many of ``keys``, from the first, other engines hold (one query; records
        past the first miss are not checked)."""
        n = 0
        for k, raw in zip(keys, self._raw_many(keys)):
            if self._record(k, raw) is None:
                break
            n += 1
        return n

    def _record(self, key: bytes, raw):
        """The record of ``key`` checked: ``(owner, addr, length, crc)``, or None for no
        record, our own, one in a tier peers cannot read (SSD), or one that is malformed
        or not authenticated (counted)."""
        d = self._checked(key, raw, skip_own=True)
        if d is None or d.get("tier", "dram") != "dram":
            return None
        return d["owner"], d["addr"], d["length"], d.get("crc", 0)

    def _checked(self, key: bytes, raw, skip_own: bool = False) -> "dict | None":
        """The decoded record of ``key`` when it is well formed and (with a MAC key)
        authenticated; None otherwise (malformed and unauthenticated ones counted), and
        for our own with ``skip_own``."""
        if not raw:
            return None
        try:
            d = json.loads(raw)
            owner, addr, length, crc = d["owner"], d["addr"], d["length"], d.get("crc", 0)
            tier = d.get("tier", "dram")
            if not (isinstance(owner, str) and 0 < len(owner.encode()) <= _MAX_OWNER
                    and all(type(v) is int for v in (addr, length, crc))
                    and tier in TIERS and (0 < addr or (tier != "dram" and addr == 0))
                    and 0 <= length and addr + HEADER_SIZE + length <= _U64
                    and 0 <= crc < (1 << 32)
                    and (self.max_length is None or length <= self.max_length)):
                raise ValueError("out of range")
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeError):
            self.rejected += 1
            return None
        if skip_own and owner == self.owner:
            return None
        if self.mac_key is not None and not mac_ok(self.mac_key, d.get("mac"),
                                                   *_parts(key, owner, addr, length, crc,
                                                           tier)):
            self.rejected += 1
            if self.rejected in (1, 10, 100) or self.rejected % 1000 == 0:
                log.warning("kvcache: owner index record for %s (owner %r) has no valid MAC; "
                            "ignored (%d so far): written by a process without this "
                            "cluster's auth_token, or by an engine of an older version",
                            key.hex(), owner, self.rejected)
            return None
        return d

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
        demotes = [k for k, op in batch.items() if isinstance(op, _Demote)]
        puts = {self._key(k): self._encode(k, *op)
                for k, op in batch.items()
                if op is not _DROP and op is not _DELETE and not isinstance(op, _Demote)}
        if withdraws or demotes:
            # Only our own records (or none, for a demotion): another owner may have
            # published since.
            raws = self.store.get_many(withdraws + [self._key(k) for k in demotes])
            drops += [k for k, raw in zip(withdraws, raws) if self._owned(raw)]
            for k, raw in zip(demotes, raws[len(withdraws):]):
                if not raw or self._owned(raw):
                    length, crc = batch[k]
                    puts[self._key(k)] = self._encode(k, 0, length, crc, "ssd")
        if drops:
            self.store.delete_many(drops)
        if puts:
            self.store.put_many(puts)

    def _encode(self, key: bytes, addr: int, length: int, crc: int,
                tier: str = "dram") -> bytes:
        d = {"owner": self.owner, "addr": addr, "length": length, "crc": crc}
        if tier != "dram":
            d["tier"] = tier
        if self.mac_key is not None:
            d["mac"] = mac(self.mac_key, *_parts(key, self.owner, addr, length, crc, tier))
        return json.dumps(d).encode()

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

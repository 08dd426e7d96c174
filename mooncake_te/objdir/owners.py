# SPDX-License-Identifier: Apache-2.0
"""Owner records: which engine holds an object, where, and its checksum.

One record per object, ``<area>/<name>`` (:class:`~.directory.ObjectDirectory`) ->
``{"owner": segment name, "addr": address of the object in the owner's registered
memory, "length": payload bytes, "crc": the payload's CRC-32[, "tier": ...][, "mac": ...]}``.

Tiers. ``tier`` says where the owner holds it: ``"dram"`` (registered memory, readable
with a one-sided READ; a record without ``tier`` is one, as older engines wrote them) or
``"ssd"`` (private to the owner, ``addr`` 0: a router sees that the owner can still serve
it, a reader over the network cannot). :meth:`OwnerDirectory.lookup_many` answers only
what can be read (DRAM records of other owners); :meth:`OwnerDirectory.lookup_tiers`
every valid record's ``(owner, tier)``.

Authentication. A CRC is an integrity check, not an authentication: anyone who can write
the metadata store can write a record. With a ``mac_key`` (derived from the engines'
``auth_token``, :func:`mooncake_te.auth.derive_key`) each record carries ``mac``,
HMAC-SHA256 over name, owner, address, length and CRC (and the tier, for a tier other
than DRAM): the object directory's record MAC (:mod:`.record_mac`). A record without a
valid one is refused (a miss, counted in :attr:`OwnerDirectory.rejected`). A malformed
record (an address or length out of range, a missing field) is refused and counted in
either mode, never an exception for the whole lookup. Records need no lease or lock: the reader checks what it read
(:func:`~.read.read_verified`), so a stale record costs one wasted read, never wrong bytes.

Writes go through a background thread that coalesces (only the last operation on a name
is sent) and sends what is queued in one round trip each for puts and deletes, so a
publish does not wait for the network, and many objects do not cost one round trip each.
One HMAC per record, computed on that thread.
"""
from __future__ import annotations

import json
import logging
import threading

from ..metadata.base import KeyValueBackend
from .directory import ObjectDirectory
from .record_mac import record_mac, record_mac_ok

_DELETE = object()
_DROP = object()
_U64 = 1 << 64
MAX_OWNER = 256            # bytes of a segment name in a record
TIERS = ("dram", "ssd")     # where an owner holds an object (the record's "tier")


def _parts(name: bytes, owner: str, addr: int, length: int, crc: int,
           tier: str = "dram") -> tuple:
    p = (name, owner.encode(), addr.to_bytes(8, "little"), length.to_bytes(8, "little"),
         crc.to_bytes(4, "little"))
    # A DRAM record's MAC is what it always was; another tier is bound into its MAC.
    return p if tier == "dram" else p + (tier.encode(),)


def parse_tier(raw) -> "tuple[str, str] | None":
    """``(owner, tier)`` of a raw record, unauthenticated (for routers that only rank:
    the reader checks the MAC); None where there is none or it is malformed."""
    try:
        d = json.loads(raw) if raw else None
        tier = "dram" if d is None else d.get("tier", "dram")
        return None if d is None or tier not in TIERS else (str(d["owner"]), tier)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class _Demote(tuple):
    """A queued :meth:`OwnerDirectory.demote`: ``(length, crc)``."""


class OwnerDirectory:
    """Publishes this engine's objects and finds other engines' in one area.

    Parameters
    ----------
    store : KeyValueBackend
        An etcd, redis or HTTP metadata store.
    area : str
        The records' area (:class:`~.directory.ObjectDirectory`).
    owner : str
        This engine's segment name.
    mac_key : bytes, optional
        Key of the records' MACs; None: records are not authenticated.
    max_length : int, optional
        Largest payload a record may name.
    overhead : int
        Bytes a reader reads at ``addr`` besides the payload (a header): a record whose
        ``addr + overhead + length`` passes 2^64 is malformed.
    name : str
        What the log lines and the writer thread are called.
    """

    def __init__(self, store: KeyValueBackend, area: str, owner: str,
                 mac_key: "bytes | None" = None, max_length: "int | None" = None,
                 overhead: int = 0, name: str = "objdir"):
        self.dir = ObjectDirectory(store, area)
        self.store = store
        self.owner = owner
        self.mac_key = mac_key
        self.max_length = max_length
        self.overhead = overhead
        self.name = name
        self._log = logging.getLogger(f"mooncake_te.{name}")
        self.rejected = 0           # records refused: malformed, or a MAC that did not check
        self.prefix = self.dir.prefix
        self.errors = 0             # failed writes
        self._pending: dict = {}
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-index", daemon=True)
        self._thread.start()

    def _key(self, key: bytes) -> str:
        return self.prefix + key.hex()

    # -- writes (queued) -------------------------------------------------------------------
    def _queue(self, key: bytes, op) -> None:
        with self._cv:
            self._pending[key] = op
            self._cv.notify()

    def publish(self, key: bytes, addr: int, length: int, crc: int) -> None:
        """We hold ``key``'s ``length`` bytes at ``addr`` (registered memory)."""
        self._queue(key, (addr, length, crc))

    def demote(self, key: bytes, length: int, crc: int = 0) -> None:
        """``key`` moved to our SSD tier: its record says so (``"tier": "ssd"``) instead
        of going away. Only our own record (or none) is rewritten: a peer that published
        the object since keeps its (readable) record."""
        self._queue(key, _Demote((int(length), int(crc))))

    def withdraw(self, key: bytes) -> None:
        """Delete ``key``'s record if it is still ours."""
        self._queue(key, _DELETE)

    def drop(self, key: bytes) -> None:
        """Delete ``key``'s record whoever owns it (the object was removed)."""
        self._queue(key, _DROP)

    # -- lookups (one round trip each) ------------------------------------------------------
    def lookup(self, key: bytes) -> "tuple | None":
        """``(owner, addr, length, crc)`` of another engine holding ``key`` in DRAM (a
        record it can be read with), or None."""
        return self.lookup_many([key])[0]

    def lookup_many(self, keys) -> list:
        """:meth:`lookup` of every key in one query to the store."""
        return [self._record(k, raw) for k, raw in zip(keys, self._raw_many(keys))]

    def _raw_many(self, keys) -> list:
        prefix = self.prefix
        return self.dir.get_keys([prefix + k.hex() for k in keys])

    def lookup_tiers(self, keys) -> list:
        """``(owner, tier)`` of each key's valid record, ours included, None where there
        is none or it is malformed or not authenticated (one query). For routers;
        :meth:`lookup_many` gives what can be read."""
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

    def _record(self, key: bytes, raw) -> "tuple | None":
        d = self._checked(key, raw, skip_own=True)
        if d is None or d.get("tier", "dram") != "dram":
            return None
        # A plain tuple: built per key on vLLM's hot path (a NamedTuple costs more).
        return d["owner"], d["addr"], d["length"], d.get("crc", 0)

    def _checked(self, key: bytes, raw, skip_own: bool = False) -> "dict | None":
        """The decoded record when it is well formed and (with a MAC key) authenticated;
        None otherwise (malformed and unauthenticated ones counted), and for our own
        with ``skip_own``."""
        if not raw:
            return None
        try:
            d = json.loads(raw)
            owner, addr, length, crc = d["owner"], d["addr"], d["length"], d.get("crc", 0)
            tier = d.get("tier", "dram")
            if not (isinstance(owner, str) and 0 < len(owner.encode()) <= MAX_OWNER
                    and all(type(v) is int for v in (addr, length, crc))
                    and tier in TIERS and (0 < addr or (tier != "dram" and addr == 0))
                    and 0 <= length and addr + self.overhead + length <= _U64
                    and 0 <= crc < (1 << 32)
                    and (self.max_length is None or length <= self.max_length)):
                raise ValueError("out of range")
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeError):
            self.rejected += 1
            return None
        if skip_own and owner == self.owner:
            return None
        if self.mac_key is not None and not record_mac_ok(
                self.mac_key, d.get("mac"), *_parts(key, owner, addr, length, crc, tier)):
            self.rejected += 1
            if self.rejected in (1, 10, 100) or self.rejected % 1000 == 0:
                self._log.warning("%s: owner record for %s (owner %r) has no valid MAC; ignored "
                            "(%d so far): written by a process without this cluster's "
                            "auth_token, or by an engine of an older version",
                            self.name, key.hex(), owner, self.rejected)
            return None
        return d

    # -- the writer thread ------------------------------------------------------------------
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
                    self._log.warning("%s: owner record update failed (%d so far): %s",
                                self.name, self.errors, e)
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _send(self, batch: dict) -> None:
        drops = [k.hex() for k, op in batch.items() if op is _DROP]
        withdraws = [k for k, op in batch.items() if op is _DELETE]
        demotes = [k for k, op in batch.items() if isinstance(op, _Demote)]
        puts = {k.hex(): self.encode(k, *op) for k, op in batch.items()
                if op is not _DROP and op is not _DELETE and not isinstance(op, _Demote)}
        if withdraws or demotes:
            # Only our own records (or none, for a demotion): another owner may have
            # published since.
            raws = self.store.get_many([self._key(k) for k in withdraws + demotes])
            drops += [k.hex() for k, raw in zip(withdraws, raws) if self._owned(raw)]
            for k, raw in zip(demotes, raws[len(withdraws):]):
                if not raw or self._owned(raw):
                    length, crc = batch[k]
                    puts[k.hex()] = self.encode(k, 0, length, crc, "ssd")
        self.dir.delete_many(drops)
        self.dir.put_many(puts)

    def encode(self, key: bytes, addr: int, length: int, crc: int,
               tier: str = "dram") -> bytes:
        """Our record of ``key`` (MAC'd with a key)."""
        d: dict = {"owner": self.owner, "addr": addr, "length": length, "crc": crc}
        if tier != "dram":
            d["tier"] = tier
        if self.mac_key is not None:
            d["mac"] = record_mac(self.mac_key,
                                  *_parts(key, self.owner, addr, length, crc, tier))
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

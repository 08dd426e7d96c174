# SPDX-License-Identifier: Apache-2.0
"""The object directory's record MAC: one scheme for every kind of record it keeps.

Anyone who can write the metadata store can write a record, so with the engines'
``auth_token`` each record carries a MAC that its reader checks before trusting it:
HMAC-SHA256 over the record's fields, each length-prefixed
(:func:`mooncake_te.auth.mac`: no two field lists give the same input), as 64 hex
digits, under a key derived from the token for that kind of record
(:func:`record_key`, :func:`mooncake_te.auth.derive_key`; the engine's
``derive_key(label)`` gives the same key): a MAC made for one kind of record never
passes for another, and the token itself keys no record.

Its users, each with its own label and fields:

* owner records (:mod:`.owners`): the KV cache's label is ``kvcache-index/<namespace>``,
  the fields name, owner, address, length, CRC[, tier];
* the P2P store's holder-list entries (:mod:`mooncake_te.p2p_store.directory`): label
  ``p2p_store/holders``, the fields the object's name and id and the holder's name,
  address, segment and instance.
"""
from __future__ import annotations

from ..auth import derive_key, mac, mac_ok


def record_key(token: "bytes | None", label: str) -> "bytes | None":
    """The MAC key of the records labelled ``label``; None without a token (records are
    then not authenticated)."""
    return derive_key(token, label)


def _as_bytes(fields) -> tuple:
    return tuple(f.encode() if isinstance(f, str) else f for f in fields)


def record_mac(key: bytes, *fields: "bytes | str") -> str:
    """The MAC of a record's ``fields`` (a str counts as its UTF-8 bytes)."""
    return mac(key, *_as_bytes(fields))


def record_mac_ok(key: bytes, tag, *fields: "bytes | str") -> bool:
    """Whether ``tag`` (as read from the store: of any type) is :func:`record_mac` of
    ``fields``; compared in constant time."""
    return mac_ok(key, tag, *_as_bytes(fields))

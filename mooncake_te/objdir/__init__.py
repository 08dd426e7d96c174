# SPDX-License-Identifier: Apache-2.0
"""The object directory: which engine holds an object, where, with which checksum, and
the verified READ that fetches it (docs/architecture.md, "The object directory").

One home for what the KV cache's shared pool (:mod:`mooncake_te.kvcache`) and the P2P
store (:mod:`mooncake_te.p2p_store`) both need, so neither imports the other:

* :class:`ObjectDirectory` (:mod:`.directory`): an area of keys in a metadata store
  (etcd, redis, our HTTP server) beside the engines' descriptors, batch reads and writes
  in one round trip, read-modify-write with read-back;
* :class:`OwnerDirectory` (:mod:`.owners`): owner records (owner engine, address,
  length, CRC-32, tier, MAC with the cluster token), published through a coalescing
  writer thread, looked up one or many at a time;
* :func:`record_mac` (:mod:`.record_mac`): the one MAC scheme of the records kept here
  (owner records, the P2P store's holder entries), each kind under its own key;
* :func:`read_verified` (:mod:`.read`): READs from the owners into registered memory,
  each checked; a failure is a miss;
* :mod:`.checksum`: CRC-32 with the GIL held or released.
"""
from __future__ import annotations

from .checksum import CRC32_IMPL, crc32_held, crc32_many, crc32_released
from .directory import ObjectDirectory, area_prefix
from .owners import TIERS, OwnerDirectory, parse_tier
from .read import read_verified
from .record_mac import record_key, record_mac, record_mac_ok

__all__ = ["ObjectDirectory", "area_prefix", "OwnerDirectory", "TIERS", "parse_tier",
           "read_verified", "record_key", "record_mac", "record_mac_ok", "crc32_held",
           "crc32_released", "crc32_many", "CRC32_IMPL"]

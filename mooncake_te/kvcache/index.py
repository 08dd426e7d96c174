# SPDX-License-Identifier: Apache-2.0
"""Key -> owner index: which engine holds a block in its DRAM pool, in the metadata store.

The records are the object directory's owner records (:mod:`mooncake_te.objdir.owners`,
which documents the format, tiers, MACs and the batched writer), in the area
``kvcache/<namespace>``: one per block, ``mooncake/[<cluster>/]kvcache/<namespace>/<key
hex>`` -> ``{"owner", "addr" (of the slot in the owner's pool), "length", "crc"[, "tier":
"ssd"][, "mac"]}``, the same bytes as before the object directory existed.

What is the KV cache's own: a reader reads header + data of the slot in one transfer
(``overhead`` = the 64-byte header, :mod:`.record`) and checks the header's key, length
and CRC against the record (:mod:`.remote`); a block the owner demoted to its SSD keeps
its record as ``"tier": "ssd"`` (:meth:`OwnerIndex.demote`) so a router (the conductor)
sees the owner can still serve it. The MAC key is derived from the engine's
``auth_token`` and the namespace (``kvcache-index/<namespace>``).
"""
from __future__ import annotations

from ..metadata.base import KeyValueBackend
from ..objdir.owners import TIERS, OwnerDirectory
from .record import HEADER_SIZE

__all__ = ["OwnerIndex", "TIERS"]


class OwnerIndex(OwnerDirectory):
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
        super().__init__(store, f"kvcache/{namespace}", owner, mac_key=mac_key,
                         max_length=max_length, overhead=HEADER_SIZE, name="kvcache")

# SPDX-License-Identifier: Apache-2.0
"""P2P store: decentralized distribution of large named objects over the engine.

>>> from mooncake_te.p2p_store import P2PStore
>>> store = P2PStore(eng, metadata="etcd://127.0.0.1:2379")     # doctest: +SKIP

See ``docs/p2p_store.md``.
"""
from __future__ import annotations

from .errors import NoHolderError, ObjectExistsError, ObjectNotFoundError, ObjectUnregisteredError
from .manifest import DEFAULT_CHUNK_SIZE, HolderRef, Manifest
from .store import ObjectInfo, P2PStore

__all__ = ["P2PStore", "ObjectInfo", "Manifest", "HolderRef", "DEFAULT_CHUNK_SIZE",
           "ObjectNotFoundError", "ObjectUnregisteredError", "ObjectExistsError",
           "NoHolderError"]

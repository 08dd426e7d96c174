# SPDX-License-Identifier: Apache-2.0
"""A cache of peers' segment descriptors.

Mooncake caches descriptors forever, so a restarted peer (new addresses) keeps being
addressed with stale ones until someone calls ``syncSegmentCache`` (reference §9). We
cache too (a fetch is a round trip), but every entry carries the peer's instance id;
when a data connection reports a different id, :meth:`invalidate` drops the entry and
the next lookup fetches afresh.
"""
from __future__ import annotations

import threading

from .base import MetadataBackend
from .descriptor import SegmentDescriptor


class SegmentCache:
    def __init__(self, backend: MetadataBackend, enabled: bool = True):
        self._backend = backend
        self._enabled = enabled
        self._entries: dict[str, SegmentDescriptor] = {}
        #: The live cache, for lock-free reads on hot paths (``entries.get(name)``: one
        #: dict lookup under the GIL); never written outside this class. An entry that is
        #: dropped or replaced is a new object, so a caller holding the old one can tell.
        self.entries = self._entries
        self._lock = threading.Lock()

    def get(self, name: str, timeout: float, refresh: bool = False) -> SegmentDescriptor:
        if self._enabled and not refresh:
            with self._lock:
                desc = self._entries.get(name)
            if desc is not None:
                return desc
        desc = self._backend.fetch(name, timeout)
        with self._lock:
            self._entries[name] = desc
        return desc

    def invalidate(self, name: str, instance_id: str | None = None) -> bool:
        """Drop ``name`` (only if its cached instance differs from ``instance_id``, when given)."""
        with self._lock:
            desc = self._entries.get(name)
            if desc is None or (instance_id is not None and desc.instance_id == instance_id):
                return False
            del self._entries[name]
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

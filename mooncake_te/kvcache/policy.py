# SPDX-License-Identifier: Apache-2.0
"""Eviction policies: LRU and LFU (ties broken by recency), each O(1) per operation.

Both keep only keys; the tiers and the trace simulator keep the data. The same classes
serve the simulator (``mooncake-te trace replay``) and the real tiers, so what the
simulator predicts is what the cache does.

LFU follows the constant-time scheme of Shah, Mitra and Matani, "An O(1) algorithm for
implementing the LFU cache eviction scheme" (2010): one insertion-ordered bucket per
frequency. A key enters bucket ``f + 1`` at the moment it is accessed, so inside a bucket
keys are ordered by last access, and the head of the lowest bucket is the least
frequently used key with ties broken by least recent use, as the issue asks.
"""
from __future__ import annotations

from collections import OrderedDict

__all__ = ["Policy", "LRU", "LFU", "make_policy", "POLICIES"]


class Policy:
    """Which key to evict next. Subclasses keep the set of keys they were told about.

    Methods
    -------
    insert(key, freq=1)
        A new key (``freq`` lets a tier carry an LFU count from another tier).
    touch(key)
        An access to a key already present.
    remove(key)
        Forget a key (it left the tier for another reason).
    victim(skip=())
        The key to evict next, not removing it; keys in ``skip`` are passed over.
    pop()
        Remove and return the key to evict next.
    """

    name = "?"

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key) -> bool:
        raise NotImplementedError

    def frequency(self, key) -> int:
        return 1


class LRU(Policy):
    """Least recently used first."""

    name = "lru"
    __slots__ = ("_od",)

    def __init__(self):
        self._od: OrderedDict = OrderedDict()

    def __len__(self):
        return len(self._od)

    def __contains__(self, key):
        return key in self._od

    def __iter__(self):
        """Keys from the next victim to the most recently used."""
        return iter(self._od)

    def insert(self, key, freq: int = 1) -> None:
        self._od[key] = None
        self._od.move_to_end(key)

    def touch(self, key) -> None:
        self._od.move_to_end(key)

    def remove(self, key) -> None:
        self._od.pop(key, None)

    def victim(self, skip=()):
        for key in self._od:
            if key not in skip:
                return key
        return None

    def pop(self):
        return self._od.popitem(last=False)[0]


class LFU(Policy):
    """Least frequently used first; among equals, least recently used first.

    A key's count starts at 1 when it is inserted (or at the count a promotion carries)
    and grows by one per access; it is forgotten when the key is evicted.
    """

    name = "lfu"
    __slots__ = ("_freq", "_buckets", "_min")

    def __init__(self):
        self._freq: dict = {}
        self._buckets: dict[int, OrderedDict] = {}
        self._min = 0

    def __len__(self):
        return len(self._freq)

    def __contains__(self, key):
        return key in self._freq

    def __iter__(self):
        """Keys from the next victim on (lowest count, then least recent)."""
        for f in sorted(self._buckets):
            yield from self._buckets[f]

    def frequency(self, key) -> int:
        return self._freq.get(key, 0)

    def insert(self, key, freq: int = 1) -> None:
        if key in self._freq:
            self.remove(key)
        freq = max(1, int(freq))
        self._freq[key] = freq
        b = self._buckets.get(freq)
        if b is None:
            b = self._buckets[freq] = OrderedDict()
        b[key] = None
        if freq < self._min or len(self._freq) == 1:
            self._min = freq

    def touch(self, key) -> None:
        f = self._freq[key]
        b = self._buckets[f]
        del b[key]
        if not b:
            del self._buckets[f]
            if self._min == f:
                self._min = f + 1
        self._freq[key] = f + 1
        nb = self._buckets.get(f + 1)
        if nb is None:
            nb = self._buckets[f + 1] = OrderedDict()
        nb[key] = None

    def remove(self, key) -> None:
        f = self._freq.pop(key, None)
        if f is None:
            return
        b = self._buckets[f]
        del b[key]
        if not b:
            del self._buckets[f]
            if self._min == f:
                self._fix_min()

    def _fix_min(self) -> None:
        # Rare (only when the lowest bucket empties without an insertion following), so a
        # scan over the distinct counts is fine.
        self._min = min(self._buckets) if self._buckets else 0

    def victim(self, skip=()):
        if not skip:
            b = self._buckets.get(self._min)
            return next(iter(b)) if b else None
        for key in self:
            if key not in skip:
                return key
        return None

    def pop(self):
        b = self._buckets[self._min]
        key, _ = b.popitem(last=False)
        del self._freq[key]
        if not b:
            del self._buckets[self._min]
            self._fix_min()
        return key


POLICIES = {"lru": LRU, "lfu": LFU}


def make_policy(name: str) -> Policy:
    """A new empty policy by name (``"lru"`` or ``"lfu"``)."""
    try:
        return POLICIES[str(name).lower()]()
    except KeyError:
        from ..errors import InvalidArgumentError
        raise InvalidArgumentError(f"unknown eviction policy {name!r}; use 'lru' or 'lfu'") \
            from None

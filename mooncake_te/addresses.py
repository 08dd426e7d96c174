# SPDX-License-Identifier: Apache-2.0
"""Which buffer holds an address: the one lookup every layer uses (issue 40).

An :class:`AddressTable` is built from non-overlapping spans (a peer's published buffers,
this engine's regions, a transport's view of either) and answers, for one address or a
whole group of requests at once (numpy), the index of the span that holds each
``[address, address + length)`` whole, or -1. The native region table
(``src/core/regions.c``) is the C side's counterpart for our own registered memory.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

__all__ = ["AddressTable"]


class AddressTable:
    """Sorted, non-overlapping spans and the items they stand for.

    Parameters
    ----------
    items : iterable
        Objects with ``address`` and ``length`` (BufferInfo, MemoryRegion), or, with
        ``spans``, anything.
    spans : sequence of (start, end), optional
        The span of each item, when the items do not carry ``address``/``length``.
    """

    __slots__ = ("items", "starts", "ends")

    def __init__(self, items: Iterable, spans: "Sequence[tuple] | None" = None):
        items = list(items)
        if spans is None:
            spans = [(int(i.address), int(i.address) + int(i.length)) for i in items]
        order = sorted(range(len(items)), key=lambda j: spans[j][0])
        self.items = [items[j] for j in order]
        self.starts = np.array([spans[j][0] for j in order], np.uint64)
        self.ends = np.array([spans[j][1] for j in order], np.uint64)

    def __len__(self) -> int:
        return len(self.items)

    def index(self, addresses, lengths=1) -> np.ndarray:
        """Per address, the index (into :attr:`items`) of the span holding
        ``[address, address + length)`` whole, or -1 (int64 array). ``lengths``: one per
        address, or one for all."""
        a = np.atleast_1d(np.asarray(addresses, dtype=np.uint64))
        n = np.asarray(lengths, dtype=np.uint64)
        if n.ndim and len(n) != len(a):
            n = n[0] if len(n) else np.uint64(1)
        k = np.searchsorted(self.starts, a, side="right").astype(np.int64) - 1
        if not len(self.starts):
            return np.full(len(a), -1, np.int64)
        ok = (k >= 0) & (a + n <= self.ends[np.maximum(k, 0)])
        return np.where(ok, k, -1)

    def covers(self, addresses, lengths=1) -> bool:
        """Whether every ``[address, address + length)`` lies inside one span."""
        return bool((self.index(addresses, lengths) >= 0).all())

    def first_outside(self, addresses, lengths=1) -> int:
        """Index of the first address whose span is not inside the table, or -1."""
        bad = np.flatnonzero(self.index(addresses, lengths) < 0)
        return int(bad[0]) if len(bad) else -1

    def find(self, address: int, length: int = 1):
        """The item holding ``[address, address + length)`` whole, or None."""
        k = int(self.index(address, length)[0])
        return self.items[k] if k >= 0 else None

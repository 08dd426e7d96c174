# SPDX-License-Identifier: Apache-2.0
"""Leases on a producer's blocks: held from the end of prefill until the consumer says it
has read them, or until the lease runs out (a consumer that died, was never started, or
gave up), so a producer never keeps blocks forever."""
from __future__ import annotations

import time


class LeaseTable:
    """Request id -> expiry. A read-done message may arrive before the lease itself is
    known to the worker (the scheduler's metadata comes with the next step); it is kept
    for ``lease_s`` and applied when the lease arrives."""

    def __init__(self, lease_s: float, clock=time.monotonic):
        self.lease_s = float(lease_s)
        self._clock = clock
        self._leases: dict = {}
        self._early: dict = {}          # request id -> time the read-done arrived
        self.released_by_reader = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, req_id: str) -> None:
        now = self._clock()
        # -1: read already, release on the next collect()
        self._leases[req_id] = -1.0 if self._early.pop(req_id, None) is not None \
            else now + self.lease_s

    def read_done(self, req_id: str) -> None:
        if req_id in self._leases:
            self._leases[req_id] = -1.0
        else:
            self._early[req_id] = self._clock()

    def collect(self) -> set:
        """Request ids whose blocks may be freed now (read, or lease expired)."""
        now = self._clock()
        out = set()
        for req_id, until in list(self._leases.items()):
            if until < 0:
                out.add(req_id)
                self.released_by_reader += 1
            elif until <= now:
                out.add(req_id)
                self.expired += 1
            else:
                continue
            del self._leases[req_id]
        for req_id, t in list(self._early.items()):
            if t + self.lease_s <= now:        # never matched a lease: forget it
                del self._early[req_id]
        return out

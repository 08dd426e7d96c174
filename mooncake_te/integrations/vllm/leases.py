# SPDX-License-Identifier: Apache-2.0
"""Leases on a producer's blocks: held from the end of prefill until the consumer says it
has read them, or until the lease runs out (a consumer that died, was never started, or
gave up), so a producer never keeps blocks forever.

A lease is bound to whoever was given the request's ``kv_transfer_params``: the producer
draws a random lease key per request and sends it in them, and a read-done message
releases the lease only if it carries that key (issue 35, item 3: any sender could
release another request's lease early, and the blocks be reused under a reader)."""
from __future__ import annotations

import hmac
import time

#: Read-done messages for requests not (yet) known that are kept, at most; the oldest is
#: dropped past it. A read-done arrives at most a step before its lease, so a handful is
#: the honest need; the bound is what a flood of unknown ids can make us hold.
MAX_EARLY = 1024
#: Longest request id (characters) a read-done may name; longer ones are ignored.
MAX_ID = 256


class LeaseTable:
    """Request id -> expiry. A read-done message may arrive before the lease itself is
    known to the worker (the scheduler's metadata comes with the next step); it is kept
    (at most :data:`MAX_EARLY` of them, each at most ``lease_s``) and applied when the
    lease arrives, if its key matches."""

    def __init__(self, lease_s: float, clock=time.monotonic, max_early: int = MAX_EARLY):
        self.lease_s = float(lease_s)
        self._clock = clock
        self.max_early = int(max_early)
        self._leases: dict = {}          # request id -> expiry (-1: read), lease key
        self._early: dict = {}          # request id -> (time the read-done arrived, key)
        self.released_by_reader = 0
        self.expired = 0
        self.refused = 0                # read-dones with a wrong key, or ids too long
        self.early_dropped = 0          # early read-dones dropped for the bound

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, req_id: str, key: "str | None" = None) -> None:
        now = self._clock()
        early = self._early.pop(req_id, None)
        read = early is not None and _same(key, early[1])
        # -1: read already, release on the next collect()
        self._leases[req_id] = [-1.0 if read else now + self.lease_s, key]

    def read_done(self, req_id: str, key: "str | None" = None) -> None:
        if len(req_id) > MAX_ID:
            self.refused += 1
            return
        lease = self._leases.get(req_id)
        if lease is not None:
            if _same(lease[1], key):
                lease[0] = -1.0
            else:
                self.refused += 1
            return
        self._early.pop(req_id, None)
        while len(self._early) >= self.max_early:
            del self._early[next(iter(self._early))]      # the oldest
            self.early_dropped += 1
        self._early[req_id] = (self._clock(), key)

    def collect(self) -> set:
        """Request ids whose blocks may be freed now (read, or lease expired)."""
        now = self._clock()
        out = set()
        for req_id, (until, _) in list(self._leases.items()):
            if until < 0:
                out.add(req_id)
                self.released_by_reader += 1
            elif until <= now:
                out.add(req_id)
                self.expired += 1
            else:
                continue
            del self._leases[req_id]
        for req_id, (t, _) in list(self._early.items()):
            if t + self.lease_s <= now:        # never matched a lease: forget it
                del self._early[req_id]
        return out


def _same(want: "str | None", got: "str | None") -> bool:
    """A lease without a key (older scheduler) is released by any read-done."""
    if want is None:
        return True
    return got is not None and hmac.compare_digest(want.encode(), got.encode())

# SPDX-License-Identifier: Apache-2.0
"""Liveness and pins of exported GPU regions, shared between processes of one host.

A CUDA IPC mapping cannot be revoked: once a peer opened our handle, it can write into
the allocation whatever we do. So that unregistering still means "peers can no longer
touch it" (docs/architecture.md), every exported region has a slot in a small file in
/dev/shm: 8 bytes, the region's epoch (0 once unregistered). An importer takes a *shared*
open-file-description lock on the slot's bytes (fcntl(2) F_OFD_SETLK, so the lock belongs
to its open file, not its process, and dies with it), reads the epoch, and keeps the lock
until its copies finished. The owner's unregister writes 0, then takes an *exclusive*
lock on the slot, which it gets only once every importer's copies are done; later
importers read 0 and refuse. A crashed importer's locks vanish with it; a stopped one
holds up unregister for at most ``timeout`` seconds (then it goes on, with a warning).
"""
from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time

log = logging.getLogger("mooncake_te")

SLOT = 8
_F_RDLCK, _F_WRLCK, _F_UNLCK = fcntl.F_RDLCK, fcntl.F_WRLCK, fcntl.F_UNLCK
# linux/fcntl.h: open file description locks (Linux 3.15); Python names them on 3.9+.
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


def _lock(fd: int, kind: int, slot: int, count: int = 1) -> bool:
    """Lock (or unlock) ``count`` slots from ``slot`` on; False when another open file
    holds a conflicting lock on any of them."""
    # struct flock (x86-64 and aarch64 layout): short type, short whence, off_t start,
    # off_t len, pid_t pid (0 for OFD locks), padding.
    arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, slot * SLOT, SLOT * count, 0)
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, arg)
        return True
    except OSError:
        return False


def _runs(slots) -> "list[tuple[int, int]]":
    """(first, count) of each run of consecutive numbers in ``slots``, in order."""
    out: list = []
    for x in sorted(set(slots)):
        if out and out[-1][0] + out[-1][1] == x:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((x, 1))
    return out


class SlotTable:
    """The owner's side: one slot per exported region."""

    def __init__(self, tag: str):
        base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        self.path = f"{base}/mooncake_te.cuda_ipc.{os.getpid()}.{tag}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._free: list = []
        self._next = 0
        self._epoch = int(time.time_ns()) | 1
        self._mu = threading.Lock()

    def add(self) -> "tuple[int, int]":
        """(slot, epoch) of a newly live region."""
        with self._mu:
            slot = self._free.pop() if self._free else self._next
            self._next = max(self._next, slot + 1)
            self._epoch += 2
            epoch = self._epoch
        os.pwrite(self._fd, struct.pack("<Q", epoch), slot * SLOT)
        return slot, epoch

    def retire(self, slot: int, timeout: float) -> bool:
        """Mark the slot dead, then wait (up to ``timeout`` s) until no importer holds it.
        True when it is quiet."""
        os.pwrite(self._fd, struct.pack("<Q", 0), slot * SLOT)
        until = time.monotonic() + timeout
        while not _lock(self._fd, _F_WRLCK, slot):
            if time.monotonic() > until:
                log.warning("a same-host peer still holds GPU region slot %d after %.0f s "
                            "(stopped?); unregistering anyway", slot, timeout)
                return False
            time.sleep(0.0005)
        _lock(self._fd, _F_UNLCK, slot)
        with self._mu:
            self._free.append(slot)
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            try:
                os.unlink(self.path)
            except OSError:
                pass


class SlotView:
    """An importer's side of a peer's table: shared locks, counted per slot in this
    process (OFD locks of one open file do not stack)."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self._held: dict = {}
        self._mu = threading.Lock()

    def acquire(self, slot: int, epoch: int) -> bool:
        """Hold the slot if its region is still the live one of ``epoch``."""
        with self._mu:
            n, held = self._held.get(slot, (0, 0))
            if n and held != epoch:
                return False              # a newer region took the slot: ours is gone
            if n == 0:
                if not _lock(self._fd, _F_RDLCK, slot):
                    return False          # the owner is retiring it right now
                got = os.pread(self._fd, SLOT, slot * SLOT)
                if len(got) != SLOT or struct.unpack("<Q", got)[0] != epoch:
                    _lock(self._fd, _F_UNLCK, slot)
                    return False
            self._held[slot] = (n + 1, epoch)
            return True

    def acquire_many(self, slots: "list[int]", epochs: "list[int]") -> "list[bool]":
        """:meth:`acquire` for many slots at once (a group's remote buffers): the slots
        not yet held here are locked one contiguous run at a time, and their epochs read
        with one ``pread`` of the run, rather than a lock and a read each. Whether each
        slot is now held; a slot named twice is held twice."""
        got = [False] * len(slots)
        with self._mu:
            fresh: dict = {}                      # slot -> epoch wanted, not held yet
            for i, (slot, epoch) in enumerate(zip(slots, epochs)):
                n, held = self._held.get(slot, (0, 0))
                if n:
                    got[i] = held == epoch
                elif fresh.setdefault(slot, epoch) != epoch:
                    fresh[slot] = -1              # two epochs for one slot: one is stale
            live: set = set()
            for first, count in _runs(fresh):
                if _lock(self._fd, _F_RDLCK, first, count):
                    took = list(range(first, first + count))
                else:                             # the owner retires one of them: one by one
                    took = [x for x in range(first, first + count)
                            if _lock(self._fd, _F_RDLCK, x)]
                raw = os.pread(self._fd, SLOT * count, first * SLOT)
                for x in took:
                    o = (x - first) * SLOT
                    ep = struct.unpack_from("<Q", raw, o)[0] if o + SLOT <= len(raw) else 0
                    if ep == fresh[x]:
                        live.add(x)
                    else:
                        _lock(self._fd, _F_UNLCK, x)
            for i, (slot, epoch) in enumerate(zip(slots, epochs)):
                if slot in fresh:
                    got[i] = slot in live and fresh[slot] == epoch
            for i, slot in enumerate(slots):
                if got[i]:
                    n, _ = self._held.get(slot, (0, 0))
                    self._held[slot] = (n + 1, epochs[i])
        return got

    def release_many(self, slots: "list[int]") -> None:
        """:meth:`release` for each of ``slots``; the slots no longer held are unlocked
        one contiguous run at a time."""
        with self._mu:
            free = []
            for slot in slots:
                held = self._held.get(slot)
                if held is None:
                    continue
                n, epoch = held
                if n <= 1:
                    del self._held[slot]
                    free.append(slot)
                else:
                    self._held[slot] = (n - 1, epoch)
            for first, count in _runs(free):
                _lock(self._fd, _F_UNLCK, first, count)

    def release(self, slot: int) -> None:
        with self._mu:
            n, epoch = self._held.get(slot, (1, 0))
            if n <= 1:
                self._held.pop(slot, None)
                _lock(self._fd, _F_UNLCK, slot)
            else:
                self._held[slot] = (n - 1, epoch)

    def close(self) -> None:
        with self._mu:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

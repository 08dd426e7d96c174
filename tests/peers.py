# SPDX-License-Identifier: Apache-2.0
"""Engines in separate processes, driven over a pipe, for integration tests.

Each PeerProcess is a real OS process (tests/child.py, the suite's one child-process
harness) running its own TransferEngine on 127.0.0.1 with one registered numpy buffer;
the test asks it to fill, hash, read back, register, transfer or exit. Every call has a
timeout so a wedged peer fails the test instead of hanging it.
"""
from __future__ import annotations

import hashlib
import os

from child import Child

CALL_TIMEOUT = 60.0


class _Peer:
    """The child's side: an engine with one registered buffer (and any it allocates)."""

    def __init__(self, size, kwargs):
        import numpy as np
        import mooncake_te as mte
        self.np, self.mte = np, mte
        self.eng = mte.TransferEngine(host="127.0.0.1", **kwargs)
        self.buf = np.zeros(size, dtype=np.uint8)
        self.region = self.eng.register(self.buf)
        self.extra = {}
        self.retired = []     # unregistered arrays kept alive (a stale peer may aim at them)

    def hello(self):
        return self.eng.name, self.region.address, os.getpid()

    def close(self):
        self.eng.close()

    def _view(self, addr, n):
        for arr in [self.buf, *self.extra.values(), *self.retired]:
            base = arr.ctypes.data
            if base <= addr and addr + n <= base + arr.nbytes:
                return arr[addr - base: addr - base + n]
        raise ValueError(f"{addr:#x}+{n} is not in this peer's buffers")

    def do_fill(self, addr, data):              # (addr, bytes)
        self._view(addr, len(data))[:] = self.np.frombuffer(data, self.np.uint8)

    def do_get(self, addr, n):                  # -> bytes
        return self._view(addr, n).tobytes()

    def do_sha(self, addr, n):                  # -> hex digest
        return hashlib.sha256(self._view(addr, n)).hexdigest()

    def do_alloc(self, size, access):           # -> addr
        arr = self.np.zeros(size, dtype=self.np.uint8)
        r = self.eng.register(arr, access=access)
        self.extra[r.address] = arr
        return r.address

    def do_unregister(self, addr):
        self.eng.unregister(addr)
        arr = self.extra.pop(addr, None)
        if arr is not None:
            self.retired.append(arr)

    def do_rdma_stats(self):                    # per-device counters of the RDMA transport
        t = self.eng._transports.get("rdma")
        return t.stats() if t is not None else None

    def do_notifications(self):
        return [(n.sender, n.message) for n in self.eng.notifications()]

    def do_write_pattern(self, target, raddr, n, seed, block):   # WRITE as initiator
        np = self.np
        data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        self.buf[:n] = data
        offs = np.arange(0, n, block, dtype=np.uint64)
        lens = np.minimum(block, n - offs).astype(np.uint64)
        self.eng.submit_arrays(self.mte.WRITE, target, self.region.address + offs,
                               raddr + offs, lens).wait()
        return hashlib.sha256(data).hexdigest()


class PeerProcess(Child):
    """A TransferEngine in another process. ``name``, ``address`` (its buffer), ``pid``."""

    def __init__(self, size: int = 1 << 20, **engine_kwargs):
        self.size = size
        super().__init__(_Peer, size, engine_kwargs, what="peer process",
                         timeout=CALL_TIMEOUT)

    def on_ready(self, hello) -> None:
        self.name, self.address, _ = hello


def sigstop(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads has stopped.

    kill() only queues the signal: a thread that is running (our receivers poll for a
    few microseconds before they block) can still serve one more request before it
    stops, which would make a "hung peer" test race with its own set-up."""
    import glob
    import signal
    import time
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(stat) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not stop within {timeout} s")

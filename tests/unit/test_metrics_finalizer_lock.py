# SPDX-License-Identifier: Apache-2.0
"""A finalizer that untracks a component while its own thread is inside ``track``
(issue 39, item 5): an unclosed store (or engine) left in a reference cycle is
collected by the cyclic GC at some allocation inside ``track`` of a new engine; its
``__del__`` closes it, which untracks it and releases its /metrics server. With a
plain lock the thread waited on itself forever. Run in a child process so a hang is a
timeout, not a stuck test session."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import gc, sys
from mooncake_te.compat.store import MooncakeDistributedStore
from mooncake_te.metrics import prometheus

def leak_engine():
    from mooncake_te.compat import TransferEngine
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    te._self = te                   # closed inline by its finalizer, inside track
    return id(te.get_engine())


def leak():
    if sys.argv[2] == "engine":
        return leak_engine()
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "",
                   "127.0.0.1:50051") == 0
    s._self = s                     # a reference cycle: only the cyclic GC frees it
    return id(s._eng)

gc.disable()
leaked = {leak() for _ in range(int(sys.argv[1]))}
assert leaked <= {id(o) for _, o in prometheus._live()}

class Probe:
    pass


class CollectingWeakref:
    # weakref as track sees it, collecting once when track takes a reference (inside
    # its locked section): what the cyclic GC does at any allocation there.
    def __init__(self, real):
        self.real, self.done = real, False

    def ref(self, obj, *a):
        if not self.done:
            self.done = True
            gc.collect()
        return self.real.ref(obj, *a)


probe = Probe()
real = prometheus.weakref
prometheus.weakref = CollectingWeakref(real)
try:
    prometheus.track("kvcache", probe)
finally:
    prometheus.weakref = real
assert not gc.garbage
import time
deadline = time.monotonic() + 20
while True:                        # the stores' finalizers close them on threads
    live = {id(o) for _, o in prometheus._live()}
    if not leaked & live or time.monotonic() > deadline:
        break
    time.sleep(0.05)
assert id(probe) in live
assert not leaked & live, "the collected stores' engines are still tracked"
print("ok", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leaked", ["store", "engine"])
def test_untrack_from_finalizer_inside_track_does_not_hang(leaked):
    env = dict(os.environ, PYTHONPATH=ROOT)
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, "3", leaked], capture_output=True, text=True,
                           timeout=40, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung: a finalizer's untrack waited on the lock its own "
                    "thread held inside track")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]

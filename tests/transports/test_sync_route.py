# SPDX-License-Identifier: Apache-2.0
"""The synchronous path (``write``/``read``): few Python calls, and a route cache that
is dropped whenever what it was worked out from changes (issue 38, item 7).

Call counts are deterministic, so they are asserted; speed is measured in
``benchmarks/test_latency.py``, not here.
"""
from __future__ import annotations

import collections
import sys

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.metrics.engine import set_enabled

MAX_PY_CALLS = 10        # Python-level calls per synchronous 4 KiB request (was 19-20)


@pytest.fixture(params=["tcp", "shm"])
def pair(request):
    a = mte.TransferEngine(host="127.0.0.1", protocol=request.param)
    b = mte.TransferEngine(host="127.0.0.1", protocol=request.param)
    src, dst = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[: 1 << 16], \
        np.zeros(1 << 16, np.uint8)
    ra, rb = a.register(src), b.register(dst)
    try:
        yield a, b, ra, rb, src, dst
    finally:
        a.close()
        b.close()


def calls(fn) -> collections.Counter:
    """(module, function) of every Python function called on this thread by ``fn()``
    (this file's own lambdas aside)."""
    seen: collections.Counter = collections.Counter()

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename != __file__:
            seen[(frame.f_code.co_filename.rsplit("mooncake_te/", 1)[-1],
                  frame.f_code.co_name)] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def picks(c: collections.Counter) -> int:
    return c[("routing.py", "pick")]


def test_sync_4k_python_calls_bounded(pair):
    a, b, ra, rb, src, dst = pair
    assert a.internal.transfer_metrics is not None   # metrics on: the default
    for _ in range(3):
        a.write(b.name, ra.address, rb.address, 4096)
        a.read(b.name, ra.address + 8192, rb.address, 4096)
    for op in (a.write, a.read):
        c = calls(lambda: op(b.name, ra.address, rb.address, 4096))
        n = sum(c.values())
        assert n <= MAX_PY_CALLS, f"{op.__name__}: {n} Python calls: {dict(c)}"
        assert picks(c) == 0                          # the route came from the cache
    assert bytes(dst[:4096]) == bytes(src[:4096])
    counted = sum(t["requests"] for t in a.metrics()["transfers"])
    assert counted == 8


def test_route_recomputed_after_register_and_unregister(pair):
    a, b, ra, rb, *_ = pair
    w = lambda: a.write(b.name, ra.address, rb.address, 4096)    # noqa: E731
    w()
    assert picks(calls(w)) == 0
    extra = a.register(np.zeros(4096, np.uint8))
    assert picks(calls(w)) == 1                       # regions changed: asked again
    assert picks(calls(w)) == 0
    a.unregister(extra)
    assert picks(calls(w)) == 1
    assert picks(calls(w)) == 0
    a.unregister(ra)
    with pytest.raises(mte.AddressNotRegisteredError, match="not inside a region"):
        w()


def test_route_recomputed_after_descriptor_changes(pair):
    a, b, ra, rb, *_ = pair
    w = lambda: a.write(b.name, ra.address, rb.address, 4096)    # noqa: E731
    w()
    a.open_segment(b.name, refresh=True)              # a new descriptor object
    assert picks(calls(w)) == 1
    assert picks(calls(w)) == 0
    a._peers.lost(b.name)                             # what a failed connection does
    assert picks(calls(w)) == 1
    assert picks(calls(w)) == 0


def test_metrics_switched_off_and_on_between_calls(pair):
    """The cached route carries the metrics cell: switching metrics off must stop the
    counting at once, and on again resume it."""
    a, b, ra, rb, *_ = pair
    w = lambda: a.write(b.name, ra.address, rb.address, 4096)    # noqa: E731

    def count():      # what was counted stays readable while counting is off
        return sum(t["requests"] for t in a.internal.counted.snapshot())
    w()
    w()
    set_enabled(a, True)
    assert count() == 2
    set_enabled(a, False)
    w()
    assert a.metrics()["enabled"] is False
    assert count() == 2
    set_enabled(a, True)
    w()
    assert count() == 3


def test_bad_arguments_still_refused(pair):
    a, b, ra, rb, *_ = pair
    a.write(b.name, ra.address, rb.address, 4096)     # route cached
    with pytest.raises(mte.InvalidArgumentError, match="length must be positive"):
        a.write(b.name, ra.address, rb.address, 0)
    with pytest.raises(mte.InvalidArgumentError, match="must be non-negative"):
        a.write(b.name, -1, rb.address, 16)
    with pytest.raises(mte.InvalidArgumentError, match="bool"):
        a.write(b.name, ra.address, rb.address, True)
    with pytest.raises(mte.InvalidArgumentError, match="below 2\\*\\*64"):
        a.write(b.name, ra.address, 1 << 64, 16)
    with pytest.raises(mte.InvalidArgumentError, match="segment name"):
        a.write("", ra.address, rb.address, 16)
    # numpy integers take the general checks and still work
    a.write(b.name, np.uint64(ra.address), np.int64(rb.address), np.int32(16))
    a.close()
    with pytest.raises(mte.errors.ClosedError):
        a.write(b.name, ra.address, rb.address, 16)

# SPDX-License-Identifier: Apache-2.0
"""``notifications(timeout=)`` waits, GIL released, for the first notification instead of
a polling loop: it returns at once when one is queued, as soon as one arrives, empty when
the time is up, and wakes when the engine is closed under it."""
from __future__ import annotations

import threading
import time

import pytest

import mooncake_te as mte


def test_returns_at_once_when_one_is_queued(engine_pair):
    a, b = engine_pair
    a.send_notification(b.name, b"queued")
    t = time.monotonic()
    assert [n.message for n in b.notifications(timeout=30)] == [b"queued"]
    assert time.monotonic() - t < 10


def test_wakes_when_one_arrives(engine_pair):
    a, b = engine_pair
    sender = threading.Timer(0.05, a.send_notification, (b.name, b"late"))
    sender.start()
    try:
        got = b.notifications(timeout=30)
    finally:
        sender.join()
    assert [(n.sender, n.message) for n in got] == [(a.name, b"late")]


def test_empty_when_none_comes_and_other_threads_run_meanwhile(engine_pair):
    _, b = engine_pair
    ticks = []
    stop = threading.Event()

    def spin():                       # needs the GIL: runs only if the wait released it
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    th = threading.Thread(target=spin)
    th.start()
    t = time.monotonic()
    try:
        assert b.notifications(timeout=0.2) == []
    finally:
        stop.set()
        th.join()
    assert time.monotonic() - t >= 0.15
    assert len(ticks) > 5


def test_close_wakes_a_waiter():
    e = mte.TransferEngine(host="127.0.0.1")
    out = {}

    def wait():
        out["got"] = e.notifications(timeout=60)

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.1)
    e.close()
    th.join(timeout=20)
    assert not th.is_alive() and out["got"] == []


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan")])
def test_bad_timeout_is_refused(engine_pair, bad):
    with pytest.raises(mte.InvalidArgumentError, match="timeout"):
        engine_pair[0].notifications(timeout=bad)

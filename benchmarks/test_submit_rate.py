# SPDX-License-Identifier: Apache-2.0
"""Descriptor submission rate through ``submit_arrays`` (issue 9 target: >= 5 M/s).

What is timed is the call alone: validation of every descriptor against the registered
regions, the segment lookup, and queueing to the peer's lanes. Completion is not: the
previous batch is waited for in pytest-benchmark's untimed ``setup``.

Two peers:

* ``paused``: the target process is stopped (SIGSTOP) and an untimed "plug" batch of
  64 Ki descriptors is queued first, enough to fill every lane's socket buffer (TCP
  payload, or the same-host transport's headers), so the lanes are blocked in the
  kernel while the timed call runs and the 2 CPUs belong to the submitting thread. This
  is the call's own cost per descriptor.
* ``live``: the target runs; the lanes start moving the first descriptors while the rest
  are still being queued, as in an application. On 2 CPUs they compete with the call.

Both routes of the ``engine`` fixture (TCP, same-host) are measured; the call does the
same work for both, the lanes differ.

Descriptors are 512 B and spread over a 64 MiB buffer. Their length does not change the
submission cost while it is under the slice size (one queue item per descriptor); it
only keeps the untimed completion short (1 M x 4 KiB would move 4 GB per round).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import mooncake_te as mte

DESC_LEN = 512
PLUG = 65536
ROUNDS = {1_000: 100, 10_000: 30, 100_000: 8, 1_000_000: 3}


@pytest.mark.parametrize("peer_state", ["paused", "live"])
@pytest.mark.parametrize("n", sorted(ROUNDS))
def test_submit_arrays(benchmark, engine, peer, record, n, peer_state):
    nblocks = min(engine.region.length, peer.length) // DESC_LEN
    offs = (np.arange(n, dtype=np.uint64) % np.uint64(nblocks)) * np.uint64(DESC_LEN)
    src = offs + np.uint64(engine.region.address)
    dst = offs + np.uint64(peer.address)
    plug_offs = (np.arange(PLUG, dtype=np.uint64) % np.uint64(nblocks)) * np.uint64(DESC_LEN)
    plug_src = plug_offs + np.uint64(engine.region.address)
    plug_dst = plug_offs + np.uint64(peer.address)
    last = []

    def settle():
        # Untimed: let the previous batches finish, then stop the peer and fill the lanes'
        # sockets so that nothing moves while the next call is timed.
        peer.resume()
        while last:
            last.pop().wait(timeout=120)
        if peer_state == "paused":
            peer.pause()
            last.append(engine.submit_arrays(mte.WRITE, peer.segment, plug_src, plug_dst,
                                             DESC_LEN, timeout=120))
            time.sleep(0.02)            # the lanes take their share and block

    def submit():
        last.append(engine.submit_arrays(mte.WRITE, peer.segment, src, dst, DESC_LEN,
                                         timeout=120))

    try:
        benchmark.pedantic(submit, setup=settle, rounds=ROUNDS[n], warmup_rounds=1)
    finally:
        settle()
        peer.resume()
    times = record.times(benchmark)
    if times:
        med = float(np.median(times))
        rate = n / med
        record("submit_arrays, 512 B WRITE descriptors, call only [>= 5 M desc/s]",
               f"{engine.route}: {n:>9,} descriptors, peer {peer_state}",
               f"{rate / 1e6:6.2f} M desc/s  {med / n * 1e9:7.1f} ns/desc  "
               f"(median of {len(times)} calls, {med * 1e3:.2f} ms)")

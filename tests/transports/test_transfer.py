# SPDX-License-Identifier: Apache-2.0
"""Transfers between engines in separate processes over loopback, every byte checked:
what TCP and its same-host mode do beyond the contract every transport keeps
(tests/transports/test_contract.py): lanes, read-only regions, dead, hung and restarted
peers, cancel, cross-memory attach."""
from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import mooncake_te as mte
from peers import PeerProcess, sigstop


@pytest.fixture(params=["tcp", "shm"])
def engine(request):
    """Every test here runs over TCP and over the same-host transport (unix socket and
    cross-memory attach): one suite, every transport."""
    eng = mte.TransferEngine(host="127.0.0.1", protocol=request.param)
    yield eng
    eng.close()


def sha(b) -> str:
    return hashlib.sha256(np.ascontiguousarray(b)).hexdigest()


def rand(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_segment_lists_published_buffers(engine, peer):
    seg = engine.open_segment(peer.name)
    assert seg.name == peer.name and seg.protocol == "tcp"
    assert [(b.address, b.length) for b in seg.buffers] == [(peer.address, peer.size)]


def test_huge_request_is_sliced_over_lanes(engine, peer):
    big = PeerProcess(64 << 20)
    try:
        src = rand(64 << 20, 3)
        r = engine.register(src)
        engine.write(big.name, r.address, big.address, 64 << 20)
        assert big.call("sha", big.address, 64 << 20) == sha(src)
        dst = np.zeros(64 << 20, np.uint8)
        rd = engine.register(dst)
        b = engine.submit([mte.TransferRequest(mte.READ, rd.address, big.name, big.address,
                                               64 << 20)])
        b.wait()
        assert b.status() == [mte.TransferStatus("completed", 64 << 20)]
        assert sha(dst) == sha(src)
    finally:
        big.close()


def test_two_initiators_write_to_one_target():
    target = PeerProcess(8 << 20)
    a, b = PeerProcess(4 << 20), PeerProcess(4 << 20)
    try:
        results = {}

        def run(p, off, seed):
            results[seed] = p.call("write_pattern", target.name, target.address + off,
                                   4 << 20, seed, 65536)

        ts = [threading.Thread(target=run, args=(a, 0, 11)),
              threading.Thread(target=run, args=(b, 4 << 20, 12))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert target.call("sha", target.address, 4 << 20) == results[11]
        assert target.call("sha", target.address + (4 << 20), 4 << 20) == results[12]
    finally:
        for p in (a, b, target):
            p.close()


def test_only_the_bad_request_of_a_batch_fails(engine, local_buf, peer):
    buf, r = local_buf
    buf[:8192] = 5
    b = engine.submit_arrays(mte.WRITE, peer.name,
                             np.array([r.address, r.address + 4096], np.uint64),
                             np.array([peer.address, 12345], np.uint64), 4096)
    with pytest.raises(mte.AddressNotRegisteredError, match="request 1"):
        b.wait()
    assert [s.state for s in b.status()] == ["completed", "failed"]
    assert peer.call("get", peer.address, 4096) == b"\x05" * 4096


def test_read_only_and_local_regions(engine, local_buf, peer):
    buf, r = local_buf
    ro = peer.call("alloc", 8192, "r")
    hidden = peer.call("alloc", 8192, "local")
    peer.call("fill", ro, b"\x07" * 8192)
    engine.read(peer.name, r.address, ro, 8192)
    assert (buf[:8192] == 7).all()
    with pytest.raises(mte.AddressNotRegisteredError, match="does not allow remote writes"):
        engine.write(peer.name, r.address, ro, 8192)
    with pytest.raises(mte.AddressNotRegisteredError):
        engine.read(peer.name, r.address, hidden, 4096)
    seg = engine.open_segment(peer.name, refresh=True)
    published = {b.address: b.access for b in seg.buffers}
    assert published.get(ro) == "r" and hidden not in published


def test_unregister_and_register_again(engine, local_buf, peer):
    buf, r = local_buf
    extra = peer.call("alloc", 65536, "rw")
    engine.write(peer.name, r.address, extra, 65536)
    peer.call("unregister", extra)
    with pytest.raises(mte.AddressNotRegisteredError):
        engine.write(peer.name, r.address, extra, 65536)
    again = peer.call("alloc", 65536, "rw")
    buf[:65536] = 9
    engine.write(peer.name, r.address, again, 65536)
    assert peer.call("get", again, 16) == b"\x09" * 16
    # Locally too: after unregister the local side refuses.
    engine.unregister(r)
    with pytest.raises(mte.AddressNotRegisteredError):
        engine.write(peer.name, r.address, peer.address, 16)
    r2 = engine.register(buf)
    engine.write(peer.name, r2.address, peer.address, 16)


def test_peer_killed_mid_batch_fails_within_deadline(engine):
    victim = PeerProcess(64 << 20)
    try:
        src = np.ones(64 << 20, np.uint8)
        r = engine.register(src)
        offs = np.arange(0, 64 << 20, 1 << 20, dtype=np.uint64)
        batches = [engine.submit_arrays(mte.WRITE, victim.name, r.address + offs,
                                        victim.address + offs, 1 << 20, timeout=10)
                   for _ in range(20)]
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        failures = 0
        for b in batches:
            try:
                b.wait()
            except mte.TransferError:
                failures += 1
        assert failures >= 1
        assert time.monotonic() - t0 < 15
        # The next transfer to the dead peer fails cleanly too (its descriptor was
        # dropped, so it is not even found any more).
        with pytest.raises((mte.TransferError, mte.SegmentNotFoundError)):
            engine.write(victim.name, r.address, victim.address, 4096, timeout=5)
    finally:
        victim.kill()


def test_hung_peer_times_out(engine):
    victim = PeerProcess(1 << 20)
    try:
        src = np.ones(1 << 20, np.uint8)
        r = engine.register(src)
        engine.write(victim.name, r.address, victim.address, 4096)     # connections up
        sigstop(victim.pid)
        t0 = time.monotonic()
        b = engine.submit_arrays(mte.READ, victim.name,
                                 np.array([r.address], np.uint64),
                                 np.array([victim.address], np.uint64), 1 << 20, timeout=1.0)
        with pytest.raises(mte.TransferTimeoutError):
            b.wait()
        assert time.monotonic() - t0 < 5
        assert b.status()[0].state == "timeout"
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        victim.kill()


def test_poll_never_blocks_and_elapsed_is_the_transfer_time(engine, local_buf, peer):
    src = rand(1 << 20, 5)
    r = engine.register(src)
    t_submit = time.monotonic()
    b = engine.submit([mte.TransferRequest(mte.WRITE, r.address, peer.name, peer.address,
                                           1 << 20)])
    assert b.poll(timeout=10)                               # returns once it landed
    done_at = time.monotonic()
    b.raise_for_status()
    assert b.elapsed is not None and 0 < b.elapsed < 10
    first = b.elapsed
    time.sleep(0.05)
    # The transfer's own time: looking later does not make it longer.
    assert b.elapsed == first
    assert first <= done_at - t_submit + 1e-3
    assert peer.call("sha", peer.address, 1 << 20) == sha(src)


def test_poll_expires_a_batch_past_its_deadline(engine):
    victim = PeerProcess(1 << 20)
    try:
        src = np.ones(1 << 20, np.uint8)
        r = engine.register(src)
        engine.write(victim.name, r.address, victim.address, 4096)     # connections up
        sigstop(victim.pid)
        b = engine.submit_arrays(mte.READ, victim.name,
                                 np.array([r.address], np.uint64),
                                 np.array([victim.address], np.uint64), 1 << 20, timeout=0.3)
        assert b.poll() is False and b.elapsed is None
        t = time.monotonic()
        assert b.poll(timeout=0.05) is False               # waits that long, no longer
        assert 0.04 < time.monotonic() - t < 0.25
        t0 = time.monotonic()
        while not b.poll():
            assert time.monotonic() - t0 < 5
            time.sleep(0.01)
        assert b.status()[0].state == "timeout"
        with pytest.raises(mte.TransferTimeoutError):
            b.raise_for_status()
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        victim.kill()


def test_restarted_peer_is_noticed():
    a = PeerProcess(1 << 20)
    eng = mte.TransferEngine(host="127.0.0.1")
    try:
        buf = np.full(4096, 3, np.uint8)
        r = eng.register(buf)
        eng.write(a.name, r.address, a.address, 4096)
        host, port = a.name.rsplit(":", 1)
        a.close()
        # A new engine on the same RPC port, i.e. the same p2p segment name.
        b = PeerProcess(1 << 20, port=int(port))
        try:
            assert b.name == a.name
            # The cached descriptor is stale; the new incarnation is noticed at the
            # hello and the transfer refused instead of landing at old addresses.
            with pytest.raises(mte.TransferError, match="restarted"):
                eng.write(b.name, r.address, b.address, 4096)
            seg = eng.open_segment(b.name)          # refreshed descriptor
            assert seg.buffers[0].address == b.address
            eng.write(b.name, r.address, b.address, 4096)
            assert b.call("get", b.address, 4) == b"\x03" * 4
        finally:
            b.close()
    finally:
        eng.close()


def test_cancel_before_it_runs(engine, local_buf, peer):
    buf, r = local_buf
    offs = np.arange(0, 4 << 20, 4096, dtype=np.uint64)
    bs = [engine.submit_arrays(mte.WRITE, peer.name, r.address + offs, peer.address + offs, 4096)
          for _ in range(8)]
    bs[-1].cancel()
    for b in bs[:-1]:
        b.wait()
    with pytest.raises((mte.TransferCanceledError,)):
        bs[-1].wait()
    states = {s.state for s in bs[-1].status()}
    assert "canceled" in states and states <= {"canceled", "completed"}


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(st.tuples(st.sampled_from([mte.WRITE, mte.READ]),
                               st.integers(0, (1 << 20) - 1), st.integers(1, 300000)),
                     min_size=1, max_size=24),
       seed=st.integers(0, 2 ** 32 - 1))
def test_random_batches_every_byte(engine, local_buf, peer, reqs, seed):
    """A model of both memories predicts every byte after random READ/WRITE batches."""
    buf, r = local_buf
    size = 2 << 20
    local = rand(size, seed)
    remote = rand(size, seed + 1)
    buf[:size] = local
    peer.call("fill", peer.address, remote.tobytes())
    requests = []
    # Local windows are disjoint per request so the expected result is well defined;
    # remote windows of WRITEs do not overlap other requests either.
    lcursor = 0
    used_remote = []
    for op, roff, length in reqs:
        length = min(length, size - roff, size - lcursor)
        if length <= 0 or any(roff < e and s < roff + length for s, e in used_remote):
            continue
        used_remote.append((roff, roff + length))
        requests.append((op, lcursor, roff, length))
        lcursor += length
    if not requests:
        return
    b = engine.submit([mte.TransferRequest(op, r.address + lo, peer.name, peer.address + ro, n)
                       for op, lo, ro, n in requests])
    b.wait()
    for op, lo, ro, n in requests:
        if op == mte.WRITE:
            remote[ro:ro + n] = local[lo:lo + n]
        else:
            local[lo:lo + n] = remote[ro:ro + n]
    assert sha(buf[:size]) == sha(local)
    assert peer.call("sha", peer.address, size) == sha(remote)


def test_same_host_peer_uses_cross_memory_attach(local_buf, peer):
    with mte.TransferEngine(host="127.0.0.1") as eng:         # protocol "auto"
        buf = np.arange(1 << 20, dtype=np.uint8)
        r = eng.register(buf)
        b = eng.submit_arrays(mte.WRITE, peer.name, np.array([r.address], np.uint64),
                              np.array([peer.address], np.uint64), 1 << 20)
        b.wait()
        assert b.transport == "shm"
        assert eng._transports["tcp"]._peers[peer.name].cma    # bytes moved by process_vm_*
        assert peer.call("sha", peer.address, 1 << 20) == sha(buf)
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp") as eng:
        r = eng.register(np.zeros(4096, np.uint8))
        b = eng.submit_arrays(mte.READ, peer.name, [r.address], [peer.address], 4096)
        b.wait()
        assert b.transport == "tcp"


@pytest.mark.parametrize("lanes", [1, 8])
def test_same_host_read_that_timed_out_never_lands_after_unregister(lanes):
    """The same-host server copies into our memory itself (process_vm_writev), so after a
    timed-out READ whose request reached the server the region stays pinned (unregister
    waits) until the server has answered; once unregister returns, nothing lands in the
    memory any more.

    With one lane the READ goes out on the lane the first read connected, so its request
    is in the stopped server's socket and unregister must wait. With 8 lanes (the default
    on 16 CPUs) the READ's slices may all go to lanes that are not connected yet: their
    hello is never answered, they time out before any request leaves, nothing is pinned
    and unregister returns at once, which is right, since no request can land. (This test
    once asserted the wait with the default lanes: it failed 12 of 20 runs on 16 CPUs, for
    that reason; the guarantee itself held.) What every case must show: after unregister
    returns and the server runs again, the memory is the user's."""
    victim = PeerProcess(1 << 20)
    cfg = mte.Config.load(None).with_overrides({"transfer_engine": {"tcp_lanes": lanes}})
    eng = mte.TransferEngine(host="127.0.0.1", config=cfg)
    try:
        victim.call("fill", victim.address, b"\xaa" * (1 << 20))
        buf = np.zeros(1 << 20, np.uint8)
        r = eng.register(buf)
        eng.read(victim.name, r.address, victim.address, 4096)        # connections up
        sigstop(victim.pid)
        b = eng.submit_arrays(mte.READ, victim.name, [r.address], [victim.address], 1 << 20,
                              timeout=0.3)
        with pytest.raises(mte.TransferTimeoutError):
            b.wait()
        done = threading.Event()
        t = threading.Thread(target=lambda: (eng.unregister(r), done.set()), daemon=True)
        t.start()
        if lanes == 1:
            assert not done.wait(0.5)      # still pinned: the server may yet copy
        else:
            done.wait(0.5)
        returned_while_stopped = done.is_set()
        if returned_while_stopped:
            buf[:] = 0x11                   # the user reuses the memory at once
        os.kill(victim.pid, signal.SIGCONT)
        assert done.wait(20)
        if not returned_while_stopped:
            buf[:] = 0x11                   # the user reuses the memory
        # The server now runs every request it had queued: none may land.
        time.sleep(0.5)
        assert (buf == 0x11).all()
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        victim.kill()
        eng.close()


def test_queue_wraps_and_grows_with_bytes_intact(engine, local_buf, peer):
    """Batches of 700-1,500 slices queued back to back, without waiting: the peer's ring
    (1,024 slots at first) wraps around and grows while lanes drain it; every byte lands
    where its request said."""
    buf, r = local_buf
    buf[: 4 << 20] = rand(4 << 20, 5)
    rng = np.random.default_rng(11)
    size = 512
    slots = (4 << 20) // size
    dsts = rng.permutation(slots).astype(np.uint64) * size      # no slot written twice
    batches, expect, used = [], np.zeros(4 << 20, np.uint8), 0
    for n in (700, 900, 1500, 800, 1200):
        src = rng.choice(slots, n, replace=False).astype(np.uint64) * size
        dst, used = dsts[used:used + n], used + n
        batches.append(engine.submit_arrays(mte.WRITE, peer.name, r.address + src,
                                            peer.address + dst, size))
        for s, d in zip(src.tolist(), dst.tolist()):
            expect[d:d + size] = buf[s:s + size]
    for b in batches:
        b.wait(timeout=60)
    assert peer.call("get", peer.address, 4 << 20) == expect.tobytes()

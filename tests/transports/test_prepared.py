# SPDX-License-Identifier: Apache-2.0
"""Prepared descriptor lists (eng.prepare / PreparedTransfer.post) between two engines
over real sockets: the right bytes move, bad indices and addresses are typed errors,
and memory unregistered after preparing fails the request instead of being touched."""
from __future__ import annotations

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import errors as E

BLOCK = 4096
NB = 8


@pytest.fixture(params=["tcp", "auto"])
def pair(request):
    with mte.TransferEngine(host="127.0.0.1", protocol=request.param) as a, \
            mte.TransferEngine(host="127.0.0.1", protocol=request.param) as b:
        yield a, b


def _tables(a, b, regions=3):
    """Per region (a K or V plane), NB blocks: local planes are separate arrays (as
    vLLM's per-layer tensors), the remote ones slices of one buffer."""
    rng = np.random.default_rng(7)
    local = [rng.integers(0, 256, NB * BLOCK, dtype=np.uint8) for _ in range(regions)]
    remote = np.zeros(regions * NB * BLOCK, np.uint8)
    lb = np.array([a.register(x).address for x in local], np.uint64)
    rb = b.register(remote).address + np.arange(regions, dtype=np.uint64) * NB * BLOCK
    steps = np.arange(NB, dtype=np.uint64) * BLOCK
    return local, remote, lb[:, None] + steps, rb[:, None] + steps


def test_post_moves_each_block_of_every_region(pair):
    a, b = pair
    local, remote, lt, rt = _tables(a, b)
    p = a.prepare(b.name, lt, rt, BLOCK)
    assert p.local_blocks == NB and p.transport in ("tcp", "shm")
    p.post(mte.WRITE, np.array([1, 5]), np.array([6, 0])).wait(timeout=10)
    view = remote.reshape(3, NB, BLOCK)
    for r in range(3):
        assert (view[r, 6] == local[r][1 * BLOCK:2 * BLOCK]).all()
        assert (view[r, 0] == local[r][5 * BLOCK:6 * BLOCK]).all()
        assert not view[r, [1, 2, 3, 4, 5, 7]].any()          # nothing else written
    for x in local:
        x[:] = 0
    batch = p.post(mte.READ, np.array([2]), np.array([6]), notify=b"done")
    batch.wait(timeout=10)
    assert [s.state for s in batch.status()] == ["completed"] * 3
    for r in range(3):
        assert (local[r][2 * BLOCK:3 * BLOCK] == view[r, 6]).all()
    assert b.notifications()[-1].message == b"done"


def test_one_dimensional_tables_take_indices(pair):
    a, b = pair
    src = np.arange(NB * BLOCK, dtype=np.uint32).view(np.uint8)[:NB * BLOCK].copy()
    dst = np.zeros(NB * BLOCK, np.uint8)
    la, ra = a.register(src).address, b.register(dst).address
    steps = np.arange(NB, dtype=np.uint64) * BLOCK
    p = a.prepare(b.name, la + steps, ra + steps, BLOCK)
    p.post(mte.WRITE, np.arange(NB), np.arange(NB)[::-1].copy()).wait(timeout=10)
    assert (dst.reshape(NB, BLOCK)[::-1] == src.reshape(NB, BLOCK)).all()


def test_ids_of_any_integer_dtype_and_layout(pair):
    """The native gather takes int64; other integer ids (uint64, int32, strided views)
    are converted, and ids that would wrap as int64 are refused, not wrapped."""
    a, b = pair
    local, remote, lt, rt = _tables(a, b)
    p = a.prepare(b.name, lt, rt, BLOCK)
    view = remote.reshape(3, NB, BLOCK)
    ids = np.array([3, 9, 7, 9], np.uint64)[::2]                 # [3, 7], strided
    p.post(mte.WRITE, ids, np.array([4, 2], np.int32)).wait(timeout=10)
    for r in range(3):
        assert (view[r, 4] == local[r][3 * BLOCK:4 * BLOCK]).all()
        assert (view[r, 2] == local[r][7 * BLOCK:8 * BLOCK]).all()
    view[:] = 0
    p.post(mte.WRITE, np.array([5, 0, 6], np.int64)[::2],             # int64, strided
           np.array([1, 0], ">i8")).wait(timeout=10)                  # big-endian
    for r in range(3):
        assert (view[r, 1] == local[r][5 * BLOCK:6 * BLOCK]).all()
        assert (view[r, 0] == local[r][6 * BLOCK:7 * BLOCK]).all()
    with pytest.raises(E.InvalidArgumentError, match=r"local_ids\[1\] = 18446744073709551615"):
        p.post(mte.WRITE, np.array([0, (1 << 64) - 1], np.uint64), np.array([0, 1]))
    with pytest.raises(E.InvalidArgumentError, match=r"remote_ids\[1\] = 8"):
        p.post(mte.WRITE, np.array([0, 1]), np.array([0, NB]))
    assert len(p.post(mte.WRITE, np.array([], np.int64), np.array([], np.int64))) == 0


def test_bad_indices_and_addresses_are_typed_errors(pair):
    a, b = pair
    local, remote, lt, rt = _tables(a, b)
    p = a.prepare(b.name, lt, rt, BLOCK)
    with pytest.raises(E.InvalidArgumentError, match="outside"):
        p.post(mte.WRITE, np.array([NB]), np.array([0]))
    with pytest.raises(E.InvalidArgumentError, match="outside"):
        p.post(mte.WRITE, np.array([-1]), np.array([0]))
    with pytest.raises(E.InvalidArgumentError, match="integer"):
        p.post(mte.WRITE, np.array([0.5]), np.array([0]))
    with pytest.raises(E.InvalidArgumentError, match="op"):
        p.post(7, np.array([0]), np.array([0]))
    with pytest.raises(E.AddressNotRegisteredError, match="local block"):
        a.prepare(b.name, lt + np.uint64(1 << 40), rt, BLOCK)
    with pytest.raises(E.AddressNotRegisteredError, match="remote block"):
        a.prepare(b.name, lt, rt + np.uint64(BLOCK), BLOCK)     # last block runs past
    with pytest.raises(E.InvalidArgumentError, match="same number of regions"):
        a.prepare(b.name, lt, rt[:2], BLOCK)
    with pytest.raises(E.InvalidArgumentError, match="block_size"):
        a.prepare(b.name, lt, rt, 0)


def test_memory_unregistered_after_prepare_fails_the_request(pair):
    a, b = pair
    local, remote, lt, rt = _tables(a, b, regions=1)
    p = a.prepare(b.name, lt, rt, BLOCK)
    a.unregister(int(lt[0, 0]))           # the region of local[0]
    batch = p.post(mte.WRITE, np.array([0]), np.array([0]))
    with pytest.raises(E.MooncakeError):
        batch.wait(timeout=10)
    assert batch.status()[0].state == "failed"
    assert not remote.any()


def test_posts_are_counted_by_metrics_and_time_out_like_batches(pair):
    a, b = pair
    local, remote, lt, rt = _tables(a, b)
    p = a.prepare(b.name, lt, rt, BLOCK)
    p.post(mte.WRITE, np.array([1, 2]), np.array([3, 4])).wait(timeout=10)
    batch = p.post(mte.READ, np.array([0]), np.array([5]), timeout=30)
    batch.wait(timeout=10)
    assert batch.transport == p.transport
    counted = {t["op"]: t["requests"] for t in a.metrics()["transfers"]
               if t["peer"] == b.name}
    assert counted == {"write": 6, "read": 3}         # 3 regions each
    with pytest.raises(E.InvalidArgumentError, match="timeout"):
        p.post(mte.READ, np.array([0]), np.array([5]), timeout=-1)


# --- the native post (issue 38, item 1): one call from ids to the peer's queue ---------

def test_post_over_tcp_is_one_native_call(pair, monkeypatch):
    """Over TCP and the same-host transport a post never gathers addresses in Python:
    the prepared tables live in the core and the transport queues by index."""
    from mooncake_te.prepared import PreparedTransfer

    def gathered(*a, **k):
        raise AssertionError("post took the gathered path")

    a, b = pair
    local, remote, lt, rt = _tables(a, b)
    p = a.prepare(b.name, lt, rt, BLOCK)
    monkeypatch.setattr(PreparedTransfer, "_post_gathered", gathered)
    assert p._table.shape == (3, NB, NB) and not p._table.any_device
    batch = p.post(mte.WRITE, np.array([2, 3]), np.array([7, 1]), notify=b"landed")
    batch.wait(timeout=10)
    assert len(batch) == 6 and batch.transport == p.transport
    assert b.notifications(timeout=10)[-1].message == b"landed"
    view = remote.reshape(3, NB, BLOCK)
    for r in range(3):
        assert (view[r, 7] == local[r][2 * BLOCK:3 * BLOCK]).all()
        assert (view[r, 1] == local[r][3 * BLOCK:4 * BLOCK]).all()


def test_native_post_refuses_bad_ids_and_queues_nothing(pair):
    """An id outside the table is refused before anything is queued: no request of the
    post runs (the good ids before it included), so nothing outside the prepared blocks
    (or anything at all) is written."""
    a, b = pair
    local, remote, lt, rt = _tables(a, b)
    p = a.prepare(b.name, lt, rt, BLOCK)
    cases = [(np.array([0, 1, NB]), np.array([0, 1, 2]), r"local_ids\[2\] = 8"),
             (np.array([0, -3]), np.array([0, 1]), r"local_ids\[1\] = -3"),
             (np.array([0, 1]), np.array([1, 1 << 40]), r"remote_ids\[1\] = 1099511627776"),
             (np.array([0, 1]), np.array([-1, 0]), r"remote_ids\[0\] = -1")]
    for lids, rids, msg in cases:
        with pytest.raises(E.InvalidArgumentError, match=msg):
            p.post(mte.WRITE, lids, rids)
    with pytest.raises(E.InvalidArgumentError, match="3 local_ids but 2 remote_ids"):
        p.post(mte.WRITE, np.array([0, 1, 2]), np.array([0, 1]))
    with pytest.raises(E.InvalidArgumentError, match="integer"):
        p.post(mte.WRITE, np.zeros((2, 2), np.int64), np.array([0, 1]))
    with pytest.raises(E.InvalidArgumentError, match="1 MiB"):
        p.post(mte.WRITE, np.array([0]), np.array([0]), notify=bytes((1 << 20) + 1))
    # Nothing was queued: a good post after the refusals is the only write that lands.
    p.post(mte.WRITE, np.array([4]), np.array([5])).wait(timeout=10)
    view = remote.reshape(3, NB, BLOCK)
    for r in range(3):
        assert (view[r, 5] == local[r][4 * BLOCK:5 * BLOCK]).all()
        view[r, 5] = 0
    assert not remote.any()


def test_native_post_takes_ranges_and_reports_failed_blocks(pair):
    """ids may be ranges; a failed request's error names its own block's addresses (the
    batch computes them from the tables only when asked)."""
    a, b = pair
    local, remote, lt, rt = _tables(a, b, regions=2)
    p = a.prepare(b.name, lt, rt, BLOCK)
    p.post(mte.WRITE, range(0, 4), range(4, 8)).wait(timeout=10)
    view = remote.reshape(2, NB, BLOCK)
    for r in range(2):
        assert (view[r, 4:8].ravel() == local[r][:4 * BLOCK]).all()
    a.unregister(int(lt[1, 0]))              # region 1's plane: its requests fail
    batch = p.post(mte.WRITE, np.array([6, 2]), np.array([0, 3]))
    with pytest.raises(E.MooncakeError) as exc:
        batch.wait(timeout=10)
    states = [s.state for s in batch.status()]
    assert states[:2] == ["completed"] * 2 and states[2:] == ["failed"] * 2
    err = batch._error(2, E.ERR_LOCAL_NOT_REGISTERED)     # region 1, block 6 -> 0
    assert f"local {int(lt[1, 6]):#x}" in str(err) and f"remote {int(rt[1, 0]):#x}" in str(err)
    assert exc.value is not None


def test_native_post_on_a_closed_engine_is_refused(pair):
    a, b = pair
    local, remote, lt, rt = _tables(a, b, regions=1)
    p = a.prepare(b.name, lt, rt, BLOCK)
    a.close()
    with pytest.raises(E.ClosedError):
        p.post(mte.WRITE, np.array([0]), np.array([0]))
    assert not remote.any()


def test_native_post_honours_its_deadline_against_a_hung_peer():
    """A post to a peer that stopped answering ends at its deadline (timeout=), as
    any batch: "timeout" states, TransferTimeoutError, no hang."""
    import os
    import signal
    import time

    from peers import PeerProcess, sigstop
    victim = PeerProcess(1 << 20)
    try:
        with mte.TransferEngine(host="127.0.0.1", protocol="tcp") as eng:
            src = np.ones(NB * BLOCK, np.uint8)
            la = eng.register(src).address
            steps = np.arange(NB, dtype=np.uint64) * BLOCK
            p = eng.prepare(victim.name, la + steps, victim.address + steps, BLOCK)
            p.post(mte.WRITE, np.array([0]), np.array([0])).wait(timeout=10)   # lanes up
            sigstop(victim.pid)
            t0 = time.monotonic()
            batch = p.post(mte.READ, np.arange(NB), np.arange(NB), timeout=0.5)
            with pytest.raises(mte.TransferTimeoutError):
                batch.wait()
            assert time.monotonic() - t0 < 5
            assert {s.state for s in batch.status()} == {"timeout"}
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        victim.kill()


def test_native_post_of_tables_in_any_order(pair):
    """Evenly spaced rows (a paged KV cache) are kept as base + stride; rows in any other
    order keep their full table. Both move the right blocks, in one post."""
    a, b = pair
    local, remote, lt, rt = _tables(a, b, regions=2)
    p = a.prepare(b.name, lt, rt, BLOCK)
    assert p._table.evenly_spaced == (True, True)
    perm = np.random.default_rng(3).permutation(NB)
    lt2, rt2 = lt[:, perm].copy(), rt[:, ::-1].copy()          # shuffled; reversed
    q = a.prepare(b.name, lt2, rt2, BLOCK)
    assert q._table.evenly_spaced == (False, True)              # reversed: stride -BLOCK
    q.post(mte.WRITE, np.array([0, 5]), np.array([1, 6])).wait(timeout=10)
    view = remote.reshape(2, NB, BLOCK)
    for r in range(2):
        for li, ri in ((0, 1), (5, 6)):
            src = local[r].reshape(NB, BLOCK)[perm[li]]
            assert (view[r, NB - 1 - ri] == src).all()
    written = {NB - 1 - 1, NB - 1 - 6}
    assert not view[:, [c for c in range(NB) if c not in written]].any()


def test_consecutive_blocks_merge_only_inside_one_region(pair):
    """Blocks with consecutive ids on both sides of a back-to-back row move as one
    request (what the vLLM connector's coalescing did); a row that spans two registered
    regions here, or two buffers of the peer, is never merged, so no request crosses a
    region's end. Every request still reports its own block."""
    a, b = pair
    local, remote, lt, rt = _tables(a, b)
    p = a.prepare(b.name, lt, rt, BLOCK)
    assert p._table.merged_rows == 3
    batch = p.post(mte.WRITE, np.array([1, 2, 3, 6]), np.array([4, 5, 6, 0]))
    batch.wait(timeout=10)
    st = batch.status()
    assert [s.state for s in st] == ["completed"] * 12
    assert {s.transferred_bytes for s in st} == {BLOCK}
    view = remote.reshape(3, NB, BLOCK)
    for r in range(3):
        assert (view[r, 4:7].ravel() == local[r][BLOCK:4 * BLOCK]).all()
        assert (view[r, 0] == local[r][6 * BLOCK:7 * BLOCK]).all()
    # One plane registered as two regions that meet between blocks 3 and 4; the peer's
    # buffer published as two buffers that meet between its blocks 3 and 4.
    src = np.arange(NB * BLOCK, dtype=np.uint32).astype(np.uint8)
    dst = np.zeros(NB * BLOCK, np.uint8)
    half = NB // 2 * BLOCK
    la = a.register(src[:half]).address
    a.register(src[half:])
    ra = b.register(dst[:half]).address
    b.register(dst[half:])
    steps = np.arange(NB, dtype=np.uint64) * BLOCK
    a.open_segment(b.name, refresh=True)          # b's new buffers
    q = a.prepare(b.name, (la + steps)[None, :], (ra + steps)[None, :], BLOCK)
    assert q._table.merged_rows == 0
    q.post(mte.WRITE, np.arange(2, 6), np.arange(2, 6)).wait(timeout=10)
    assert (dst[2 * BLOCK:6 * BLOCK] == src[2 * BLOCK:6 * BLOCK]).all()
    assert not dst[:2 * BLOCK].any() and not dst[6 * BLOCK:].any()


def test_merged_blocks_fail_together_when_their_region_goes(pair):
    a, b = pair
    local, remote, lt, rt = _tables(a, b, regions=2)
    p = a.prepare(b.name, lt, rt, BLOCK)
    a.unregister(int(lt[0, 0]))
    batch = p.post(mte.WRITE, np.array([0, 1, 2]), np.array([3, 4, 5]))
    with pytest.raises(E.MooncakeError):
        batch.wait(timeout=10)
    assert [s.state for s in batch.status()] == ["failed"] * 3 + ["completed"] * 3
    view = remote.reshape(2, NB, BLOCK)
    assert not view[0].any()
    assert (view[1, 3:6].ravel() == local[1][:3 * BLOCK]).all()

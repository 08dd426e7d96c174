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

# SPDX-License-Identifier: Apache-2.0
"""The transport contract, written once and run against every transport this machine
has (uvloop runs each suite against two loops; we run this one against all of them):

=============  ==========================================================  ==========
param          set-up                                                      runs where
=============  ==========================================================  ==========
tcp            engine (protocol="tcp") -> engine in another process        anywhere
shm            engine (protocol="shm") -> same-host engine, another process anywhere
storage-file   engine -> its own storage segment backed by a file          anywhere
rdma           engine on rxe0 -> engine on rxe2 in another process         fabric lab
nvmeof         engine -> storage segment of an nvmet namespace, connected  fabric lab
cuda_ipc       engine -> GPU buffer of an engine in another process        GPU
=============  ==========================================================  ==========

Each test sees a :class:`Side`: the initiator engine in this process, the target segment,
the route ``Batch.transport`` must report, and ``peek``/``poke``, which read and write
the target's bytes by another path (the peer process, the backing file), so what the
transport did is checked independently of the transport. Tests specific to one transport
(lanes, rails, MTUs, alignment, IPC handles) stay in that transport's own file.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import uuid

import numpy as np
import pytest

import mooncake_te as mte
from peers import PeerProcess

SIZE = 4 << 20          # the target's bytes, on every transport


def sha(b) -> str:
    return hashlib.sha256(b if isinstance(b, bytes) else np.ascontiguousarray(b)).hexdigest()


def rand(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Side:
    """One transport, set up for the contract.

    Attributes
    ----------
    eng : TransferEngine
        The initiator, in this process.
    target : str
        The segment it moves bytes to and from; ``base`` .. ``base + size`` is its memory
        (a peer's buffer, or a storage segment's offsets).
    route : str
        What ``Batch.transport`` reports.
    peek, poke : callable
        ``peek(addr, n) -> bytes`` and ``poke(addr, data)``: the target's bytes, read and
        written without this transport.
    refused : str or None
        What the error says when a request leaves the target's memory (None: any text).
    notes : callable or None
        The target engine's received notifications (None: the target is not an engine).
    """

    def __init__(self, eng, target, base, route, peek, poke, refused=None, notes=None):
        self.eng, self.target, self.base, self.size = eng, target, base, SIZE
        self.route, self.peek, self.poke = route, peek, poke
        self.refused, self.notes = refused, notes


# --------------------------------------------------------------------------- set-ups
def _engine_peer(peer, eng, route, refused=None):
    return Side(eng, peer.name, peer.address, route,
                lambda a, n: peer.call("get", a, n), lambda a, d: peer.call("fill", a, d),
                refused, lambda: peer.call("notifications"))


def _memory(protocol):
    with PeerProcess(SIZE) as peer, mte.TransferEngine(host="127.0.0.1",
                                                       protocol=protocol) as eng:
        yield _engine_peer(peer, eng, protocol, "not inside a region it registered")


def _rdma():
    raw = os.environ.get("MOONCAKE_LAB_RXE")
    if not raw or len(json.loads(raw)) < 3:
        pytest.skip("needs the fabric lab's three rxe devices (MOONCAKE_LAB_RXE)")
    with PeerProcess(SIZE, protocol="rdma", devices=["rxe2"]) as peer, \
            mte.TransferEngine(host="127.0.0.1", protocol="rdma", devices=["rxe0"]) as eng:
        yield _engine_peer(peer, eng, "rdma")


def _file_side(eng, target, path):
    def peek(a, n):
        with open(path, "rb") as f:
            f.seek(a)
            return f.read(n)

    def poke(a, data):
        with open(path, "r+b") as f:
            f.seek(a)
            f.write(data)
    return Side(eng, target, 0, "nvmeof", peek, poke, "outside storage segment")


def _image(folder) -> str:
    path = os.path.join(folder, f"img-{uuid.uuid4().hex[:6]}")
    with open(path, "wb") as f:
        f.truncate(SIZE)
    return path


def _storage_file(tmp_path):
    img = _image(tmp_path)
    with mte.TransferEngine(host="127.0.0.1") as eng:
        seg = eng.register_storage("disk", path=img)
        yield _file_side(eng, seg.name, img)


def _nvmeof(tmp_path):
    from mooncake_te import nvmeof_admin as nvmeof
    workdir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"contract-{uuid.uuid4().hex[:6]}")
    os.makedirs(workdir)
    img = _image(workdir)
    nqn = f"nqn.2026-12.io.mooncake-te.test:contract-{uuid.uuid4().hex[:6]}"
    nvmeof.create_target(nqn, img, "tcp", "127.0.0.1", 4429)
    try:
        nvmeof.connect(nqn, "127.0.0.1", 4429, "tcp")
        try:
            with mte.TransferEngine(host="127.0.0.1") as owner, \
                    mte.TransferEngine(host="127.0.0.1") as eng:
                seg = owner.register_storage("pool", nqn=nqn)
                yield _file_side(eng, seg.name, img)
        finally:
            nvmeof.disconnect(nqn)
    finally:
        nvmeof.delete_target(nqn)
        subprocess.run(["rm", "-rf", workdir])


def _cuda_ipc():
    from gpu_peer import GpuPeer
    with GpuPeer() as peer, mte.TransferEngine(host="127.0.0.1") as eng:
        addr, loc = peer.call("alloc", "cupy", SIZE, 512, 0, "rw")
        assert loc == "cuda:0"
        yield Side(eng, peer.name, addr, "cuda_ipc", lambda a, n: peer.call("get", a, n),
                   lambda a, d: peer.call("put", a, d), None,
                   lambda: peer.call("notifications"))


@pytest.fixture(params=[
    "tcp", "shm", "storage-file",
    pytest.param("rdma", marks=pytest.mark.rdma(rxe=3)),
    pytest.param("nvmeof", marks=pytest.mark.nvmeof),
    pytest.param("cuda_ipc", marks=pytest.mark.gpu),
])
def side(request, tmp_path):
    kind = request.param
    make = {"tcp": lambda: _memory("tcp"), "shm": lambda: _memory("shm"),
            "storage-file": lambda: _storage_file(tmp_path), "rdma": _rdma,
            "nvmeof": lambda: _nvmeof(tmp_path), "cuda_ipc": _cuda_ipc}[kind]
    yield from make()


@pytest.fixture
def local(side):
    buf = np.zeros(8 << 20, dtype=np.uint8)
    return buf, side.eng.register(buf)


# --------------------------------------------------------------------------- the contract
def test_write_then_read_back(side, local):
    buf, r = local
    buf[: 1 << 20] = rand(1 << 20, 1)
    side.eng.write(side.target, r.address, side.base, 1 << 20)
    assert sha(side.peek(side.base, 1 << 20)) == sha(buf[: 1 << 20])
    side.eng.read(side.target, r.address + (2 << 20), side.base, 1 << 20)
    assert sha(buf[2 << 20: 3 << 20]) == sha(buf[: 1 << 20])


def test_many_small_requests_in_one_batch(side, local):
    buf, r = local
    n, block = 1024, 4096           # fills the whole 4 MiB target
    buf[: n * block] = rand(n * block, 2)
    offs = np.arange(n, dtype=np.uint64) * block
    b = side.eng.submit_arrays(mte.WRITE, side.target, r.address + offs, side.base + offs,
                               block)
    b.wait()
    assert b.transport == side.route
    assert all(s == mte.TransferStatus("completed", block) for s in b.status())
    assert sha(side.peek(side.base, n * block)) == sha(buf[: n * block])
    # Scatter READ back in reverse order into the second half of the local buffer.
    dst = r.address + (4 << 20) + offs[::-1].copy()
    side.eng.submit_arrays(mte.READ, side.target, dst, side.base + offs, block).wait()
    back = buf[4 << 20: 8 << 20].reshape(n, block)[::-1].reshape(-1)
    assert sha(back) == sha(buf[: n * block])


def test_mixed_batch_keeps_caller_indices(side, local):
    buf, r = local
    buf[:8192] = rand(8192, 4)
    side.poke(side.base + 65536, bytes(range(256)) * 16)
    reqs = [
        mte.TransferRequest(mte.WRITE, r.address, side.target, side.base, 4096),
        mte.TransferRequest(mte.READ, r.address + 100000, side.target, side.base + 65536, 4096),
        mte.TransferRequest(mte.WRITE, r.address + 4096, side.target, side.base + 4096, 4096),
    ]
    b = side.eng.submit(reqs)
    b.wait()
    assert [s.transferred_bytes for s in b.status()] == [4096] * 3
    assert sha(side.peek(side.base, 8192)) == sha(buf[:8192])
    assert bytes(buf[100000:104096]) == bytes(range(256)) * 16


@pytest.mark.parametrize("op", [mte.WRITE, mte.READ])
def test_outside_the_target_is_refused_and_memory_unchanged(side, local, op):
    buf, r = local
    buf[:4096] = 0xAB
    before = sha(side.peek(side.base, side.size))
    # Straddles the end of the target's memory.
    with pytest.raises(mte.AddressNotRegisteredError, match=side.refused):
        (side.eng.write if op == mte.WRITE else side.eng.read)(
            side.target, r.address, side.base + side.size - 100, 4096)
    assert sha(side.peek(side.base, side.size)) == before
    if op == mte.READ:
        assert (buf[:4096] == 0xAB).all()          # nothing landed locally either
    # A good request after the rejected one still works.
    side.eng.write(side.target, r.address, side.base, 4096)
    assert side.peek(side.base, 4) == b"\xab" * 4


def test_local_memory_must_be_registered(side):
    junk = np.zeros(4096, np.uint8)           # never registered
    with pytest.raises(mte.AddressNotRegisteredError, match="register the buffer first"):
        side.eng.write(side.target, junk.ctypes.data, side.base, 4096)


def test_notifications_follow_the_data(side, local):
    if side.notes is None:
        pytest.skip("a storage segment is not an engine: nothing receives notifications")
    buf, r = local
    buf[:4096] = 1
    side.eng.submit_arrays(mte.WRITE, side.target, np.array([r.address], np.uint64),
                           np.array([side.base], np.uint64), 4096,
                           notify=b"kv-ready:42").wait()
    assert side.peek(side.base, 4096) == b"\x01" * 4096
    side.eng.send_notification(side.target, b"second")
    assert side.notes() == [(side.eng.name, b"kv-ready:42"), (side.eng.name, b"second")]
    assert side.notes() == []          # drained


def test_random_batches_match_a_model(side, local):
    """Random batches of READs and WRITEs (sizes from 1 byte to 1 MiB, unaligned, in any
    order); both memories match a model after every batch."""
    rng = np.random.default_rng(4)
    size = side.size
    buf, ra = local
    mine = buf[:size]
    mine[:] = rng.integers(0, 256, size, dtype=np.uint8)
    theirs = rng.integers(0, 256, size, dtype=np.uint8)
    side.poke(side.base, theirs.tobytes())
    for _ in range(6):
        reqs = []
        used_l, used_r = np.zeros(size, bool), np.zeros(size, bool)
        expect_mine, expect_theirs = mine.copy(), theirs.copy()
        for _ in range(int(rng.integers(1, 24))):
            n = int(rng.choice([1, 7, 4096, 65536 + 3, 200_000, 1 << 20]))
            lo, ro = int(rng.integers(0, size - n)), int(rng.integers(0, size - n))
            if used_l[lo:lo + n].any() or used_r[ro:ro + n].any():
                continue
            used_l[lo:lo + n] = used_r[ro:ro + n] = True
            op = mte.READ if rng.random() < 0.5 else mte.WRITE
            reqs.append(mte.TransferRequest(op, ra.address + lo, side.target, side.base + ro, n))
            if op == mte.READ:
                expect_mine[lo:lo + n] = theirs[ro:ro + n]
            else:
                expect_theirs[ro:ro + n] = mine[lo:lo + n]
        batch = side.eng.submit(reqs, timeout=60)
        batch.wait()
        assert batch.transport == side.route
        assert all(s.state == "completed" for s in batch.status())
        assert (mine == expect_mine).all()
        theirs = expect_theirs
        assert sha(side.peek(side.base, size)) == sha(theirs)

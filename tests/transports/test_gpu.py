# SPDX-License-Identifier: Apache-2.0
"""GPU memory: intake (__cuda_array_interface__, DLPack), TCP with pinned staging, CUDA
IPC between processes, and the refusals without CUDA.

Host-side tests run everywhere: CAI parsing (fake CAI objects over host memory, parsing
only), the refusal messages on a machine without CUDA, the slot table that keeps IPC
importers out of unregistered regions. Tests marked ``gpu`` need a CUDA GPU and CuPy
(and PyTorch for the torch cases); ``multi_gpu`` needs two GPUs. Without them they skip
with the reason (conftest.py)."""
from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
import weakref

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import cuda
from mooncake_te.memory import parse_cai
from mooncake_te.transports.cuda_ipc.slots import SlotTable, SlotView

from gpu_peer import GpuPeer, checksum, expected, fill, free_caches, gpu_buffer

HAVE_CUDA, NO_CUDA_REASON = cuda.available()


class FakeCAI:
    """__cuda_array_interface__ over host memory: for parsing tests only."""

    def __init__(self, nbytes=4096, **over):
        self.host = np.zeros(nbytes, np.uint8)
        self.__cuda_array_interface__ = dict(
            {"version": 3, "shape": (nbytes,), "typestr": "|u1",
             "data": (self.host.ctypes.data, False), "strides": None, "stream": None}, **over)


# --- host side: parsing and refusals ---------------------------------------------------
def test_parse_cai_v2_v3_contiguous():
    f = FakeCAI(4096)
    assert parse_cai(f.__cuda_array_interface__) == (f.host.ctypes.data, 4096, False, None)
    cai = dict(f.__cuda_array_interface__, version=2, shape=(16, 64), typestr="<f4",
               strides=(256, 4), data=(f.host.ctypes.data, True))
    cai.pop("stream")
    assert parse_cai(cai) == (f.host.ctypes.data, 4096, True, None)
    # size-1 dimensions may carry any stride (PyTorch does this)
    assert parse_cai(dict(cai, shape=(1, 1024), strides=(7, 4)))[1] == 4096
    assert parse_cai(dict(f.__cuda_array_interface__, stream=1))[3] == 1


@pytest.mark.parametrize("over, words", [
    ({"version": 1}, "version 1"),
    ({"strides": (2,), "shape": (2048,)}, "non-contiguous"),
    ({"mask": object()}, "masked"),
    ({"shape": (0,)}, "empty"),
    ({"stream": 0}, "wrong stream usage"),
    ({"stream": -5}, "stream -5"),
    ({"data": (0, False)}, "null data pointer"),
])
def test_parse_cai_refusals(over, words):
    with pytest.raises(mte.InvalidArgumentError, match=words):
        parse_cai(FakeCAI(4096, **over).__cuda_array_interface__, "FakeCAI")


def test_parse_cai_malformed():
    with pytest.raises(mte.InvalidArgumentError, match="malformed"):
        parse_cai({"version": 3, "shape": (4,)})


@pytest.mark.skipif(HAVE_CUDA, reason="checks the refusals of a machine without CUDA")
def test_gpu_memory_refused_clearly_without_cuda(engine):
    with pytest.raises(mte.TransportUnavailableError, match="GPU memory, but CUDA is unavail"):
        engine.register(FakeCAI())
    buf = np.zeros(4096, np.uint8)
    with pytest.raises(mte.InvalidArgumentError, match="cannot register cuda:0 memory"):
        engine.register_address(buf.ctypes.data, 4096, location="cuda:0", owner=buf)
    with pytest.raises(mte.InvalidArgumentError, match="use 'auto', 'cpu:<numa node>' or"):
        engine.register_address(buf.ctypes.data, 4096, location="gpu0", owner=buf)
    ok, reason = cuda.available()
    assert not ok and reason
    with pytest.raises(mte.TransportUnavailableError):
        cuda.pointer_info(buf.ctypes.data)
    assert not cuda.loaded()                # nothing above loaded a driver
    assert engine.regions == []


def test_slot_table_keeps_importers_out_after_retire():
    table = SlotTable(f"test{os.getpid()}")
    try:
        s1, e1 = table.add()
        s2, e2 = table.add()
        view = SlotView(table.path)
        assert view.acquire(s1, e1) and view.acquire(s1, e1)     # counted per process
        assert not view.acquire(s2, e1)                          # wrong epoch
        done = []
        t = threading.Thread(target=lambda: done.append(table.retire(s1, timeout=10)))
        t.start()
        time.sleep(0.2)
        assert not done                       # an importer still holds the slot
        view.release(s1)
        time.sleep(0.1)
        assert not done                       # ...twice
        view.release(s1)
        t.join(5)
        assert done == [True]
        assert not view.acquire(s1, e1)       # retired: refused
        s3, e3 = table.add()                  # the slot is reused with a new epoch
        assert s3 == s1 and e3 != e1
        assert not view.acquire(s1, e1) and view.acquire(s3, e3)
        view.release(s3)
        assert table.retire(s2, timeout=1)
        view.close()
    finally:
        table.close()
    assert not os.path.exists(table.path)


def test_slot_view_takes_many_slots_at_once():
    """acquire_many/release_many (one lock per run of slots) keep the rules of
    acquire/release: wrong or stale epochs refused, counts per slot, a retiring slot
    refused while its neighbours in the run are taken, retire waits for every holder."""
    table = SlotTable(f"many{os.getpid()}")
    try:
        se = [table.add() for _ in range(6)]
        view = SlotView(table.path)
        slots = [s for s, _ in se]
        epochs = [e for _, e in se]
        epochs[2] += 2                                       # a stale epoch: refused
        assert view.acquire_many(slots, epochs) == [True, True, False, True, True, True]
        assert view.acquire(slots[0], se[0][1])              # counted with acquire's
        assert view.acquire_many([slots[1], slots[1]], [se[1][1]] * 2) == [True, True]
        assert table.retire(slots[2], timeout=0.2)           # never taken: quiet at once
        done = []
        t = threading.Thread(target=lambda: done.append(table.retire(slots[1], timeout=10)))
        t.start()
        time.sleep(0.2)
        view.release_many([slots[1], slots[1]])
        time.sleep(0.1)
        assert not done                                      # still held once
        view.release_many([slots[0], slots[1], slots[3], slots[4], slots[5]])
        t.join(5)
        assert done == [True]
        assert not view.acquire_many([slots[1]], [se[1][1]])[0]   # retired: refused
        view.release(slots[0])                               # the acquire() above
        for s in (0, 3, 4, 5):                               # nothing left held
            assert table.retire(slots[s], timeout=0.2)
        # A run with a slot being retired: its neighbours are still taken.
        s7, e7 = table.add()
        s8, e8 = table.add()
        other = SlotView(table.path)
        assert other.acquire(s8, e8)
        t = threading.Thread(target=lambda: done.append(table.retire(s8, timeout=10)))
        t.start()
        time.sleep(0.2)                          # epoch 0 written, waiting for `other`
        assert view.acquire_many([s7, s8], [e7, e8]) == [True, False]
        other.release(s8)
        t.join(5)
        view.release_many([s7])
        assert table.retire(s7, timeout=0.2)
        view.close()
        other.close()
    finally:
        table.close()


def test_slot_retire_gives_up_on_a_stuck_importer():
    table = SlotTable(f"stuck{os.getpid()}")
    try:
        s, e = table.add()
        view = SlotView(table.path)
        assert view.acquire(s, e)
        t0 = time.monotonic()
        assert table.retire(s, timeout=0.3) is False
        assert 0.25 < time.monotonic() - t0 < 5
        view.close()
    finally:
        table.close()


# --- on a GPU --------------------------------------------------------------------------
gpu = pytest.mark.gpu
LIBS = ["cupy", "torch"]


def _need(lib):
    if lib == "torch":
        torch = pytest.importorskip("torch", reason="PyTorch is not installed")
        if not torch.cuda.is_available():
            pytest.skip("PyTorch sees no CUDA device")


@gpu
def test_cuda_module_basics():
    assert HAVE_CUDA, NO_CUDA_REASON
    import cupy as cp
    assert cuda.device_count() >= 1
    x = cp.zeros(4 << 20, cp.uint8)
    assert cuda.pointer_info(x.data.ptr) == (True, x.device.id)
    host = np.zeros(4096, np.uint8)
    assert cuda.pointer_info(host.ctypes.data) == (False, -1)
    with cuda.PinnedBuffer(1 << 20) as pb:
        assert cuda.pointer_info(pb.address)[0] is False
        pb.array[:] = 7
        s = cuda.Stream(0)
        with cuda.device(0):
            cuda.memcpy_async(x.data.ptr, pb.address, 1 << 20, s)
        s.synchronize()
        s.close()
    assert int(x[: 1 << 20].sum()) == 7 << 20
    base, size = cuda.allocation_range(x.data.ptr + 100)
    assert base <= x.data.ptr and x.data.ptr + x.nbytes <= base + size
    fd = cuda.dmabuf_fd(x.data.ptr, 2 << 20)       # the RDMA transport's door
    assert fd >= 0
    os.close(fd)
    # topology matches sysfs GPUs to CUDA ordinals through the same bus ids
    from mooncake_te.topology.cuda import cuda_bus_ids
    assert [b for b, _ in cuda_bus_ids()] == cuda.pci_bus_ids()


@gpu
@pytest.mark.parametrize("lib", LIBS)
def test_register_gpu_slice_keeps_exporter(engine, lib):
    _need(lib)
    obj, base = gpu_buffer(lib, 1 << 20, offset=4096)
    r = engine.register(obj)
    assert r.location == "cuda:0" and r.length == 1 << 20
    base_addr = base.data_ptr() if lib == "torch" else base.data.ptr
    assert r.address == base_addr + 4096          # the slice, not its allocation
    ref = weakref.ref(obj)
    del obj
    gc.collect()
    assert ref() is not None                      # kept alive while registered
    with pytest.raises(mte.InvalidArgumentError, match="driver places this"):
        engine.register(base[: 4096], location="cuda:1")
    engine.unregister(r)
    del r
    gc.collect()
    assert ref() is None


@gpu
def test_register_dlpack_only_object(engine):
    import cupy as cp

    class OnlyDLPack:          # hides __cuda_array_interface__, keeps __dlpack__
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, stream=None):
            return self.a.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    a = cp.arange(1 << 16, dtype=cp.uint8)
    r = engine.register(OnlyDLPack(a))
    assert (r.address, r.length, r.location) == (a.data.ptr, 1 << 16, "cuda:0")
    engine.unregister(r)


@gpu
def test_wrong_stream_usage_caught(engine):
    import cupy as cp

    class Exported:            # a v3 exporter naming the stream its data was made on
        def __init__(self, arr, stream):
            self.arr = arr
            self.__cuda_array_interface__ = dict(arr.__cuda_array_interface__, version=3,
                                                 stream=stream)

    x = cp.zeros(1 << 20, cp.uint8)
    with pytest.raises(mte.InvalidArgumentError, match="wrong stream usage.*stream 0"):
        engine.register(Exported(x, 0))
    with pytest.raises(mte.InvalidArgumentError, match="wrong stream usage.*stream 0"):
        engine.register_many([x, Exported(x[1024:], 0)])      # all or nothing
    # (A destroyed stream handle cannot be told from a live one: the driver's behaviour
    # on one is undefined, a crash here. Only the exporter can keep that promise.)
    assert engine.regions == []
    # A live stream is honoured: registration waits for the work queued on it, so the
    # engine's own streams see the finished data.
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        y = cp.zeros(256 << 20, cp.uint8)
        for _ in range(20):
            y += 1
    r = engine.register(Exported(y, s.ptr))
    assert r.location == "cuda:0"
    assert s.done                      # synchronized by register()
    assert int(y[-1]) == 20
    engine.unregister(r)


def _roundtrip(eng, peer, lib, protocol_expect, n=8 << 20, block=1 << 20):
    """WRITE a GPU pattern to the peer's GPU buffer, READ it back into another, check
    both sides' checksums on the GPU."""
    src, _ = gpu_buffer(lib, n)
    dst, _ = gpu_buffer(lib, n)
    rs, rd = eng.register(src), eng.register(dst)
    addr, loc = peer.call("alloc", lib, n, 512, 0, "rw")
    assert loc == "cuda:0"
    fill(rs.address, n, 11, True)
    offs = np.arange(0, n, block, dtype=np.uint64)
    b = eng.submit_arrays(mte.WRITE, peer.name, rs.address + offs, addr + offs, block)
    b.wait(timeout=60)
    assert b.transport == protocol_expect
    assert peer.call("checksum", addr, n) == expected(n, 11)
    b = eng.submit_arrays(mte.READ, peer.name, rd.address + offs, addr + offs, block)
    b.wait(timeout=60)
    assert b.transport == protocol_expect
    assert checksum(rd.address, n, True) == expected(n, 11)
    # one request bigger than a slice, and the synchronous path
    peer.call("fill", addr, n, 12)
    eng.read(peer.name, rd.address, addr, n)
    assert checksum(rd.address, n, True) == expected(n, 12)
    eng.write(peer.name, rs.address + 4096, addr + 100, 1000)
    eng.unregister(rs)
    eng.unregister(rd)


@gpu
@pytest.mark.parametrize("lib", LIBS)
def test_two_processes_gpu_over_tcp(lib):
    _need(lib)
    with GpuPeer() as peer, mte.TransferEngine(host="127.0.0.1", protocol="tcp") as eng:
        _roundtrip(eng, peer, lib, "tcp")


@gpu
@pytest.mark.parametrize("lib", LIBS)
def test_two_processes_gpu_over_ipc(lib):
    _need(lib)
    with GpuPeer() as peer, mte.TransferEngine(host="127.0.0.1") as eng:
        _roundtrip(eng, peer, lib, "cuda_ipc")


@gpu
@pytest.mark.parametrize("protocol, expect", [("auto", "shm"), ("tcp", "tcp")])
def test_mixed_cpu_gpu_batch(protocol, expect):
    """GPU->CPU, CPU->GPU and GPU->GPU in one batch: the peer's host memory is in the
    group, so the TCP transport carries it (same-host path under auto), GPU sides staged."""
    n = 3 << 20
    with GpuPeer() as peer, mte.TransferEngine(host="127.0.0.1", protocol=protocol) as eng:
        g, _ = gpu_buffer("cupy", n)
        c = np.zeros(n, np.uint8)
        rg, rc = eng.register(g), eng.register(c)
        pg, _ = peer.call("alloc", "cupy", n, 0, 0, "rw")
        pc, loc = peer.call("alloc", "cpu", n, 0, 0, "rw")
        assert loc.startswith("cpu")
        fill(rg.address, n, 21, True)
        fill(rc.address, n, 22, False)
        h = n // 2
        reqs = [mte.TransferRequest(mte.WRITE, rg.address, peer.name, pc, h),          # G->C
                mte.TransferRequest(mte.WRITE, rc.address, peer.name, pg, h),          # C->G
                mte.TransferRequest(mte.WRITE, rg.address + h, peer.name, pg + h, h)]  # G->G
        b = eng.submit(reqs)
        b.wait(timeout=60)
        assert b.transport == expect
        fill(rg.address, n, 0, True)       # now READ everything back crosswise
        fill(rc.address, n, 0, False)
        reqs = [mte.TransferRequest(mte.READ, rc.address, peer.name, pc, h),           # C<-C
                mte.TransferRequest(mte.READ, rg.address, peer.name, pg, n)]           # G<-G
        eng.submit(reqs).wait(timeout=60)
        assert checksum(rc.address, h, False) == expected(h, 21)
        got = checksum(rg.address, n, True)
        import cupy as cp
        want = cp.concatenate([_pat(h, 22), _pat(n - h, 21, skip=h)])
        assert got == checksum(want.data.ptr, n, True)


def _pat(n, seed, skip=0):
    import cupy as cp

    from gpu_peer import pattern
    return pattern(n + skip, seed, cp)[skip:]


@gpu
@pytest.mark.parametrize("protocol", ["auto", "tcp"])
def test_freed_after_unregister_is_refused(protocol):
    """The owner unregisters and frees its buffer: a peer holding the old descriptor
    (and, over IPC, an open mapping) is refused and writes nothing."""
    n = 1 << 20
    with GpuPeer() as peer, mte.TransferEngine(host="127.0.0.1", protocol=protocol) as eng:
        src, _ = gpu_buffer("torch" if _has_torch() else "cupy", n)
        rs = eng.register(src)
        fill(rs.address, n, 5, True)
        addr, _ = peer.call("alloc", "cupy", n, 0, 0, "rw")
        eng.write(peer.name, rs.address, addr, n)             # maps it (IPC under auto)
        assert peer.call("checksum", addr, n) == expected(n, 5)
        peer.call("unregister_free", addr)
        with pytest.raises(mte.AddressNotRegisteredError):
            eng.write(peer.name, rs.address, addr, n)             # stale descriptor
        # The memory again, for a new region, likely at the same address. Over TCP the
        # owner checks addresses against its current regions, so a write there is a write
        # to the new region; an IPC importer holds a mapping of the *old* allocation and
        # must not use it: its stale descriptor's region is refused.
        addr2, _ = peer.call("alloc", "cupy", n, 0, 0, "rw")
        peer.call("fill", addr2, n, 6)
        if protocol == "auto":
            with pytest.raises(mte.AddressNotRegisteredError):
                eng.write(peer.name, rs.address, addr2 if addr2 == addr else addr, n)
            assert peer.call("checksum", addr2, n) == expected(n, 6)
        # once the descriptor is fetched again, the new region works
        eng.open_segment(peer.name, refresh=True)
        eng.write(peer.name, rs.address, addr2, n)
        assert peer.call("checksum", addr2, n) == expected(n, 5)


def _has_torch():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


@gpu
def test_gpu_between_engines_of_one_process(engine_pair):
    """Two engines of one process: CUDA IPC cannot open a process's own handles, so the
    transport uses the pointers directly."""
    a, b = engine_pair
    n = 4 << 20
    x, _ = gpu_buffer("cupy", n)
    y, _ = gpu_buffer("cupy", n)
    ra, rb = a.register(x), b.register(y)
    fill(ra.address, n, 8, True)
    bt = a.submit([mte.TransferRequest(mte.WRITE, ra.address, b.name, rb.address, n)])
    bt.wait(timeout=30)
    assert bt.transport == "cuda_ipc"
    assert checksum(rb.address, n, True) == expected(n, 8)
    b.unregister(rb)
    with pytest.raises(mte.AddressNotRegisteredError):
        a.write(b.name, ra.address, rb.address, n)


@pytest.mark.multi_gpu
def test_two_gpus_two_processes_ipc():
    """#12: one process per GPU, both directions, WRITE and READ through CUDA IPC."""
    n = 64 << 20
    with GpuPeer() as peer, mte.TransferEngine(host="127.0.0.1") as eng:
        import cupy as cp
        with cp.cuda.Device(1):
            mine = cp.zeros(n, cp.uint8)
        r = eng.register(mine)
        assert r.location == "cuda:1"
        addr, loc = peer.call("alloc", "cupy", n, 0, 0, "rw")
        assert loc == "cuda:0"
        fill(r.address, n, 31, True)
        b = eng.submit_arrays(mte.WRITE, peer.name, [r.address], [addr], n)
        b.wait(timeout=60)
        assert b.transport == "cuda_ipc"
        assert peer.call("checksum", addr, n) == expected(n, 31)
        peer.call("fill", addr, n, 32)
        eng.read(peer.name, r.address, addr, n)
        with cp.cuda.Device(1):
            assert checksum(r.address, n, True) == expected(n, 32)


@gpu
def test_gpu_blocks_to_a_host_pool_of_this_process_by_dma():
    """KV offload in one process: GPU blocks to another engine's host pool and back go
    one cuMemcpyAsync each ("cuda_dma"), bytes intact; an access-"r" pool refuses WRITEs;
    the pool's owner can unregister it afterwards (its page-locking is undone)."""
    import cupy as cp
    with mte.TransferEngine(host="127.0.0.1") as a, mte.TransferEngine(host="127.0.0.1") as b:
        blk, nblk = 256 << 10, 16
        g = cp.random.randint(0, 256, blk * nblk, dtype=cp.uint8)
        a.register(g)
        pool = np.zeros(blk * nblk, np.uint8)
        pr = b.register(pool)
        ids = np.array([3, 0, 9, 15], np.uint64)
        src = g.data.ptr + ids * blk
        dst = pr.address + np.arange(len(ids), dtype=np.uint64) * blk
        batch = a.submit_arrays(mte.WRITE, b.name, src, dst, blk)
        batch.wait(timeout=30)
        assert batch.transport == "cuda_dma"
        host = cp.asnumpy(g).reshape(nblk, blk)
        assert (pool.reshape(nblk, blk)[:4] == host[ids.astype(int)]).all()
        g.fill(0)
        a.submit_arrays(mte.READ, b.name, src, dst, blk).wait(timeout=30)
        assert (cp.asnumpy(g).reshape(nblk, blk)[ids.astype(int)] == host[ids.astype(int)]).all()
        ro = b.register(np.zeros(blk, np.uint8), access="r")
        bad = a.submit_arrays(mte.WRITE, b.name, src[:1], np.array([ro.address], np.uint64), blk)
        with pytest.raises(mte.MooncakeError):
            bad.wait(timeout=30)
        b.unregister(pr)


def test_host_dma_route_takes_arrays_and_ints_and_skips_host_memory():
    """The same-process GPU<->host route is asked with arrays (batches) and with ints (a
    synchronous request); with host memory on our side it must decline, not raise (a
    TypeError here once broke every synchronous CUDA IPC transfer)."""
    from mooncake_te.core import Regions
    from mooncake_te.transports.base import TransportContext
    from mooncake_te.transports.cuda_ipc import CudaIpcTransport
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp") as a, \
            mte.TransferEngine(host="127.0.0.1", protocol="tcp") as b:
        pr = b.register(np.zeros(1 << 16, np.uint8))
        t = CudaIpcTransport(TransportContext(regions=Regions(), host="127.0.0.1",
                                              name="probe", instance=1, config={}))
        try:
            desc = a.open_segment(b.name).descriptor
            assert t.route(desc, mte.WRITE, 4096, pr.address) is None
            assert t.route(desc, mte.READ, np.array([4096], np.uint64),
                           np.array([pr.address], np.uint64)) is None
        finally:
            t.close()

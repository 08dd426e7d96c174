# SPDX-License-Identifier: Apache-2.0
"""The connector with vLLM's KV cache in GPU memory, without vLLM: vLLM-shaped GPU KV
tensors (FlashAttention, FlashInfer, MLA, the cross-layer layout, HND stride order) read
by ``layout_from_tensors``, copied to and from block images by the batched GPU copier,
stored in and loaded from a real KVCache (DRAM and SSD), through the pool worker, and
P/D between two processes (CUDA IPC and TCP staging).

Needs PyTorch with a CUDA GPU: CI has none, so everything here skips there; run it on a
GPU machine with ``scripts/gpu_check.sh``."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch with a CUDA GPU "
                                            "(scripts/gpu_check.sh runs this on one)")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (CI has none; scripts/gpu_check.sh runs these on one)",
                allow_module_level=True)

from mooncake_te import cuda  # noqa: E402
from mooncake_te.cuda.kvcopy import DeviceBlockCopier  # noqa: E402
from mooncake_te.integrations.vllm.layout import layout_from_tensors  # noqa: E402
from mooncake_te.kvcache import KVCache  # noqa: E402

NB, BS, H, D, L = 40, 16, 8, 128, 4


def _rand(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def make_kv(kind: str, seed: int = 0):
    """Per-layer KV tensors as vLLM's GPU backends lay them out."""
    if kind == "flash_attn":            # [2, num_blocks, block_size, kv_heads, head_dim]
        return {f"l{i}": _rand((2, NB, BS, H, D), seed + i) for i in range(L)}
    if kind == "flashinfer":            # [num_blocks, 2, block_size, kv_heads, head_dim]
        return {f"l{i}": _rand((NB, 2, BS, H, D), seed + i) for i in range(L)}
    if kind == "mla":                   # [num_blocks, block_size, kv_lora_rank + rope dim]
        return {f"l{i}": _rand((NB, BS, 576), seed + i) for i in range(L)}
    if kind == "hnd":                   # FlashAttention's shape over an HND physical order
        return {f"l{i}": _rand((2, NB, H, BS, D), seed + i).permute(0, 1, 3, 2, 4)
                for i in range(L)}
    if kind == "cross_layer":           # one tensor [num_blocks, layers, 2, bs, h, d]
        t = _rand((NB, L, 2, BS, H, D), seed)
        return {f"l{i}": t[:, i].permute(1, 0, 2, 3, 4) for i in range(L)}
    raise ValueError(kind)


KINDS = ("flash_attn", "flashinfer", "mla", "hnd", "cross_layer")


def block_image(layout, b: int) -> np.ndarray:
    """Block ``b`` of every region, one after another, read with plain cuMemcpy."""
    out = []
    for base, stride, blen in zip(layout.base, layout.stride, layout.block_len):
        host = torch.empty(int(blen), dtype=torch.uint8)
        src = int(base) + b * int(stride)
        torch.cuda.synchronize()
        cuda.memcpy(host.data_ptr(), src, int(blen))
        out.append(host.numpy())
    return np.concatenate(out)


def pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@pytest.mark.parametrize("kind", KINDS)
def test_layouts_are_read_from_the_tensors(kind):
    kv = make_kv(kind)
    layout, storages = layout_from_tensors(kv)
    assert layout.num_blocks == NB
    per_block = {"flash_attn": 2 * BS * H * D * 2, "flashinfer": 2 * BS * H * D * 2,
                 "mla": BS * 576 * 2, "hnd": 2 * BS * H * D * 2,
                 "cross_layer": 2 * BS * H * D * 2}[kind]
    assert int(layout.block_len.sum()) == L * per_block
    assert len(storages) == (1 if kind == "cross_layer" else L)


@pytest.mark.parametrize("kind", KINDS)
def test_gather_and_scatter_every_layout(kind):
    kv = make_kv(kind, seed=3)
    layout, _ = layout_from_tensors(kv)
    cp = DeviceBlockCopier.from_layout(layout, staging_bytes=4 * int(layout.block_len.sum()))
    try:
        ids = [7, 3, 39, 0, 12, 13, 14]           # more than a staging half: 3 chunks
        bb = cp.block_bytes
        host = pinned(len(ids) * bb)
        cp.gather_to(ids, [host.data_ptr() + i * bb for i in range(len(ids))])
        imgs = host.numpy().reshape(len(ids), bb)
        for j, b in enumerate(ids):
            assert np.array_equal(imgs[j], block_image(layout, b)), (kind, b)
        # Back into other blocks: every region of those blocks equals the source's.
        dst = [20, 21, 25, 30, 31, 1, 2]
        before = {b: block_image(layout, b) for b in (19, 22, 24, 26)}   # untouched
        cp.scatter_from([host.data_ptr() + i * bb for i in range(len(ids))], dst)
        for j, b in enumerate(dst):
            assert np.array_equal(block_image(layout, b), imgs[j]), (kind, b)
        for b, img in before.items():
            assert np.array_equal(block_image(layout, b), img)
        with pytest.raises(Exception, match="outside"):
            cp.gather_to([NB], [host.data_ptr()])
    finally:
        cp.close()


def test_fence_orders_the_copy_after_the_forward_pass():
    # A long kernel on the compute stream writes the block; the gather fenced on that
    # stream must see the written values, not the old ones.
    kv = make_kv("flash_attn", seed=5)
    layout, _ = layout_from_tensors(kv)
    cp = DeviceBlockCopier.from_layout(layout)
    try:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):
                a = a @ a / 64.0                    # keep the stream busy
            for t in kv.values():
                t[:, 5].fill_(1.5)
        ev = cp.fence(s.cuda_stream)
        host = pinned(cp.block_bytes)
        cp.gather_to([5], [host.data_ptr()], after=ev)
        want = torch.full((BS, H, D), 1.5, dtype=torch.bfloat16).view(torch.uint8).numpy()
        assert np.array_equal(host.numpy()[:want.size], want.reshape(-1))
        ev.close()
    finally:
        cp.close()


def test_through_the_kvcache_dram_and_ssd(tmp_path):
    kv = make_kv("flash_attn", seed=9)
    layout, _ = layout_from_tensors(kv)
    cp = DeviceBlockCopier.from_layout(layout)
    bb = cp.block_bytes
    keys = [bytes([i]) * 16 for i in range(8)]
    src = list(range(8))
    want = {i: block_image(layout, b) for i, b in enumerate(src)}
    try:
        c = KVCache(bb, 4 * (bb + 8192), 16 * (bb + 8192), str(tmp_path / "kv"),
                    log_interval_s=0)
        cp.pin_host(c.base, c.dram_slots * c.slot_size)
        c.put(keys, fill=lambda items: cp.gather_to([src[i] for i, _ in items],
                                                     [v.ctypes.data for _, v in items]))
        assert c.stats()["dram_blocks"] == 4 and c.stats()["ssd_blocks"] >= 4
        cp.unpin_host(c.base)
        c.close(persist=True)
        c = KVCache(bb, 4 * (bb + 8192), 16 * (bb + 8192), str(tmp_path / "kv"),
                    log_interval_s=0)
        cp.pin_host(c.base, c.dram_slots * c.slot_size)
        dst = list(range(30, 38))

        class Sink:
            def __init__(self):
                self.q = []

            def __call__(self, i, view):
                self.q.append((dst[i], view.ctypes.data))

            def flush(self):
                if self.q:
                    cp.scatter_from([a for _, a in self.q], [b for b, _ in self.q])
                self.q = []
        got = c.get(keys, copy=Sink())             # 8 blocks from SSD through 4 slots
        assert got == [bb] * 8
        for i, b in enumerate(dst):
            assert np.array_equal(block_image(layout, b), want[i]), b
        cp.unpin_host(c.base)
        c.close()
    finally:
        cp.close()


# --- the pool worker with a GPU KV cache ----------------------------------------------------
def _pool_settings(tmp_path, bb, dram_blocks, ssd_blocks, **kw):
    from mooncake_te.integrations.vllm.pool import PoolSettings
    slot = bb + 4096
    return PoolSettings(dram_bytes=dram_blocks * slot, ssd_bytes=ssd_blocks * slot,
                        cache_dir=str(tmp_path / "kv") if ssd_blocks else "", **kw)


def _worker(settings, layout, ns="gpu-ns"):
    import uuid

    from mooncake_te.integrations.vllm.pool import PoolWorker, lookup_address
    return PoolWorker(settings, layout, None, ns, lookup_address(uuid.uuid4().hex))


def _settle(pool, rid, timeout=30.0):
    import time
    t = time.monotonic() + timeout
    while True:
        saved, loaded = pool.collect()
        if rid in saved or rid in loaded:
            return saved, loaded
        assert time.monotonic() < t, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ("flash_attn", "flashinfer", "mla", "cross_layer"))
def test_pool_worker_saves_and_loads_gpu_blocks(tmp_path, kind):
    from mooncake_te.integrations.vllm.gpu_copier import GpuBlockCopier
    from mooncake_te.integrations.vllm.pool import PoolLoadSpec, SaveSpec
    kv = make_kv(kind, seed=11)
    layout, _ = layout_from_tensors(kv)
    pool = _worker(_pool_settings(tmp_path, int(layout.block_len.sum()), 8, 16), layout)
    try:
        assert isinstance(pool.copier, GpuBlockCopier)
        keys = [bytes([i + 1]) * 16 for i in range(6)]
        src, dst = [2, 4, 6, 8, 10, 12], [30, 31, 32, 33, 34, 35]
        want = [block_image(layout, b) for b in src]
        assert pool.save(SaveSpec("r1", keys, src))
        _settle(pool, "r1")
        pool.load(PoolLoadSpec("r2", keys, dst))
        _, loaded = _settle(pool, "r2")
        assert loaded == {"r2": True}
        for i, b in enumerate(dst):
            assert np.array_equal(block_image(layout, b), want[i]), (kind, b)
        c = pool.take_counters()
        assert c["blocks_saved"] == 6 and c["blocks_loaded"] == 6
    finally:
        pool.close()


def test_pool_worker_gpu_ssd_after_restart_corrupt_and_evicted(tmp_path):
    from mooncake_te.integrations.vllm.pool import PoolLoadSpec, SaveSpec
    kv = make_kv("flash_attn", seed=12)
    layout, _ = layout_from_tensors(kv)
    bb = int(layout.block_len.sum())
    keys = [bytes([i + 1]) * 16 for i in range(6)]
    pool = _worker(_pool_settings(tmp_path, bb, 8, 16), layout)
    want = [block_image(layout, b) for b in range(6)]
    assert pool.save(SaveSpec("r1", keys, list(range(6))))
    _settle(pool, "r1")
    pool.close()                                    # persists the DRAM tier to SSD
    pool = _worker(_pool_settings(tmp_path, bb, 8, 16), layout)
    try:
        assert pool.lookup(keys)[:2] == (0, 6) or sum(pool.lookup(keys)) == 6
        pool.load(PoolLoadSpec("r2", keys, list(range(20, 26))))
        _, loaded = _settle(pool, "r2")
        assert loaded == {"r2": True}
        for i in range(6):
            assert np.array_equal(block_image(layout, 20 + i), want[i])
        # A key nobody holds (evicted since the lookup): a failed load, nothing served.
        gone = [keys[0], b"\xee" * 16]
        before = block_image(layout, 27)
        pool.load(PoolLoadSpec("r3", gone, [26, 27]))
        _, loaded = _settle(pool, "r3")
        assert loaded == {"r3": False}
        assert np.array_equal(block_image(layout, 27), before)
    finally:
        pool.close()
    # A corrupt SSD record: the block is dropped, the load fails, vLLM recomputes.
    import glob
    slab = glob.glob(str(tmp_path / "kv" / "**" / "kvcache.slab"), recursive=True)[0]
    with open(slab, "r+b") as f:
        f.seek(4096 + 100)
        f.write(b"\xff" * 64)
    pool = _worker(_pool_settings(tmp_path, bb, 8, 16), layout)
    try:
        pool.load(PoolLoadSpec("r4", keys, list(range(30, 36))))
        _, loaded = _settle(pool, "r4")
        assert loaded == {"r4": False}
        assert pool.take_counters()["failed_loads"] == 1
    finally:
        pool.close()


def test_layer_wise_save_copies_each_layer_after_its_forward_pass(tmp_path):
    # A forward pass as vLLM runs it: each layer's KV written on the compute stream (busy
    # with other work first), then save_kv_layer; wait_for_save at the end. The pool must
    # hold what each layer wrote, and the next step's writes (queued right after
    # wait_for_save) must not reach the saved copy.
    from mooncake_te.integrations.vllm.pool import PoolLoadSpec, SaveSpec
    kv = make_kv("flash_attn", seed=40)
    layout, _ = layout_from_tensors(kv)
    bb = int(layout.block_len.sum())
    pool = _worker(_pool_settings(tmp_path, bb, 16, 0), layout)
    try:
        keys = [bytes([i + 1]) * 16 for i in range(5)]
        ids = [3, 4, 5, 6, 7]
        s = torch.cuda.Stream()
        a = torch.randn(2048, 2048, device="cuda")
        with torch.cuda.stream(s):
            pool.begin_layer_saves([SaveSpec("r", keys, ids)])
            for n, (name, t) in enumerate(kv.items()):
                for _ in range(5):
                    a = a @ a / 40.0                 # the layer's compute
                for j, b in enumerate(ids):
                    t[:, b].fill_(float(n * 10 + j))
                pool.save_layer(name)
            pool.end_layer_saves()
            for t in kv.values():                    # the next step overwrites them
                t[:, ids].fill_(-1.0)
        want = {}
        for n, name in enumerate(kv):
            for j in range(len(ids)):
                want[(n, j)] = float(n * 10 + j)
        assert pool.flush()
        c = pool.take_counters()
        assert c["blocks_layer_saved"] == 5 and c["blocks_saved"] == 5
        assert pool.collect() == (set(), {})         # nothing held, nothing to report
        dst = [20, 21, 22, 23, 24]
        pool.load(PoolLoadSpec("l", keys, dst))
        assert pool.collect()[1] == {"l": True}
        for n, t in enumerate(kv.values()):
            for j, b in enumerate(dst):
                assert bool((t[:, b] == want[(n, j)]).all()), (n, j)
        # Layers vLLM did not announce are copied at wait_for_save.
        pool.begin_layer_saves([SaveSpec("r2", [b"\x77" * 16], [9])])
        pool.end_layer_saves()
        assert pool.flush()
        assert pool.take_counters()["blocks_layer_saved"] == 1
    finally:
        pool.close()


def test_layer_wise_staging_full_leaves_blocks_to_the_request_end(tmp_path):
    from mooncake_te.integrations.vllm.pool import SaveSpec
    kv = make_kv("flash_attn", seed=41)
    layout, _ = layout_from_tensors(kv)
    bb = int(layout.block_len.sum())
    # A save queue (and staging) of two blocks: three asked, two staged, one skipped.
    pool = _worker(_pool_settings(tmp_path, bb, 16, 0, save_queue_bytes=2 * bb), layout)
    try:
        pool.begin_layer_saves([SaveSpec("r", [bytes([i + 1]) * 16 for i in range(3)],
                                         [1, 2, 3])])
        pool.end_layer_saves()
        assert pool.flush()
        c = pool.take_counters()
        assert c["blocks_layer_saved"] == 2 and c["blocks_layer_skipped"] == 1
    finally:
        pool.close()


def test_tp2_ranks_keep_their_own_keys_and_dirs(tmp_path):
    from mooncake_te.integrations.vllm.pool import PoolLoadSpec, SaveSpec
    from mooncake_te.integrations.vllm.worker import rank_pool_settings
    kvs = [make_kv("flash_attn", seed=20 + r) for r in range(2)]
    layouts = [layout_from_tensors(k)[0] for k in kvs]
    bb = int(layouts[0].block_len.sum())
    base = _pool_settings(tmp_path, bb, 8, 16)
    keys = [bytes([i + 1]) * 16 for i in range(4)]
    pools = [_worker(rank_pool_settings(base, r, 2), layouts[r], f"gpu-ns-tp{r}")
             for r in range(2)]
    want = [[block_image(layouts[r], b) for b in range(4)] for r in range(2)]
    for r, p in enumerate(pools):
        assert p.save(SaveSpec(f"s{r}", keys, list(range(4))))
        _settle(p, f"s{r}")
    for p in pools:
        p.close()
    pools = [_worker(rank_pool_settings(base, r, 2), layouts[r], f"gpu-ns-tp{r}")
             for r in range(2)]
    try:
        for r, p in enumerate(pools):
            p.load(PoolLoadSpec(f"l{r}", keys, list(range(10, 14))))
            _, loaded = _settle(p, f"l{r}")
            assert loaded == {f"l{r}": True}
            for i in range(4):       # each rank its own shard back, not the other's
                assert np.array_equal(block_image(layouts[r], 10 + i), want[r][i])
    finally:
        for p in pools:
            p.close()


# --- P/D between two processes, through the connector's worker side -------------------------
def _producer(conn, protocol, seed, port):
    import time

    from mooncake_te.integrations.vllm.scheduler import Work
    from mooncake_te.integrations.vllm.settings import parse_extra_config
    from mooncake_te.integrations.vllm.worker import WorkerSide
    s = parse_extra_config({"protocol": protocol})
    w = WorkerSide(s, _compat(), "127.0.0.1", port, is_producer=True, is_consumer=False)
    w.register_kv_caches(make_kv("flash_attn", seed), NB)
    w.start(Work(leases=["p1"]))
    conn.send(w.engine.name)
    told = False
    while not conn.poll(0.01):
        sending, _, _ = w.collect()
        if "p1" in sending and not told:       # the reader's read-done freed the lease
            conn.send("freed p1")
            told = True
        time.sleep(0.005)
    conn.recv()
    w.close()


def _compat():
    from mooncake_te.integrations.vllm import handshake
    return handshake.compat_fields(model="gpu-test", dtype="bfloat16", block_size=BS,
                                   layout=f"block {[NB, BS, H, D]}", num_layers=L,
                                   tp_size=1, vllm_version="none", connector_version="test")


@pytest.mark.parametrize("protocol,transport", [("auto", "cuda_ipc"), ("tcp", "tcp")])
def test_pd_reads_the_producers_gpu_blocks(protocol, transport):
    import multiprocessing as mp
    import time

    from mooncake_te.integrations.vllm.scheduler import LoadSpec, Work
    from mooncake_te.integrations.vllm.settings import parse_extra_config
    from mooncake_te.integrations.vllm.worker import WorkerSide
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    from servers import free_port
    p = ctx.Process(target=_producer, args=(b, protocol, 31, free_port()))
    p.start()
    try:
        assert a.poll(120), "the producer did not start"
        name = a.recv()
        w = WorkerSide(parse_extra_config({"protocol": protocol}), _compat(), "127.0.0.1",
                       free_port(), is_producer=False, is_consumer=True)
        kv = make_kv("flash_attn", seed=32)
        w.register_kv_caches(kv, NB)
        want = make_kv("flash_attn", seed=31)           # the producer's (same seeds)
        remote, local = [1, 2, 3, 9, 20], [5, 6, 7, 8, 30]
        w.start(Work(loads=[LoadSpec("c1", local, remote, name, "p1")]))
        t = time.monotonic() + 60
        done = set()
        while "c1" not in done:
            _, ok, failed = w.collect()
            assert not failed, w.stats["errors"]
            done |= ok
            assert time.monotonic() < t
            time.sleep(0.005)
        assert w.stats["requests"][-1]["transport"] == transport
        for layer in kv:
            for lb, rb in zip(local, remote):
                assert torch.equal(kv[layer][:, lb], want[layer][:, rb])
        w.close()
        # The READ's notification tells the producer its blocks may be freed (well
        # before the lease runs out).
        assert a.poll(30) and a.recv() == "freed p1"
        a.send("stop")
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()

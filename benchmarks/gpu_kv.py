# SPDX-License-Identifier: Apache-2.0
"""The vLLM connector's GPU KV paths without vLLM, each beside its reference in one run.

A vLLM-shaped GPU KV cache (per layer ``[2, num_blocks, 16, kv_heads, head_dim]`` bf16,
FlashAttention's layout; ``--shape 8b``: 32 layers x 8 heads x 128, ``1b``: 16 x 8 x 64),
and a prompt's worth of its blocks (``--tokens``, 8192 by default: 512 blocks of 16
tokens, 1 GiB for the 8B shape) moved the ways the connector moves them:

* pool save, GPU -> DRAM pool (``DeviceBlockCopier.gather_to`` into the pool's slots), and
  the same through ``KVCache.put(fill=)`` (slots handed out, checksummed, published),
  against a pinned device -> host copy of the same bytes (one ``cudaMemcpy``);
* pool load, DRAM pool -> GPU (``KVCache.get(copy=)`` with the copier's batched sink),
  against a pinned host -> device copy of the same bytes;
* SSD -> GPU after a restart (the pool's SSD tier read, checked, scattered), against an
  O_DIRECT read of the SSD tier's own file in the same run;
* saving beside compute: a bf16 matmul loop's rate alone and while the copier saves
  1 GiB again and again on its own stream;
* P/D between two processes on the GPU, the connector's READ of the prompt's blocks
  (``layout.plan`` + ``submit_arrays``): over CUDA IPC against a device-to-device copy of
  the same bytes, and over TCP (GPU memory staged through pinned buffers) against host
  KV caches of the same shape over TCP.

    python benchmarks/gpu_kv.py [--shape 8b] [--tokens 8192] [--json out.json]

Needs PyTorch with a CUDA GPU. Figures are GB/s (1e9 bytes/s), the median of
``--reps`` timed runs after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time

SHAPES = {"8b": (32, 8, 128), "1b": (16, 8, 64)}
BS = 16


def _kv(layers, heads, dim, nblocks, device, seed=0):
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    return {f"model.layers.{i}.self_attn": torch.randn(
        (2, nblocks, BS, heads, dim), generator=g, device=device).to(torch.bfloat16)
        for i in range(layers)}


def _median_gbps(fn, nbytes, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts) / 1e9


def pool_figures(args, out):
    import numpy as np
    import torch

    from mooncake_te.cuda.kvcopy import DeviceBlockCopier
    from mooncake_te.integrations.vllm.layout import layout_from_tensors
    from mooncake_te.kvcache import KVCache
    from mooncake_te.kvcache.record import CRC32_IMPL

    layers, heads, dim = SHAPES[args.shape]
    n = args.tokens // BS
    kv = _kv(layers, heads, dim, n + 8, "cuda")
    layout, _ = layout_from_tensors(kv)
    cp = DeviceBlockCopier.from_layout(layout, staging_bytes=args.staging_mb << 20)
    bb = cp.block_bytes
    total = n * bb
    ids = list(range(n))
    out.update(shape=args.shape, layers=layers, kv_heads=heads, head_dim=dim, blocks=n,
               block_bytes=bb, bytes=total, batch_copy=cp.batch_kind, crc32=CRC32_IMPL,
               staging_mb=cp.staging_bytes >> 20)
    print(f"{args.shape}: {layers} layers x [2, N, {BS}, {heads}, {dim}] bf16; {n} blocks "
          f"of {bb >> 10} KiB = {total / 2**30:.2f} GiB; copies: {cp.batch_kind}, "
          f"staging {cp.staging_bytes >> 20} MiB, crc32: {CRC32_IMPL}")

    # references: one pinned copy of the same bytes each way
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    ref_d2h = _median_gbps(d2h, total, args.reps)
    ref_h2d = _median_gbps(h2d, total, args.reps)
    del dev, host

    tmp = tempfile.mkdtemp(prefix="mte-gpu-kv-", dir=args.ssd_dir)
    slot = bb + 4096
    cache = KVCache(bb, (n + 4) * slot, (2 * n + 8) * slot, tmp, log_interval_s=0)
    t0 = time.perf_counter()
    cp.pin_host(cache.base, cache.dram_slots * cache.slot_size)
    out["pin_pool_s"] = time.perf_counter() - t0
    slots = [cache.base + i * cache.slot_size + 64 for i in range(n)]   # payload areas

    copy_save = _median_gbps(lambda: cp.gather_to(ids, slots), total, args.reps)
    # Saves into a DRAM-only pool of the prompt's size (each round's blocks evict the
    # last round's), so no SSD write is timed here.
    dram = KVCache(bb, (n + 4) * slot, 0, None, log_interval_s=0)
    cp.pin_host(dram.base, dram.dram_slots * dram.slot_size)
    rep = [0]

    def fill(items):
        cp.gather_to([ids[i] for i, _ in items], [v.ctypes.data for _, v in items])

    def put(c=dram):
        rep[0] += 1
        keys = [b"%04d%012d" % (rep[0] % 10000, i) for i in range(n)]
        c.put(keys, fill=fill)
        return keys
    pool_save = _median_gbps(put, total, args.reps)
    cp.unpin_host(dram.base)
    dram.close()
    keys = put(cache)

    class Sink:
        def __init__(self):
            self.q = []

        def __call__(self, i, view):
            self.q.append((ids[i], view.ctypes.data))

        def flush(self):
            if self.q:
                cp.scatter_from([a for _, a in self.q], [b for b, _ in self.q])
            self.q = []

    def get():
        got = cache.get(keys, copy=Sink())
        assert all(g == bb for g in got), "a pool block was not served"
    pool_load = _median_gbps(get, total, args.reps)

    # SSD: persist, restart with a DRAM tier that holds the prompt, read it back to the GPU
    cp.unpin_host(cache.base)
    cache.close(persist=True)
    direct_ref = _odirect_read(os.path.join(tmp, "kvcache.slab"), total, args.reps)
    ssd_load = []
    for _ in range(args.reps):
        c = KVCache(bb, (n + 4) * slot, (2 * n + 8) * slot, tmp, log_interval_s=0,
                    prefault_restart=False)
        cp.pin_host(c.base, c.dram_slots * c.slot_size)
        c._np[::4096] = 0                          # fault the pool in outside the timing
        t0 = time.perf_counter()
        got = c.get(keys, copy=Sink())
        dt = time.perf_counter() - t0
        assert all(g == bb for g in got), "an SSD block was not served"
        ssd_load.append(total / dt / 1e9)
        cp.unpin_host(c.base)
        c.close()
    ssd = statistics.median(ssd_load)
    fig = {"ref_d2h_gbps": ref_d2h, "ref_h2d_gbps": ref_h2d, "copy_save_gbps": copy_save,
           "pool_save_gbps": pool_save, "pool_load_gbps": pool_load,
           "odirect_read_gbps": direct_ref, "ssd_load_gbps": ssd}
    out.update(fig)
    print(f"  save GPU -> pool slots (copier)   {copy_save:7.2f} GB/s = {copy_save / ref_d2h:.2f}"
          f" of pinned D2H {ref_d2h:.2f}   (goal >= 0.8)")
    print(f"  save through KVCache.put(fill=)   {pool_save:7.2f} GB/s = {pool_save / ref_d2h:.2f}"
          f" (checksums on the CPU, {CRC32_IMPL})")
    print(f"  load DRAM pool -> GPU             {pool_load:7.2f} GB/s = {pool_load / ref_h2d:.2f}"
          f" of pinned H2D {ref_h2d:.2f}   (goal >= 0.8)")
    print(f"  load SSD -> GPU (restart)         {ssd:7.2f} GB/s = {ssd / direct_ref:.2f} of "
          f"an O_DIRECT read {direct_ref:.2f}   (goal >= 0.8)")

    # saving beside compute
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()

    def matmuls(seconds):
        k, t0 = 0, time.perf_counter()
        with torch.cuda.stream(s):
            while time.perf_counter() - t0 < seconds:
                for _ in range(10):
                    torch.mm(a, a)
                s.synchronize()
                k += 10
        return k / (time.perf_counter() - t0)
    matmuls(0.5)
    alone = matmuls(args.seconds)
    stop, saves = threading.Event(), [0]
    c = KVCache(bb, (n + 4) * slot, 0, None, log_interval_s=0)
    cp.pin_host(c.base, c.dram_slots * c.slot_size)
    cslots = [c.base + i * c.slot_size + 64 for i in range(n)]

    def saver():
        while not stop.is_set():
            cp.gather_to(ids, cslots)
            saves[0] += 1
    th = threading.Thread(target=saver)
    th.start()
    beside = matmuls(args.seconds)
    stop.set()
    th.join()
    cp.unpin_host(c.base)
    c.close()
    slow = 1 - beside / alone
    out.update(matmul_alone_per_s=alone, matmul_beside_saves_per_s=beside,
               saves_during=saves[0], compute_slowdown=slow)
    print(f"  bf16 8192^3 matmuls alone {alone:.1f}/s, beside {saves[0]} saves of "
          f"{total / 2**30:.2f} GiB {beside:.1f}/s: compute slowed {slow:.1%}   (goal <= 5%)")
    cp.close()


def _odirect_read(path, total, reps):
    """GB/s of reading the first ``total`` bytes of ``path`` with O_DIRECT, 16 MiB reads."""
    chunk = 16 << 20
    buf = mmap.mmap(-1, chunk)
    size = min(total, os.path.getsize(path)) // 4096 * 4096
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)           # no O_DIRECT here: the page cache figure
    try:
        def read():
            off = 0
            while off < size:
                got = os.preadv(fd, [memoryview(buf)[:min(chunk, size - off)]], off)
                if got <= 0:
                    break
                off += got
        return _median_gbps(read, size, reps)
    finally:
        os.close(fd)


# --- P/D between two processes ------------------------------------------------------------
def _producer(conn, protocol, on_gpu, shape, nblocks):
    import mooncake_te as mte
    from mooncake_te.integrations.vllm.layout import layout_from_tensors
    from mooncake_te.integrations.vllm.worker import _byte_view
    layers, heads, dim = SHAPES[shape]
    kv = _kv(layers, heads, dim, nblocks, "cuda" if on_gpu else "cpu", seed=1)
    layout, storages = layout_from_tensors(kv)
    eng = mte.TransferEngine(host="127.0.0.1", protocol=protocol)
    eng.register_many([_byte_view(t) for _, _, t in storages], access="r")
    conn.send((eng.name, layout.to_json()))
    conn.recv()
    eng.close()


def pd_figures(args, out):
    import numpy as np
    import torch

    import mooncake_te as mte
    from mooncake_te.integrations.vllm.layout import KVLayout, layout_from_tensors, plan
    from mooncake_te.integrations.vllm.worker import _byte_view
    layers, heads, dim = SHAPES[args.shape]
    n = args.tokens // BS
    ctx = mp.get_context("spawn")
    res = {}
    for label, protocol, on_gpu in (("ipc", "auto", True), ("tcp_gpu", "tcp", True),
                                    ("tcp_cpu", "tcp", False)):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_producer, args=(b, protocol, on_gpu, args.shape, n + 8))
        p.start()
        name, lj = a.recv()
        kv = _kv(layers, heads, dim, n + 8, "cuda" if on_gpu else "cpu", seed=2)
        layout, storages = layout_from_tensors(kv)
        eng = mte.TransferEngine(host="127.0.0.1", protocol=protocol)
        eng.register_many([_byte_view(t) for _, _, t in storages])
        rl = KVLayout.from_json(lj)
        transport = []
        # Contiguous block ids on both sides (a fresh cache: every layer's run coalesces
        # into one request) and scattered ones (a cache in use: one request a block and
        # layer, 32 KiB each for the 8B shape).
        perm = np.random.default_rng(0).permutation(n + 8)[:n]
        # "_kernel": the contiguous case with every piece, long ones too, on the
        # mte_copy_pieces kernel instead of the copy engines (which of the two the
        # transport picks for long pieces is this comparison's to decide).
        from mooncake_te.transports import cuda_ipc
        ce_max = cuda_ipc.KERNEL_MAX_MEAN
        for suffix, ids in (("", list(range(n))), ("_scattered", perm.tolist()),
                            ("_kernel", list(range(n)))):
            cuda_ipc.KERNEL_MAX_MEAN = 1 << 62 if suffix == "_kernel" else ce_max
            local, remote, lens, _ = plan(layout, rl, ids, range(n))
            total = int(lens.sum())

            split = []

            def read():
                t0 = time.perf_counter()
                bt = eng.submit_arrays(mte.READ, name, local, remote, lens)
                t1 = time.perf_counter()
                bt.wait()
                split.append((t1 - t0, time.perf_counter() - t1))
                transport.append(bt.transport)
            if args.profile and label == "ipc":
                import cProfile
                import pstats
                read()
                prof = cProfile.Profile()
                prof.runcall(lambda: [eng.submit_arrays(mte.READ, name, local, remote,
                                                         lens).wait() for _ in range(20)])
                print(f"--- profile: 20 IPC reads{suffix or ' (contiguous ids)'}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(22)
            if not suffix or label == "ipc":
                res[label + suffix] = _median_gbps(read, total, args.reps)
                res[label + suffix + "_requests"] = len(local)
                res[label + suffix + "_submit_ms"] = 1e3 * statistics.median(
                    a for a, _ in split)
                res[label + suffix + "_wait_ms"] = 1e3 * statistics.median(b for _, b in split)
        cuda_ipc.KERNEL_MAX_MEAN = ce_max
        res[label + "_transport"] = transport[-1]
        eng.close()
        a.send("done")
        p.join(30)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)

    def d2d():
        dev2.copy_(dev)
        torch.cuda.synchronize()
    res["ref_d2d_gbps"] = _median_gbps(d2d, total, args.reps)
    out.update({f"pd_{k}": v for k, v in res.items()}, pd_bytes=total)
    print(f"  P/D READ of {n} blocks ({total / 2**30:.2f} GiB), two processes:")
    print(f"    CUDA IPC ({res['ipc_transport']}) {res['ipc']:8.2f} GB/s = "
          f"{res['ipc'] / res['ref_d2d_gbps']:.2f} of a D2D copy {res['ref_d2d_gbps']:.1f}"
          f"   (goal >= 0.8)")
    print(f"      (submit {res['ipc_submit_ms']:.2f} ms, then wait {res['ipc_wait_ms']:.2f} ms; "
          f"the D2D copy takes {total / res['ref_d2d_gbps'] / 1e6:.2f} ms)")
    print(f"    CUDA IPC, scattered block ids ({res['ipc_scattered_requests']} requests) "
          f"{res['ipc_scattered']:8.2f} GB/s = {res['ipc_scattered'] / res['ref_d2d_gbps']:.2f}"
          f" of the D2D copy (submit {res['ipc_scattered_submit_ms']:.2f} ms, wait "
          f"{res['ipc_scattered_wait_ms']:.2f} ms)")
    print(f"    CUDA IPC, contiguous ids, every piece on the kernel {res['ipc_kernel']:8.2f} "
          f"GB/s = {res['ipc_kernel'] / res['ref_d2d_gbps']:.2f} of the D2D copy (submit "
          f"{res['ipc_kernel_submit_ms']:.2f} ms, wait {res['ipc_kernel_wait_ms']:.2f} ms)")
    print(f"    TCP, GPU KV       {res['tcp_gpu']:8.2f} GB/s = "
          f"{res['tcp_gpu'] / res['tcp_cpu']:.2f} of host KV over TCP {res['tcp_cpu']:.2f}"
          f"   (goal >= 0.85)")


SKIPPED = 77      # --smoke's exit status when this machine cannot run it (the reason printed)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0, help="each matmul timing")
    ap.add_argument("--staging-mb", type=int, default=64)
    ap.add_argument("--ssd-dir", default=None, help="where the SSD tier goes (default /tmp)")
    ap.add_argument("--no-pd", action="store_true")
    ap.add_argument("--no-pool", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the IPC reads")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two, smallest sizes (CI); exits 77 saying why where "
                         "there is no GPU")
    args = ap.parse_args(argv)
    if args.smoke:
        from mooncake_te.cuda import missing
        why = missing("torch")
        if why:
            print(f"skipped: gpu_kv needs a CUDA GPU and PyTorch: {why}")
            return SKIPPED
        args.shape, args.tokens, args.reps, args.seconds = "1b", 256, 1, 0.1
        args.staging_mb = 8
    out: dict = {}
    if not args.no_pool:
        pool_figures(args, out)
    if not args.no_pd:
        pd_figures(args, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

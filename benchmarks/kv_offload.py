# SPDX-License-Identifier: Apache-2.0
"""GPU KV-cache blocks to a registered host DRAM pool and back, beside pinned copies.

What a KV-cache offload does: a vLLM-shaped KV cache on the GPU (per layer one tensor
``[2, num_blocks, block_tokens, heads, head_dim]`` of bf16, 32 layers) and a host DRAM
pool of block slots registered with an engine. One batch moves a random half of the
blocks of every layer (K and V) into pool slots (WRITE, offload) and the same blocks back
(READ, reload), by block lists (``submit_arrays``), about 1 GiB per batch. Two layouts of
the pool owner:

* **same process**: the pool belongs to a second engine in this process;
* **second process**: the pool belongs to an engine in a spawned process;

each with ``protocol="auto"`` (what the engine picks on one host) and ``"tcp"``. The
reference, measured in the same run: pinned host<->device copies through CUDA (one
64 MiB ``cudaMemcpyAsync`` each way) and the same block list copied block by block with
``cudaMemcpyAsync`` from pinned memory. Prints GB/s (1e9 B/s) and the ratio to pinned.
Block sizes: ``--tokens`` per block x 8 heads x 128 x 2 bytes (16 tokens = 32 KiB, vLLM's
default; 128 = 256 KiB; 512 = 1 MiB). Needs CuPy and a CUDA GPU.

    python benchmarks/kv_offload.py [--tokens 16,128,512] [--seconds 1.5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

LAYERS, HEADS, HEAD_DIM, ELEM = 32, 8, 128, 2
MOVE = 1 << 30                  # bytes per batch


def geometry(tokens: int):
    block = tokens * HEADS * HEAD_DIM * ELEM
    per_batch = MOVE // (LAYERS * 2 * block)      # blocks of each (layer, K|V) per batch
    num_blocks = 2 * per_batch                     # the batch moves half of the cache
    return block, num_blocks, per_batch


def _pool_owner(conn, protocol, nbytes):
    import numpy as np

    import mooncake_te as mte
    eng = mte.TransferEngine(host="127.0.0.1", protocol=protocol)
    pool = np.zeros(nbytes, np.uint8)
    r = eng.register(pool)
    conn.send((eng.name, r.address))
    conn.recv()
    eng.close()


def _timed(fn, seconds: float, nbytes: int) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def pinned_reference(seconds: float, tokens: int) -> dict:
    import cupy as cp
    import numpy as np
    n = 64 << 20
    rt = cp.cuda.runtime
    pinned = cp.cuda.alloc_pinned_memory(n)
    h = np.frombuffer(pinned, np.uint8, n)
    d = cp.empty(n, cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)

    def one(kind, dst, src):
        def fn():
            rt.memcpyAsync(dst, src, n, kind, s.ptr)
            s.synchronize()
        return fn
    out = {"h2d_64M": _timed(one(rt.memcpyHostToDevice, d.data.ptr, h.ctypes.data), seconds, n),
           "d2h_64M": _timed(one(rt.memcpyDeviceToHost, h.ctypes.data, d.data.ptr), seconds, n)}
    # Block by block, as a framework's offload loop would (one cudaMemcpyAsync a block).
    block = tokens * HEADS * HEAD_DIM * ELEM
    k = n // block

    def blocks(kind, dst, src):
        def fn():
            for i in range(k):
                rt.memcpyAsync(dst + i * block, src + i * block, block, kind, s.ptr)
            s.synchronize()
        return fn
    out["h2d_blocks"] = _timed(blocks(rt.memcpyHostToDevice, d.data.ptr, h.ctypes.data),
                               seconds, k * block)
    out["d2h_blocks"] = _timed(blocks(rt.memcpyDeviceToHost, h.ctypes.data, d.data.ptr),
                               seconds, k * block)
    return out


def offload(protocol: str, second_process: bool, tokens: int, seconds: float) -> dict:
    import cupy as cp
    import numpy as np

    import mooncake_te as mte
    block, num_blocks, per_batch = geometry(tokens)
    pool_bytes = LAYERS * 2 * per_batch * block
    ctx = mp.get_context("spawn")
    proc = owner = None
    with mte.TransferEngine(host="127.0.0.1", protocol=protocol) as eng:
        if second_process:
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_pool_owner, args=(child, protocol, pool_bytes),
                               daemon=True)
            proc.start()
            name, pool_addr = conn.recv()
        else:
            owner = mte.TransferEngine(host="127.0.0.1", protocol=protocol)
            pool = np.zeros(pool_bytes, np.uint8)
            name, pool_addr = owner.name, owner.register(pool).address
        try:
            layers = [cp.empty((2, num_blocks, tokens, HEADS, HEAD_DIM), cp.uint16)
                      for _ in range(LAYERS)]
            for t in layers:
                t[...] = cp.random.randint(0, 1 << 16, t.shape, dtype=cp.uint16)
            bases = np.array([eng.register(t).address for t in layers], np.uint64)
            rng = np.random.default_rng(0)
            ids = np.sort(rng.choice(num_blocks, per_batch, replace=False)).astype(np.uint64)
            # GPU address of (layer, kv, block id), pool slot j of (layer, kv).
            kv_off = np.arange(2, dtype=np.uint64) * np.uint64(num_blocks * block)
            gpu = (bases[:, None, None] + kv_off[None, :, None] +
                   ids[None, None, :] * np.uint64(block)).ravel()
            host = pool_addr + np.arange(gpu.size, dtype=np.uint64) * np.uint64(block)
            route = []

            def run(op):
                def fn():
                    b = eng.submit_arrays(op, name, gpu, host, block)
                    b.wait(timeout=120)
                    route[:] = [b.transport]
                return fn
            out = {"block": block, "blocks_per_batch": int(gpu.size)}
            out["write"] = _timed(run(mte.WRITE), seconds, gpu.size * block)
            out["transport"] = route[0]
            out["read"] = _timed(run(mte.READ), seconds, gpu.size * block)
            # Round trip intact: offload, scribble the GPU blocks, reload, compare.
            want = [cp.asnumpy(t) for t in layers[:2]]
            run(mte.WRITE)()
            for t in layers[:2]:
                t.fill(0)
            run(mte.READ)()
            sel = ids.astype(np.int64)
            out["intact"] = bool(all((cp.asnumpy(t)[:, sel] == w[:, sel]).all()
                                     for t, w in zip(layers[:2], want)))
            return out
        finally:
            if proc is not None:
                conn.send("done")
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
            if owner is not None:
                owner.close()


SKIPPED = 77      # --smoke's exit status when this machine cannot run it (the reason printed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="16,128,512", help="tokens per block (list)")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--protocols", default="auto,tcp")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two, smallest sizes (CI); exits 77 saying why where "
                         "there is no GPU")
    args = ap.parse_args()
    if args.smoke:
        from mooncake_te.cuda import missing
        why = missing("cupy")
        if why:
            print(f"skipped: kv_offload needs a CUDA GPU and CuPy: {why}")
            return SKIPPED
        args.tokens, args.seconds, args.protocols = "16", 0.1, "auto"
    from mooncake_te import cuda
    ok, why = cuda.available()
    if not ok:
        sys.exit(f"kv_offload needs a CUDA GPU: {why}")
    res = {"rows": []}
    print(f"KV cache: {LAYERS} layers x [2, num_blocks, tokens, {HEADS}, {HEAD_DIM}] bf16; "
          f"~1 GiB per batch; GB/s = 1e9 B/s", flush=True)
    print(f"{'block':>8} {'pool owner':>14} {'proto':>5} {'via':>8} {'write':>7} {'read':>7} "
          f"{'W/d2h':>6} {'R/h2d':>6} {'ok':>3}", flush=True)
    for tokens in [int(x) for x in args.tokens.split(",")]:
        ref = pinned_reference(args.seconds, tokens)
        res["rows"].append({"tokens": tokens, "reference": ref})
        print(f"{tokens * HEADS * HEAD_DIM * ELEM >> 10:>6}K reference: pinned h2d "
              f"{ref['h2d_64M']:.1f} d2h {ref['d2h_64M']:.1f} GB/s (64 MiB); block by block "
              f"h2d {ref['h2d_blocks']:.1f} d2h {ref['d2h_blocks']:.1f}", flush=True)
        for second in (False, True):
            for proto in args.protocols.split(","):
                try:
                    r = offload(proto, second, tokens, args.seconds)
                except Exception as e:      # a failure is a row, not the end of the run
                    r = {"error": f"{type(e).__name__}: {e}"}
                r.update(tokens=tokens, second_process=second, protocol=proto)
                res["rows"].append(r)
                who = "second process" if second else "same process"
                if "error" in r:
                    print(f"{'':>8} {who:>14} {proto:>5} ERROR {r['error']}", flush=True)
                    continue
                print(f"{r['block'] >> 10:>6}K {who:>14} {proto:>5} {r['transport']:>8} "
                      f"{r['write']:7.2f} {r['read']:7.2f} {r['write'] / ref['d2h_64M']:6.2f} "
                      f"{r['read'] / ref['h2d_64M']:6.2f} {'yes' if r['intact'] else 'NO':>3}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

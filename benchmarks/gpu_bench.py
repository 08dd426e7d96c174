# SPDX-License-Identifier: Apache-2.0
"""GPU figures beside the machine's own references, measured in one run.

Two processes on one host (this one initiates, a spawned one is the target), each with
1 GiB buffers of the kinds under test; each timed batch moves the whole GiB as 1 MiB or
64 MiB requests. Prints GB/s (1e9 bytes/s) of:

* references: pinned host->device and device->host copies, a device-to-device copy (all
  64 MiB, CUDA events), and our CPU->CPU TCP figure (protocol="tcp");
* GPU->GPU over TCP loopback (pinned staging, protocol="tcp") and over CUDA IPC
  (protocol="auto", the same-host route), at 1 MiB and 64 MiB requests;

with the issue's aims: IPC >= 80 % of the device-to-device copy at 64 MiB, GPU over TCP
>= 80 % of our CPU TCP figure. Needs CuPy and a CUDA GPU.

Then, each in a fresh pair of processes, GPU and CPU over TCP at 64 MiB with other
settings (8 lanes; other staging chunk and GPU slice sizes than the 2 MiB and 4 MiB
defaults; benchmarks/gpu_sweep.py sweeps them), to show what limits the staged path.

    python benchmarks/gpu_bench.py [--seconds 1.5] [--json out.json] [--no-sweep]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

BUF = 1 << 30          # per batch: 1,024 requests of 1 MiB or 16 of 64 MiB
SIZES = (1 << 20, 64 << 20)


def _target(conn, protocol):
    import cupy as cp
    import numpy as np

    import mooncake_te as mte
    eng = mte.TransferEngine(host="127.0.0.1", protocol=protocol)
    g = cp.zeros(BUF, cp.uint8)
    c = np.zeros(BUF, np.uint8)
    rg, rc = eng.register(g), eng.register(c)
    conn.send((eng.name, rg.address, rc.address))
    conn.recv()                      # until the initiator is done
    eng.close()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn, seconds: float, nbytes: int) -> float:
    fn()                             # warm up (connections, mappings, staging)
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return _gbps(n * nbytes, time.perf_counter() - t0)


def references(seconds: float) -> dict:
    import cupy as cp
    import numpy as np
    n = 64 << 20
    pinned = cp.cuda.alloc_pinned_memory(n)
    h = np.frombuffer(pinned, np.uint8, n)
    d1, d2 = cp.empty(n, cp.uint8), cp.empty(n, cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime

    def run(kind_copy):
        def fn():
            kind_copy()
            s.synchronize()
        return _timed(fn, seconds, n)

    return {
        "h2d_pinned": run(lambda: rt.memcpyAsync(d1.data.ptr, h.ctypes.data, n,
                                                 rt.memcpyHostToDevice, s.ptr)),
        "d2h_pinned": run(lambda: rt.memcpyAsync(h.ctypes.data, d1.data.ptr, n,
                                                 rt.memcpyDeviceToHost, s.ptr)),
        "d2d": run(lambda: rt.memcpyAsync(d2.data.ptr, d1.data.ptr, n,
                                          rt.memcpyDeviceToDevice, s.ptr)),
    }


def transfers(protocol: str, seconds: float, kinds, sizes=SIZES) -> dict:
    """GB/s of WRITE (and READ) for each (local kind, remote kind) at each size."""
    import cupy as cp
    import numpy as np

    import mooncake_te as mte
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, protocol), daemon=True)
    proc.start()
    name, remote_gpu, remote_cpu = conn.recv()
    out = {}
    try:
        with mte.TransferEngine(host="127.0.0.1", protocol=protocol) as eng:
            g = cp.ones(BUF, cp.uint8)
            c = np.ones(BUF, np.uint8)
            local = {"gpu": eng.register(g).address, "cpu": eng.register(c).address}
            remote = {"gpu": remote_gpu, "cpu": remote_cpu}
            for kind, op in kinds:
                for size in sizes:
                    offs = np.arange(0, BUF, size, dtype=np.uint64)
                    src, dst = local[kind] + offs, remote[kind] + offs
                    route = []

                    def fn():
                        b = eng.submit_arrays(op, name, src, dst, size)
                        b.wait(timeout=120)
                        route[:] = [b.transport]
                    gbps = _timed(fn, seconds, BUF)
                    key = f"{kind}_{'write' if op == mte.WRITE else 'read'}_{size >> 20}M"
                    out[key] = {"gbps": gbps, "transport": route[0]}
    finally:
        conn.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


SWEEP = (("8 lanes", {"MC_TCP_LANES_PER_PEER": "8"}),
         ("256 KiB chunks, 1 MiB slices", {"MC_GPU_STAGE_CHUNK": str(256 << 10),
                                           "MC_GPU_SLICE": str(1 << 20)}),
         ("1 MiB chunks, 16 MiB slices", {"MC_GPU_STAGE_CHUNK": str(1 << 20),
                                          "MC_GPU_SLICE": str(16 << 20)}))


def sweep(seconds: float) -> dict:
    out = {}
    for label, env in SWEEP:
        r = subprocess.run([sys.executable, __file__, "--tcp-only", "--seconds", str(seconds)],
                           env=dict(os.environ, **env), capture_output=True, text=True,
                           timeout=300)
        out[label] = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-500:]}
    return out


SKIPPED = 77      # --smoke's exit status when this machine cannot run it (the reason printed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="seconds per figure")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--no-sweep", action="store_true", help="skip the settings sweep")
    ap.add_argument("--tcp-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two, smallest sizes (CI); exits 77 saying why where "
                         "there is no GPU")
    args = ap.parse_args()
    if args.smoke:
        from mooncake_te.cuda import missing
        why = missing("cupy")
        if why:
            print(f"skipped: gpu_bench needs a CUDA GPU and CuPy: {why}")
            return SKIPPED
        args.seconds, args.no_sweep = 0.1, True
    import mooncake_te as mte
    from mooncake_te import cuda
    ok, why = cuda.available()
    if not ok:
        sys.exit(f"gpu_bench needs a CUDA GPU: {why}")
    if args.tcp_only:         # one point of the sweep, in its own processes
        W, R = mte.WRITE, mte.READ
        print(json.dumps(transfers("tcp", args.seconds, [("cpu", W), ("gpu", W), ("gpu", R)],
                                   sizes=(64 << 20,))))
        return 0
    ref = references(args.seconds)
    W, R = mte.WRITE, mte.READ
    tcp = transfers("tcp", args.seconds, [("cpu", W), ("gpu", W), ("cpu", R), ("gpu", R)])
    ipc = transfers("auto", args.seconds, [("gpu", W), ("gpu", R)])
    res = {"references_64M": ref, "tcp": tcp, "ipc": ipc,
           "aims": {
               "ipc_write_64M_of_d2d": ipc["gpu_write_64M"]["gbps"] / ref["d2d"],
               "ipc_read_64M_of_d2d": ipc["gpu_read_64M"]["gbps"] / ref["d2d"],
               "gpu_tcp_write_of_cpu_tcp_1M": tcp["gpu_write_1M"]["gbps"] /
               tcp["cpu_write_1M"]["gbps"],
               "gpu_tcp_write_of_cpu_tcp_64M": tcp["gpu_write_64M"]["gbps"] /
               tcp["cpu_write_64M"]["gbps"],
               "gpu_tcp_read_of_cpu_tcp_64M": tcp["gpu_read_64M"]["gbps"] /
               tcp["cpu_read_64M"]["gbps"]}}
    print("references (64 MiB, CUDA stream): " + ", ".join(
        f"{k} {v:.1f} GB/s" for k, v in ref.items()))
    for label, table in (("TCP loopback", tcp), ("same host (auto)", ipc)):
        for k, v in table.items():
            print(f"{label:17} {k:16} {v['gbps']:8.2f} GB/s  via {v['transport']}")
    for k, v in res["aims"].items():
        print(f"aim {k}: {v:.0%} (aim 80%)")
    if not args.no_sweep:
        res["sweep"] = sweep(args.seconds)
        for label, table in res["sweep"].items():
            print(f"TCP, {label}: " + ", ".join(
                f"{k} {v['gbps']:.2f}" for k, v in table.items() if isinstance(v, dict))
                + (f" ERROR {table['error']}" if "error" in table else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

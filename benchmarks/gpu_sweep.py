# SPDX-License-Identifier: Apache-2.0
"""GPU memory over TCP: staging chunk x GPU slice sweep, beside CPU memory, in one run.

Each point is a fresh pair of processes (``gpu_bench.py --tcp-only``: CPU WRITE, GPU
WRITE and GPU READ of 64 MiB requests, 1 GiB per batch, over TCP loopback) with
``MC_GPU_STAGE_CHUNK`` and ``MC_GPU_SLICE`` set, and optionally other variables
(``--extra VAR=VALUE``, e.g. ``MC_TCP_LANES_PER_PEER=8``). Prints GB/s and the ratio of GPU
to the CPU figure of the same point, so defaults can be chosen from it.

    python benchmarks/gpu_sweep.py [--chunks 256K,512K,1M,2M] [--slices 1M,4M,16M] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def point(env: dict, seconds: float) -> dict:
    r = subprocess.run([sys.executable, os.path.join(HERE, "gpu_bench.py"), "--tcp-only",
                        "--seconds", str(seconds)], env=dict(os.environ, **env),
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return {"error": r.stderr[-400:]}
    return {k: v["gbps"] for k, v in json.loads(r.stdout).items()}


SKIPPED = 77      # --smoke's exit status when this machine cannot run it (the reason printed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="256K,512K,1M,2M")
    ap.add_argument("--slices", default="1M,4M,16M")
    ap.add_argument("--extra", action="append", default=[], metavar="VAR=VALUE",
                    help="one more variant with this variable set (at 512K/4M and the best)")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two, smallest sizes (CI); exits 77 saying why where "
                         "there is no GPU")
    args = ap.parse_args()
    if args.smoke:
        from mooncake_te.cuda import missing
        why = missing("cupy")
        if why:
            print(f"skipped: gpu_sweep needs a CUDA GPU and CuPy: {why}")
            return SKIPPED
        args.chunks, args.slices, args.seconds = "256K", "1M", 0.1
    rows = []
    print(f"{'chunk':>6} {'slice':>6} {'extra':>22} {'cpu W':>7} {'gpu W':>7} {'gpu R':>7} "
          f"{'W/cpu':>6} {'R/cpu':>6}", flush=True)

    def run(chunk, sl, extra=None):
        env = {"MC_GPU_STAGE_CHUNK": str(size(chunk)), "MC_GPU_SLICE": str(size(sl))}
        if extra:
            k, _, v = extra.partition("=")
            env[k] = v
        r = point(env, args.seconds)
        r.update(chunk=chunk, slice=sl, extra=extra or "")
        rows.append(r)
        if "error" in r:
            print(f"{chunk:>6} {sl:>6} {extra or '':>22} ERROR {r['error']}", flush=True)
            return r
        c, w, rd = r["cpu_write_64M"], r["gpu_write_64M"], r["gpu_read_64M"]
        print(f"{chunk:>6} {sl:>6} {extra or '':>22} {c:7.2f} {w:7.2f} {rd:7.2f} "
              f"{w / c:6.2f} {rd / c:6.2f}", flush=True)
        return r
    for chunk in args.chunks.split(","):
        for sl in args.slices.split(","):
            if size(sl) >= size(chunk):
                run(chunk, sl)
    for extra in args.extra:
        run("512K", "4M", extra)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""Synchronous 4 KiB ``write``/``read`` latency of several checkouts, runs alternating.

Each run is a fresh process pair on 127.0.0.1 (this process's engine and a target engine
in a spawned child) that times ``--requests`` synchronous 4 KiB writes, then reads, one
by one (after 300 untimed), and prints the p50 and p90. The checkouts (``--trees``, paths
of built source trees; default: this one) take turns round by round, so the shared
machine's drift lands on all of them alike; the summary is the median over the rounds of
each run's p50. Metrics stay at the engine's default (on, where the tree has them).

    python benchmarks/sync_latency_ab.py --trees /work/wt-base,/work/wt-new [--rounds 6]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _target(conn, protocol):
    import numpy as np

    import mooncake_te as mte
    e = mte.TransferEngine(host="127.0.0.1", protocol=protocol)
    buf = np.zeros(1 << 20, np.uint8)
    conn.send((e.name, e.register(buf).address))
    conn.recv()
    e.close()


def one(protocol: str, n: int) -> dict:
    """This interpreter's mooncake_te: {"write": {p50, p90}, "read": ..., "metrics"}."""
    import numpy as np

    import mooncake_te as mte
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_target, args=(b, protocol))
    p.start()
    name, raddr = a.recv()
    e = mte.TransferEngine(host="127.0.0.1", protocol=protocol)
    try:
        local = e.register(np.ones(1 << 20, np.uint8)).address
        core = getattr(e, "internal", None)      # trees before issue 40 have no internal door
        tm = core.transfer_metrics if core is not None else getattr(e, "_tmetrics", None)
        out: dict = {"metrics": tm is not None}
        clock = time.perf_counter_ns
        for op in ("write", "read"):
            f = getattr(e, op)
            for _ in range(300):
                f(name, local, raddr, 4096)
            ts = []
            for _ in range(n):
                t0 = clock()
                f(name, local, raddr, 4096)
                ts.append(clock() - t0)
            ts.sort()
            out[op] = {"p50_us": ts[n // 2] / 1e3, "p90_us": ts[int(n * 0.9)] / 1e3}
        return out
    finally:
        e.close()
        a.send("done")
        p.join(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=os.path.dirname(HERE),
                    help="comma-separated built checkouts (default: this one)")
    ap.add_argument("--protocols", default="tcp,shm")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=3000, help="timed requests per op")
    ap.add_argument("--json", metavar="FILE", help="also write every run here")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: this checkout, tcp, 1 round of 200 (CI)")
    ap.add_argument("--one", nargs=2, metavar=("PROTOCOL", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]))))
        return 0
    if args.smoke:
        args.trees, args.protocols, args.rounds, args.requests = \
            os.path.dirname(HERE), "tcp", 1, 200
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    runs = []
    for rnd in range(args.rounds):
        for proto in args.protocols.split(","):
            for tree in trees:
                env = dict(os.environ, PYTHONPATH=tree)
                r = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", proto,
                                    str(args.requests)], env=env, cwd="/", text=True,
                                   capture_output=True, timeout=300)
                if r.returncode != 0:
                    sys.exit(f"{tree} ({proto}) failed:\n{r.stderr[-2000:]}")
                runs.append(dict(json.loads(r.stdout), tree=tree, protocol=proto, round=rnd))
    print(f"sync 4 KiB latency, {args.rounds} round(s) of {args.requests} requests per op, "
          f"alternating; median over rounds of each run's p50 (µs)")
    for proto in args.protocols.split(","):
        for tree in trees:
            mine = [r for r in runs if r["tree"] == tree and r["protocol"] == proto]
            p50 = {op: statistics.median(r[op]["p50_us"] for r in mine)
                   for op in ("write", "read")}
            print(f"  {proto:4} {tree:40} write {p50['write']:6.2f}  read {p50['read']:6.2f}"
                  f"  (metrics {'on' if mine[0]['metrics'] else 'off/absent'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

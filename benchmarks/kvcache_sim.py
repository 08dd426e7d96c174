# SPDX-License-Identifier: Apache-2.0
"""Benchmark: speed of the trace simulator (``mooncake-te trace replay/sweep``).

Usage::

    python benchmarks/kvcache_sim.py [TRACE ...]

Prints, per trace: load time, then block accesses per second for LRU and LFU at 10,000
blocks and unlimited, and the time of a default 19-point sweep. Defaults to the two
sample traces in the repository's ``data/traces/``.
"""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, os.pardir, "data", "traces")


def main(argv=None) -> int:
    from mooncake_te.kvcache.trace import load_trace, simulate, sweep
    argv = list(argv if argv is not None else sys.argv[1:])
    smoke = "--smoke" in argv          # does it still run (CI): the smaller trace only
    if smoke:
        argv.remove("--smoke")
    paths = argv or [os.path.join(DATA, f) for f in (
        ("synthetic_trace.jsonl",) if smoke else ("conversation_trace.jsonl",
                                                  "synthetic_trace.jsonl"))]
    for path in paths:
        t = time.perf_counter()
        tr = load_trace(path)
        load = time.perf_counter() - t
        refs = sum(len(x) for x in tr.hash_ids)
        print(f"{os.path.basename(path)}: {len(tr):,} requests, {refs:,} block references, "
              f"loaded in {load:.2f} s")
        for policy in ("lru", "lfu"):
            for cap in (10_000, None):
                t = time.perf_counter()
                r = simulate(tr, policy, cap)
                dt = time.perf_counter() - t
                print(f"  {policy} {'unlimited' if cap is None else f'{cap:,} blocks':>14}: "
                      f"hit {r.block_hit_rate:.4f} in {dt * 1e3:7.1f} ms "
                      f"({refs / dt / 1e6:.2f} M block accesses/s)")
        t = time.perf_counter()
        pts = sweep(tr, "lru")
        print(f"  lru sweep of {len(pts)} points: {time.perf_counter() - t:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

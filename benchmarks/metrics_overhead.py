# SPDX-License-Identifier: Apache-2.0
"""The cost of transfer metrics: the `mooncake-te bench` workload with counting on and
off, in one process against one target, in many short adjacent windows.

    .venv/bin/python benchmarks/metrics_overhead.py [--pairs 30] [--window 0.25]
        [--block-sizes 4K,1M] [--protocol tcp] [--op write] [--json]

Each pair is one window with metrics on and one with them off, back to back (the order
alternates from pair to pair), so both halves of a pair see the same machine load; the
figure is the median over pairs of the per-pair ratio, for throughput (GB/s) and for the
initiator's CPU time per request (getrusage: every thread of this process, where the
counting happens). Medians of the plain throughputs are printed too.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys

from mooncake_te.bench.runner import BenchConfig
from mooncake_te.bench.session import BenchSession
from mooncake_te.units import parse_sizes
from mooncake_te.metrics.engine import set_enabled


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def micro(reps: int = 7) -> dict:
    """Build and run benchmarks/metrics_completion.c (best of ``reps``); its JSON."""
    import os
    import subprocess
    import sysconfig
    import tempfile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.join(root, "src")
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "metrics_completion")
        # The core's batch, metrics and clock, compiled into the program (as in _core).
        subprocess.run([sysconfig.get_config_var("CC").split()[0] or "cc", "-O2", "-std=gnu11",
                        "-pthread", "-DMTE_CORE_BUILD=1", "-I", src,
                        os.path.join(root, "benchmarks", "metrics_completion.c"),
                        *(os.path.join(src, "core", f) for f in ("batch.c", "metrics.c",
                                                                  "clock.c")),
                        "-ldl", "-o", exe], check=True)
        return json.loads(subprocess.run([exe, str(reps)], check=True, capture_output=True,
                                         text=True).stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--window", type=float, default=0.25, help="seconds per window")
    ap.add_argument("--block-sizes", default="4K,1M")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--op", default="write", choices=("write", "read"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--micro", action="store_true",
                    help="only the native completion path, CPU ns per request")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds, smallest sizes, --micro once: does it still run (CI)")
    a = ap.parse_args(argv)
    if a.smoke:         # the windows, then the native program built and run once
        a.pairs, a.window, a.block_sizes = 1, 0.05, "4K"
        print("native completion path (1 repetition): "
              f"{len(micro(1)) - 1} figures")
    if a.micro:
        m = micro()
        if a.json:
            print(json.dumps(m, indent=1))
        else:
            print("native completion path, CPU ns per request (best of 7), off -> on:")
            for k, v in m.items():
                if isinstance(v, dict):
                    print(f"  {k:24} {v['ns_per_request_off']:7.2f} -> "
                          f"{v['ns_per_request_on']:7.2f}  (+"
                          f"{v['ns_per_request_on'] - v['ns_per_request_off']:.2f} ns)")
        return 0
    sizes = parse_sizes(a.block_sizes)
    out = {"pairs": a.pairs, "window_s": a.window, "protocol": a.protocol, "op": a.op,
           "points": []}
    with BenchSession("loopback", host="127.0.0.1", protocol=a.protocol) as s:
        out["transport"] = s.transport
        for bs in sizes:
            cfg = BenchConfig(ops=[a.op], block_sizes=[bs], duration=a.window,
                              warmup=0.02, sync=False)
            runs = {True: [], False: []}
            for i in range(a.pairs):
                for on in ((True, False) if i % 2 == 0 else (False, True)):
                    set_enabled(s.engine, on)
                    c0 = _cpu()
                    p = s.run(cfg)["points"][0]
                    runs[on].append((p["gbps"], (_cpu() - c0) / max(p["requests"], 1)))
            tput = [off[0] / on[0] for on, off in zip(runs[True], runs[False]) if on[0]]
            cpu = [on[1] / off[1] for on, off in zip(runs[True], runs[False]) if off[1]]
            out["points"].append({
                "block_size": bs,
                "gbps_on": statistics.median(r[0] for r in runs[True]),
                "gbps_off": statistics.median(r[0] for r in runs[False]),
                # > 0: slower with metrics on
                "throughput_overhead": statistics.median(tput) - 1.0,
                "cpu_us_per_request_on": statistics.median(r[1] for r in runs[True]) * 1e6,
                "cpu_us_per_request_off": statistics.median(r[1] for r in runs[False]) * 1e6,
                "cpu_overhead": statistics.median(cpu) - 1.0,
            })
        out["requests_counted"] = sum(t["requests"] for t in s.engine.metrics()["transfers"])
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print(f"metrics overhead, {a.op} over {out['transport']}: {a.pairs} pairs of "
              f"{a.window} s windows, on/off adjacent; medians")
        for p in out["points"]:
            print(f"  {p['block_size']:>8} B  GB/s on {p['gbps_on']:.3f} off "
                  f"{p['gbps_off']:.3f}  throughput overhead {p['throughput_overhead']:+.2%}"
                  f"  |  CPU us/request on {p['cpu_us_per_request_on']:.3f} off "
                  f"{p['cpu_us_per_request_off']:.3f}  CPU overhead {p['cpu_overhead']:+.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

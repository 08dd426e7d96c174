# SPDX-License-Identifier: Apache-2.0
"""Loopback figures beside the machine's ceilings, measured in the same run.

Runs iperf3 (Debian's, one stream, 1 MiB writes, the plain-C ceiling of loopback TCP on
this machine), then ``mooncake-te bench --protocol tcp`` at 4 KiB, 64 KiB, 1 MiB and
16 MiB, then iperf3 again, and prints GB/s per block size with the ratio to the mean
iperf3 figure, plus the synchronous 4 KiB latency. Then the same-host transport
(``--protocol shm``) beside a single-thread memcpy of the same size. Machines are noisy
(±20-30 % run to run), so only ratios within one run mean anything.

    python benchmarks/loopback_vs_iperf3.py [--duration 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time

# Figures measured elsewhere on this 2-core machine class (issue 2), for scale only.
REFERENCE = {
    "mooncake (PyPI TE, TCP)": {4096: 0.14, 65536: 1.6, 1 << 20: 2.1, 16 << 20: 2.2},
    "nixl (UCX TCP)": {4096: 0.30, 65536: 1.6, 1 << 20: 2.2, 16 << 20: 2.4},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iperf3(seconds: float) -> float:
    """GB/s of one iperf3 stream over 127.0.0.1 with 1 MiB writes."""
    if not shutil.which("iperf3"):
        sys.exit("iperf3 is not installed: apt-get install iperf3")
    port = free_port()
    server = subprocess.Popen(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)     # a probe connection would count as iperf3's test client
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-l", "1M", "-P", "1",
                              "-t", str(seconds), "-J"], capture_output=True, text=True,
                             check=True, timeout=seconds + 30).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8e9
    finally:
        server.kill()
        server.wait()


def bench(seconds: float, protocol: str, sizes="4K,64K,1M,16M") -> dict:
    out = subprocess.run([sys.executable, "-m", "mooncake_te", "bench", "--host", "127.0.0.1",
                          "--protocol", protocol, "--block-sizes", sizes,
                          "--duration", str(seconds), "--json", "--no-progress"],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    return json.loads(out)


def memcpy(nbytes: int, seconds: float = 1.0) -> float:
    """GB/s of one thread copying nbytes (numpy's copyto is a plain memcpy here)."""
    import numpy as np
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    np.copyto(b, a)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        np.copyto(b, a)
        n += 1
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per point")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: 1 s of iperf3, 4 KiB and 1 MiB points of 0.1 s "
                         "(does it still run: CI)")
    args = ap.parse_args()
    ip, sizes, shm_sizes, mc_s = 3, "4K,64K,1M,16M", "1M,16M", 1.0
    if args.smoke:
        args.duration, ip, sizes, shm_sizes, mc_s = 0.1, 1, "4K,1M", "1M", 0.1
    before = iperf3(ip)
    res = bench(args.duration, "tcp", sizes)
    after = iperf3(ip)
    ceiling = (before + after) / 2
    mc_before = memcpy(16 << 20, mc_s)
    shm = bench(args.duration, "shm", shm_sizes)
    mc = (mc_before + memcpy(16 << 20, mc_s)) / 2
    shm_rows = [{"op": p["op"], "block_size": p["block_size"], "gbps": p["gbps"],
                 "ratio_to_memcpy": p["gbps"] / mc} for p in shm["points"]]
    rows = []
    for p in res["points"]:
        rows.append({"op": p["op"], "block_size": p["block_size"], "batch": p["batch_size"],
                     "gbps": p["gbps"], "ratio_to_iperf3": p["gbps"] / ceiling,
                     "lat_avg_us": p["lat_us"]["avg"], "lat_p99_us": p["lat_us"]["p99"]})
    sync = {s["op"]: {"p50_us": s["lat_us"]["p50"], "p99_us": s["lat_us"]["p99"]}
            for s in res.get("sync", [])}
    report = {"iperf3_gbps": {"before": before, "after": after, "mean": ceiling},
              "points": rows, "sync_4k": sync, "reference": REFERENCE,
              "memcpy_16m_gbps": mc, "shm_points": shm_rows,
              "shm_sync_4k": {s["op"]: {"p50_us": s["lat_us"]["p50"], "p99_us": s["lat_us"]["p99"]}
                              for s in shm.get("sync", [])},
              "loadavg": res["machine"]}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"iperf3 loopback, 1 stream, 1 MiB writes: {before:.2f} GB/s before, "
          f"{after:.2f} after (ceiling = mean {ceiling:.2f})")
    print(f"{'op':6}{'block':>8}{'batch':>7}{'GB/s':>8}{'of iperf3':>11}{'avg µs':>10}"
          f"{'p99 µs':>10}   {'mooncake':>9}{'nixl':>7}")
    for r in rows:
        bs = r["block_size"]
        ref = [REFERENCE[k].get(bs) for k in REFERENCE]
        size = f"{bs >> 20}M" if bs >= 1 << 20 else f"{bs >> 10}K"
        print(f"{r['op']:6}{size:>8}{r['batch']:>7}{r['gbps']:>8.2f}{r['ratio_to_iperf3']:>10.0%}"
              f"{r['lat_avg_us']:>10.0f}{r['lat_p99_us']:>10.0f}   "
              + "".join(f"{v:>9.2f}" if v else f"{'-':>9}" for v in ref[:1])
              + "".join(f"{v:>7.2f}" if v else f"{'-':>7}" for v in ref[1:]))
    for op, s in sync.items():
        print(f"synchronous 4 KiB {op}: median {s['p50_us']:.1f} µs, p99 {s['p99_us']:.1f} µs")
    print("(mooncake/nixl columns: figures measured on this machine class for issue 2, "
          "not in this run)")
    print(f"\nsame-host transport (unix socket + cross-memory attach); single-thread memcpy "
          f"of 16 MiB: {mc:.2f} GB/s")
    for r in shm_rows:
        bs = r["block_size"]
        print(f"{r['op']:6}{bs >> 20:>7}M{r['gbps']:>8.2f} GB/s  {r['ratio_to_memcpy']:>5.0%} of memcpy")
    for op, s_ in report["shm_sync_4k"].items():
        print(f"synchronous 4 KiB {op} (shm): median {s_['p50_us']:.1f} µs, p99 {s_['p99_us']:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

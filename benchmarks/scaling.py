# SPDX-License-Identifier: Apache-2.0
"""Throughput as lanes and threads grow, beside N-way references, in one run.

For each N (default 1, 2, 4, 8, 16), one after the other on this machine:

* **iperf3 x N**: N independent iperf3 server/client pairs on 127.0.0.1 at once (1 MiB
  writes, one stream each; Debian's iperf3 3.12 runs all ``-P`` streams of one client in
  one thread, so ``-P N`` would not scale), summed: the kernel's loopback ceiling with N
  threads on each side;
* **memcpy x N**: N threads each copying its own 64 MiB buffer (``ctypes.memmove``, GIL
  released), summed: the ceiling of a same-host copy with N threads;
* **tcp**: ``mooncake-te bench --protocol tcp --threads N`` with
  ``MC_TCP_LANES_PER_PEER=N``, 1 MiB blocks, WRITE and READ;
* **shm**: the same with ``--protocol shm`` (same-host path);
* **auto**: what ``protocol="auto"`` picks between two local engines, and its figure.

and prints GB/s (1e9 bytes/s) with the ratios: tcp / iperf3 x N, shm / memcpy x N, and
whether shm >= tcp (``auto`` must never pick the slower path). The machine's core count
is printed too. Only ratios within one run mean anything.

    python benchmarks/scaling.py [--n 1,2,4,8,16] [--duration 1.5] [--json out.json]
    IPERF3=/path/to/iperf3 python benchmarks/scaling.py     # another iperf3 binary
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iperf3_pairs(n: int, seconds: float) -> float:
    """GB/s summed over n concurrent iperf3 pairs (one stream each, 1 MiB writes)."""
    exe = os.environ.get("IPERF3") or shutil.which("iperf3")
    if not exe:
        sys.exit("iperf3 is not installed: apt-get install iperf3 (or IPERF3=/path)")
    ports = [free_port() for _ in range(n)]
    servers = [subprocess.Popen([exe, "-s", "-1", "-B", "127.0.0.1", "-p", str(p)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for p in ports]
    try:
        time.sleep(0.5 + 0.05 * n)
        clients = [subprocess.Popen([exe, "-c", "127.0.0.1", "-p", str(p), "-l", "1M",
                                     "-t", str(seconds), "-J"], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True) for p in ports]
        total = 0.0
        for c in clients:
            out, _ = c.communicate(timeout=seconds + 60)
            total += json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8e9
        return total
    finally:
        for s in servers:
            if s.poll() is None:
                s.kill()
            s.wait()


def memcpy_threads(n: int, seconds: float, nbytes: int = 64 << 20) -> float:
    """GB/s summed over n threads, each memmove-ing its own nbytes buffer repeatedly."""
    bufs = [(ctypes.create_string_buffer(nbytes), ctypes.create_string_buffer(nbytes))
            for _ in range(n)]
    for a, b in bufs:                       # touch every page first
        ctypes.memset(a, 1, nbytes)
        ctypes.memset(b, 2, nbytes)
    counts = [0] * n
    start = threading.Barrier(n + 1)
    stop = time.perf_counter() + 1e9
    deadline = [stop]

    def work(i):
        a, b = bufs[i]
        start.wait()
        while time.perf_counter() < deadline[0]:
            ctypes.memmove(b, a, nbytes)
            counts[i] += 1

    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    deadline[0] = time.perf_counter() + seconds
    t0 = time.perf_counter()
    start.wait()
    for t in ts:
        t.join()
    return sum(counts) * nbytes / (time.perf_counter() - t0) / 1e9


def bench(protocol: str, n: int, seconds: float, size: str = "1M") -> dict:
    """{"write": GB/s, "read": GB/s, "transport": ...} of mooncake-te bench."""
    env = dict(os.environ, MC_TCP_LANES_PER_PEER=str(n))
    out = subprocess.run([sys.executable, "-m", "mooncake_te", "bench", "--host", "127.0.0.1",
                          "--protocol", protocol, "--block-sizes", size, "--threads", str(n),
                          "--duration", str(seconds), "--json", "--no-progress", "--no-sync",
                          "--buffer-size", "256M"],
                         capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        return {"error": out.stderr[-800:]}
    res = json.loads(out.stdout)
    fig = {"transport": res["header"].get("transport")}
    for p in res["points"]:
        if p.get("kind", "batch") == "batch":
            fig[p["op"]] = p["bytes"] / p["seconds"] / 1e9
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="1,2,4,8,16", help="lane/thread counts")
    ap.add_argument("--duration", type=float, default=1.5, help="seconds per figure")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    ap.add_argument("--protocols", default="tcp,shm,auto")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: N = 1, 1 s of iperf3, 0.2 s points (does it still "
                         "run: CI)")
    args = ap.parse_args()
    ipf_s = max(2.0, args.duration)
    if args.smoke:
        args.n, args.duration, ipf_s = "1", 0.2, 1
    ns = [int(x) for x in args.n.split(",")]
    protos = args.protocols.split(",")
    rows = []
    print(f"machine: {os.cpu_count()} CPUs; 1 MiB blocks; GB/s = 1e9 B/s", flush=True)
    print(f"{'N':>3} {'iperf3xN':>9} {'memcpyxN':>9} {'tcp W':>7} {'tcp R':>7} "
          f"{'W/ipf':>6} {'R/ipf':>6} {'shm W':>7} {'shm R':>7} {'W/mcp':>6} {'R/mcp':>6} "
          f"{'auto':>6} {'autoW':>7} {'autoR':>7}", flush=True)
    for n in ns:
        row = {"n": n, "iperf3": iperf3_pairs(n, ipf_s),
               "memcpy": memcpy_threads(n, args.duration)}
        for pr in protos:
            row[pr] = bench(pr, n, args.duration)
        rows.append(row)
        t, s, a = row.get("tcp", {}), row.get("shm", {}), row.get("auto", {})

        def g(d, k):
            return d.get(k, float("nan"))
        print(f"{n:3d} {row['iperf3']:9.2f} {row['memcpy']:9.2f} {g(t, 'write'):7.2f} "
              f"{g(t, 'read'):7.2f} {g(t, 'write') / row['iperf3']:6.2f} "
              f"{g(t, 'read') / row['iperf3']:6.2f} {g(s, 'write'):7.2f} {g(s, 'read'):7.2f} "
              f"{g(s, 'write') / row['memcpy']:6.2f} {g(s, 'read') / row['memcpy']:6.2f} "
              f"{str(a.get('transport')):>6} {g(a, 'write'):7.2f} {g(a, 'read'):7.2f}",
              flush=True)
        for pr in protos:
            if "error" in row[pr]:
                print(f"    {pr} failed: {row[pr]['error']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

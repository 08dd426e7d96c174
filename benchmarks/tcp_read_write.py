# SPDX-License-Identifier: Apache-2.0
"""Why TCP READ trails WRITE: throughput with the CPU each side spends, beside iperf3.

Two processes on 127.0.0.1 (this one initiates; a spawned one owns the target buffer),
TCP only. For each op and each lane count (``--lanes``), 1 MiB requests in batches of 16
with 4 batches in flight for ``--seconds``, walking 128 MiB buffers whose pages were
touched first. Around each point the CPU time of each process (user and system, from
/proc) and its context switches are read, so the table shows, per GB moved, where the
CPU went: the initiator's lanes, or the target's server threads. iperf3 (one stream,
1 MiB writes) runs before and after, also with its CPU per GB (``-J``'s cpu_utilization).

    python benchmarks/tcp_read_write.py [--lanes 4] [--seconds 3] [--json out.json]
    taskset -c 0,1 python benchmarks/tcp_read_write.py       # a 2-core machine's view
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import time

BUF = 128 << 20
BLOCK = 1 << 20
BATCH = 16
TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> dict:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    ut, st = int(parts[11]) / TICK, int(parts[12]) / TICK
    vol = invol = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
        except OSError:
            pass
    return {"user": ut, "sys": st, "vcs": vol, "ics": invol}


def _target(conn, lanes):
    import numpy as np

    import mooncake_te as mte
    eng = mte.TransferEngine(host="127.0.0.1", protocol="tcp")
    buf = np.ones(BUF, np.uint8)
    conn.send((eng.name, eng.register(buf).address, os.getpid()))
    conn.recv()
    eng.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iperf3(seconds: float) -> dict:
    exe = os.environ.get("IPERF3") or shutil.which("iperf3")
    port = free_port()
    srv = subprocess.Popen([exe, "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run([exe, "-c", "127.0.0.1", "-p", str(port), "-l", "1M", "-t",
                              str(seconds), "-J"], capture_output=True, text=True,
                             timeout=seconds + 30).stdout
        j = json.loads(out)["end"]
        gbps = j["sum_received"]["bits_per_second"] / 8e9
        u = j["cpu_utilization_percent"]
        # percent of one CPU over the run -> CPU seconds per GB
        return {"gbps": gbps, "sender_cpu_s_per_gb": u["host_total"] / 100 / gbps,
                "receiver_cpu_s_per_gb": u["remote_total"] / 100 / gbps}
    finally:
        srv.kill()
        srv.wait()


def point(eng, mte, op, name, local, remote, tpid, seconds) -> dict:
    import numpy as np
    n = BUF // BLOCK
    offs = (np.arange(n, dtype=np.uint64) * BLOCK)
    batches = [(local + offs[i:i + BATCH], remote + offs[i:i + BATCH]) for i in
               range(0, n, BATCH)]
    k = 0

    def submit():
        nonlocal k
        s, d = batches[k % len(batches)]
        k += 1
        return eng.submit_arrays(op, name, s, d, BLOCK)
    for _ in range(8):
        submit().wait(timeout=60)
    me, them = cpu(os.getpid()), cpu(tpid)
    t0 = time.perf_counter()
    inflight = [submit() for _ in range(4)]
    moved = 0
    while time.perf_counter() - t0 < seconds:
        inflight.pop(0).wait(timeout=60)
        moved += BATCH * BLOCK
        inflight.append(submit())
    for b in inflight:
        b.wait(timeout=60)
        moved += BATCH * BLOCK
    dt = time.perf_counter() - t0
    me2, them2 = cpu(os.getpid()), cpu(tpid)
    gb = moved / 1e9
    return {"gbps": gb / dt,
            "initiator": {k: (me2[k] - me[k]) / gb for k in me},
            "target": {k: (them2[k] - them[k]) / gb for k in them}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", default="4")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: 1 s of iperf3, 0.1 s points (does it still run: CI)")
    args = ap.parse_args()
    ipf_s = args.seconds
    if args.smoke:
        args.seconds, ipf_s, args.lanes = 0.1, 1, "2"
    import mooncake_te as mte
    res = {"cpus": len(os.sched_getaffinity(0)), "iperf3_before": iperf3(ipf_s),
           "points": []}
    for lanes in [int(x) for x in args.lanes.split(",")]:
        os.environ["MC_TCP_LANES_PER_PEER"] = str(lanes)
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_target, args=(child, lanes), daemon=True)
        proc.start()
        name, raddr, tpid = conn.recv()
        import numpy as np
        try:
            with mte.TransferEngine(host="127.0.0.1", protocol="tcp") as eng:
                mine = np.ones(BUF, np.uint8)
                local = eng.register(mine).address
                for op, label in ((mte.WRITE, "write"), (mte.READ, "read"),
                                  (mte.WRITE, "write"), (mte.READ, "read")):
                    r = point(eng, mte, op, name, local, raddr, tpid, args.seconds)
                    r.update(op=label, lanes=lanes)
                    res["points"].append(r)
        finally:
            conn.send("done")
            proc.join(30)
    res["iperf3_after"] = iperf3(ipf_s)
    ref = (res["iperf3_before"]["gbps"] + res["iperf3_after"]["gbps"]) / 2
    print(f"{res['cpus']} CPUs; iperf3 1 stream: {res['iperf3_before']['gbps']:.2f} before, "
          f"{res['iperf3_after']['gbps']:.2f} after GB/s; CPU s/GB sender "
          f"{res['iperf3_before']['sender_cpu_s_per_gb']:.3f} receiver "
          f"{res['iperf3_before']['receiver_cpu_s_per_gb']:.3f}")
    print(f"{'op':6} {'lanes':>5} {'GB/s':>6} {'of ipf':>6} | initiator CPU s/GB usr sys "
          f"vcs/GB | target CPU s/GB usr sys vcs/GB")
    for r in res["points"]:
        i, t = r["initiator"], r["target"]
        print(f"{r['op']:6} {r['lanes']:5d} {r['gbps']:6.2f} {r['gbps'] / ref:6.2f} | "
              f"{i['user']:.3f} {i['sys']:.3f} {i['vcs']:8.0f} | {t['user']:.3f} {t['sys']:.3f} "
              f"{t['vcs']:8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

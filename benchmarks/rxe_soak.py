# SPDX-License-Identifier: Apache-2.0
"""Sustained one-rail RDMA load on Soft-RoCE, beside perftest at the same pattern.

In one boot of the fabric lab (two rxe devices on a veth pair) this runs, in order:

1. perftest ``ib_write_bw`` and ``ib_read_bw`` from rxe0 to rxe1 at the engine's
   pattern: 64 KiB messages, two QPs (``-q 2``), 32-WR post lists (``-l 32``), the
   engine's queue depth (``-t``, default 256 = ``rdma_max_wr``), for ``--duration``
   seconds;
2. the engine on ONE rail (engine A on rxe0, engine B on rxe1, one process): a single
   batch of ``--gib`` GiB of 64 KiB WRITEs, then the same of READs (the blocks walk a
   64 MiB buffer again and again), checked byte for byte at the end;

and around each step the devices' counters (``hw_counters``: retransmissions, duplicate
and out-of-sequence packets, RNR NAKs, send errors) and the kernel log lines rxe wrote,
so a failure shows which side saw what. Under software emulation the MB/s mean nothing
beyond their ratio (docs/fabric-lab.md).

    sudo python benchmarks/rxe_soak.py [--duration 20] [--gib 1] [--depth 256] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

MIB = float(1 << 20)
COUNTERS = ("sent_pkts", "rcvd_pkts", "duplicate_request", "out_of_seq_request",
            "rcvd_rnr_err", "send_rnr_err", "rcvd_seq_err", "ack_deferred",
            "retry_exceeded_err", "retry_rnr_exceeded_err", "completer_retry_err",
            "send_err", "link_downed", "rdma_sends", "rdma_recvs")


def counters(dev: str) -> dict:
    base = f"/sys/class/infiniband/{dev}/ports/1/hw_counters"
    out = {}
    for n in COUNTERS:
        try:
            with open(os.path.join(base, n)) as f:
                out[n] = int(f.read())
        except OSError:
            pass
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def dmesg_tail(since_lines: int) -> list[str]:
    """Kernel log lines since ``since_lines``: the rxe/rdma ones and each WARNING or BUG
    with the 6 lines after it (where in rxe it fired)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    lines = out.splitlines()
    if since_lines < 0:
        return lines
    lines, keep, left = lines[since_lines:], [], 0
    for line in lines:
        if "WARNING" in line or "BUG" in line:
            left = 7
        if left or "rxe" in line.split("]", 1)[-1][:40] or "rdma" in line.lower()[:60]:
            keep.append(line)
        left = max(0, left - 1)
    return keep


def dmesg_len() -> int:
    return len(dmesg_tail(-1))


def perftest(tool, server, client, args, port) -> dict:
    common = ["-s", str(64 << 10), "-q", "2", "-l", "32", "-t", str(args.depth),
              "-D", str(int(args.duration)), "-F", "-p", str(port), "-u", str(args.qp_timeout)]
    gid = lambda d: ["-x", str(d["gid_index"])]  # noqa: E731
    srv = subprocess.Popen([tool, "-d", server["name"], *gid(server), *common],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.5)
            out = subprocess.run([tool, "-d", client["name"], *gid(client), *common,
                                  server["addr"]], capture_output=True, text=True,
                                 timeout=args.duration + 120)
            if out.returncode == 0 or srv.poll() is not None:
                break
        srv.wait(60)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    text = (out.stdout + out.stderr) if out else "no run"
    m = re.search(r"^\s*65536\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)", text, re.M)
    return {"rc": out.returncode if out else None, "ok": bool(m) and out.returncode == 0,
            "iters": int(m.group(1)) if m else 0,
            "mib_s": float(m.group(3)) if m else 0.0,
            "server_tail": (srv.stdout.read() if srv.stdout else "")[-1500:],
            "client_tail": text[-1500:]}


def engine_run(client, server, args) -> dict:
    import numpy as np

    import mooncake_te as mte
    from mooncake_te.config import Config

    def cfg():
        c = Config.load()
        te = {"rdma_max_wr": args.depth, "rdma_qp_timeout": args.qp_timeout}
        if args.no_retry:
            te["retry_count"] = 0
        c.data["transfer_engine"].update(te)
        return c
    buf = 64 << 20
    block = 64 << 10
    n = int(args.gib * (1 << 30)) // block
    res = {}
    with mte.TransferEngine(host="127.0.0.1", protocol="rdma", devices=[client["name"]],
                            config=cfg()) as a, \
            mte.TransferEngine(host="127.0.0.1", protocol="rdma", devices=[server["name"]],
                               config=cfg()) as b:
        src = np.random.default_rng(1).integers(0, 256, buf, dtype=np.uint8)
        dst = np.zeros(buf, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        offs = (np.arange(n, dtype=np.uint64) * block) % buf
        for op, name in ((mte.WRITE, "write"), (mte.READ, "read")):
            if op == mte.READ:
                src[:] = 0
            before = {d["name"]: counters(d["name"]) for d in (client, server)}
            t0 = time.monotonic()
            batch = a.submit_arrays(op, b.name, ra.address + offs, rb.address + offs, block,
                                    timeout=args.duration * 60 + 600)
            err = None
            try:
                batch.wait()
            except mte.MooncakeError as e:
                err = f"{type(e).__name__}: {e}"
            dt = time.monotonic() - t0
            st = batch.status()
            failed = [(i, s.state) for i, s in enumerate(st) if s.state != "completed"]
            done = sum(s.transferred_bytes for s in st)
            res[name] = {"transport": batch.transport, "requests": n, "seconds": round(dt, 1),
                         "bytes_done": int(done), "mib_s": done / dt / MIB if dt else 0.0,
                         "error": err, "not_completed": len(failed),
                         "first_failed": failed[:5],
                         "counters": {k: delta(before[k], counters(k)) for k in before}}
        res["intact"] = bool((src == dst).all())
    return res


def guest_main(args) -> int:
    devs = json.loads(os.environ["MOONCAKE_LAB_RXE"])
    client, server = devs[0], devs[1]
    out = {"depth": args.depth, "duration": args.duration, "qp_timeout": args.qp_timeout,
           "kernel": os.uname().release}
    port = 18800
    for tool in ("ib_write_bw", "ib_read_bw"):
        port += 1
        before = {d["name"]: counters(d["name"]) for d in (client, server)}
        k = dmesg_len()
        r = perftest(tool, server, client, args, port)
        r["counters"] = {d: delta(before[d], counters(d)) for d in before}
        r["dmesg"] = dmesg_tail(k)[-20:]
        out[tool] = r
        print(f"{tool}: ok={r['ok']} {r['mib_s']:.1f} MiB/s iters={r['iters']} "
              f"counters={r['counters']}", flush=True)
    k = dmesg_len()
    try:
        out["engine"] = engine_run(client, server, args)
    except Exception as e:               # reported, not hidden: the point is to see it
        out["engine"] = {"exception": f"{type(e).__name__}: {e}"}
    out["engine_dmesg"] = dmesg_tail(k)[-30:]
    print("@@result@@" + json.dumps(out), flush=True)
    return 0


def render(res: dict) -> str:
    lines = [f"one rail rxe0 -> rxe1, 64 KiB messages, 2 QPs, 32-WR chains, depth "
             f"{res['depth']}, QP timeout {res.get('qp_timeout', 14)} "
             f"({4.096e-6 * 2 ** res.get('qp_timeout', 14) * 1e3:.0f} ms), guest kernel "
             f"{res.get('kernel', '?')}"]
    for tool in ("ib_write_bw", "ib_read_bw"):
        r = res[tool]
        lines.append(f"  perftest {tool:12} {'clean' if r['ok'] else 'FAILED'}  "
                     f"{r['mib_s']:8.1f} MiB/s  {r['iters']} iterations in "
                     f"{res['duration']:.0f} s  counters {r['counters']}")
    e = res["engine"]
    if "exception" in e:
        lines.append(f"  engine: {e['exception']}")
    for op in ("write", "read"):
        if op in e:
            r = e[op]
            lines.append(f"  engine {op:5} {r['requests']} x 64 KiB in one batch: "
                         f"{'ERROR ' + r['error'] if r['error'] else 'completed'}  "
                         f"{r['bytes_done'] / MIB:.0f} MiB in {r['seconds']} s "
                         f"({r['mib_s']:.1f} MiB/s) via {r['transport']}  "
                         f"counters {r['counters']}")
            if r["first_failed"]:
                lines.append(f"    first failed requests: {r['first_failed']}")
    if "intact" in e:
        lines.append(f"  bytes intact after write + read: {e['intact']}")
    for line in res.get("engine_dmesg", []):
        lines.append(f"  dmesg: {line}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=20.0, help="perftest seconds")
    p.add_argument("--gib", type=float, default=1.0, help="GiB per engine batch")
    p.add_argument("--depth", type=int, default=256, help="WRs per QP (perftest -t)")
    p.add_argument("--qp-timeout", type=int, default=14,
                   help="QP local ACK timeout exponent (perftest -u, rdma_qp_timeout)")
    p.add_argument("--no-retry", action="store_true",
                   help="engine retry_count 0 (a QP failure fails the request)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--smoke", action="store_true",
                   help="CI: exits 77 saying why (the soak needs the fabric lab guest's rxe "
                        "pair, minutes to boot)")
    args = p.parse_args()
    if args.smoke:
        print("skipped: rxe_soak needs the fabric lab guest's rxe pair (minutes to boot); "
              "the RDMA transport itself is tested by tests/fabric")
        return 77
    if args.in_guest:
        return guest_main(args)
    import io

    from mooncake_te import lab
    buf = io.BytesIO()
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
    extra = ["--no-retry"] if args.no_retry else []
    t0 = time.monotonic()
    r = lab.run([sys.executable, here, "--in-guest", "--duration", str(args.duration),
                 "--gib", str(args.gib), "--depth", str(args.depth),
                 "--qp-timeout", str(args.qp_timeout), *extra],
                rxe=2, env=env, cwd=root, out=buf, timeout=args.timeout)
    text = buf.getvalue().decode(errors="replace")
    m = re.search(r"@@result@@(.*)", text)
    if r.returncode != 0 or not m:
        print(text, file=sys.stderr)
        return r.returncode or 1
    res = json.loads(m.group(1))
    res["guest_run_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(render(res))
        print(f"(one lab boot, {res['guest_run_s']} s; software emulation: only ratios mean "
              f"anything)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

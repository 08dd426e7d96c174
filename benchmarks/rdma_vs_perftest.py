# SPDX-License-Identifier: Apache-2.0
"""The RDMA transport beside perftest, on the same devices in one boot of the fabric lab.

In one guest run (two Soft-RoCE devices, rxe0 and rxe1, on a veth pair): perftest's
``ib_write_bw`` and ``ib_read_bw`` from rxe0 to rxe1 at 64 KiB and 1 MiB messages, then
``mooncake-te bench --protocol rdma --device rxe0 --target-device rxe1`` at the same
block sizes, then perftest again; prints MB/s of each and the ratio ours / perftest
(perftest taken as the mean of its two runs). Under software emulation the absolute
numbers mean nothing; the ratio does (docs/fabric-lab.md).

    sudo python benchmarks/rdma_vs_perftest.py [--duration 3] [--json]

With RDMA hardware (``--native``), the same runs happen on this machine's devices
(``--devices mlx5_0,mlx5_1``; the first is the initiator's, the second the target's).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

SIZES = (64 << 10, 1 << 20)
MIB = float(1 << 20)


def perftest(tool: str, size: int, server: dict, client: dict, seconds: float,
             port: int) -> float:
    """Average MB/s (MiB/s, perftest's unit) of ``tool`` (ib_write_bw / ib_read_bw)."""
    common = ["-s", str(size), "-D", str(max(1, int(round(seconds)))), "-F", "-p", str(port)]
    gid = lambda d: ["-x", str(d["gid_index"])] if d.get("gid_index") is not None else []  # noqa
    srv = subprocess.Popen([tool, "-d", server["name"], *gid(server), *common],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        out = None
        while time.monotonic() < deadline:
            time.sleep(0.3)
            out = subprocess.run([tool, "-d", client["name"], *gid(client), *common,
                                  server["addr"]], capture_output=True, text=True,
                                 timeout=seconds + 60)
            if out.returncode == 0 or srv.poll() is not None:
                break
        srv.wait(30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    if out is None or out.returncode != 0:
        raise RuntimeError(f"{tool} failed: {(out.stdout + out.stderr) if out else 'no run'}")
    m = re.search(rf"^\s*{size}\s+\d+\s+([0-9.]+)\s+([0-9.]+)", out.stdout, re.M)
    if not m:
        raise RuntimeError(f"cannot parse {tool} output:\n{out.stdout}")
    return float(m.group(2))


def ours(size_list, duration: float, client: str, server: str) -> dict:
    """{(op, size): MiB/s} from mooncake-te bench --protocol rdma."""
    cmd = [sys.executable, "-m", "mooncake_te", "bench", "--protocol", "rdma",
           "--device", client, "--target-device", server, "--block-sizes",
           ",".join(f"{s >> 10}K" for s in size_list), "--op", "both", "--no-sync",
           "--no-progress", "--json", "--duration", str(duration),
           "--buffer-size", "64M"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"mooncake-te bench failed ({out.returncode}):\n{out.stderr}")
    res = json.loads(out.stdout)
    if res["header"]["transport"] != "rdma":
        raise RuntimeError(f"the bench moved data over {res['header']['transport']}, not rdma")
    return {(p["op"], p["block_size"]): p["bytes"] / p["seconds"] / MIB
            for p in res["points"] if p.get("kind", "batch") == "batch"}


def measure(devs, duration: float) -> dict:
    client, server = devs[0], devs[1]
    port = 18700
    pt = {}
    for rnd in range(2):
        for size in SIZES:
            for op, tool in (("write", "ib_write_bw"), ("read", "ib_read_bw")):
                port += 1
                pt.setdefault((op, size), []).append(
                    perftest(tool, size, server, client, duration, port))
        if rnd == 0:
            mine = ours(SIZES, duration, client["name"], server["name"])
    rows = []
    for size in SIZES:
        for op in ("write", "read"):
            ref = sum(pt[(op, size)]) / len(pt[(op, size)])
            rows.append({"op": op, "size": size, "perftest_mib_s": ref,
                         "perftest_runs": pt[(op, size)], "ours_mib_s": mine[(op, size)],
                         "ratio": mine[(op, size)] / ref if ref else 0.0})
    return {"devices": [client["name"], server["name"]], "rows": rows}


def render(res: dict) -> str:
    lines = [f"RDMA {res['devices'][0]} -> {res['devices'][1]} (perftest: mean of two runs "
             f"around ours)",
             f"{'op':6} {'size':>6} {'perftest MiB/s':>15} {'ours MiB/s':>11} {'ours/perftest':>14}"]
    for r in res["rows"]:
        size = f"{r['size'] >> 10}K" if r["size"] < (1 << 20) else f"{r['size'] >> 20}M"
        lines.append(f"{r['op']:6} {size:>6} {r['perftest_mib_s']:15.1f} "
                     f"{r['ours_mib_s']:11.1f} {r['ratio']:14.2f}")
    return "\n".join(lines)


def guest_main(args) -> int:
    devs = json.loads(os.environ["MOONCAKE_LAB_RXE"]) if os.environ.get("MOONCAKE_LAB_RXE") \
        else None
    if devs is None:
        names = args.devices.split(",")
        devs = [{"name": n, "addr": args.addr, "gid_index": None} for n in names]
    res = measure(devs, args.duration)
    print("@@result@@" + json.dumps(res), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    p.add_argument("--json", action="store_true")
    p.add_argument("--native", action="store_true", help="use this machine's devices")
    p.add_argument("--devices", default="mlx5_0,mlx5_1", help="with --native: client,server")
    p.add_argument("--addr", default="", help="with --native: the server device's IP")
    p.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true",
                   help="CI: exits 77 saying why (the figures need RDMA devices: the fabric "
                        "lab guest's rxe pair, minutes to boot, or --native)")
    args = p.parse_args()
    if args.smoke:
        print("skipped: rdma_vs_perftest needs two RDMA devices (the fabric lab guest's rxe "
              "pair, minutes to boot, or --native on a machine with NICs); the RDMA transport "
              "itself is tested by tests/fabric")
        return 77
    if args.in_guest or args.native:
        if args.native:
            for t in ("ib_write_bw", "ib_read_bw"):
                if not shutil.which(t):
                    sys.exit(f"{t} is not installed: apt-get install perftest")
        return guest_main(args)
    from mooncake_te import lab
    import io
    buf = io.BytesIO()
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
    t0 = time.monotonic()
    r = lab.run([sys.executable, here, "--in-guest", "--duration", str(args.duration)],
                rxe=2, env=env, cwd=root, out=buf, timeout=args.timeout)
    text = buf.getvalue().decode(errors="replace")
    m = re.search(r"@@result@@(.*)", text)
    if r.returncode != 0 or not m:
        print(text, file=sys.stderr)
        return r.returncode or 1
    res = json.loads(m.group(1))
    res["guest_run_s"] = round(time.monotonic() - t0, 1)
    res["accel"] = r.accel
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(render(res))
        print(f"(one lab boot, accel={r.accel}, {res['guest_run_s']} s; software emulation: "
              f"only the ratio means anything)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

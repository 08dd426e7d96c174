# SPDX-License-Identifier: Apache-2.0
"""Storage segments through the engine beside fio, on the same connected namespace.

Makes an NVMe-oF target (a loop device over a file in memory, exported over tcp on
127.0.0.1 with ``mooncake_te.nvmeof_admin``), connects to it, publishes it as a storage
segment and then, for sequential and random reads and writes of 1 MiB and 64 KiB
blocks, measures the engine (one batch of every block, ``MC_NVMEOF_QUEUE_DEPTH`` in
flight, default 16) and fio (Debian's, libaio, O_DIRECT, iodepth 16, one job) on the
same block device, alternating engine and fio ``--repeat`` times, and prints MB/s and
the ratio ours/fio of the medians. Only the ratio means anything in the lab: software
emulation makes absolute figures small.

    python benchmarks/nvmeof_vs_fio.py --lab [--size-mib 256] [--json]   # boots the lab
    python benchmarks/nvmeof_vs_fio.py [--json]       # where nvmet and nvme-tcp work (root)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

NQN = "nqn.2026-12.io.mooncake-te:bench"
PORT = 4426
DEPTH = 16


def fio(dev: str, rw: str, bs: int, size: int) -> float:
    """MB/s of one fio job (libaio, O_DIRECT, iodepth 16) over [0, size) of ``dev``."""
    out = subprocess.run(["fio", "--name=bench", f"--filename={dev}", f"--rw={rw}",
                          f"--bs={bs}", f"--size={size}", f"--iodepth={DEPTH}",
                          "--ioengine=libaio", "--direct=1", "--numjobs=1",
                          "--output-format=json"],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    job = json.loads(out)["jobs"][0]
    side = job["read"] if "read" in rw else job["write"]
    return side["bw_bytes"] / 1e6


def ours(eng, seg, region, rw: str, bs: int, size: int, rng) -> float:
    """MB/s of one batch covering [0, size) in blocks of ``bs`` (random: a permutation)."""
    import numpy as np
    import mooncake_te as mte
    n = size // bs
    offs = np.arange(n, dtype=np.uint64) * np.uint64(bs)
    if rw.startswith("rand"):
        offs = rng.permutation(offs)
    slots = region.length // bs              # memory blocks reused round robin, as fio does
    local = region.address + (np.arange(n, dtype=np.uint64) % np.uint64(slots)) * np.uint64(bs)
    op = mte.READ if "read" in rw else mte.WRITE
    t0 = time.perf_counter()
    b = eng.submit_arrays(op, seg.name, local, offs, bs, timeout=600)
    b.wait(timeout=600)
    dt = time.perf_counter() - t0
    assert b.transport == "nvmeof", b.transport
    return size / dt / 1e6


def bench(size: int, repeat: int) -> dict:
    import numpy as np
    import mooncake_te as mte
    from mooncake_te import nvmeof_admin as nvmeof

    work = tempfile.mkdtemp(prefix="nvmeof-bench-", dir=os.environ.get("TMPDIR"))
    img = os.path.join(work, "img")
    with open(img, "wb") as f:
        f.truncate(size)
    loop = subprocess.run(["losetup", "-f", "--show", img], capture_output=True, text=True,
                          check=True).stdout.strip()
    rows = []
    try:
        nvmeof.create_target(NQN, loop, "tcp", "127.0.0.1", PORT)
        conn = nvmeof.connect(NQN, "127.0.0.1", PORT)
        dev = conn.devices[0]
        try:
            with mte.TransferEngine(host="127.0.0.1") as eng:
                seg = eng.register_storage("bench", nqn=NQN)
                buf = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
                region = eng.register(buf)
                buf_mod = region.address % 4096        # numpy's: usually 16-byte aligned
                memalign = None
                rng = np.random.default_rng(1)
                # Warm up: every block of the namespace written once (fio's reads of a
                # never-written loop file would be faster than real data).
                ours(eng, seg, region, "write", 1 << 20, size, rng)
                for rw in ("read", "write", "randread", "randwrite"):
                    for bs in (1 << 20, 64 << 10):
                        o, f = [], []
                        for _ in range(repeat):
                            o.append(ours(eng, seg, region, rw, bs, size, rng))
                            f.append(fio(dev, rw, bs, size))
                        row = {"rw": rw, "bs": bs, "ours_mb_s": statistics.median(o),
                               "fio_mb_s": statistics.median(f), "ours_all": o, "fio_all": f}
                        row["ratio"] = row["ours_mb_s"] / row["fio_mb_s"]
                        rows.append(row)
                        d = eng._transports["nvmeof"]._devices.get(dev)
                        memalign = d.memalign if d is not None else None
                        print(f"  {rw:9s} {bs >> 10:5d} KiB  ours {row['ours_mb_s']:8.1f} MB/s"
                              f"  fio {row['fio_mb_s']:8.1f} MB/s  ratio {row['ratio']:.2f}",
                              file=sys.stderr, flush=True)
        finally:
            nvmeof.disconnect(NQN)
    finally:
        try:
            nvmeof.delete_target(NQN)
        finally:
            subprocess.run(["losetup", "-d", loop])
            shutil.rmtree(work, ignore_errors=True)
    return {"device": dev, "size": size, "queue_depth": DEPTH, "repeat": repeat,
            "buffer_address_mod_4096": buf_mod, "memalign": memalign,
            "lab": os.environ.get("MOONCAKE_LAB") == "1", "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lab", action="store_true", help="run inside the fabric lab guest")
    ap.add_argument("--size-mib", type=int, default=256, help="namespace size (default 256)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, median (default 3)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--smoke", action="store_true",
                    help="CI: exits 77 saying why (the figures need an NVMe-oF target: the "
                         "fabric lab guest, which takes minutes to boot, or root with nvmet)")
    args = ap.parse_args()
    if args.smoke:
        print("skipped: nvmeof_vs_fio needs a connected NVMe-oF namespace (the fabric lab "
              "guest: --lab, minutes to boot; or root with nvmet and nvme-tcp); the storage "
              "path itself is tested by tests/fabric")
        return 77
    if args.lab:
        from mooncake_te import lab
        argv = [sys.executable, os.path.abspath(__file__), "--size-mib", str(args.size_mib),
                "--repeat", str(args.repeat)] + (["--json"] if args.json else [])
        r = lab.run(argv, rxe=0, nvmeof=True, timeout=1800, memory_mb=2048)
        return r.returncode
    if not shutil.which("fio"):
        sys.exit("fio is not installed: apt-get install fio")
    res = bench(args.size_mib << 20, args.repeat)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"NVMe-oF tcp, {res['device']}, {res['size'] >> 20} MiB, queue depth "
              f"{DEPTH}, median of {args.repeat}{' (lab guest, software emulation)' if res['lab'] else ''}")
        print(f"engine memory at address % 4096 = {res['buffer_address_mod_4096']}; the "
              f"device took memory aligned to {res['memalign']} bytes directly "
              f"(less aligned memory goes through a bounce buffer)")
        print(f"{'pattern':9s} {'block':>9s} {'ours MB/s':>10s} {'fio MB/s':>10s} {'ratio':>6s}")
        for r in res["rows"]:
            print(f"{r['rw']:9s} {r['bs'] >> 10:5d} KiB {r['ours_mb_s']:10.1f} "
                  f"{r['fio_mb_s']:10.1f} {r['ratio']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

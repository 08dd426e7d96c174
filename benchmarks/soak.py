# SPDX-License-Identifier: Apache-2.0
"""Soak: N target engines in their own processes, one initiator driving mixed READ/WRITE
batches at them with every byte verified, targets SIGKILLed and restarted at random.

Prints transfers completed, bytes verified, checksum mismatches (must be 0), peers
killed, failures reported against failures expected (only batches to a peer killed while
they ran may fail), and this process's file descriptors and RSS at start and end.

    python benchmarks/soak.py --minutes 10 --peers 3 [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time

import numpy as np

BUF = 8 << 20


def _target(conn):
    import mooncake_te as mte
    eng = mte.TransferEngine(host="127.0.0.1")
    buf = np.zeros(BUF, np.uint8)
    r = eng.register(buf)
    conn.send((eng.name, r.address))
    try:
        conn.recv()                   # returns when the driver closes the pipe
    except EOFError:
        pass
    eng.close()


class Peer:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.name, self.address = self.conn.recv()
        self.alive = True

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)
        self.alive = False

    def close(self):
        self.conn.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.proc.close()             # releases the process sentinel fd


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=5.0, help="mean seconds between kills")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="two seconds, two peers, a kill a second (does it still run: CI)")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.peers, args.kill_every = 2 / 60, 2, 1.0

    import mooncake_te as mte
    rng = random.Random(args.seed)
    ctx = mp.get_context("spawn")
    stats = dict(batches=0, transfers=0, bytes_verified=0, mismatches=0, peers_killed=0,
                 failures_expected=0, failures_unexpected=0, timeouts=0)
    eng = mte.TransferEngine(host="127.0.0.1")
    out = np.zeros(BUF, np.uint8)
    back = np.zeros(BUF, np.uint8)
    r_out, r_back = eng.register(out), eng.register(back)
    peers = [Peer(ctx) for _ in range(args.peers)]
    def warm():
        # Every lane to every current peer connected: the start and end figures are taken
        # in this same state, before teardown, so a leak per kill/restart shows up.
        offs = np.arange(256, dtype=np.uint64) * 4096
        for p in peers:
            eng.submit_arrays(mte.WRITE, p.name, r_out.address + offs, p.address + offs,
                              4096).wait()

    warm()
    start_fds, start_rss = fds(), rss_kib()
    end_fds = end_rss = None
    end = time.monotonic() + args.minutes * 60
    next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every)
    try:
        while time.monotonic() < end:
            i = rng.randrange(len(peers))
            p = peers[i]
            # A batch of disjoint random windows; WRITE them, then READ them back elsewhere.
            n = rng.randint(1, 64)
            size = rng.choice([512, 4096, 65536, 1 << 20])
            slots = rng.sample(range(BUF // size), min(n, BUF // size))
            offs = np.array(slots, np.uint64) * size
            out[:] = 0
            for o in offs.tolist():
                out[o:o + size] = np.frombuffer(os.urandom(size), np.uint8)
            killed_during = False
            try:
                b = eng.submit_arrays(mte.WRITE, p.name, r_out.address + offs, p.address + offs,
                                      size, timeout=10)
                if time.monotonic() > next_kill:        # kill it while the batch runs
                    p.kill()
                    stats["peers_killed"] += 1
                    killed_during = True
                    next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every)
                b.wait()
                eng.submit_arrays(mte.READ, p.name, r_back.address + offs, p.address + offs,
                                  size, timeout=10).wait()
                stats["batches"] += 2
                stats["transfers"] += 2 * len(offs)
                for o in offs.tolist():
                    if not np.array_equal(out[o:o + size], back[o:o + size]):
                        stats["mismatches"] += 1
                stats["bytes_verified"] += len(offs) * size
            except (mte.TransferError, mte.SegmentNotFoundError) as e:
                if isinstance(e, mte.TransferTimeoutError):
                    stats["timeouts"] += 1
                if killed_during or not p.alive:
                    stats["failures_expected"] += 1
                else:
                    stats["failures_unexpected"] += 1
                    print(f"unexpected failure against live peer {p.name}: {e}", file=sys.stderr)
            if not p.alive:                             # restart it (new process, new name)
                p.close()
                peers[i] = Peer(ctx)
        warm()
        end_fds, end_rss = fds(), rss_kib()
    finally:
        for p in peers:
            p.close()
        eng.close()
    stats.update(minutes=args.minutes, peers=args.peers, fds_start=start_fds, fds_end=end_fds,
                 rss_kib_start=start_rss, rss_kib_end=end_rss)
    if args.json:
        print(json.dumps(stats, indent=1))
    else:
        for k, v in stats.items():
            print(f"{k:20} {v}")
    return 1 if stats["mismatches"] or stats["failures_unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())

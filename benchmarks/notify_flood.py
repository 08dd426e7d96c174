# SPDX-License-Identifier: Apache-2.0
"""The receiver's memory under a flood of notifications it never reads (issue #20 item 6):
600 messages of 1 MiB from one engine to another in a second process, then the
receiver's RSS before and after, and how many the bounded queue refused.

    .venv/bin/python benchmarks/notify_flood.py [--count 600] [--size 1M]

Measured on the 2-core VM (2026-12-03): landed main 115d13e 36 -> 639 MiB, 0 refused;
with the 64 MiB / 65,536-message bound 38 -> 104 MiB, 536 refused.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time

import mooncake_te as mte
from mooncake_te.units import parse_sizes

RECEIVER = textwrap.dedent("""
    import sys, mooncake_te as mte
    eng = mte.TransferEngine(host="127.0.0.1", protocol="tcp")
    print(eng.name, flush=True)
    for line in sys.stdin:          # one line in, its RSS in MiB out; never reads notifications
        kib = next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]
        print(int(kib) // 1024, flush=True)
""")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=600)
    ap.add_argument("--size", default="1M", help="bytes per message (at most 1M)")
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two, smallest sizes: does it still run (CI)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.count, a.size = 20, "64K"
    size = parse_sizes(a.size)[0]
    child = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()

        def rss() -> int:
            child.stdin.write("rss\n")
            child.stdin.flush()
            return int(child.stdout.readline())

        with mte.TransferEngine(host="127.0.0.1", protocol="tcp") as sender:
            msg = b"n" * size
            before, refused, t0 = rss(), 0, time.monotonic()
            for _ in range(a.count):
                try:
                    sender.send_notification(name, msg)
                except mte.TransferError:
                    refused += 1
            dt = time.monotonic() - t0
            print(f"{a.count} notifications of {size} bytes in {dt:.2f} s: receiver RSS "
                  f"{before} -> {rss()} MiB, {refused} refused")
    finally:
        child.stdin.close()
        child.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""What peer authentication costs, with and without a token in the same run.

- handshake: a descriptor fetch over the RPC port (open_segment(refresh=True)), and the
  first transfer of a fresh initiator (descriptor fetch + data connection + hello);
- throughput: 64 x 64 KiB WRITE batches for a few seconds (authentication happens when
  a connection opens, so this ratio should be about 1).

    python benchmarks/auth_cost.py [--seconds 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import mooncake_te as mte


def measure(token, seconds):
    tgt = mte.TransferEngine(host="127.0.0.1", auth_token=token)
    dst = tgt.register(np.zeros(64 << 20, np.uint8))
    try:
        with mte.TransferEngine(host="127.0.0.1", auth_token=token) as ini:
            fetch = []
            for _ in range(200):
                t = time.perf_counter()
                ini.open_segment(tgt.name, refresh=True)
                fetch.append(time.perf_counter() - t)
        first = []
        for _ in range(30):
            with mte.TransferEngine(host="127.0.0.1", auth_token=token) as ini:
                src = ini.register(np.ones(4096, np.uint8))
                t = time.perf_counter()
                ini.write(tgt.name, src.address, dst.address, 4096)
                first.append(time.perf_counter() - t)
        with mte.TransferEngine(host="127.0.0.1", auth_token=token) as ini:
            src = ini.register(np.ones(64 << 20, np.uint8))
            offs = np.arange(64, dtype=np.uint64) * 65536
            ini.submit_arrays(mte.WRITE, tgt.name, src.address + offs, dst.address + offs,
                              65536).wait()
            moved, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                bs = [ini.submit_arrays(mte.WRITE, tgt.name, src.address + offs + k * (4 << 20),
                                        dst.address + offs + k * (4 << 20), 65536)
                      for k in range(4)]
                for b in bs:
                    b.wait()
                moved += 4 * 64 * 65536
            gbps = moved / (time.perf_counter() - t0) / 1e9
    finally:
        tgt.close()
    return {"fetch_us": statistics.median(fetch) * 1e6,
            "first_transfer_us": statistics.median(first) * 1e6, "gbps": gbps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two, smallest sizes: does it still run (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.seconds = 0.1
    measure(None, 0.05 if args.smoke else 0.2)                          # warm-up: imports, page cache, sockets
    runs = {"plain": [], "auth": []}
    for _ in range(2):                          # interleaved, so drift hits both alike
        runs["plain"].append(measure(None, args.seconds))
        runs["auth"].append(measure("a shared secret", args.seconds))
    print(f"{'':28}{'no token':>20}{'token':>20}{'ratio':>8}")
    for key, label in (("fetch_us", "descriptor fetch (µs, p50)"),
                       ("first_transfer_us", "first transfer (µs, p50)"),
                       ("gbps", "64 KiB batches (GB/s)")):
        p = [r[key] for r in runs["plain"]]
        a = [r[key] for r in runs["auth"]]
        print(f"{label:28}{' / '.join(f'{v:.1f}' for v in p):>20}"
              f"{' / '.join(f'{v:.1f}' for v in a):>20}{statistics.mean(a) / statistics.mean(p):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""How long opening a segment takes per metadata backend, and how long a killed engine
stays visible.

For each backend (p2p, etcd, redis, http) this starts the real server on 127.0.0.1
(tests/servers.py: Debian's etcd and redis-server, ``mooncake-te metadata-server``), a
peer engine in another process, and measures in this process:

* ``cold``: a new backend client's first lookup (connect + fetch + decode), what an
  engine pays the first time it meets a peer;
* ``refresh``: ``open_segment(name, refresh=True)`` on a warm client (fetch + decode);
* ``cached``: ``open_segment(name)`` served from the descriptor cache;
* ``visible``: seconds from SIGKILL of the peer until ``open_segment(refresh=True)``
  stops finding it (the lease/TTL at work; p2p has no store, so the peer's RPC port
  simply stops answering).

Usage::

    python benchmarks/metadata_open_segment.py [--ttl 10] [--repeat 200] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import mooncake_te as mte                                     # noqa: E402
from mooncake_te.errors import MooncakeError                  # noqa: E402
from mooncake_te.metadata import open_backend                 # noqa: E402
from peers import PeerProcess                                 # noqa: E402
from servers import EtcdServer, HttpMetadataServer, RedisServer   # noqa: E402


def stats_us(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median_us": round(statistics.median(s) * 1e6, 1),
            "p99_us": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, 1),
            "n": len(s)}


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(kind: str, spec: str, ttl: float, repeat: int) -> dict:
    peer = PeerProcess(1 << 20, metadata=spec, name=f"bench-{kind}")
    try:
        with mte.TransferEngine(name=f"bench-{kind}-client", metadata=spec,
                                host="127.0.0.1") as eng:
            name = peer.name
            eng.open_segment(name)          # warm up

            def cold():
                b = open_backend(spec)
                try:
                    b.fetch(name, 5.0)
                finally:
                    # a lookup-only client publishes nothing; close drops its connection
                    b.close()
            result = {
                "cold": stats_us(timed(cold, max(min(20, repeat), repeat // 5))),
                "refresh": stats_us(timed(lambda: eng.open_segment(name, refresh=True), repeat)),
                "cached": stats_us(timed(lambda: eng.open_segment(name), repeat * 10)),
            }
            peer.kill()
            killed = time.monotonic()
            limit = ttl * 3 + 10
            while time.monotonic() - killed < limit:
                try:
                    eng.open_segment(name, refresh=True)
                except MooncakeError:
                    break
                time.sleep(0.02)
            result["visible_s"] = round(time.monotonic() - killed, 2)
            return result
    finally:
        peer.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ttl", type=float, default=10.0, help="lease/TTL seconds (default 10)")
    ap.add_argument("--repeat", type=int, default=200, help="lookups per figure")
    ap.add_argument("--backends", default="p2p,etcd,redis,http")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: p2p and http, 5 lookups per figure, TTL 2 s (does "
                         "it still run: CI; every backend goes through the same code)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeat, args.ttl, args.backends = 5, 2.0, "p2p,http"

    servers = {"etcd": EtcdServer, "redis": RedisServer, "http": HttpMetadataServer}
    results = {}
    for kind in args.backends.split(","):
        if kind == "p2p":
            results[kind] = measure(kind, "p2p", args.ttl, args.repeat)
            continue
        with servers[kind]() as srv:
            results[kind] = measure(kind, f"{srv.url}?ttl={args.ttl:g}", args.ttl, args.repeat)
    if args.json:
        print(json.dumps({"ttl_s": args.ttl, "results": results}, indent=2))
        return 0
    print(f"open_segment latency (127.0.0.1, median / p99 in microseconds), TTL {args.ttl:g} s")
    print(f"{'backend':8} {'cold':>18} {'refresh':>18} {'cached':>16} {'killed visible':>15}")
    for kind, r in results.items():
        f = lambda k: f"{r[k]['median_us']:>8.0f} / {r[k]['p99_us']:<7.0f}"   # noqa: E731
        print(f"{kind:8} {f('cold'):>18} {f('refresh'):>18} {f('cached'):>16} "
              f"{r['visible_s']:>13.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

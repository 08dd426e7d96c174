# SPDX-License-Identifier: Apache-2.0
"""Time to distribute one object to N getter processes: decentralized vs from one holder.

A publisher process registers an object of ``--size`` bytes; N getter processes, each
with its own engine and P2PStore on 127.0.0.1, wait at a common start signal, fetch it,
and keep serving until every getter has finished (as nodes in a rollout would). For
each N and mode this reports:

* ``seconds``: from the start signal until the last getter holds every chunk;
* ``aggregate GB/s``: N x size / seconds;
* ``slowest / fastest`` getter seconds;
* ``publisher uploaded``: bytes read from the publisher, in units of the object size
  (centralized: exactly N; decentralized: less, the rest came from other getters);
* ``cpu``: CPU seconds of all processes from the start signal to the end.

``centralized`` is ``decentralized=False`` (``[p2p_store] decentralized = false``):
every getter reads everything from the publisher. Destination buffers are allocated and
touched before the start signal, so page faults are not timed. All processes share this
machine's cores, so on a small machine both modes are bound by CPU (memcpy through
loopback TCP plus CRC-32 of every chunk); the publisher's share of the uploads is what
carries over to a real network, where its NIC is the bottleneck.

Usage::

    python benchmarks/p2p_store_distribution.py [--size 1G] [--getters 2,4,8]
        [--modes decentralized,centralized] [--chunk-size 4M] [--metadata p2p|etcd]
        [--verify] [--json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _cpu_seconds() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _publisher(conn, size, chunk_size, metadata, start):
    import numpy as np
    import mooncake_te as mte
    from mooncake_te.p2p_store import P2PStore
    eng = mte.TransferEngine(host="127.0.0.1", metadata=metadata)
    store = P2PStore(eng, metadata=metadata, chunk_size=chunk_size)
    data = np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)
    store.register("bench", data)
    digest = hashlib.sha256(data).hexdigest()
    conn.send((store.address, digest))
    start.wait()
    cpu0 = _cpu_seconds()
    conn.recv()                                  # "stats"
    conn.send(dict(store.stats(), cpu_s=_cpu_seconds() - cpu0))
    conn.recv()                                  # "exit"
    store.close()
    eng.close()


def _getter(conn, size, metadata, seed, decentralized, parallelism, start, verify):
    import numpy as np
    import mooncake_te as mte
    from mooncake_te.p2p_store import P2PStore
    eng = mte.TransferEngine(host="127.0.0.1", metadata=metadata)
    store = P2PStore(eng, metadata=metadata, seeds=[seed] if metadata == "p2p" else None,
                     decentralized=decentralized, parallelism=parallelism)
    dst = np.ones(size, dtype=np.uint8)          # allocated and touched before timing
    conn.send("ready")
    start.wait()
    cpu0 = _cpu_seconds()
    t0 = time.time()
    store.get("bench", into=dst)
    t1 = time.time()
    conn.send((t0, t1))
    conn.recv()                                  # everyone is done: stop serving
    out = {"stats": store.stats(), "cpu_s": _cpu_seconds() - cpu0}
    if verify:
        out["sha"] = hashlib.sha256(dst).hexdigest()
    conn.send(out)
    store.close()
    eng.close()


def run_once(size, n, decentralized, chunk_size, metadata, parallelism, verify):
    ctx = mp.get_context("spawn")
    pconn, child = ctx.Pipe()
    start = ctx.Event()
    pub = ctx.Process(target=_publisher, args=(child, size, chunk_size, metadata, start),
                      daemon=True)
    pub.start()
    seed, digest = pconn.recv()
    getters = []
    for _ in range(n):
        c, child = ctx.Pipe()
        p = ctx.Process(target=_getter, args=(child, size, metadata, seed, decentralized,
                                              parallelism, start, verify), daemon=True)
        p.start()
        getters.append((p, c))
    for _, c in getters:
        assert c.recv() == "ready"
    t_start = time.time()
    start.set()
    times = [c.recv() for _, c in getters]
    for _, c in getters:
        c.send("stop")
    results = [c.recv() for _, c in getters]
    pconn.send("stats")
    pub_stats = pconn.recv()
    pconn.send("exit")
    for p, _ in getters:
        p.join(30)
    pub.join(30)
    if verify:
        assert all(r["sha"] == digest for r in results), "a getter ended with other bytes"
    end = max(t1 for _, t1 in times)
    durations = [t1 - t0 for t0, t1 in times]
    seconds = end - t_start
    return {"getters": n, "mode": "decentralized" if decentralized else "centralized",
            "size": size, "seconds": seconds, "aggregate_gbps": n * size / seconds / 1e9,
            "fastest_s": min(durations), "slowest_s": max(durations),
            "publisher_uploaded": pub_stats["bytes_uploaded"],
            "publisher_uploaded_x": pub_stats["bytes_uploaded"] / size,
            "downloaded": sum(r["stats"]["bytes_downloaded"] for r in results),
            # CPU seconds of all processes from the start signal until the last getter
            # finished: on a machine with few cores this, not the network, bounds the rate
            "cpu_s": pub_stats["cpu_s"] + sum(r["cpu_s"] for r in results),
            "verified": bool(verify)}


def main(argv=None) -> int:
    from mooncake_te.units import parse_size
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--getters", default="2,4,8")
    ap.add_argument("--modes", default="decentralized,centralized")
    ap.add_argument("--chunk-size", default="4M")
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--metadata", default="p2p", choices=["p2p", "etcd"],
                    help="p2p: getters are given the publisher's address; etcd: start a "
                         "real etcd (tests/servers.py) and keep holder lists there")
    ap.add_argument("--verify", action="store_true", help="sha256 every getter's copy")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two: 8 MiB to 2 getters, 1 MiB chunks, verified (does "
                         "it still run: CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size, args.getters, args.chunk_size, args.verify = "8M", "2", "1M", True
    size, chunk = parse_size(args.size), parse_size(args.chunk_size)
    server = None
    metadata = "p2p"
    if args.metadata == "etcd":
        from servers import EtcdServer
        server = EtcdServer()
        server.start()
        metadata = server.url
    rows = []
    try:
        for n in [int(x) for x in args.getters.split(",")]:
            for mode in args.modes.split(","):
                row = run_once(size, n, mode == "decentralized", chunk, metadata,
                               args.parallelism, args.verify)
                rows.append(row)
                if not args.json:
                    print(f"N={n:<2} {row['mode']:<13} {row['seconds']:7.2f} s  "
                          f"{row['aggregate_gbps']:6.2f} GB/s aggregate  getters "
                          f"{row['fastest_s']:.2f}-{row['slowest_s']:.2f} s  publisher "
                          f"uploaded {row['publisher_uploaded_x']:.2f} x size  "
                          f"cpu {row['cpu_s']:.1f} s", flush=True)
    finally:
        if server is not None:
            server.close()
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "chunk_size": chunk, "metadata": args.metadata,
                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""Per-request submit cost of a vLLM-shaped KV transfer: prepared lists vs the current path.

A request moves 16 blocks of every layer's K and V planes: 32 layers x 2 x 16 = 1,024
descriptors of one block each (16 tokens x 8 heads x 128 x bf16 = 32 KiB), between this
process (32 per-layer tensors ``[2, num_blocks, 16, 8, 128]``, registered one by one, as
vLLM's) and a peer process (one buffer). Timed, per request, from the Python call to its
return (the descriptors are queued to the lanes, which are sending them by then: "to the
wire"), median and p90 over ``--requests`` requests; each request is waited for, untimed,
before the next, so every call finds the queues empty. The variants:

* ``connector path``: what ``mooncake_te.integrations.vllm`` does today per request:
  ``layout.plan`` (block ids -> addresses, coalescing) + ``eng.submit_arrays``;
* ``submit_arrays``: the same addresses precomputed outside the timing (the engine's own
  per-call cost: conversion, region check, peer lookup, routing, queueing);
* ``gathered post``: ``eng.prepare(...)`` once, then per request the path ``post`` took
  before issue 38 item 1 (``PreparedTransfer._post_gathered``: addresses gathered into
  arrays by one native loop, then queued as a batch);
* ``prepared post``: ``PreparedTransfer.post(READ, ids, ids)`` per request: over TCP and
  the same-host transport one native call that checks the ids and writes the requests
  into the peer's queue (goal: <= 20 us);
* ``prepared post, burst``: the same, ``--burst`` posts back to back, each timed, then
  all waited for: the lanes are awake and busy, so a post does not pay for waking one.

The variants alternate request by request (A, B, C, A, B, C, ...) so that a busy machine
weighs on each alike; ``prepared / gathered`` is the median of the per-round ratios.
Block ids are random (not contiguous, so coalescing merges nothing). ``--json`` writes
the figures.

    python benchmarks/prepared_submit.py [--requests 300] [--protocol tcp] [--json out.json]
    python benchmarks/prepared_submit.py --smoke      # does it still run (CI)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

LAYERS, TOKENS, HEADS, HEAD_DIM = 32, 16, 8, 128
BLOCK = TOKENS * HEADS * HEAD_DIM * 2
PER_REQ = 16


def _peer(conn, protocol, nbytes):
    import numpy as np

    import mooncake_te as mte
    eng = mte.TransferEngine(host="127.0.0.1", protocol=protocol)
    buf = np.ones(nbytes, np.uint8)
    conn.send((eng.name, eng.register(buf).address))
    conn.recv()
    eng.close()


def stats(xs):
    xs = sorted(xs)
    return {"median_us": xs[len(xs) // 2] * 1e6, "p90_us": xs[int(len(xs) * 0.9)] * 1e6,
            "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--num-blocks", type=int, default=64, help="blocks per layer plane")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--burst", type=int, default=8, help="posts back to back in the burst row")
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="untimed pause after each request finished, before the next post "
                         "(lanes and receivers stop polling after 50 us, MC_TCP_SPIN_US)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two: 20 requests, 16 blocks per plane (CI runs this)")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.num_blocks = 20, 16
    import numpy as np

    import mooncake_te as mte
    from mooncake_te.integrations.vllm.layout import KVLayout, plan
    nb = args.num_blocks
    regions = LAYERS * 2
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, args.protocol, regions * nb * BLOCK),
                       daemon=True)
    proc.start()
    name, raddr = conn.recv()
    res = {"descriptors_per_request": regions * PER_REQ, "block": BLOCK,
           "protocol": args.protocol}
    try:
        with mte.TransferEngine(host="127.0.0.1", protocol=args.protocol) as eng:
            layers = [np.zeros((2, nb, TOKENS, HEADS, HEAD_DIM), np.uint16)
                      for _ in range(LAYERS)]
            bases = [eng.register(t).address for t in layers]
            names = [f"l{i}#{kv}" for i in range(LAYERS) for kv in "kv"]
            lbase = [b + kv * nb * BLOCK for b in bases for kv in range(2)]
            rbase = [raddr + r * nb * BLOCK for r in range(regions)]
            lay_l = KVLayout.from_regions(names, lbase, [BLOCK] * regions, [BLOCK] * regions, nb)
            lay_r = KVLayout.from_regions(names, rbase, [BLOCK] * regions, [BLOCK] * regions, nb)
            rng = np.random.default_rng(0)
            reqs = [(rng.choice(nb, PER_REQ, replace=False), rng.choice(nb, PER_REQ,
                                                                        replace=False))
                    for _ in range(args.requests)]
            R = mte.READ

            def connector(lids, rids):
                loc, rem, lens, _ = plan(lay_l, lay_r, lids, rids)
                return eng.submit_arrays(R, name, loc, rem, lens)

            pre = [plan(lay_l, lay_r, a, b)[:3] for a, b in reqs]
            it = iter(pre)

            def plain(lids, rids):
                loc, rem, lens = next(it)
                return eng.submit_arrays(R, name, loc, rem, lens)

            t0 = time.perf_counter()
            p = eng.prepare(name, lay_l.base[:, None] + np.arange(nb, dtype=np.uint64) * BLOCK,
                            lay_r.base[:, None] + np.arange(nb, dtype=np.uint64) * BLOCK, BLOCK)
            res["prepare_ms"] = (time.perf_counter() - t0) * 1e3

            def prepared(lids, rids):
                return p.post(R, lids, rids)

            tr, route = p._route(int(R))

            def gathered(lids, rids):
                return p._post_gathered(tr, route, p._desc, int(R), lids, rids, None, None)

            variants = (("connector path", connector), ("submit_arrays", plain),
                        ("gathered post", gathered), ("prepared post", prepared))
            for label, fn in variants:
                it = iter(pre)
                for a, b in reqs[:10]:          # warm-up: connections, caches
                    fn(a, b).wait(timeout=60)
            it = iter(pre)
            times = {label: [] for label, _ in variants}
            ratios = []
            for i, (a, b) in enumerate(reqs):
                k = i % len(variants)           # rotate which variant goes first
                took = {}
                for label, fn in variants[k:] + variants[:k]:
                    t0 = time.perf_counter()
                    batch = fn(a, b)
                    took[label] = time.perf_counter() - t0
                    batch.wait(timeout=60)
                    if args.gap_us:
                        time.sleep(args.gap_us * 1e-6)
                    res.setdefault(label, {})["transport"] = batch.transport
                for label, v in took.items():
                    times[label].append(v)
                ratios.append(took["prepared post"] / took["gathered post"])
            for label, _ in variants:
                res[label].update(stats(times[label]))
            res["prepared / gathered"] = sorted(ratios)[len(ratios) // 2]
            # Back to back: the lanes are awake, no post pays for waking one.
            burst = []
            for j in range(0, len(reqs) - args.burst + 1, args.burst):
                batches = []
                for a, b in reqs[j:j + args.burst]:
                    t0 = time.perf_counter()
                    batches.append(p.post(R, a, b))
                    burst.append(time.perf_counter() - t0)
                for bt in batches:
                    bt.wait(timeout=60)
            res["prepared post, burst"] = stats(burst)
            res["prepared post, burst"]["transport"] = batches[-1].transport
            # Python call to landed (submit + transfer), the connector's coalesced path vs
            # the prepared post, alternating, for random block ids (coalescing merges
            # nothing) and contiguous ones (it merges each plane's 16 blocks into one).
            landed = {}
            nl = max(10, args.requests // 3)
            for pattern in ("random", "contiguous"):
                if pattern == "random":
                    pairs = reqs[:nl]
                else:
                    starts = rng.integers(0, nb - PER_REQ + 1, (nl, 2))
                    pairs = [(np.arange(x, x + PER_REQ), np.arange(y, y + PER_REQ))
                             for x, y in starts]
                tl = {"connector path": [], "prepared post": []}
                for i, (a, b) in enumerate(pairs):
                    order = (("connector path", connector), ("prepared post", prepared))
                    for label, fn in order[i % 2:] + order[:i % 2]:
                        t0 = time.perf_counter()
                        fn(a, b).wait(timeout=60)
                        tl[label].append(time.perf_counter() - t0)
                landed[pattern] = {k: stats(v) for k, v in tl.items()}
            res["to_landed"] = landed
            # Where the gathered post's time went (engine internals, diagnostic only).
            from mooncake_te import submit as S
            from mooncake_te.batch import Batch
            from mooncake_te.transports.tcp import NativeBatch
            stages = {k: [] for k in ("gather", "resolve+route", "NativeBatch", "queue (native)",
                                      "seal", "Batch object")}
            for a, b in reqs:
                c = time.perf_counter
                t0 = c()
                src = p._gather(p._local, a, "l")
                dst = p._gather(p._remote, b, "r")
                t1 = c()
                desc = eng._resolve(name)
                tr, route = p._route(int(R))
                t2 = c()
                nat = NativeBatch(len(src), S.deadline(eng.timeout, len(src) * BLOCK, None))
                t3 = c()
                tr.submit(nat, desc, int(R), src, dst, p._bs, 0, False)
                t4 = c()
                nat.seal()
                t5 = c()
                bt = Batch(nat, route, 0, [(name, 0, src, dst, p._bs, int(R))], eng._peers.lost)
                t6 = c()
                for k, v in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                    stages[k].append(v)
                nat.wait(time.monotonic_ns() + 60 * 10**9)
                del bt
            res["breakdown_us"] = {k: stats(v)["median_us"] for k, v in stages.items()}
            # The prepared path moved the right bytes: one request checked end to end.
            src = np.frombuffer(np.random.default_rng(1).bytes(BLOCK), np.uint8)
            layers[5].view(np.uint8).reshape(2, nb, -1)[1, 7] = src
            p.post(mte.WRITE, np.array([7]), np.array([9])).wait(timeout=30)
            layers[5][...] = 0
            p.post(R, np.array([2]), np.array([9])).wait(timeout=30)
            res["intact"] = bool((layers[5].view(np.uint8).reshape(2, nb, -1)[1, 2]
                                  == src).all())
    finally:
        conn.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    print(f"vLLM-shaped request: {LAYERS} layers x 2 x {PER_REQ} blocks = "
          f"{res['descriptors_per_request']} descriptors of {BLOCK >> 10} KiB, READ over "
          f"{args.protocol}; per request, Python call to queued (us)")
    for label in ("connector path", "submit_arrays", "gathered post", "prepared post",
                  "prepared post, burst"):
        r = res[label]
        print(f"  {label:21} median {r['median_us']:7.1f}  p90 {r['p90_us']:7.1f}  "
              f"(n={r['n']}, via {r['transport']})")
    print(f"  prepared / gathered (median of per-round ratios): "
          f"{res['prepared / gathered']:.2f}")
    for pattern, r in res["to_landed"].items():
        c, p_ = r["connector path"], r["prepared post"]
        print(f"  to landed, {pattern:10} ids: connector path median {c['median_us']:7.0f} "
              f"us, prepared post {p_['median_us']:7.0f} us (n={c['n']})")
    print("  gathered post, by stage (median us): " + ", ".join(
        f"{k} {v:.1f}" for k, v in res["breakdown_us"].items()))
    print(f"  prepare once: {res['prepare_ms']:.2f} ms; prepared post / connector path: "
          f"{res['prepared post']['median_us'] / res['connector path']['median_us']:.2f}; "
          f"goal <= 20 us: {'met' if res['prepared post']['median_us'] <= 20 else 'missed'}; "
          f"bytes intact: {res['intact']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

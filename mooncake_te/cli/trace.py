# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te trace``: statistics, cache replay and capacity sweeps of Mooncake's JSONL
request traces (samples in the repository's ``data/traces/``), and ``replay --real`` through the
tiered KV cache. The simulation is the one issue 13 defines (see
:mod:`mooncake_te.kvcache.trace`); ``replay --engine-cache-blocks`` models vLLM's prefix
cache in front of the pool (:mod:`mooncake_te.kvcache.engine_model`)."""
from __future__ import annotations

import json
import os
import sys

from ..errors import MooncakeError

#: DRAM tier of ``replay --real`` when neither flags nor config size the cache
DEFAULT_DRAM_GB = 1.0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "trace", help="Mooncake request traces: stats, cache replay, capacity sweep",
        description="Read Mooncake's JSONL request traces (timestamp, input_length, "
                    "output_length, hash_ids; one hash id = one 512-token prefix block) and "
                    "measure prefix-cache hit rates.")
    sub = p.add_subparsers(dest="trace_command", metavar="<subcommand>")

    s = sub.add_parser("stats", help="requests, tokens, unique blocks, unlimited hit rate")
    s.add_argument("file", help="a Mooncake JSONL trace (samples: data/traces/ in the repository)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run)

    r = sub.add_parser("replay", help="hit rate of one cache size (simulated or --real)",
                       description="Replay the requests in file order through one cache: "
                                   "hit length = longest cached run of hash_ids from the "
                                   "start, then each block is touched or inserted (evicting "
                                   "while the cache holds the capacity or more). With "
                                   "--engine-cache-blocks: vLLM's own prefix cache in front "
                                   "of the pool's DRAM (and SSD) tier, hit rates per level.")
    r.add_argument("file", help="a Mooncake JSONL trace")
    r.add_argument("--policy", choices=("lru", "lfu"),
                   help="eviction policy (default lru; with --real, the config's)")
    cap = r.add_mutually_exclusive_group()
    cap.add_argument("--capacity-blocks", type=int, metavar="N",
                     help="cache size in blocks (default: unlimited)")
    cap.add_argument("--capacity-tokens", type=float, metavar="N",
                     help="cache size in tokens (blocks = tokens // 512)")
    r.add_argument("--warmup", type=float, default=0.0, metavar="F",
                   help="fraction of requests that only warm the cache (default 0)")
    r.add_argument("--engine-cache-blocks", type=int, metavar="E",
                   help="model vLLM's own prefix cache of E usable blocks (its "
                        "num_gpu_blocks - 1) in front of the pool, whose DRAM tier is then "
                        "--capacity-blocks (default 0: vLLM alone); prints hit rates per "
                        "level (docs/kvcache.md)")
    r.add_argument("--ssd-capacity-blocks", type=int, default=0, metavar="S",
                   help="with --engine-cache-blocks: the pool's SSD tier in blocks")
    r.add_argument("--block-tokens", type=int, metavar="T",
                   help="tokens per hash id (default 512, Mooncake's traces; the vLLM "
                        "benchmark's traces use its block size)")
    r.add_argument("--real", action="store_true",
                   help="push synthetic KV bytes through the real tiered cache; capacities "
                        "from --config [kvcache] or --dram-gb/--ssd-gb")
    r.add_argument("--config", help="config.toml whose [kvcache] sizes the cache (--real)")
    r.add_argument("--dram-gb", type=float, metavar="G",
                   help="DRAM tier in GiB (--real; overrides config; default: the config's, "
                        "or 1 when no tier is sized)")
    r.add_argument("--ssd-gb", type=float, metavar="G",
                   help="SSD tier in GiB (--real; overrides config)")
    r.add_argument("--cache-dir", metavar="DIR",
                   help="SSD tier directory (--real; overrides config; default: a temporary "
                        "directory under /var/tmp, removed afterwards)")
    r.add_argument("--bytes-per-token", type=int, default=2048,
                   help="KV bytes per token for --real (default 2048: 1 MiB per 512-token "
                        "block)")
    r.add_argument("--requests", type=int, metavar="N", help="replay only the first N requests")
    r.add_argument("--verify", action="store_true", help="check every block read back (--real)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=run)

    w = sub.add_parser("sweep", help="hit rate against capacity (FAST'25 Fig. 9 shape)")
    w.add_argument("file", nargs="+", help="one or more Mooncake JSONL traces")
    w.add_argument("--policy", choices=("lru", "lfu"), default="lru", help="eviction policy")
    w.add_argument("--capacities-tokens", metavar="LIST",
                   help="comma-separated capacities in tokens (default 1e4 .. 1e9)")
    w.add_argument("--warmup", type=float, default=0.0, metavar="F",
                   help="fraction of requests that only warm the cache")
    w.add_argument("--plot", metavar="PNG", help="plot token hit rate against capacity "
                                                 "(needs matplotlib)")
    w.add_argument("--json", action="store_true", help="print one JSON object")
    w.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run(args) -> int:
    """Dispatch ``trace <subcommand>``; returns the exit status."""
    try:
        return {"stats": _stats, "replay": _replay, "sweep": _sweep}[args.trace_command](args)
    except MooncakeError as e:
        print(f"mooncake-te trace: {e}", file=sys.stderr)
        return 2


def _load(path, n=None, block_tokens=None):
    from ..kvcache.trace import TRACE_BLOCK_TOKENS, load_trace
    t = load_trace(path, block_tokens or TRACE_BLOCK_TOKENS)
    return t.head(n) if n else t


def _stats(args) -> int:
    from ..kvcache.trace import trace_stats
    s = trace_stats(_load(args.file))
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print(f"{s['path']}")
    print(f"  requests            {s['requests']:,} over {s['duration_s']:.0f} s")
    print(f"  input tokens        {s['input_tokens']:,} (mean {s['mean_input_tokens']:,.1f})")
    print(f"  output tokens       {s['output_tokens']:,} (mean {s['mean_output_tokens']:,.1f})")
    print(f"  block references    {s['block_references']:,} ({s['block_tokens']} tokens each)")
    print(f"  unique blocks       {s['unique_blocks']:,}")
    print(f"  unlimited-cache prefix hit rate: {s['unlimited_block_hit_rate']:.4f} of blocks "
          f"({s['unlimited_hit_blocks']:,}), {s['unlimited_token_hit_rate']:.4f} of tokens")
    return 0


def _capacity(args, block_tokens):
    from ..errors import InvalidArgumentError
    if args.capacity_blocks is not None:
        return args.capacity_blocks
    if args.capacity_tokens is not None:
        blocks = int(args.capacity_tokens) // block_tokens
        if blocks < 1:
            raise InvalidArgumentError(f"--capacity-tokens {args.capacity_tokens:g} is less "
                                       f"than one {block_tokens}-token block")
        return blocks
    return None


def _replay(args) -> int:
    from ..errors import InvalidArgumentError
    from ..kvcache.trace import simulate
    if args.block_tokens is not None and args.block_tokens < 1:
        raise InvalidArgumentError(f"--block-tokens must be a positive number of tokens, got "
                                   f"{args.block_tokens}")
    trace = _load(args.file, args.requests, args.block_tokens)
    if args.engine_cache_blocks is not None:
        return _replay_engine(args, trace)
    if args.ssd_capacity_blocks:
        raise InvalidArgumentError("--ssd-capacity-blocks sizes the pool behind vLLM's cache: "
                                   "give --engine-cache-blocks too (or use --real --ssd-gb)")
    if args.real:
        return _replay_real(args, trace)
    args.policy = args.policy or "lru"
    res = simulate(trace, args.policy, _capacity(args, trace.block_tokens), args.warmup)
    d = res.to_dict()
    d["path"] = trace.path
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    cap = "unlimited" if res.capacity_blocks is None else f"{res.capacity_blocks:,} blocks"
    print(f"{trace.path}: {args.policy.upper()}, {cap}, {res.requests:,} requests"
          + (f" (first {res.measured_from:,} warm-up only)" if res.measured_from else ""))
    print(f"  block hit rate  {res.block_hit_rate:.4f}  ({res.hit_blocks:,} / {res.blocks:,})")
    print(f"  token hit rate  {res.token_hit_rate:.4f}  ({res.hit_tokens:,} / {res.tokens:,})")
    print(f"  evictions       {res.evictions:,}; peak {res.peak_blocks:,} blocks held")
    return 0


def _replay_engine(args, trace) -> int:
    from ..errors import InvalidArgumentError
    from ..kvcache.engine_model import simulate_engine
    if args.real or args.warmup:
        raise InvalidArgumentError("--engine-cache-blocks models vLLM in front of the pool "
                                   "for the whole trace; it takes neither --real nor --warmup")
    policy = args.policy or "lru"
    dram = _capacity(args, trace.block_tokens) or 0
    res = simulate_engine(trace, args.engine_cache_blocks, dram, args.ssd_capacity_blocks,
                          policy)
    d = res.to_dict()
    d["path"] = trace.path
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    pool = (f"pool DRAM {dram:,} blocks" + (f" + SSD {res.ssd_capacity_blocks:,}"
                                            if res.ssd_capacity_blocks else "")
            + f" ({policy.upper()})") if dram else "no pool"
    print(f"{trace.path}: vLLM's prefix cache of {res.engine_cache_blocks:,} blocks, {pool}; "
          f"{res.requests:,} requests, {res.blocks:,} full prompt blocks of "
          f"{res.block_tokens} tokens")
    for name, n in (("vllm", res.hit_vllm), ("dram", res.hit_dram), ("ssd", res.hit_ssd),
                    ("total", res.hit_vllm + res.hit_dram + res.hit_ssd), ("miss", res.miss)):
        print(f"  {name:5} {res.rate(n):7.2%}  ({n:,})")
    print(f"  evictions from vLLM's cache {res.engine_evictions:,}; pool promotions "
          f"{res.promotions:,}, demotions {res.demotions:,}, SSD evictions "
          f"{res.evictions_ssd:,}")
    return 0


def _replay_real(args, trace) -> int:
    from ..config import Config
    cfg = Config.load(args.config)
    k = cfg["kvcache"]
    gib = 1 << 30
    block_bytes = trace.block_tokens * args.bytes_per_token
    dram = args.dram_gb if args.dram_gb is not None else k["dram_cache_gb"]
    ssd = args.ssd_gb if args.ssd_gb is not None else k["ssd_cache_gb"]
    cache_dir = args.cache_dir or k["cache_dir"] or None
    policy = args.policy or k["eviction_policy"]
    if dram <= 0:
        # Nothing configured (a cache of 0 bytes hits nothing), or only an SSD tier (which
        # reads and writes through DRAM): pick a small DRAM tier and say so (stderr, so
        # --json output stays one document).
        dram = DEFAULT_DRAM_GB
        print(f"mooncake-te trace: no DRAM tier given (--dram-gb, or [kvcache] "
              f"dram_cache_gb in --config); using --dram-gb {dram:g}", file=sys.stderr)
    from ..kvcache.store import slot_size_for
    slot = slot_size_for(block_bytes)
    if dram * gib < slot:
        print(f"mooncake-te trace: --dram-gb {dram:g} holds no block of {block_bytes} bytes "
              f"({slot} with header and alignment; --bytes-per-token {args.bytes_per_token} x "
              f"{trace.block_tokens} tokens); use --dram-gb {slot / gib:.4f} or more",
              file=sys.stderr)
        return 2
    tmp = None
    if ssd > 0 and not cache_dir:
        import tempfile
        tmp = cache_dir = tempfile.mkdtemp(prefix="mooncake-te-trace-", dir="/var/tmp"
                                           if os.path.isdir("/var/tmp") else None)
        print(f"mooncake-te trace: --ssd-gb without --cache-dir; the SSD tier lives in "
              f"{tmp} for this run (removed afterwards)", file=sys.stderr)
    try:
        return _run_real(args, trace, k, block_bytes, dram, ssd, cache_dir, policy)
    finally:
        if tmp:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)


def _run_real(args, trace, k, block_bytes, dram, ssd, cache_dir, policy) -> int:
    from ..kvcache.replay import replay_real
    from ..kvcache.stats import human
    from ..kvcache.store import KVCache
    gib = 1 << 30
    with KVCache(block_bytes, int(dram * gib), int(ssd * gib), cache_dir, policy,
                 block_tokens=trace.block_tokens, log_interval_s=0) as cache:
        def progress(done, total):
            if not args.json and sys.stderr.isatty():
                print(f"\r  {done:,}/{total:,} requests", end="", file=sys.stderr, flush=True)
        s = replay_real(trace, cache, args.bytes_per_token, args.verify, progress)
        line = cache.log_stats()
    if not args.json and sys.stderr.isatty():
        print(file=sys.stderr)
    s["path"] = trace.path
    if args.json:
        print(json.dumps(s, indent=2, default=str))
        return 0 if not s.get("verify_mismatches") else 1
    print(f"{trace.path}: real cache, {policy.upper()}, {s['requests']:,} requests in "
          f"{s['wall_s']:.1f} s; blocks of up to {human(block_bytes)}")
    print(f"  DRAM tier  {s['dram_capacity_blocks']:,} blocks ({human(s['dram_capacity_bytes'])})"
          f"   SSD tier  {s['ssd_capacity_blocks']:,} blocks "
          f"({human(s['ssd_capacity_bytes'])}, {s['ssd_io'] or 'none'})")
    # The local tiers, from the cache's registry (those with a capacity): dram, ssd, ...
    local = [t for t in s["tiers"] if f"{t}_capacity_bytes" in s]
    rates = ", ".join(f"{t} {s[f'block_hit_rate_{t}']:.4f}" for t in local)
    print(f"  block hit rate  {s['block_hit_rate']:.4f}  ({rates})   token hit rate "
          f"{s['token_hit_rate']:.4f}")
    print(f"  served from DRAM  {human(s['served_dram_bytes'])} at {s['dram_read_gbps']:.2f} GB/s")
    print(f"  served from SSD   {human(s['served_ssd_bytes'])} at {s['ssd_read_gbps']:.2f} GB/s "
          f"({s['promotions']:,} promotions)")
    print(f"  demoted to SSD    {human(s['demoted_bytes'])} at {s['ssd_write_gbps']:.2f} GB/s "
          f"({s['demotions']:,} demotions, {s['evictions_ssd']:,} SSD evictions)")
    if args.verify:
        print(f"  verify: {s['verify_mismatches']} mismatching blocks")
    print(f"  {line}")
    return 0 if not s.get("verify_mismatches") else 1


def _sweep(args) -> int:
    from ..errors import InvalidArgumentError
    from ..kvcache.trace import sweep
    caps = None
    if args.capacities_tokens:
        try:
            caps = [int(float(x)) for x in args.capacities_tokens.split(",") if x.strip()]
        except ValueError:
            raise InvalidArgumentError(f"--capacities-tokens {args.capacities_tokens!r}: "
                                       f"expected numbers like 1e4,1e5,3e6") from None
    if args.plot:
        from ..bench.report import plot_available
        why = plot_available()
        if why:
            raise InvalidArgumentError(why)
    results = {}
    for path in args.file:
        results[path] = sweep(_load(path), args.policy, caps, args.warmup)
    if args.json:
        print(json.dumps({p: [r.to_dict() for r in rs] for p, rs in results.items()}, indent=2))
    else:
        for path, rs in results.items():
            print(f"{path}: {args.policy.upper()}")
            print(f"  {'capacity (tokens)':>18} {'blocks':>10} {'block hit':>10} "
                  f"{'token hit':>10}")
            for r in rs:
                ct = r.extra["capacity_tokens"]
                print(f"  {'unlimited' if ct is None else f'{ct:.0e}':>18} "
                      f"{'-' if r.capacity_blocks is None else f'{r.capacity_blocks:,}':>10} "
                      f"{r.block_hit_rate:>10.4f} {r.token_hit_rate:>10.4f}")
    if args.plot:
        _plot(results, args.plot, args.policy)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def _plot(results, path, policy) -> None:
    import os

    import matplotlib
    matplotlib.use("Agg")                      # files only; no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for p, rs in results.items():
        pts = [(r.extra["capacity_tokens"], r.token_hit_rate) for r in rs
               if r.extra["capacity_tokens"] is not None]
        line, = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3,
                        label=os.path.basename(p))
        ax.axhline(rs[-1].token_hit_rate, color=line.get_color(), ls=":", lw=0.8)
    ax.axvline(3e6, color="grey", ls="--", lw=0.8)         # FAST'25 Fig. 9's 3M-token mark
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix hit rate (tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{policy.upper()} hit rate against capacity (dotted: unlimited)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

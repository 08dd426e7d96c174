# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te bench``: GB/s and latency of WRITE and READ over a sweep of block sizes.

With no arguments it starts a target in a second process on 127.0.0.1 and measures
against it. Across two hosts run ``--mode target`` on one and ``--mode initiator
--segment NAME`` on the other. The measuring lives in :mod:`mooncake_te.bench`; this
module only turns flags into a :class:`~mooncake_te.bench.BenchConfig` and prints.
"""
from __future__ import annotations

import json
import signal
import sys

from ..config import protocols
from ._parser import HelpFormatter, metadata_url, port, size

_DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="measure GB/s and latency (default: loopback, 4 KiB to 16 MiB)",
        description="Measure WRITE and READ throughput and latency with batches of "
                    "submit_arrays requests, plus synchronous 4 KiB request latency. With "
                    "no arguments: a target in a second process on 127.0.0.1, block sizes "
                    f"{_DEFAULT_SIZES}, 1 s per point. Columns: see docs/bench.md.",
        formatter_class=HelpFormatter)
    g = p.add_argument_group("where")
    g.add_argument("--mode", choices=["loopback", "initiator", "target"], default="loopback",
                   help="loopback: start a target here and measure; target: serve and wait; "
                        "initiator: measure against --segment")
    g.add_argument("--host", default=None,
                   help="address this engine serves on (loopback default 127.0.0.1; "
                        "otherwise the engine's default: MC_TCP_BIND_ADDRESS or the first "
                        "UP interface)")
    g.add_argument("--port", type=port, default=0,
                   help="RPC port of the target (--mode target); 0 picks a free one")
    # The second names are Mooncake's transfer_engine_bench flags, accepted as they are.
    g.add_argument("--segment", "--segment_id", metavar="NAME",
                   help="target segment name (initiator mode)")
    g.add_argument("--metadata", "--metadata_server", default=None, type=metadata_url,
                   help="metadata backend: p2p (no server), etcd://h:2379, redis://h:6379, "
                        "http://h:8080/metadata (default: the config's, else p2p)")
    g.add_argument("--protocol", default=None, choices=protocols(),
                   help="transport to measure (default: auto, the best this machine has)")
    g.add_argument("--device", default=None, metavar="NIC[,NIC]",
                   help="RDMA devices of this engine (default: all; also MC_TE_FILTERS)")
    g.add_argument("--target-device", default=None, metavar="NIC[,NIC]",
                   help="RDMA devices of the loopback target (default: as --device)")
    g.add_argument("--buffer-size", default="128M", type=size, metavar="SIZE",
                   help="bytes registered on each side, e.g. 128M or 1G (default: 128M)")
    g = p.add_argument_group("what")
    g.add_argument("--op", "--operation", choices=["write", "read", "both"], default="both",
                   help="which direction to measure")
    g.add_argument("--block-sizes", "--block_size", default=_DEFAULT_SIZES, metavar="LIST",
                   help="comma-separated block (request) sizes, e.g. 4K,64K,1M")
    g.add_argument("--batch-size", "--batch_size", default="auto", metavar="N[,N...]",
                   help="requests per batch, or a list to sweep; auto = 64, fewer for blocks "
                        "above 256 KiB (at most 16 MiB per batch)")
    g.add_argument("--inflight", type=int, default=4,
                   help="batches each thread keeps outstanding")
    g.add_argument("--threads", type=int, default=1, help="submitting threads")
    g.add_argument("--duration", type=float, default=1.0, help="timed seconds per point")
    g.add_argument("--warmup", type=float, default=None,
                   help="untimed seconds before each point (default: duration/10, "
                        "0.05-0.25 s)")
    g.add_argument("--sync-size", default="4K", metavar="SIZE",
                   help="bytes per synchronous eng.write/eng.read request")
    g.add_argument("--no-sync", action="store_true",
                   help="skip the synchronous single-request latency points")
    g.add_argument("--verify", action="store_true",
                   help="fill with a pattern and check every byte after each point")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the results as one JSON object")
    g.add_argument("--csv", metavar="FILE", help="also write one CSV row per point")
    g.add_argument("--plot", metavar="FILE.png",
                   help="also plot GB/s and latency against block size (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"mooncake-te bench: {msg}", file=sys.stderr)
    return 2


def _cannot_run(args, buffer_size: int) -> str | None:
    """Why these flags cannot work on this machine (said before anything starts), or None."""
    from ..units import format_size
    from ._parser import memory_bytes
    sides = 2 if args.mode == "loopback" else 1
    mem = memory_bytes()
    if mem and buffer_size * sides > mem:
        return (f"--buffer-size {format_size(buffer_size)} needs {format_size(buffer_size * sides)} "
                f"of memory ({'both sides here' if sides == 2 else 'registered here'}), but this "
                f"machine has {mem / 2**30:.1f} GiB; use a smaller --buffer-size, e.g. 128M")
    if args.protocol not in (None, "auto"):
        from ..transports import probe
        t = probe().get(args.protocol)
        if t is not None and getattr(t, "available", True) is False:
            return (f"--protocol {args.protocol} is unavailable here: {t.reason}; use "
                    f"--protocol tcp or auto (`mooncake-te version` lists the transports)")
    if args.port and args.mode != "target":
        return (f"--port is the RPC port of a --mode target; in {args.mode} mode "
                + ("the target started here takes any free port" if args.mode == "loopback"
                   else "this engine takes any free port")
                + "; drop --port, or run `mooncake-te bench --mode target --port "
                  f"{args.port}` on the target host")
    if args.mode == "initiator" and not args.segment:
        return "--mode initiator needs --segment NAME (the target prints it)"
    return None


def _on_sigterm(signum, frame):
    # Turn SIGTERM into the Ctrl-C path so targets and engines are closed on the way out.
    raise KeyboardInterrupt


def run(args) -> int:
    """Run the command; return the exit status (0 ok, 1 failed or mismatch, 2 usage,
    130 interrupted)."""
    from ..bench import BenchConfig, VerifyError
    from ..bench import report
    from ..units import parse_size, parse_sizes
    from ..errors import MooncakeError

    buffer_size = args.buffer_size
    why = _cannot_run(args, buffer_size)
    if why:                                # before any process or engine starts
        return _fail(why)
    try:
        cfg = BenchConfig(
            ops=["write", "read"] if args.op == "both" else [args.op],
            block_sizes=parse_sizes(args.block_sizes),
            batch_sizes=None if args.batch_size == "auto" else
            [int(x) for x in args.batch_size.split(",") if x.strip()],
            duration=args.duration, warmup=args.warmup, threads=args.threads,
            inflight=args.inflight, verify=args.verify, sync=not args.no_sync,
            sync_size=parse_size(args.sync_size))
    except ValueError as e:
        return _fail(str(e))
    big = max(cfg.block_sizes)
    if args.mode == "loopback" and big > buffer_size:   # known before the target starts
        from ..units import format_size
        return _fail(f"block size {format_size(big)} is larger than --buffer-size "
                     f"{format_size(buffer_size)}; raise --buffer-size or drop that block size")
    if args.plot:
        why = report.plot_available()
        if why:                            # say so before spending a minute measuring
            return _fail(why)

    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.mode == "target":
            return _serve(args, buffer_size)
        return _measure(args, cfg, buffer_size, report)
    except KeyboardInterrupt:
        # Ctrl-C during set-up, before the runner's own handler: nothing was measured.
        print("mooncake-te bench: interrupted before the first point; nothing measured",
              file=sys.stderr)
        return 130
    except (MooncakeError, VerifyError, RuntimeError, TimeoutError, ValueError) as e:
        from ..errors import describe
        print(f"mooncake-te bench: {describe(e)}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)


def _measure(args, cfg, buffer_size: int, report) -> int:
    from ..bench.session import BenchSession
    progress = report.RichProgress(enabled=not args.no_progress)
    with BenchSession(args.mode, host=args.host, segment=args.segment,
                      buffer_size=buffer_size, metadata=args.metadata,
                      protocol=args.protocol, devices=args.device,
                      target_devices=args.target_device or args.device) as s:
        results = s.run(cfg, progress)
    if args.json:
        print(report.to_json(results))
    else:
        report.render(results)
    if args.csv:
        report.write_csv(results, args.csv)
    if args.plot:
        report.plot(results, args.plot)
    if not args.json and (args.csv or args.plot):
        print("wrote " + ", ".join(f for f in (args.csv, args.plot) if f))
    return 130 if results.get("interrupted") else 0


def _serve(args, buffer_size: int) -> int:
    import threading
    from ..bench.target import BenchTarget
    from ..units import format_size
    t = BenchTarget(buffer_size, host=args.host, port=args.port, metadata=args.metadata,
                    protocol=args.protocol, devices=args.device)
    stop = threading.Event()
    try:
        info = t.info()
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            print(f"mooncake-te bench target: segment {info['segment']}, "
                  f"{format_size(info['length'])} registered, protocol {info['protocol']}\n"
                  f"on the initiator run:  mooncake-te bench --mode initiator --segment "
                  f"{info['segment']}\nwaiting; Ctrl-C to stop", flush=True)
        t.serve(stop)
    except KeyboardInterrupt:            # Ctrl-C or SIGTERM: the way a target stops
        pass
    finally:
        t.close()
    return 0

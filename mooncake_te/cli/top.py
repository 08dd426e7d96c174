# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te top``: a live view of a running engine's metrics (its /metrics endpoint):
throughput per peer and transport, latency percentiles, failures, connections."""
from __future__ import annotations

import json
import os
import sys
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "top", help="live view of an engine's /metrics (throughput, latency, errors)",
        description="Watch a running engine through its /metrics endpoint (the engine "
                    "serves it when [transfer_engine] metrics_port or MC_METRICS_PORT is "
                    "set): throughput and requests per peer, transport and direction, "
                    "latency percentiles, failures by status, connections, registered "
                    "memory, KV cache hit rates. docs/observability.md lists the metrics.")
    p.add_argument("url", nargs="?", help="the /metrics URL, or host:port (default "
                   "http://127.0.0.1:$MC_METRICS_PORT/metrics)")
    p.add_argument("--interval", type=float, default=None,
                   help="seconds between scrapes (live view: 1; with --once: 0, totals "
                        "only, no rates)")
    p.add_argument("--once", action="store_true",
                   help="print one view and exit (two scrapes --interval apart for rates)")
    p.add_argument("--json", action="store_true", help="with --once: print one JSON object")
    p.set_defaults(func=run)


def _url(arg) -> str:
    if not arg:
        port = os.environ.get("MC_METRICS_PORT")
        if not port:
            raise SystemExit("mooncake-te top: give the /metrics URL (or host:port), or set "
                             "MC_METRICS_PORT")
        return f"http://127.0.0.1:{port}/metrics"
    if "://" not in arg:
        arg = f"http://{arg}"
    if arg.count("/") == 2:
        arg += "/metrics"
    return arg


def run(args) -> int:
    from ..errors import MooncakeError
    from ..metrics.prometheus import require
    try:
        require("mooncake-te top")          # it reads the text format with its parser
    except MooncakeError as e:
        print(f"mooncake-te top: {e}", file=sys.stderr)
        return 1
    from ..metrics.top import render, scrape, summarize
    url = _url(args.url)
    try:
        if args.once:
            interval = args.interval or 0.0
            prev = None
            if interval > 0:
                prev = scrape(url)
                time.sleep(interval)
            view = summarize(scrape(url), prev, interval)
            if args.json:
                json.dump(dict(view, url=url), sys.stdout, indent=1, default=str)
                print()
            else:
                # One view, printed once: as wide as its cells need (names and numbers
                # whole), never cropped to the terminal's width.
                from rich.console import Console
                from ..metrics.top import width
                group = render(view, url, expand=False)
                console = Console()
                Console(width=max(console.width, width(group))).print(render(view, url))
            return 0
        from rich.live import Live
        interval = args.interval or 1.0
        prev, t_prev = scrape(url), time.monotonic()
        with Live(render(summarize(prev), url), refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                cur, now = scrape(url), time.monotonic()
                live.update(render(summarize(cur, prev, now - t_prev), url))
                prev, t_prev = cur, now
    except MooncakeError as e:
        print(f"mooncake-te top: {e}", file=sys.stderr)
        return 1

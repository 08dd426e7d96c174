# SPDX-License-Identifier: Apache-2.0
"""How ``mooncake-te bench`` shows its results: tables, JSON, CSV, a plot, a progress bar."""
from __future__ import annotations

import csv
import json

from .runner import Progress
from ..units import format_bytes, format_size

CSV_FIELDS = ["op", "block_size", "batch_size", "threads", "inflight", "batches", "requests",
              "bytes", "seconds", "gbps", "requests_per_s", "us_per_request",
              "lat_avg_us", "lat_p50_us", "lat_p99_us", "post_avg_us", "post_p99_us",
              "verified"]


def _us(v) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _count(v: float) -> str:
    for unit, mult in (("M", 1e6), ("k", 1e3)):
        if v >= mult:
            return f"{v / mult:.1f}{unit}" if v < 100 * mult else f"{v / mult:.0f}{unit}"
    return f"{v:.0f}"


def render(results: dict, console=None) -> None:
    """Print one table per op, then the synchronous latencies and the totals."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    if console is None:
        console = Console()
        if not console.is_terminal:
            # Piped or logged: rich would wrap at 80 columns; whole rows read better.
            console = Console(width=120)
    head = results.get("header", {})
    cfg = results["config"]
    if head:
        console.print(f"mooncake-te bench {head.get('version', '')} {head.get('mode', '')} "
                      f"{head.get('initiator', '?')} -> {head.get('segment', '?')} "
                      f"({head.get('transport', '?')}): {cfg['threads']} "
                      f"thread{'s' if cfg['threads'] > 1 else ''} x {cfg['inflight']} "
                      f"batches in flight, {cfg['duration']:g} s/point",
                      highlight=False, soft_wrap=True)
    verify = cfg.get("verify")
    for op in ("write", "read"):
        pts = [p for p in results["points"] if p["op"] == op]
        if not pts:
            continue
        t = Table(title=f"{op.upper()} (submit_arrays batches; latency per batch)",
                  title_justify="left",
                  box=box.SIMPLE_HEAD, title_style="bold")
        for name in ("block", "batch", "GB/s", "req/s", "µs/req", "avg µs", "p99 µs",
                     "post µs", "moved"):
            t.add_column(name, justify="right")
        if verify:
            t.add_column("verified", justify="center")
        for p in pts:
            row = [format_size(p["block_size"]), str(p["batch_size"]), f"{p['gbps']:.2f}",
                   _count(p["requests_per_s"]), _us(p["us_per_request"]),
                   _us(p["lat_us"]["avg"]), _us(p["lat_us"]["p99"]),
                   _us(p["post_us"]["avg"]), format_bytes(p["bytes"])]
            if verify:
                row.append("yes" if p["verified"] else "-")
            t.add_row(*row)
        console.print(t)
    if results["sync"]:
        t = Table(title="Synchronous single requests (eng.write / eng.read), one at a time",
                  title_justify="left", box=box.SIMPLE_HEAD, title_style="bold")
        for name in ("op", "size", "count", "median µs", "avg µs", "p99 µs", "max µs"):
            t.add_column(name, justify="right")
        for s in results["sync"]:
            lat = s["lat_us"]
            t.add_row(s["op"], format_size(s["size"]), f"{s['count']:,}", _us(lat["p50"]),
                      _us(lat["avg"]), _us(lat["p99"]), _us(lat["max"]))
        console.print(t)
    load = results.get("machine", {}).get("loadavg_after")
    console.print(f"total moved {format_bytes(results['total_bytes'])} in "
                  f"{results['elapsed_s']:.1f} s"
                  + (f"; load average {load[0]:.2f} on {results['machine']['cpus']} CPUs"
                     if load else "")
                  + (" [yellow](interrupted)[/]" if results.get("interrupted") else ""),
                  highlight=False)


def to_json(results: dict) -> str:
    """The whole result as one JSON object."""
    return json.dumps(results, indent=2)


def write_csv(results: dict, path: str) -> None:
    """One row per batch point (flat columns), for spreadsheets and pandas."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for p in results["points"]:
            row = {k: p.get(k) for k in CSV_FIELDS}
            row.update(lat_avg_us=p["lat_us"]["avg"], lat_p50_us=p["lat_us"]["p50"],
                       lat_p99_us=p["lat_us"]["p99"], post_avg_us=p["post_us"]["avg"],
                       post_p99_us=p["post_us"]["p99"])
            w.writerow(row)


def plot_available() -> str | None:
    """None when ``--plot`` can work, else what to install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed; install it with "
                "`pip install matplotlib` (or `pip install '.[bench]'` in a mooncake_te clone)")
    return None


def plot(results: dict, path: str) -> None:
    """GB/s and average batch latency against block size, one line per op and batch."""
    import matplotlib
    matplotlib.use("Agg")                 # files only; no display needed
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {}
    for p in results["points"]:
        series.setdefault((p["op"], p["batch_size"] if results["config"]["batch_sizes"]
                           else None), []).append(p)
    for (op, batch), pts in series.items():
        pts = sorted(pts, key=lambda p: p["block_size"])
        x = [p["block_size"] for p in pts]
        label = op.upper() + (f" x{batch}" if batch else "")
        ax1.plot(x, [p["gbps"] for p in pts], marker="o", label=label)
        ax2.plot(x, [p["lat_us"]["avg"] for p in pts], marker="o", label=label + " avg")
        ax2.plot(x, [p["lat_us"]["p99"] for p in pts], marker="x", linestyle="--",
                 label=label + " p99")
    ticks = sorted({p["block_size"] for p in results["points"]})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(t).replace(" ", "") for t in ticks])
        ax.set_xlabel("block size")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_ylabel("GB/s")
    ax1.set_ylim(bottom=0)
    ax2.set_ylabel("batch latency (µs)")
    ax2.set_yscale("log")
    head = results.get("header", {})
    fig.suptitle(f"mooncake-te bench ({head.get('mode', '')}, {head.get('transport', '')}, "
                 f"{results['config']['duration']:g} s/point)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class RichProgress(Progress):
    """A rich progress bar over all points, on stderr so ``--json`` output stays clean."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._bar = None

    def begin(self, points: list) -> None:
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, Progress as _P, TextColumn,
                                   TimeRemainingColumn)
        console = Console(stderr=True)
        if not console.is_terminal:
            return            # a log file gains nothing from a bar (rich would add a blank line)
        self._bar = _P(TextColumn("{task.description:<22}"), BarColumn(),
                       TextColumn("{task.percentage:>3.0f}%"),
                       TimeRemainingColumn(), console=console, transient=True)
        self._bar.start()
        self._task = self._bar.add_task("starting", total=len(points))
        self._index = 0

    def point(self, index: int, label: str) -> None:
        self._index = index
        if self._bar:
            self._bar.update(self._task, description=label, completed=index)

    def advance(self, fraction: float) -> None:
        if self._bar:
            self._bar.update(self._task, completed=self._index + min(1.0, fraction))

    def end(self) -> None:
        if self._bar:
            self._bar.stop()
            self._bar = None

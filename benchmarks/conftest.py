# SPDX-License-Identifier: Apache-2.0
"""Fixtures and the closing figures for the pytest-benchmark suites in ``benchmarks/``.

    pytest benchmarks/ --benchmark-only               # every suite, ~1-2 min
    pytest benchmarks/test_register.py --benchmark-only

These are not part of the test run (``pytest`` alone collects ``tests/`` only) and assert
nothing about time: a shared 2-CPU machine cannot hold a timing threshold. Each test
records what it measured in ``FIGURES``; the summary at the end prints them beside the
issue-9 targets.
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

FIGURES: list[tuple[str, str, str]] = []     # (suite, what, figure) for the summary


class Recorder:
    """What the tests hand to the closing summary."""

    def __call__(self, suite: str, what: str, figure: str) -> None:
        FIGURES.append((suite, what, figure))

    @staticmethod
    def times(benchmark) -> list:
        """Seconds per round, as pytest-benchmark measured them."""
        return round_times(benchmark)

    def latency(self, suite: str, what: str, benchmark) -> None:
        """Percentiles of the benchmark's rounds (one call per round)."""
        times = round_times(benchmark)
        if times:
            self(suite, what, percentile_line(times))


@pytest.fixture(scope="session")
def record():
    """``record(suite, what, figure)`` and ``record.latency(suite, what, benchmark)``."""
    return Recorder()


class Peer:
    """A target engine in a child process (the ``mooncake-te bench`` target), which this
    process can pause: while it is stopped, nothing completes, so the cost of a submit
    call can be timed without the data path competing for the 2 CPUs."""

    def __init__(self, buffer_size: int):
        from mooncake_te.bench.target import LoopbackTarget
        self.target = LoopbackTarget("127.0.0.1", buffer_size)
        self.segment = self.target.segment
        self.address = self.target.info["address"]
        self.length = self.target.info["length"]
        self.paused = False

    def pause(self) -> None:
        os.kill(self.target.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.kill(self.target.proc.pid, signal.SIGCONT)
            self.paused = False

    def close(self) -> None:
        self.resume()
        self.target.close()


@pytest.fixture(scope="session")
def peer():
    p = Peer(64 << 20)
    yield p
    p.close()


@pytest.fixture(scope="session", params=["tcp", "shm"])
def engine(request, peer):
    """The initiator: an engine on 127.0.0.1 with a 64 MiB registered buffer, connected
    to ``peer`` over TCP (``protocol="tcp"``) or over the same-host transport (what
    ``protocol="auto"`` picks for a peer on this host). ``engine.route`` says which."""
    import mooncake_te as mte
    route = request.param
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp" if route == "tcp" else "auto") as eng:
        buf = np.empty(64 << 20, dtype=np.uint8)
        buf.fill(1)
        region = eng.register(buf)
        b = eng.submit_arrays(mte.WRITE, peer.segment, [region.address], [peer.address], 4096)
        b.wait(timeout=30)                          # connects the lanes
        if b.transport != route:
            pytest.skip(f"a peer on this host is reached over {b.transport!r}, not {route!r} "
                        f"(no same-host transport in this build?)")
        eng.buffer, eng.region, eng.route = buf, region, route
        yield eng


def percentile_line(samples_s) -> str:
    """``p50 / p90 / p99 / p99.9 / max`` of samples in seconds, as µs."""
    a = np.asarray(samples_s, dtype=np.float64) * 1e6
    p = np.percentile(a, [50, 90, 99, 99.9])
    return (f"p50 {p[0]:.1f}  p90 {p[1]:.1f}  p99 {p[2]:.1f}  p99.9 {p[3]:.1f}  "
            f"max {a.max():.0f} µs  (n={a.size})")


def round_times(benchmark) -> list:
    """Per-round seconds from pytest-benchmark (None when benchmarks are disabled)."""
    stats = getattr(benchmark, "stats", None)
    return list(stats.stats.data) if stats is not None else []


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not FIGURES:
        return
    tr = terminalreporter
    tr.section("mooncake_te figures (issue 9 targets in brackets)")
    la = os.getloadavg()
    tr.write_line(f"{os.cpu_count()} CPUs, load average {la[0]:.2f} at the end: a shared "
                  f"machine, so expect ±20-30 % between runs")
    first = {}
    for s, _, _ in FIGURES:
        first.setdefault(s, len(first))
    suite = None
    for s, what, fig in sorted(FIGURES, key=lambda f: first[f[0]]):
        if s != suite:
            tr.write_line("")
            tr.write_line(s)
            suite = s
        tr.write_line(f"  {what:<44} {fig}")

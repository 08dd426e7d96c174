# SPDX-License-Identifier: Apache-2.0
"""The measurement loop of ``mooncake-te bench``.

One *point* is (op, block size, batch size). For a point, each of ``threads`` submitting
threads keeps ``inflight`` batches of ``batch_size`` requests outstanding through
``submit_arrays`` (the path KV-cache movers use) for ``duration`` seconds, after a short
untimed warm-up. A batch covers one window of ``batch_size`` consecutive blocks, and
successive batches (from all threads, in turn) walk through the whole buffer, so the
working set is the buffer (128 MiB by default), not a few cache-resident MiB: a KV cache
being shipped is not in the CPU cache either. The windows used are always a prefix of
the buffer, which is what ``verify`` checks. Requests in flight never overlap unless the buffer holds fewer windows than
there are batches in flight (then they share; source and target offsets always match, so
data stays verifiable).

What is timed, per batch: *post* (the ``submit_arrays`` call) and *latency* (from just
before the submit to ``wait`` returning). Batches are waited for in submission order, so
with several in flight a batch that finished early is seen when its elders have.
Throughput is bytes moved / wall time from the first submit to the last completion.
"""
from __future__ import annotations

import itertools
import os
import platform
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from . import pattern
from ..units import format_size
from .stats import gbps, summarize_ns

DEFAULT_BLOCK_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
MAX_BATCH = 64                  # requests per batch for small blocks (Mooncake's bench: 128)
MAX_BATCH_BYTES = 16 << 20      # ...but no more bytes than this per batch by default


class VerifyError(AssertionError):
    """``--verify`` found a byte that is not what was sent."""


@dataclass
class BenchConfig:
    """What to measure.

    Parameters
    ----------
    ops : list of str
        ``"write"`` and/or ``"read"``, in that order of running.
    block_sizes : list of int
        Bytes per request.
    batch_sizes : list of int, optional
        Requests per batch; ``None`` picks per block size (:func:`auto_batch`).
    duration : float
        Timed seconds per point.
    warmup : float, optional
        Untimed seconds before each point; default a tenth of ``duration`` (0.05-0.25 s).
    threads : int
        Submitting threads.
    inflight : int
        Batches each thread keeps outstanding.
    verify : bool
        Fill with a pattern and compare every byte after each point.
    sync : bool
        Also time synchronous single requests of ``sync_size`` bytes.
    sync_size : int
        Bytes per synchronous request.
    """
    ops: list = field(default_factory=lambda: ["write", "read"])
    block_sizes: list = field(default_factory=lambda: list(DEFAULT_BLOCK_SIZES))
    batch_sizes: list | None = None
    duration: float = 1.0
    warmup: float | None = None
    threads: int = 1
    inflight: int = 4
    verify: bool = False
    sync: bool = True
    sync_size: int = 4096

    def __post_init__(self):
        for op in self.ops:
            if op not in ("read", "write"):
                raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        if self.duration <= 0:
            raise ValueError(f"duration must be positive, got {self.duration}")
        if self.threads < 1 or self.inflight < 1:
            raise ValueError(f"threads and inflight must be >= 1, got {self.threads}, "
                             f"{self.inflight}")
        if self.batch_sizes is not None and min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")

    @property
    def warmup_s(self) -> float:
        if self.warmup is not None:
            return max(0.0, self.warmup)
        return min(0.25, max(0.05, self.duration / 10))


def auto_batch(block_size: int) -> int:
    """Default requests per batch: 64, fewer when that would exceed 16 MiB per batch."""
    return max(1, min(MAX_BATCH, MAX_BATCH_BYTES // block_size))


class Progress:
    """What the runner reports while it works; the default does nothing."""

    def begin(self, points: list) -> None:
        """``points``: one label per point, in running order."""

    def point(self, index: int, label: str) -> None:
        """Point ``index`` started."""

    def advance(self, fraction: float) -> None:
        """The current point is ``fraction`` (0-1) done."""

    def end(self) -> None:
        """All points done (or interrupted)."""


class Runner:
    """Runs a :class:`BenchConfig` from an initiator engine against one target buffer.

    Parameters
    ----------
    engine : TransferEngine
        The initiator.
    segment : str
        The target's segment name.
    remote_address, remote_length : int
        The target buffer used.
    local : numpy.ndarray
        A ``uint8`` buffer registered with ``engine``.
    control : TargetControl, optional
        Needed for ``verify`` (the target fills and checks its side).
    """

    def __init__(self, engine, segment: str, remote_address: int, remote_length: int,
                 local: np.ndarray, control=None):
        self.engine = engine
        self.segment = segment
        self.remote_address = int(remote_address)
        self.local = local
        self.local_address = int(local.ctypes.data)
        self.length = min(int(remote_length), int(local.nbytes))
        self.control = control
        self._stop = threading.Event()
        self._abort = threading.Event()      # a submitting thread failed: the others stop
        self._seed = 100

    # --- planning ----------------------------------------------------------------------
    def plan(self, cfg: BenchConfig) -> list:
        """The points to run: dicts with ``kind`` ("batch" or "sync"), ``op``, sizes."""
        pts = []
        for op in cfg.ops:
            for bs in cfg.block_sizes:
                if bs > self.length:
                    raise ValueError(
                        f"block size {format_size(bs)} is larger than the buffer in use "
                        f"({format_size(self.length)}); raise --buffer-size (on the target "
                        f"too) or drop that block size")
                for n in (cfg.batch_sizes or [auto_batch(bs)]):
                    # A batch must fit in the buffer once.
                    pts.append({"kind": "batch", "op": op, "block_size": bs,
                                "batch_size": max(1, min(n, self.length // bs))})
        if cfg.sync:
            for op in cfg.ops:
                pts.append({"kind": "sync", "op": op, "block_size": cfg.sync_size,
                            "batch_size": 1})
        return pts

    @staticmethod
    def label(pt: dict) -> str:
        if pt["kind"] == "sync":
            return f"sync {pt['op']} {format_size(pt['block_size'])}"
        return f"{pt['op']} {format_size(pt['block_size'])} x{pt['batch_size']}"

    # --- running -----------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the run to stop after the batches in flight (safe from any thread)."""
        self._stop.set()

    def run(self, cfg: BenchConfig, progress: Progress | None = None) -> dict:
        """Run every point; return the results (see ``docs/bench.md`` for the fields)."""
        progress = progress or Progress()
        if cfg.verify and self.control is None:
            raise ValueError("verify needs a target that answers control messages "
                             "(a `mooncake-te bench --mode target` process)")
        pts = self.plan(cfg)
        progress.begin([self.label(p) for p in pts])
        load0 = _loadavg()
        t0 = time.monotonic()
        points, sync = [], []
        try:
            for i, pt in enumerate(pts):
                if self._stop.is_set():
                    break
                progress.point(i, self.label(pt))
                if pt["kind"] == "batch":
                    points.append(self._batch_point(cfg, pt["op"], pt["block_size"],
                                                    pt["batch_size"], progress))
                else:
                    sync.append(self._sync_point(cfg, pt["op"], pt["block_size"], progress))
        except KeyboardInterrupt:
            # Ctrl-C: the batches in flight have drained (see _phase); keep the points
            # already measured and let the caller print them marked as interrupted.
            self._stop.set()
        finally:
            progress.end()
        return {
            "config": {**asdict(cfg), "warmup": cfg.warmup_s},
            "points": points,
            "sync": sync,
            "total_bytes": sum(p["bytes"] for p in points) + sum(s["bytes"] for s in sync),
            "elapsed_s": time.monotonic() - t0,
            "interrupted": self._stop.is_set(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "loadavg_before": load0,
                        "loadavg_after": _loadavg()},
        }

    def _windows(self, bs: int, n: int):
        """Every window of the buffers: [(source addresses, target addresses)], and the
        bytes they cover."""
        window = n * bs
        # Capped so tiny batches of tiny blocks do not build 10^5 arrays; 4096 windows
        # still span 16 MiB even at 4 KiB x 1.
        nwin = max(1, min(self.length // window, 4096))
        step = np.arange(n, dtype=np.uint64) * np.uint64(bs)
        wins = [(step + np.uint64(self.local_address + w * window),
                 step + np.uint64(self.remote_address + w * window)) for w in range(nwin)]
        return wins, nwin * window

    def _batch_point(self, cfg, op: str, bs: int, n: int, progress) -> dict:
        from ..batch import Op
        mop = Op.WRITE if op == "write" else Op.READ
        wins, extent = self._windows(bs, n)
        # Threads draw windows from one counter (next() on itertools.count is atomic
        # under the GIL), so the windows touched are always 0..draws-1.
        self._draw = itertools.count()
        if cfg.verify:
            self._seed += 1
            seed = self._seed
            self._verify_prepare(op, seed, extent)
        # Warm-up: connections, page faults, caches; nothing recorded.
        if cfg.warmup_s > 0:
            self._phase(cfg, mop, bs, wins, cfg.warmup_s, None, progress, 0.0, 0.1)
        rec = [dict(lat=[], post=[], batches=0, start=0, end=0) for _ in range(cfg.threads)]
        self._phase(cfg, mop, bs, wins, cfg.duration, rec, progress, 0.1, 0.9)
        start = min(r["start"] for r in rec)
        end = max(r["end"] for r in rec)
        seconds = (end - start) / 1e9
        batches = sum(r["batches"] for r in rec)
        nbytes = batches * n * bs
        requests = batches * n
        verified = None
        if cfg.verify:
            used = min(next(self._draw), len(wins)) * n * bs
            self._verify_check(op, seed, used, bs, n)
            verified = True
        progress.advance(1.0)
        return {
            "op": op, "block_size": bs, "batch_size": n, "threads": cfg.threads,
            "inflight": cfg.inflight, "batches": batches, "requests": requests,
            "bytes": nbytes, "seconds": seconds, "gbps": gbps(nbytes, seconds),
            "requests_per_s": requests / seconds if seconds > 0 else 0.0,
            # nixlbench's "Avg Lat.": wall time per request across the whole point.
            "us_per_request": seconds * 1e6 / requests if requests else None,
            "lat_us": summarize_ns(np.concatenate([np.asarray(r["lat"], np.int64)
                                                   for r in rec])),
            "post_us": summarize_ns(np.concatenate([np.asarray(r["post"], np.int64)
                                                    for r in rec])),
            "verified": verified,
        }

    def _phase(self, cfg, mop, bs, wins, seconds, rec, progress, p0, pspan) -> None:
        """Run all threads for ``seconds``; ``rec`` None means warm-up (not recorded)."""
        errors = []
        barrier = threading.Barrier(cfg.threads + 1)
        box = {}

        def worker(t):
            try:
                barrier.wait()
                end_ns = box["end"]
                r = rec[t] if rec is not None else None
                self._drive(mop, bs, wins, cfg.inflight, end_ns, r)
            except BaseException as e:       # re-raised in the caller's thread
                errors.append(e)
                self._abort.set()

        self._abort.clear()
        threads = [threading.Thread(target=worker, args=(t,), daemon=True,
                                    name=f"bench-submit-{t}") for t in range(cfg.threads)]
        for th in threads:
            th.start()
        start = time.monotonic_ns()
        box["end"] = start + int(seconds * 1e9)
        try:
            barrier.wait()
            # Joining with a timeout keeps this thread free for progress and Ctrl-C.
            for th in threads:
                while th.is_alive():
                    th.join(0.05)
                    done = (time.monotonic_ns() - start) / (seconds * 1e9)
                    progress.advance(p0 + pspan * min(1.0, done))
        except BaseException:
            self._stop.set()
            self._abort.set()
            barrier.abort()        # threads still at the barrier leave it too
            for th in threads:
                th.join()          # in-flight batches finish or hit their deadline
            raise
        if errors:
            raise errors[0]

    def _drive(self, mop, bs, wins, inflight, end_ns, rec) -> None:
        """One submitting thread: keep ``inflight`` batches in flight until ``end_ns``."""
        submit = self.engine.submit_arrays
        seg = self.segment
        now = time.monotonic_ns
        stop, abort = self._stop, self._abort
        q = deque()
        lat, post = ([], []) if rec is None else (rec["lat"], rec["post"])
        batches = 0
        nwin = len(wins)
        draw = self._draw
        t_start = now()
        try:
            while True:
                if now() >= end_ns or stop.is_set() or abort.is_set():
                    break
                while len(q) < inflight:
                    src, dst = wins[next(draw) % nwin]
                    t0 = now()
                    b = submit(mop, seg, src, dst, bs)
                    post.append(now() - t0)
                    q.append((b, t0))
                b, t0 = q.popleft()
                b.wait()
                lat.append(now() - t0)
                batches += 1
        finally:
            # Drain: what is in flight still moves bytes inside the timed interval.
            while q:
                b, t0 = q.popleft()
                b.wait()
                lat.append(now() - t0)
                batches += 1
        if rec is not None:
            rec.update(batches=batches, start=t_start, end=now())

    def _sync_point(self, cfg, op: str, size: int, progress) -> dict:
        """Synchronous single requests: ``eng.write``/``eng.read``, one at a time."""
        fn = self.engine.write if op == "write" else self.engine.read
        seg, src, dst = self.segment, self.local_address, self.remote_address
        for _ in range(20):                       # warm-up: connection, caches
            fn(seg, src, dst, size)
        lat = []
        now = time.perf_counter_ns
        start = now()
        end = start + int(cfg.duration * 1e9)
        tick = start
        while not self._stop.is_set():
            t0 = now()
            fn(seg, src, dst, size)
            t1 = now()
            lat.append(t1 - t0)
            if t1 >= end:
                break
            if t1 - tick > 50_000_000:            # progress at 20 Hz, not per request
                tick = t1
                progress.advance((t1 - start) / (end - start))
        seconds = (now() - start) / 1e9
        progress.advance(1.0)
        return {"op": op, "size": size, "count": len(lat), "bytes": len(lat) * size,
                "seconds": seconds, "lat_us": summarize_ns(lat)}

    # --- verification ------------------------------------------------------------------
    def _verify_prepare(self, op: str, seed: int, extent: int) -> None:
        # The receiving side starts from bytes that differ from the pattern everywhere
        # that matters, so a request that moved nothing cannot pass.
        if op == "write":
            pattern.fill(self.local, seed, extent)
            self._control("fill", seed=seed ^ 0x5555, length=extent)
        else:
            self._control("fill", seed=seed, length=extent)
            pattern.fill(self.local, seed ^ 0x5555, extent)

    def _verify_check(self, op: str, seed: int, extent: int, bs: int, n: int) -> None:
        if op == "write":
            r = self._control("check", seed=seed, length=extent)
            if not r.get("ok"):
                raise VerifyError(
                    f"WRITE of {format_size(bs)} x{n}: the target holds {r.get('got')} at "
                    f"offset {r.get('offset')} of its buffer where {r.get('want')} was "
                    f"written{'; ' + r['error'] if 'error' in r else ''}")
        else:
            off = pattern.first_mismatch(self.local, seed, extent)
            if off >= 0:
                raise VerifyError(
                    f"READ of {format_size(bs)} x{n}: local byte at offset {off} is "
                    f"{int(self.local[off])}, the target holds "
                    f"{pattern.expected_byte(seed, off)} there")

    def _control(self, cmd: str, **fields) -> dict:
        r = self.control.request(cmd, **fields)
        if "error" in r:
            raise VerifyError(f"the target could not {cmd}: {r['error']}")
        return r


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:          # not on every platform
        return None

# SPDX-License-Identifier: Apache-2.0
"""The engine's transfer counters: one *cell* per (peer, route, op), updated in C.

A cell is a uint64 array laid out as ``src/core/metrics.h`` says; the native batch adds
to it (relaxed atomics into a per-thread shard) when a request or a batch finishes, and
nothing here runs on the data path: :meth:`TransferMetrics.cell` is a dict lookup at
submit time, :meth:`TransferMetrics.snapshot` sums the shards when someone asks.

Cells are never freed: a batch may still finish (and count) after its engine closed,
and must find live memory. They are small (4.3 KiB) and there is one per peer, route and
direction an engine ever used.
"""
from __future__ import annotations

import threading

import numpy as np

# Mirrors src/core/metrics.h.
BUCKETS = 28
MIN_LOG2 = 10
SHARDS = 8
SHARD_WORDS = 64
CODES = 16
CELL_WORDS = SHARDS * SHARD_WORDS + 2 * CODES
REQ_OK, BYTES, REQ_FAILED, REQ_LAT_SUM, REQ_BUCKET0 = 0, 1, 2, 3, 4
BATCHES = 4 + BUCKETS
BATCH_LAT_SUM = 5 + BUCKETS
BATCH_BUCKET0 = 6 + BUCKETS

#: Upper bounds (seconds) of the latency buckets; the last one is +Inf.
BUCKET_BOUNDS = tuple((1 << (k + MIN_LOG2)) / 1e9 for k in range(BUCKETS - 1)) + (float("inf"),)

#: Status code the native side files failures under when the code table is full.
OTHER_CODE = 1

_OPS = {1: "write", 2: "read"}
_forever: list = []          # every cell ever made (see the module docstring)
_forever_lock = threading.Lock()


class TransferMetrics:
    """Cells of one engine, keyed by (peer, route, op)."""

    def __init__(self):
        self._cells: dict = {}        # key -> array
        self._addr: dict = {}         # key -> its address (ndarray.ctypes costs us)
        self._lock = threading.Lock()

    def cell(self, peer: str, route: str, op: int) -> int:
        """Address of the cell for requests to ``peer`` over ``route`` (``"tcp"``,
        ``"shm"``, ``"rdma"``, ...) in direction ``op``; made on first use. Called for
        every submit: one dict lookup."""
        key = (peer, route, op)
        a = self._addr.get(key)
        if a is None:
            with self._lock:
                c = self._cells.get(key)
                if c is None:
                    # 64-byte aligned, so each thread's shard has cache lines of its own.
                    raw = np.zeros(CELL_WORDS + 8, dtype=np.uint64)
                    skip = (-raw.ctypes.data % 64) // 8
                    c = raw[skip:skip + CELL_WORDS]
                    with _forever_lock:
                        _forever.append(c)
                    self._cells[key] = c
                    self._addr[key] = c.ctypes.data
                a = self._addr[key]
        return a

    def snapshot(self) -> list:
        """One dict per (peer, transport, op) with its totals and histograms."""
        with self._lock:
            items = list(self._cells.items())
        out = []
        for (peer, route, op), c in items:
            s = c[:SHARDS * SHARD_WORDS].reshape(SHARDS, SHARD_WORDS).sum(axis=0)
            codes = c[SHARDS * SHARD_WORDS:].reshape(CODES, 2)
            failures: dict = {}
            for code, n in codes.tolist():
                if n:
                    code = code - (1 << 64) if code >= 1 << 63 else code   # int64 in C
                    failures[int(code)] = failures.get(int(code), 0) + int(n)
            out.append({
                "peer": peer, "transport": route, "op": _OPS.get(op, str(op)),
                "requests": int(s[REQ_OK]), "bytes": int(s[BYTES]),
                "failures": int(s[REQ_FAILED]), "failures_by_status": failures,
                "request_latency": _histogram(s, REQ_BUCKET0, REQ_LAT_SUM,
                                              int(s[REQ_OK] + s[REQ_FAILED])),
                "batches": int(s[BATCHES]),
                "batch_latency": _histogram(s, BATCH_BUCKET0, BATCH_LAT_SUM, int(s[BATCHES])),
            })
        return out


def _histogram(s, first: int, total: int, count: int) -> dict:
    """``{"count", "sum_s", "buckets": [(upper bound s, cumulative count)]}``."""
    per = s[first:first + BUCKETS]
    cum = np.cumsum(per).tolist()
    return {"count": count, "sum_s": int(s[total]) / 1e9,
            "buckets": list(zip(BUCKET_BOUNDS, (int(x) for x in cum)))}


def quantile(hist: dict, q: float) -> float:
    """The ``q`` quantile (0..1) of a histogram dict, interpolated inside its bucket as
    Prometheus' ``histogram_quantile`` does; 0.0 when it is empty."""
    buckets = hist["buckets"]
    total = buckets[-1][1] if buckets else 0
    if not total:
        return 0.0
    rank = q * total
    lo_bound, lo_count = 0.0, 0
    for bound, cum in buckets:
        if cum >= rank:
            if bound == float("inf"):
                return lo_bound
            span = cum - lo_count
            return lo_bound + (bound - lo_bound) * ((rank - lo_count) / span if span else 1.0)
        lo_bound, lo_count = bound, cum
    return lo_bound

# SPDX-License-Identifier: Apache-2.0
"""Numbers for the benchmark: latency summaries, rates (sizes: mooncake_te.units)."""
from __future__ import annotations

import numpy as np


def summarize_ns(samples) -> dict:
    """Summarise latency samples given in nanoseconds, in microseconds.

    Percentiles use numpy's default linear interpolation; with fewer than 100 samples
    p99 is close to the maximum, which is why ``count`` travels with them.

    Returns
    -------
    dict
        ``count``, ``avg``, ``min``, ``p50``, ``p90``, ``p99``, ``p999``, ``max`` (µs);
        all ``None`` except ``count`` when there are no samples.
    """
    a = np.asarray(samples, dtype=np.float64)
    keys = ("avg", "min", "p50", "p90", "p99", "p999", "max")
    if a.size == 0:
        return dict(count=0, **{k: None for k in keys})
    p50, p90, p99, p999 = np.percentile(a, [50, 90, 99, 99.9]) / 1e3
    return {"count": int(a.size), "avg": float(a.mean() / 1e3), "min": float(a.min() / 1e3),
            "p50": float(p50), "p90": float(p90), "p99": float(p99), "p999": float(p999),
            "max": float(a.max() / 1e3)}


def gbps(nbytes: int, seconds: float) -> float:
    """Bytes per second in GB/s (10^9), 0 for an empty interval."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0

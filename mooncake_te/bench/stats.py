# SPDX-License-Identifier: Apache-2.0
"""Numbers for the benchmark: size parsing and formatting, latency summaries, rates."""
from __future__ import annotations

import re

import numpy as np

# Block sizes are powers of two by convention (Mooncake's --block_size, nixlbench's
# --start_block_size), so "K"/"KB"/"KiB" all mean 1024 here; rates are base 10 (GB/s)
# because that is what nixlbench and transfer_engine_bench print.
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text) -> int:
    """Parse ``"4K"``, ``"64KiB"``, ``"1M"``, ``"16MB"`` or ``"4096"`` into bytes.

    Parameters
    ----------
    text : str or int
        A size with an optional binary suffix.

    Returns
    -------
    int
        The size in bytes (> 0).

    Raises
    ------
    ValueError
        If ``text`` is not a positive size.
    """
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ValueError(f"not a size: {text!r} (use e.g. 4096, 4K, 64KiB, 1M, 16MB)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return n


def parse_sizes(text: str) -> list:
    """Parse a comma-separated list of sizes (``"4K,64K,1M"``), keeping the order given."""
    out = [parse_size(t) for t in str(text).split(",") if t.strip()]
    if not out:
        raise ValueError(f"no sizes in {text!r}")
    return out


def format_size(n: int) -> str:
    """``4096`` -> ``"4 KiB"``; exact binary multiples only, else bytes."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def format_bytes(n: int) -> str:
    """A byte count for humans, base 10 like the GB/s column: ``"12.3 GB"``."""
    for unit, mult in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= mult:
            return f"{n / mult:.1f} {unit}"
    return f"{n} B"


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

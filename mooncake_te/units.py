# SPDX-License-Identifier: Apache-2.0
"""Byte sizes in and out: the one parser and the formatters (issue 40, item 3).

Sizes given by people (``--block-sizes 4K,1M``, ``global_segment_size = "4GB"``,
``--max-value 16M``) are binary whatever the suffix: block and buffer sizes are powers
of two by convention (Mooncake's ``--block_size``, nixlbench's ``--start_block_size``,
vLLM's Mooncake config), so ``K``, ``KB`` and ``KiB`` all mean 1024. Rates and byte
totals next to GB/s are base 10, as nixlbench and transfer_engine_bench print them.
"""
from __future__ import annotations

import re

__all__ = ["parse_size", "parse_sizes", "format_size", "format_bytes", "format_binary"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text, minimum: int = 1) -> int:
    """Parse ``"4K"``, ``"64KiB"``, ``"1M"``, ``"16MB"``, ``"64 kb"`` or ``"4096"`` into
    bytes.

    Parameters
    ----------
    text : str or int
        A size with an optional binary suffix (an int is taken as bytes).
    minimum : int
        The smallest size accepted (default 1: a size must be positive).

    Raises
    ------
    ValueError
        If ``text`` is not a size, or is below ``minimum``.
    """
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ValueError(f"not a size: {text!r} (use e.g. 4096, 4K, 64KiB, 1M, 16MB)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < minimum:
        raise ValueError(f"size must be positive, got {text!r}" if minimum == 1 else
                         f"size must be at least {minimum}, got {text!r}")
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


def format_binary(n: float, digits: int = 1, largest: str = "TiB") -> str:
    """Bytes in the largest binary unit (up to ``largest``) that keeps the number at or
    above 1, with ``digits`` decimals: ``1536`` -> ``"1.5 KiB"``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    for unit in units[:units.index(largest) + 1]:
        if abs(n) < 1024 or unit == largest:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024.0
    return ""

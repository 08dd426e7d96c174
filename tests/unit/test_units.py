# SPDX-License-Identifier: Apache-2.0
"""Byte sizes are parsed and formatted by mooncake_te.units only (issue 40, item 3):
before, the benchmark, the metadata server's CLI and the compat store each parsed sizes
their own way, and kvcache, top and the benchmark each formatted them."""
from __future__ import annotations

import argparse
import pathlib
import re

import pytest

from mooncake_te import units
from mooncake_te.compat.store import _parse_size
from mooncake_te.cli.metadata_server import _size
from mooncake_te.errors import InvalidArgumentError

PKG = pathlib.Path(__file__).resolve().parents[2] / "mooncake_te"


@pytest.mark.parametrize("text,n", [("4096", 4096), ("4K", 4096), ("64KiB", 65536),
                                    ("1M", 1 << 20), ("16MB", 16 << 20), ("64 kb", 65536),
                                    ("1.5G", 3 << 29), (" 2T ", 2 << 40), (7, 7)])
def test_parse_size(text, n):
    assert units.parse_size(text) == n


def test_every_door_parses_the_same_way():
    for text in ("4MB", "64 KB", "1G", "12345", "16MiB", "2m"):
        want = units.parse_size(text)
        assert _parse_size(text) == want          # the compat store (vLLM's config)
        assert _size(text) == want                # mooncake-te metadata-server
    # What the old compat parser took, it still takes (0 included: a "no SSD" size).
    assert _parse_size("0") == 0 and _parse_size(0) == 0
    with pytest.raises(InvalidArgumentError, match="not a number of bytes"):
        _parse_size("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="positive size"):
        _size("0")


def test_bad_sizes_say_what_to_write():
    with pytest.raises(ValueError, match="use e.g. 4096, 4K"):
        units.parse_size("4Q")
    with pytest.raises(ValueError, match="positive"):
        units.parse_size("0")
    assert units.parse_size("0", minimum=0) == 0
    assert units.parse_sizes("4K, 1M") == [4096, 1 << 20]


def test_formatters():
    assert units.format_size(4096) == "4 KiB" and units.format_size(4097) == "4097 B"
    assert units.format_bytes(12_345_678_901) == "12.3 GB"
    assert units.format_binary(1536) == "1.5 KiB"
    assert units.format_binary(3 << 40, 2, "GiB") == "3072.00 GiB"
    assert units.format_binary(512) == "512 B"


def test_no_other_module_parses_or_formats_sizes():
    unit_table = re.compile(r'"[KkMmGg][iI]?[Bb]?":\s*1\s*<<|\("B",\s*"KiB"')
    bad = [f"{p.relative_to(PKG)}:{i}" for p in sorted(PKG.rglob("*.py"))
           if p.name != "units.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if unit_table.search(line)]
    assert not bad, "parse and format byte sizes with mooncake_te.units: " + ", ".join(bad)

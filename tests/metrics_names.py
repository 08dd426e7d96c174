# SPDX-License-Identifier: Apache-2.0
"""Reading /metrics in tests: samples of the text format, sums over labels, and the
metric names docs/observability.md documents (exports are checked against it)."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documented() -> set:
    """Every ``mooncake_te_*`` name in the doc's tables, abbreviations expanded."""
    with open(os.path.join(ROOT, "docs", "observability.md")) as f:
        text = f.read()
    names = set(re.findall(r"`(mooncake_te_\w+)`", text))
    # "`mooncake_te_p2p_bytes_uploaded_total`, `..._chunks_uploaded_total`": the second
    # name shares the first one's prefix up to the family (p2p, kvcache, ...).
    for row in re.findall(r"^\|.*$", text, flags=re.M):
        full = re.findall(r"`(mooncake_te_[a-z0-9]+)_\w+`", row)
        for short in re.findall(r"`\.\.\.(_\w+)`", row):
            if full:
                names.add(full[0] + short)
    return names


def family(sample_name: str) -> str:
    """The family a sample belongs to (``_bucket``/``_count``/``_sum`` dropped)."""
    return re.sub(r"_(bucket|count|sum)$", "", sample_name)


def samples(text: str) -> dict:
    """``{(sample name, frozenset of (label, value)): value}`` of a text exposition."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(got: dict, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``; at least one
    must exist."""
    want = set(labels.items())
    hits = [v for (n, lab), v in got.items() if n == name and want <= lab]
    assert hits, f"{name}{labels} not exported"
    return sum(hits)

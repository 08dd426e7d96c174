# SPDX-License-Identifier: Apache-2.0
"""Metrics pieces without traffic: histogram math, the C layout mirrored in Python,
configuration, and the dashboard naming only documented metrics."""
from __future__ import annotations

import json
import os
import re

import pytest

import mooncake_te as mte
from mooncake_te.errors import ConfigError
from mooncake_te.metrics import cells, quantile
from metrics_names import documented

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_python_layout_matches_metrics_h():
    with open(os.path.join(ROOT, "src", "core", "metrics.h")) as f:
        h = f.read()
    defs = dict(re.findall(r"#define (MTE_M_\w+)\s+(\d+)", h))
    assert int(defs["MTE_M_BUCKETS"]) == cells.BUCKETS
    assert int(defs["MTE_M_MIN_LOG2"]) == cells.MIN_LOG2
    assert int(defs["MTE_M_SHARDS"]) == cells.SHARDS
    assert int(defs["MTE_M_SHARD_WORDS"]) == cells.SHARD_WORDS
    assert int(defs["MTE_M_CODES"]) == cells.CODES
    assert 6 + 2 * cells.BUCKETS <= cells.SHARD_WORDS
    assert cells.BUCKET_BOUNDS[0] == 1024e-9 and cells.BUCKET_BOUNDS[-1] == float("inf")
    assert cells.BUCKET_BOUNDS[-2] == 2.0 ** 36 / 1e9


def _hist(counts):
    cum, out = 0, []
    for b, n in zip(cells.BUCKET_BOUNDS, counts + [0] * (cells.BUCKETS - len(counts))):
        cum += n
        out.append((b, cum))
    return {"count": cum, "sum_s": 0.0, "buckets": out}


def test_quantile_interpolates_inside_the_bucket():
    h = _hist([0, 0, 10, 10])      # 10 in (2.05 us, 4.1 us], 10 in (4.1 us, 8.2 us]
    assert quantile(h, 0.5) == pytest.approx(4096e-9)
    assert quantile(h, 0.75) == pytest.approx(4096e-9 + 0.5 * 4096e-9)
    assert quantile(h, 1.0) == pytest.approx(8192e-9)
    assert quantile(_hist([]), 0.99) == 0.0
    assert quantile(_hist([0] * (cells.BUCKETS - 1) + [3]), 0.5) == cells.BUCKET_BOUNDS[-2]


def test_config_keys_and_variables():
    cfg = mte.Config.load(None, env={"MC_METRICS_PORT": "9464", "MC_METRICS": "0"})
    assert cfg["transfer_engine"]["metrics_port"] == 9464
    assert cfg["transfer_engine"]["metrics"] is False
    assert mte.Config.load(None, env={})["transfer_engine"]["metrics"] is True
    with pytest.raises(ConfigError, match="metrics_port"):
        mte.Config.load(None, env={"MC_METRICS_PORT": "70000"})


def test_busy_metrics_port_is_a_warning_not_a_dead_engine(caplog):
    """Processes that inherit MC_METRICS_PORT (bench targets, vLLM workers) must still
    move bytes: the engine that finds the port taken says so and runs without it."""
    import socket
    pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = mte.Config.load(None, env={"MC_METRICS_PORT": str(port)})
        with mte.TransferEngine(host="127.0.0.1", protocol="tcp", config=cfg) as eng:
            assert eng._metrics_server is None
            assert eng.metrics()["enabled"] is True
        assert f"cannot serve /metrics on 127.0.0.1:{port}" in caplog.text
        assert "MC_METRICS_PORT" in caplog.text


def test_dashboard_uses_only_documented_metrics():
    with open(os.path.join(ROOT, "docs", "grafana-dashboard.json")) as f:
        dash = json.load(f)
    used = set()
    for p in dash["panels"]:
        for t in p.get("targets", []):
            used.update(re.sub(r"_(bucket|count|sum)$", "", n)
                        for n in re.findall(r"mooncake_te_\w+", t["expr"]))
    assert used and not used - documented(), used - documented()

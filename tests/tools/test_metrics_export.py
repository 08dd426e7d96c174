# SPDX-License-Identifier: Apache-2.0
"""Exporters other than the engine's transfers, and `mooncake-te top`: the KV cache, the
P2P store and the HTTP metadata server through the same /metrics; `top --once --json`
against a real engine after real transfers (docs/observability.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import time

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import metrics
from metrics_names import documented, family, samples as _samples, total as _get

pytest.importorskip("prometheus_client")


def test_kvcache_exports_hits_misses_and_tiers(tmp_path):
    from mooncake_te.kvcache import KVCache
    from mooncake_te.kvcache.record import HEADER_SIZE
    bb = 8192 - HEADER_SIZE
    blk = [np.full(bb, i, np.uint8) for i in range(8)]
    with KVCache(bb, 2 * 8192, 8 * 8192, str(tmp_path / "kv"), namespace="obs-test",
                 log_interval_s=0) as c:
        c.put(list(range(6)), blk[:6])           # 2 fit in DRAM: 4 demoted to SSD
        c.lookup([0, 1, 2, 3, 6, 7])              # a prefix of 4 found, then misses
        c.get([0, 5])
        s = c.stats()
        got = _samples(metrics.exposition().decode())
        lab = {"cache": "obs-test"}
        assert _get(got, "mooncake_te_kvcache_lookup_blocks_total", **lab) == s["lookup_blocks"]
        assert _get(got, "mooncake_te_kvcache_miss_blocks_total", **lab) == s["miss_blocks"]
        for tier in ("dram", "ssd", "remote"):
            assert _get(got, "mooncake_te_kvcache_hit_blocks_total", tier=tier, **lab) == \
                s[f"hit_blocks_{tier}"]
        assert _get(got, "mooncake_te_kvcache_hit_blocks_total", **lab) == s["hit_blocks"] == 4
        assert _get(got, "mooncake_te_kvcache_demoted_bytes_total", **lab) == s["demoted_bytes"] > 0
        assert _get(got, "mooncake_te_kvcache_evictions_total", tier="dram", **lab) == \
            s["evictions_dram"]
        assert _get(got, "mooncake_te_kvcache_bytes", tier="ssd", **lab) == s["ssd_bytes"] > 0
        undocumented = {family(n) for n, _ in got} - documented()
        assert not undocumented, f"exported but not in docs/observability.md: {undocumented}"
    del c
    import gc
    gc.collect()
    got = _samples(metrics.exposition().decode())
    assert not [k for k in got if ("cache", "obs-test") in k[1]], "a dead cache is exported"


def test_p2p_store_exports_uploads_and_holders():
    from mooncake_te.p2p_store import P2PStore
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp") as e1, \
            mte.TransferEngine(host="127.0.0.1", protocol="tcp") as e2, \
            P2PStore(e1, "p2p", host="127.0.0.1", name="pub", chunk_size=1 << 20) as a:
        a.register("obj", data)
        with P2PStore(e2, "p2p", seeds=[a.address], host="127.0.0.1", name="getter") as b:
            out = b.get("obj")
            assert np.array_equal(out, data)
            # The holder learns each chunk's outcome from the getter's report, which may
            # arrive just after get() returned: wait (bounded) for the last one.
            deadline = time.monotonic() + 10
            while True:
                got = _samples(metrics.exposition().decode())
                try:        # not exported at all until the first report has arrived
                    done = _get(got, "mooncake_te_p2p_getter_chunks_total", store="pub") == 3
                except AssertionError:
                    done = False
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert _get(got, "mooncake_te_p2p_bytes_downloaded_total", store="getter") == data.nbytes
            assert _get(got, "mooncake_te_p2p_holder_bytes_total", store="getter",
                        holder="pub") == data.nbytes
            assert _get(got, "mooncake_te_p2p_holder_chunks_total", store="getter",
                        holder="pub") == 3
            assert _get(got, "mooncake_te_p2p_bytes_uploaded_total", store="pub") == data.nbytes
            assert _get(got, "mooncake_te_p2p_getter_chunks_total", store="pub") == 3
            undocumented = {family(n) for n, _ in got} - documented()
            assert not undocumented, f"not in docs/observability.md: {undocumented}"
            # The engine under the store counted the same bytes (READs from the publisher).
            rows = [t for t in e2.metrics()["transfers"] if t["peer"] == e1.name]
            assert sum(t["bytes"] for t in rows if t["op"] == "read") == data.nbytes


def test_metadata_server_exports_keys_requests_and_persist(tmp_path):
    pytest.importorskip("aiohttp")
    from mooncake_te.metadata.server import MetadataServer
    with MetadataServer("127.0.0.1", 0, str(tmp_path / "md.json")) as srv:
        base = srv.url
        for i in range(3):
            req = urllib.request.Request(f"{base}?key=k{i}", data=b"v", method="PUT")
            urllib.request.urlopen(req, timeout=5).read()
        urllib.request.urlopen(f"{base}?key=k0", timeout=5).read()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{base}?key=nope", timeout=5)
        metrics_url = base.replace("/metadata", "/metrics")
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            got = _samples(r.read().decode())
        lab = {"server": srv.url}
        assert _get(got, "mooncake_te_metadata_keys", **lab) == 3
        assert _get(got, "mooncake_te_metadata_requests_total", method="PUT", code="200",
                    **lab) == 3
        assert _get(got, "mooncake_te_metadata_requests_total", method="GET", code="200",
                    **lab) == 1
        assert _get(got, "mooncake_te_metadata_requests_total", method="GET", code="404",
                    **lab) == 1
        assert _get(got, "mooncake_te_metadata_persist_duration_seconds_count", **lab) == 3
        assert _get(got, "mooncake_te_metadata_persist_duration_seconds_sum", **lab) > 0
        assert not {family(n) for n, _ in got} - documented()


def test_top_once_json_reads_a_real_engine():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = mte.Config.load(None, env={"MC_METRICS_PORT": str(port)})
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp", config=cfg) as a, \
            mte.TransferEngine(host="127.0.0.1", protocol="tcp") as b:
        ra = a.register(np.ones(1 << 20, np.uint8))
        rb = b.register(np.zeros(1 << 20, np.uint8))
        for _ in range(5):
            a.write(b.name, ra.address, rb.address, 1 << 20)
        with pytest.raises(mte.MooncakeError):
            a.write(b.name, ra.address, rb.address + (8 << 20), 4096)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        out = subprocess.run([sys.executable, "-m", "mooncake_te", "top", "--once", "--json",
                              f"127.0.0.1:{port}"], capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        view = json.loads(out.stdout)
        rows = [r for r in view["transfers"] if r["engine"] == a.name and r["peer"] == b.name]
        assert len(rows) == 1
        assert rows[0]["bytes"] == 5 << 20 and rows[0]["requests"] == 5
        assert rows[0]["failures"] == 1
        assert [f["status"] for f in view["failures"] if f["engine"] == a.name] == ["-3"]
        lat = [r for r in view["latency"] if r["engine"] == a.name and r["kind"] == "request"]
        assert lat and lat[0]["count"] == 6 and 0 < lat[0]["p50_s"] <= lat[0]["p99_s"]
        assert view["engines"][a.name]["registered_bytes"] == {ra.location: 1 << 20}
        # The rich view renders too.
        out = subprocess.run([sys.executable, "-m", "mooncake_te", "top", "--once",
                              f"127.0.0.1:{port}"], capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 0 and "transfers" in out.stdout and b.name in out.stdout


def test_top_says_what_is_wrong_when_nothing_listens():
    out = subprocess.run([sys.executable, "-m", "mooncake_te", "top", "--once",
                          "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "metrics_port" in out.stderr


# --- issue #35: /metrics behind the token, and bounded -----------------------------------
def _status(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_metadata_server_metrics_need_the_credential_when_auth_is_on(tmp_path):
    pytest.importorskip("aiohttp")
    from mooncake_te.metadata.framing import metrics_credential
    from mooncake_te.metadata.server import MetadataServer
    with MetadataServer("127.0.0.1", 0, str(tmp_path / "md.json"), token="sesame") as srv:
        base = srv.url.replace("/metadata", "")
        assert _status(base + "/metrics")[0] == 401
        assert _status(base + "/metrics", {"Authorization": "Bearer sesame"})[0] == 401
        ok = {"Authorization": f"Bearer {metrics_credential(b'sesame')}"}
        code, body = _status(base + "/metrics", ok)
        assert code == 200 and b"mooncake_te_metadata_keys" in body
        # /health stays open for liveness probes, and says no more than that.
        code, body = _status(base + "/health")
        assert code == 200 and json.loads(body) == {"status": "ok", "auth": True}
        assert "persist" in json.loads(_status(base + "/health", ok)[1])


def test_engine_metrics_need_the_credential_when_auth_is_on():
    from mooncake_te.metadata.framing import metrics_credential
    from mooncake_te.metrics import prometheus
    h = prometheus.serve(0, "127.0.0.1", b"sesame")
    try:
        assert _status(h.url)[0] == 401
        code, body = _status(h.url, {"Authorization": f"Bearer {metrics_credential('sesame')}"})
        assert code == 200
    finally:
        h.release()


def test_engine_metrics_listener_takes_no_thread_per_connection():
    import socket
    import threading
    from mooncake_te.metrics import prometheus
    h = prometheus.serve(0, "127.0.0.1")
    flood = []
    try:
        before = threading.active_count()
        for _ in range(60):                     # connections that never send a request
            flood.append(socket.create_connection(("127.0.0.1", h.port),
                                                  source_address=("127.0.0.2", 0)))
        time.sleep(0.5)
        assert threading.active_count() - before <= 16
        code, body = _status(h.url)             # another address is still served
        assert code == 200
    finally:
        for f in flood:
            f.close()
        h.release()

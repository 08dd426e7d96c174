# SPDX-License-Identifier: Apache-2.0
"""The HTTP metadata server cannot be turned against its users (issue #20 item 8,
issue #23 item 9): limits, TTL checks, authentication, persistence that neither stalls
the server nor loses keys without a word."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("aiohttp", reason="the HTTP metadata server needs the [http] "
                                      "extra: pip install mooncake-te[http]")
requests = pytest.importorskip("requests", reason="the HTTP metadata client needs "
                               "the [http] extra: pip install mooncake-te[http]")

import mooncake_te as mte
from mooncake_te.errors import AuthenticationError, MetadataError
from mooncake_te.metadata import open_backend
from mooncake_te.metadata.server import (AUTH_HEADER, KeyStore, MetadataServer, sign_request)

from test_metadata_stores import descriptor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = b"cluster-secret"


def kv(srv, method, key=None, data=None, headers=None):
    params = {} if key is None else {"key": key}
    return requests.request(method, srv.url, params=params, data=data, headers=headers,
                            timeout=10)


def signed(method, key, data=b"", ttl="", token=TOKEN, **kw):
    h = {AUTH_HEADER: sign_request(token, method, key, ttl, data, **kw)}
    if ttl:
        h["X-Mooncake-TTL"] = ttl
    return h


def cli(*args, env=None, timeout=30):
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-m", "mooncake_te", "metadata-server",
                           "--host", "127.0.0.1", "--port", "0", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


# -- TTLs ------------------------------------------------------------------------------------
def test_ttl_must_be_finite():
    with MetadataServer("127.0.0.1", 0) as srv:
        for bad in ("nan", "inf", "-inf", "Infinity", "1e400", "1e12"):
            r = kv(srv, "PUT", "k", b"v", {"X-Mooncake-TTL": bad})
            assert r.status_code == 400 and "finite" in r.text, bad
        assert kv(srv, "GET", "k").status_code == 404


# -- sizes -----------------------------------------------------------------------------------
def test_value_limit_and_quota():
    with MetadataServer("127.0.0.1", 0, max_value=4096, quota=16384) as srv:
        r = kv(srv, "PUT", "big", os.urandom(4097))
        assert r.status_code == 413 and "4096" in r.text
        for i in range(3):
            assert kv(srv, "PUT", f"k{i}", os.urandom(4000)).status_code == 200
        r = kv(srv, "PUT", "k3", os.urandom(4000))
        assert r.status_code == 507 and "--quota-bytes" in r.text
        # replacing a value by one of the same size fits; freeing space lets more in
        assert kv(srv, "PUT", "k0", os.urandom(4000)).status_code == 200
        assert kv(srv, "DELETE", "k1").status_code == 200
        assert kv(srv, "PUT", "k3", os.urandom(4000)).status_code == 200
        health = requests.get(srv.url.rsplit("/", 1)[0] + "/health", timeout=5).json()
        assert health["quota"] == 16384 and 12000 < health["bytes"] <= 16384


def test_store_client_reports_the_limit():
    with MetadataServer("127.0.0.1", 0, max_value=512) as srv:
        b = open_backend(srv.url)
        try:
            with pytest.raises(MetadataError, match="413"):
                b.put("k", os.urandom(1024))
        finally:
            b.close()


# -- persistence -----------------------------------------------------------------------------
def test_empty_or_truncated_persist_file_stops_the_server(tmp_path):
    path = tmp_path / "m.json"
    with MetadataServer("127.0.0.1", 0, str(path)) as srv:
        for i in range(18):
            kv(srv, "PUT", f"mooncake/ram/e{i}", b"{}")
    full = path.read_bytes()
    assert json.loads(full)["count"] == 18
    for cut in (b"", full[:0] + b"\n", full[:len(full) // 2]):
        path.write_bytes(cut)
        with pytest.raises(MetadataError, match="m.json"):
            KeyStore(str(path))
        p = cli("--persist", str(path))
        assert p.returncode == 1 and "m.json" in p.stderr and "backup" in p.stderr, p.stderr
    # a complete file whose key count disagrees was cut short too
    doc = json.loads(full)
    doc["keys"] = dict(list(doc["keys"].items())[:5])
    path.write_text(json.dumps(doc))
    with pytest.raises(MetadataError, match="cut short"):
        KeyStore(str(path))


def test_persist_directory_is_created(tmp_path):
    path = tmp_path / "var" / "lib" / "mooncake" / "metadata.json"
    with MetadataServer("127.0.0.1", 0, str(path)) as srv:
        assert kv(srv, "PUT", "k", b"v").status_code == 200
    assert "k" in json.loads(path.read_bytes())["keys"]


def test_unusable_persist_directory_is_refused_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    p = cli("--persist", str(blocker / "sub" / "metadata.json"))
    assert p.returncode == 1 and "cannot be created or written" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_persisting_does_not_stall_the_server(tmp_path):
    """Big values on disk, a stream of changing PUTs (each rewrites the file): renewals
    and reads are still answered at once. The whole store used to be serialised on the
    event loop for every PUT (seconds each)."""
    with MetadataServer("127.0.0.1", 0, str(tmp_path / "m.json")) as srv:
        for i in range(3):
            assert kv(srv, "PUT", f"big{i}", os.urandom(24 << 20)).status_code == 200
        kv(srv, "PUT", "renewed", b"same", {"X-Mooncake-TTL": "30"})
        stop = threading.Event()

        def churn():
            with requests.Session() as s:
                i = 0
                while not stop.is_set():
                    s.put(srv.url, params={"key": "changing"}, data=str(i).encode(), timeout=60)
                    i += 1

        t = threading.Thread(target=churn)
        t.start()
        worst = 0.0
        try:
            with requests.Session() as s:
                end = time.monotonic() + 4
                while time.monotonic() < end:
                    t0 = time.monotonic()
                    r = s.put(srv.url, params={"key": "renewed"}, data=b"same",
                              headers={"X-Mooncake-TTL": "30"}, timeout=60)
                    assert r.status_code == 200
                    worst = max(worst, time.monotonic() - t0)
        finally:
            stop.set()
            t.join()
        assert worst < 3.0, f"a renewal waited {worst:.1f} s behind persistence"
    doc = json.loads((tmp_path / "m.json").read_bytes())
    assert {"big0", "big1", "big2", "renewed", "changing"} <= set(doc["keys"])


# -- authentication --------------------------------------------------------------------------
@pytest.fixture
def auth_server():
    with MetadataServer("127.0.0.1", 0, token=TOKEN) as srv:
        yield srv


def test_unsigned_and_wrongly_signed_requests_are_refused(auth_server):
    srv = auth_server
    r = kv(srv, "PUT", "mooncake/ram/x", b"evil")
    assert r.status_code == 401 and "auth_token" in r.text
    assert kv(srv, "GET", "mooncake/ram/x").status_code == 401
    assert kv(srv, "DELETE", "mooncake/ram/x").status_code == 401
    assert requests.get(srv.url + "/keys", timeout=5).status_code == 401
    r = kv(srv, "PUT", "k", b"v", signed("PUT", "k", b"v", token=b"other"))
    assert r.status_code == 401 and "wrong auth token" in r.text
    # a signature for another body, key or TTL does not carry over
    assert kv(srv, "PUT", "k", b"v2", signed("PUT", "k", b"v")).status_code == 401
    assert kv(srv, "PUT", "k2", b"v", signed("PUT", "k", b"v")).status_code == 401
    h = signed("PUT", "k", b"v", ttl="5")
    h["X-Mooncake-TTL"] = "50000"
    assert kv(srv, "PUT", "k", b"v", h).status_code == 401
    assert srv.auth_failures >= 8
    # health stays open (operators' probes), and says authentication is on
    health = requests.get(srv.url.rsplit("/", 1)[0] + "/health", timeout=5).json()
    assert health["auth"] is True


def test_signed_requests_work_once_and_replies_are_signed(auth_server):
    srv = auth_server
    h = signed("PUT", "k", b"v")
    r = kv(srv, "PUT", "k", b"v", h)
    assert r.status_code == 200 and AUTH_HEADER in r.headers
    r = kv(srv, "PUT", "k", b"v", h)                       # the same request replayed
    assert r.status_code == 401 and "replayed" in r.text
    stale = signed("PUT", "k", b"v", when=int(time.time()) - 600)
    assert kv(srv, "PUT", "k", b"v", stale).status_code == 401
    r = kv(srv, "GET", "k", headers=signed("GET", "k"))
    assert r.status_code == 200 and r.content == b"v"


def test_store_client_signs_with_the_engine_token(auth_server):
    b = open_backend(auth_server.url, token=TOKEN)
    try:
        b.publish(descriptor("signed"))
        assert b.fetch("signed", 2.0).name == "signed"
    finally:
        b.close()
    anon = open_backend(auth_server.url)
    try:
        with pytest.raises(AuthenticationError, match="auth_token"):
            anon.fetch("signed", 2.0)
    finally:
        anon.close()
    wrong = open_backend(auth_server.url, token=b"other")
    try:
        with pytest.raises(AuthenticationError, match="tokens differ"):
            wrong.fetch("signed", 2.0)
    finally:
        wrong.close()


def test_engines_with_a_token_use_an_authenticating_server(auth_server):
    url = auth_server.url
    with mte.TransferEngine(host="127.0.0.1", metadata=url, auth_token=TOKEN) as a, \
            mte.TransferEngine(host="127.0.0.1", metadata=url, auth_token=TOKEN) as b:
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, np.uint8)
        ms, md = a.register(src), b.register(dst)
        a.write(b.name, ms.address, md.address, 4096)
        assert (dst == src).all()


def test_cli_reads_the_token(tmp_path):
    tok = tmp_path / "token"
    tok.write_bytes(TOKEN + b"\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "mooncake_te", "metadata-server", "--host",
                          "127.0.0.1", "--port", "0", "--json", "--auth-token-file", str(tok)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(p.stdout.readline())
        assert info["auth"] is True
        url = info["url"]
        assert requests.put(url, params={"key": "k"}, data=b"v", timeout=5).status_code == 401
        assert requests.put(url, params={"key": "k"}, data=b"v", timeout=5,
                            headers=signed("PUT", "k", b"v")).status_code == 200
    finally:
        p.terminate()
        p.wait(10)


def test_batch_read_is_signed_and_bounded(auth_server):
    b = open_backend(auth_server.url, token=TOKEN)
    try:
        b.put("batch/a", b"\x00\xff")
        assert b.get_many(["batch/a", "batch/missing"]) == [b"\x00\xff", None]
    finally:
        b.close()
    anon = open_backend(auth_server.url)
    try:
        with pytest.raises(AuthenticationError, match="auth_token"):
            anon.get_many(["batch/a"])
    finally:
        anon.close()


def test_batch_read_refuses_bad_bodies():
    from mooncake_te.metadata.server import MAX_BATCH
    with MetadataServer("127.0.0.1", 0) as srv:
        base = srv.url + "/batch"
        assert requests.post(base, data=b"not json").status_code == 400
        assert requests.post(base, json={"get": [1, 2]}).status_code == 400
        r = requests.post(base, json={"get": ["k"] * (MAX_BATCH + 1)})
        assert r.status_code == 413 and str(MAX_BATCH) in r.text
        assert requests.post(base, json={"get": []}).json() == {"values": []}
        assert requests.post(base, json={"get": ["a"], "put": {"b": "AA=="}}).status_code == 400
        assert requests.post(base, json={"put": {"k": "not base64!"}}).status_code == 400
        assert requests.post(base, json={"put": {" ": "AA=="}}).status_code == 400


def test_batch_write_keeps_the_single_put_rules():
    import base64
    b64 = lambda v: base64.b64encode(v).decode()              # noqa: E731
    with MetadataServer("127.0.0.1", 0, quota=1000) as srv:
        base = srv.url + "/batch"
        r = requests.post(base, json={"put": {"a": b64(b"1"), "b": b64(b"2")}})
        assert r.json() == {"stored": 2, "deleted": 0}
        assert kv(srv, "GET", "a").content == b"1"
        r = requests.post(base, json={"put": {"c": b64(b"3"), "big": b64(b"x" * 900)}})
        assert r.status_code == 507 and "'big'" in r.text and "1 stored before" in r.text
        assert kv(srv, "GET", "c").content == b"3"
        kv(srv, "PUT", "seg/rpc_meta", b"one")
        r = requests.post(base, json={"put": {"seg/rpc_meta": b64(b"two")}})
        assert r.status_code == 400 and "rpc_meta" in r.text
        r = requests.post(base, json={"delete": ["a", "missing"]})
        assert r.json() == {"stored": 0, "deleted": 1}
        assert kv(srv, "GET", "a").status_code == 404

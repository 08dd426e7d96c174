# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te metadata-server``: Mooncake's wire protocol, TTLs, persistence, health.

Spoken to with plain HTTP requests, as Mooncake's C++ engines (libcurl) and operators'
tools do; the server runs in its own process (tests/servers.py) or in a thread.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("aiohttp", reason="the HTTP metadata server needs the [http] "
                                      "extra: pip install mooncake-te[http]")
requests = pytest.importorskip("requests", reason="the HTTP metadata client needs "
                               "the [http] extra: pip install mooncake-te[http]")

from servers import HttpMetadataServer, http_metadata_server  # noqa: F401

from mooncake_te.errors import MetadataError
from mooncake_te.metadata.server import KeyStore, MetadataServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kv(srv, method, key=None, data=None, headers=None):
    params = {} if key is None else {"key": key}
    return requests.request(method, srv.url, params=params, data=data, headers=headers,
                            timeout=5)


def test_mooncake_wire_protocol(http_metadata_server):
    srv = http_metadata_server
    key = "mooncake/ram/10.0.0.1:12345"
    assert kv(srv, "GET", key).status_code == 404
    assert kv(srv, "GET", key).text == "metadata not found"
    r = kv(srv, "PUT", key, b'{"name":"x"}')
    assert (r.status_code, r.text) == (200, "metadata updated")
    r = kv(srv, "GET", key)
    assert r.status_code == 200 and r.content == b'{"name":"x"}'
    assert kv(srv, "DELETE", key).status_code == 200
    assert kv(srv, "DELETE", key).status_code == 404
    assert kv(srv, "GET").status_code == 400            # no key
    assert kv(srv, "POST", key).status_code == 405
    # keys are URL-encoded by clients; odd characters survive
    odd = "mooncake/ram/[::1]:1 a&b=c/é"
    kv(srv, "PUT", odd, b"v")
    assert kv(srv, "GET", odd).content == b"v"
    kv(srv, "DELETE", odd)


def test_duplicate_rpc_meta_rule(http_metadata_server):
    """Mooncake PR #2311: a second, different rpc_meta for one name is refused, and a TTL
    header is no way around it (issue #20 item 8)."""
    srv = http_metadata_server
    key = "mooncake/rpc_meta/dup"
    assert kv(srv, "PUT", key, b'{"rpc_port":1}').status_code == 200
    assert kv(srv, "PUT", key, b'{"rpc_port":1}').status_code == 200     # idempotent
    r = kv(srv, "PUT", key, b'{"rpc_port":2}')
    assert r.status_code == 400 and "Duplicate" in r.text
    h = {"X-Mooncake-TTL": "30"}
    r = kv(srv, "PUT", key, b'{"rpc_port":2}', h)                         # the bypass
    assert r.status_code == 400 and "Duplicate" in r.text
    assert kv(srv, "GET", key).content == b'{"rpc_port":1}'
    kv(srv, "DELETE", key)
    # with a TTL: renewals of the same value are fine, another value is not
    assert kv(srv, "PUT", key, b'{"rpc_port":1}', h).status_code == 200
    assert kv(srv, "PUT", key, b'{"rpc_port":1}', h).status_code == 200
    assert kv(srv, "PUT", key, b'{"rpc_port":2}', h).status_code == 400
    assert kv(srv, "PUT", key, b'{"rpc_port":2}').status_code == 400
    # a restarted instance deletes its dead predecessor's key first (stores/http.py)
    assert kv(srv, "DELETE", key).status_code == 200
    assert kv(srv, "PUT", key, b'{"rpc_port":2}', h).status_code == 200
    kv(srv, "DELETE", key)


def test_ttl_header_and_expiry(http_metadata_server):
    srv = http_metadata_server
    r = kv(srv, "PUT", "ttl/a", b"1", {"X-Mooncake-TTL": "1"})
    assert r.status_code == 200 and r.headers["X-Mooncake-TTL"] == "1"
    assert kv(srv, "GET", "ttl/a").status_code == 200
    deadline = time.monotonic() + 5
    while kv(srv, "GET", "ttl/a").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv(srv, "GET", "ttl/a").status_code == 404
    for bad in ("0", "-3", "soon", "nan", "NaN", "inf", "-inf", "1e400", "1e12"):
        assert kv(srv, "PUT", "ttl/b", b"1", {"X-Mooncake-TTL": bad}).status_code == 400
    # without the header the key stays (Mooncake semantics) and no TTL is confirmed
    r = kv(srv, "PUT", "ttl/c", b"1")
    assert "X-Mooncake-TTL" not in r.headers
    kv(srv, "DELETE", "ttl/c")


def test_health_and_key_listing(http_metadata_server):
    srv = http_metadata_server
    kv(srv, "PUT", "mooncake/ram/h1", b"{}")
    kv(srv, "PUT", "mooncake/rpc_meta/h1", b"{}")
    base = srv.url.rsplit("/", 1)[0]
    health = requests.get(base + "/health", timeout=5).json()
    assert health["status"] == "ok" and health["keys"] >= 2 and health["uptime_s"] >= 0
    keys = requests.get(base + "/metadata/keys", params={"prefix": "mooncake/ram/"},
                        timeout=5).json()
    assert "mooncake/ram/h1" in keys and "mooncake/rpc_meta/h1" not in keys
    kv(srv, "DELETE", "mooncake/ram/h1")
    kv(srv, "DELETE", "mooncake/rpc_meta/h1")


def test_large_value(http_metadata_server):
    big = os.urandom(3 << 20)       # aiohttp's default body limit is 1 MiB
    assert kv(http_metadata_server, "PUT", "big", big).status_code == 200
    assert kv(http_metadata_server, "GET", "big").content == big
    kv(http_metadata_server, "DELETE", "big")


def test_persistence_keeps_ttl_keys_for_one_more_ttl(tmp_path):
    path = str(tmp_path / "m.json")
    with MetadataServer("127.0.0.1", 0, path) as srv:
        kv(srv, "PUT", "forever", b"F")
        kv(srv, "PUT", "leased", b"L", {"X-Mooncake-TTL": "1.5"})
    doc = json.load(open(path))
    assert doc["version"] == 1 and set(doc["keys"]) == {"forever", "leased"}
    with MetadataServer("127.0.0.1", 0, path) as srv:
        # an engine that died while the server was down does not live forever
        assert kv(srv, "GET", "leased").content == b"L"
        time.sleep(2.5)
        assert kv(srv, "GET", "leased").status_code == 404
        assert kv(srv, "GET", "forever").content == b"F"
    assert set(json.load(open(path))["keys"]) == {"forever"}


def test_corrupt_persistence_file_is_a_clear_error(tmp_path):
    path = tmp_path / "m.json"
    path.write_bytes(b"{not json")
    with pytest.raises(MetadataError, match="move it away"):
        KeyStore(str(path))
    path.write_text(json.dumps({"version": 1, "keys": {"k": {"value": "%%%", "ttl": None}}}))
    with pytest.raises(MetadataError, match=str(path)):
        KeyStore(str(path))


def test_cli_refuses_a_busy_port(http_metadata_server):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "mooncake_te", "metadata-server", "--host",
                        "127.0.0.1", "--port", str(http_metadata_server.port)],
                       capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == 2            # a bad value (README: exit 2), in one line
    assert f"127.0.0.1:{http_metadata_server.port}" in p.stderr


def test_cli_sigterm_exits_cleanly(tmp_path):
    with HttpMetadataServer(str(tmp_path)) as srv:
        kv(srv, "PUT", "k", b"v")
        srv.proc.terminate()
        assert srv.proc.wait(10) == 0
    assert "k" in json.load(open(tmp_path / "metadata.json"))["keys"]

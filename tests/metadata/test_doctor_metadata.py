# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te doctor``'s metadata checks (MTE3xx) against real servers: a real
redis-server, a real etcd and our HTTP metadata server started by tests/servers.py, an
HTTPS server, a listener that never answers, and a closed port. (Moved out of
tests/unit/ in issue 40: these start servers.)"""
from __future__ import annotations

import json
import subprocess

import pytest

from mooncake_te.doctor import Context, Severity, run_checks
from mooncake_te.doctor.probe import identify, parse_endpoints
from doctor_support import _cli, _need, metadata_toml, problems, run, toml, trees  # noqa: F401
from servers import etcd_server, free_port, http_metadata_server, redis_server  # noqa: F401


# ---- MTE3xx metadata server (real servers) -----------------------------------------

def md_problems(trees, tmp_path, kind, address):
    return problems(run(trees, config=metadata_toml(tmp_path, kind, address),
                        only=["metadata"]))


def test_mte300_address_missing_or_contradictory(trees, tmp_path):
    (f,) = problems(run(trees, config=metadata_toml(tmp_path, "etcd", ""), only=["metadata"]),
                    "MTE300")
    assert "server_address is empty" in f.message and "127.0.0.1:2379" in f.fix
    (f,) = problems(run(trees, config=metadata_toml(tmp_path, "redis", "etcd://h:2379", "b"),
                        only=["metadata"]), "MTE300")
    assert "is a etcd:// address" in f.message
    (f,) = problems(run(trees, config=metadata_toml(tmp_path, "redis", "h:notaport", "c"),
                        only=["metadata"]), "MTE300")
    assert "port is not a number" in f.message


def test_mte301_closed_port(trees, tmp_path):
    port = free_port()
    for kind in ("etcd", "redis", "http"):
        findings = run(trees, config=metadata_toml(tmp_path, kind, f"127.0.0.1:{port}", kind),
                       only=["metadata"])
        (f,) = problems(findings, "MTE301")
        assert f.severity == Severity.ERROR
        assert f"127.0.0.1:{port}" in f.message and "refused" in f.message.lower()
        assert f"--port {port}" in f.fix or f"0.0.0.0:{port}" in f.fix


def test_metadata_matches_real_redis(trees, tmp_path, redis_server):
    addr = f"127.0.0.1:{redis_server.port}"
    assert md_problems(trees, tmp_path, "redis", addr) == []
    assert md_problems(trees, tmp_path, "redis", redis_server.url) == []
    for claimed in ("etcd", "http"):
        (f,) = problems(run(trees, config=metadata_toml(tmp_path, claimed, addr, claimed),
                            only=["metadata"]), "MTE302")
        assert f.data["found"] == "redis" and f.data["expected"] == claimed
        assert "a redis server answers" in f.message
        assert 'server_type = "redis"' in f.fix


def test_metadata_matches_real_etcd(trees, tmp_path, etcd_server):
    addr = f"127.0.0.1:{etcd_server.port}"
    assert md_problems(trees, tmp_path, "etcd", addr) == []
    assert md_problems(trees, tmp_path, "etcd", f"http://{addr}") == []
    # The classic mistake: etcd's address with server_type "redis" (or "http").
    for claimed in ("redis", "http"):
        (f,) = problems(run(trees, config=metadata_toml(tmp_path, claimed, addr, claimed),
                            only=["metadata"]), "MTE302")
        assert f.data["found"] == "etcd"
        assert "an etcd server answers" in f.message and "etcd 3." in f.message
        assert f"not {'a redis' if claimed == 'redis' else 'an HTTP'} server" in f.message


def test_mte303_one_etcd_member_down(trees, tmp_path, etcd_server):
    dead = free_port()
    addr = f"127.0.0.1:{etcd_server.port},127.0.0.1:{dead}"
    (f,) = problems(run(trees, config=metadata_toml(tmp_path, "etcd", addr), only=["metadata"]))
    assert f == ("MTE303", "warning")


def test_metadata_matches_real_http_server(trees, tmp_path, http_metadata_server):
    url = http_metadata_server.url
    assert md_problems(trees, tmp_path, "http", url) == []
    assert md_problems(trees, tmp_path, "http", f"127.0.0.1:{http_metadata_server.port}") == []
    (f,) = problems(run(trees, config=metadata_toml(
        tmp_path, "etcd", f"127.0.0.1:{http_metadata_server.port}", "e"), only=["metadata"]),
        "MTE302")
    assert f.data["found"] == "http" and "an HTTP server answers" in f.message


def test_p2p_store_section_is_probed_too(trees, tmp_path, redis_server):
    cfg = toml(tmp_path, f"""
        [p2p_store]
        metadata_server = "etcd"
        metadata_address = "127.0.0.1:{redis_server.port}"
    """)
    (f,) = problems(run(trees, config=cfg, only=["metadata"]), "MTE302")
    assert f.message.startswith("[p2p_store]") and f.data["found"] == "redis"


def test_probe_helpers(redis_server):
    r = identify("127.0.0.1", redis_server.port, 1.0, expect="etcd")
    assert (r.kind, r.reachable) == ("redis", True)
    r = identify("no-such-host.invalid", 2379, 1.0)
    assert not r.reachable and "cannot resolve" in r.detail
    assert parse_endpoints("etcd", "etcd://a:1, https://b:2") == [("a", 1, "", False),
                                                                 ("b", 2, "", True)]
    assert parse_endpoints("redis", "h") == [("h", 6379, "", False)]
    assert parse_endpoints("http", "h:8080") == [("h", 8080, "/metadata", False)]
    assert parse_endpoints("http", "https://h/md") == [("h", 443, "/md", True)]
    with pytest.raises(ValueError):
        parse_endpoints("etcd", ",")


# ---- probes against servers that are neither ----------------------------------------

@pytest.fixture
def silent_server():
    """A TCP listener that accepts (the kernel does, from the backlog) and never answers."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


def test_mte302_silent_server(trees, tmp_path, silent_server):
    ctx = Context(config_path=metadata_toml(tmp_path, "etcd", f"127.0.0.1:{silent_server}"),
                  sysfs_root=trees["empty"], env={}, timeout_s=0.3)
    (f,) = problems(run_checks(ctx, only=["metadata"]), "MTE302")
    assert f.data["found"] == "unknown"
    assert "answered neither a redis PING nor an HTTP request within 0.3 s" in f.message


@pytest.fixture(scope="module")
def https_server(tmp_path_factory):
    """A minimal HTTPS server (self-signed certificate) answering every GET with 404."""
    import http.server
    import shutil
    import ssl
    import threading
    if not shutil.which("openssl"):
        _need("the openssl command (makes a test certificate)", "apt-get install openssl")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(d / "k.pem"),
                    "-out", str(d / "c.pem")], check=True, capture_output=True, timeout=60)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "c.pem", d / "k.pem")
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()
    t.join(10)


def test_https_metadata_server(trees, tmp_path, https_server, http_metadata_server):
    assert md_problems(trees, tmp_path, "http", f"https://127.0.0.1:{https_server}/metadata") == []
    # TLS spoken to a plain-HTTP server: named, not reported as "refused".
    (f,) = problems(run(trees, config=metadata_toml(
        tmp_path, "http", f"https://127.0.0.1:{http_metadata_server.port}/metadata", "t"),
        only=["metadata"]), "MTE302")
    assert "TLS handshake failed" in f.message


def test_cli_metadata_flag_overrides_config(trees, tmp_path, redis_server):
    cfg = metadata_toml(tmp_path, "etcd", "127.0.0.1:1")
    rc, out = _cli("--sysfs-root", trees["empty"], "--config", cfg, "--check", "metadata",
                   "--metadata", redis_server.url, "--json")
    assert rc == 0, out
    rc, out = _cli("--sysfs-root", trees["empty"], "--check", "metadata",
                   "--metadata", f"etcd://127.0.0.1:{redis_server.port}", "--json")
    (f,) = [f for f in json.loads(out)["findings"] if f["code"] == "MTE302"]
    assert rc == 2 and f["message"].startswith("--metadata etcd://")

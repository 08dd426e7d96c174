# SPDX-License-Identifier: Apache-2.0
"""Issue 23, items 2 and 5: a metadata server's (or any other service's) port given where
an engine's RPC port belongs is named at once; a closed store port fails fast, and a
constructor that failed logs nothing about withdrawing what it never published."""
from __future__ import annotations

import logging
import os
import socket
import ssl
import subprocess
import threading
import time

import pytest

from servers import (etcd_server, free_port, http_metadata_server, redis_server,  # noqa: F401
                     require_client)

import mooncake_te as mte


@pytest.fixture(scope="module")
def engine():
    with mte.TransferEngine(host="127.0.0.1") as e:
        yield e


@pytest.fixture(scope="module")
def tls_port(tmp_path_factory):
    """A real TLS server (Python's ssl over a listening socket) with a fresh self-signed
    certificate from openssl; it completes handshakes and then closes."""
    d = tmp_path_factory.mktemp("tls")
    key, cert = str(d / "k.pem"), str(d / "c.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1"], check=True,
                   capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                with ctx.wrap_socket(conn, server_side=True) as c:
                    c.recv(1)
            except (OSError, ssl.SSLError):
                conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    srv.close()


def _open(engine, port):
    t = time.monotonic()
    with pytest.raises(mte.MooncakeError) as ei:
        engine.open_segment(f"127.0.0.1:{port}")
    return str(ei.value), time.monotonic() - t


@pytest.mark.parametrize("kind", ["http", "redis", "etcd", "tls"])
def test_open_segment_names_the_service_on_a_wrong_port(engine, kind, request):
    if kind == "tls":
        port = request.getfixturevalue("tls_port")
    else:
        srv = request.getfixturevalue({"http": "http_metadata_server", "redis": "redis_server",
                                       "etcd": "etcd_server"}[kind])
        port = srv.port
    msg, took = _open(engine, port)
    what = {"http": "an HTTP server", "redis": "a redis server", "etcd": "an etcd server",
            "tls": "a TLS server"}[kind]
    assert f"127.0.0.1:{port} is {what}, not a transfer engine's RPC port" in msg
    assert "metadata=" in msg
    assert took < 2.0, f"took {took:.1f} s; the engine's timeout is {engine.timeout} s"


def test_a_real_peer_still_resolves(engine):
    with mte.TransferEngine(host="127.0.0.1") as peer:
        peer.register(bytearray(4096))
        assert engine.open_segment(peer.name).buffers[0].length == 4096


@pytest.mark.parametrize("scheme", ["redis", "etcd", "http"])
def test_closed_store_port_fails_fast_and_quietly(scheme, caplog):
    require_client(scheme)
    url = {"redis": "redis://127.0.0.1:{}", "etcd": "etcd://127.0.0.1:{}",
           "http": "http://127.0.0.1:{}/metadata"}[scheme].format(free_port())
    caplog.set_level(logging.DEBUG, logger="mooncake_te")
    t = time.monotonic()
    with pytest.raises(mte.MetadataError, match="refused"):
        mte.TransferEngine(host="127.0.0.1", metadata=url)
    took = time.monotonic() - t
    assert took < 2.0, f"{scheme}: a closed port took {took:.1f} s to fail"
    noise = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert noise == [], noise

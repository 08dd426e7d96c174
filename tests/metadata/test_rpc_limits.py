# SPDX-License-Identifier: Apache-2.0
"""The RPC port under floods (issue #20 items 4 and 5): one peer opening connections,
holding them, or announcing big frames must not take the port down for good, nor make
the server allocate what was announced but never sent."""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_te.metadata import framing

HERE = Path(__file__).resolve().parent


class Server:
    def __init__(self, nofile: int = 0, extra_as_mib: int = 0, token: str = "", *more):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "rpc_server_proc.py"), str(nofile), str(extra_as_mib),
             token, *map(str, more)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def stats(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def probe(self, timeout: float = 5.0, token: bytes | None = None) -> bytes:
        return framing.request("127.0.0.1", self.port, framing.PROBE, b"", timeout, token)

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server(request):
    srv = Server(*getattr(request, "param", ()))
    yield srv
    srv.close()


def _flood(port: int, n: int, first: bytes = b"") -> list:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if first:
            s.sendall(first)
        socks.append(s)
    return socks


def _wait_answering(srv: Server, within: float) -> bytes:
    deadline = time.monotonic() + within
    while True:
        try:
            return srv.probe(timeout=2.0)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("server", [(64,)], indirect=True)
def test_accept_loop_survives_descriptor_exhaustion(server):
    """64 descriptors: 150 idle connections run the server out of them (EMFILE)."""
    socks = _flood(server.port, 150)
    time.sleep(0.5)
    for s in socks:
        s.close()
    # Once the flood is gone the port answers again (it used to stop accepting forever).
    assert b"success" in _wait_answering(server, within=15)
    assert server.stats()["shed"] > 0


@pytest.mark.parametrize("server", [(0, 120)], indirect=True)
def test_accept_loop_survives_thread_exhaustion(server):
    """An address space too small for more than a few thread stacks: Thread.start()
    raises RuntimeError; the server sheds and goes on."""
    socks = _flood(server.port, 120)
    time.sleep(0.5)
    for s in socks:
        s.close()
    assert b"success" in _wait_answering(server, within=15)


def test_connections_over_the_limit_are_shed_and_the_rest_served(server):
    from mooncake_te.metadata import rpc
    socks = _flood(server.port, rpc.MAX_PER_PEER + 20)
    time.sleep(0.5)
    assert server.stats()["shed"] >= 20
    for s in socks:
        s.close()
    assert b"success" in _wait_answering(server, within=10)


@pytest.mark.parametrize("server", [(0, 0, "", 4.0)], indirect=True)
def test_a_trickling_request_is_cut_at_the_deadline(server):
    """A byte every 1.5 s keeps each recv() under its 5 s timeout; the whole-request
    deadline (4 s here) still closes the connection."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    start = time.monotonic()
    for b in struct.pack("<QB", 100, framing.PROBE)[:3]:
        s.send(bytes([b]))
        time.sleep(1.5)
    s.settimeout(15)
    try:
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass
    closed_after = time.monotonic() - start
    s.close()
    assert closed_after < 6.0, f"a trickling request held the connection {closed_after:.1f} s"


@pytest.mark.parametrize("server", [(0, 0, "sekrit")], indirect=True)
def test_announced_frames_cost_nothing_before_authentication(server):
    """300 connections announcing a 1 MiB AUTH frame: the server must not allocate the
    megabyte each (it used to: +1 MiB RSS per connection)."""
    before = server.stats()["rss_kib"]
    hdr = struct.pack("<QB", 1 << 20, framing.AUTH)
    socks = []
    for _ in range(6):
        socks += _flood(server.port, 50, hdr)
        time.sleep(0.3)
    grown = server.stats()["rss_kib"] - before
    for s in socks:
        s.close()
    assert grown < 64 << 10, f"RSS grew by {grown} KiB under 300 announced 1 MiB frames"
    assert b"success" in _wait_answering_token(server)


def _wait_answering_token(srv):
    deadline = time.monotonic() + 10
    while True:
        try:
            return srv.probe(timeout=2.0, token=b"sekrit")
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_unannounced_notify_allocates_only_what_arrived(server):
    """Without a token: a header announcing 1 MiB followed by nothing costs nothing."""
    before = server.stats()["rss_kib"]
    hdr = struct.pack("<QB", 1 << 20, framing.NOTIFY)
    socks = _flood(server.port, 60, hdr)
    time.sleep(0.5)
    grown = server.stats()["rss_kib"] - before
    for s in socks:
        s.close()
    assert grown < 32 << 10, f"RSS grew by {grown} KiB under 60 announced 1 MiB frames"

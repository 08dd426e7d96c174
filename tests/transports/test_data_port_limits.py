# SPDX-License-Identifier: Apache-2.0
"""The data port's bounds (issue #20 item 6): one peer cannot hold the descriptors and
threads that others need, a connection that never finishes its hello or a request header
is closed, and idle connections are given back (the client's lanes reconnect).

Before these bounds, about 1,015 idle connections from one address exhausted a target's
1,024-descriptor limit and a legitimate READ then failed."""
from __future__ import annotations

import socket
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.config import Config

N = 1 << 16
MAGIC_HELLO = 0x4845544D


def _engine(**te):
    cfg = Config.load(None)
    cfg.data["transfer_engine"].update(te)
    return mte.TransferEngine(host="127.0.0.1", protocol="tcp", config=cfg)


def _connect(port: int, source: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """True if the server ends the connection within ``seconds``."""
    s.settimeout(seconds)
    try:
        while True:
            if not s.recv(4096):
                return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def _assert_closed_soon(s: socket.socket, limit: float, what: str) -> None:
    """The server ends the connection, and within ``limit`` seconds."""
    t0 = time.monotonic()
    assert _closed_within(s, 2 * limit), what
    assert time.monotonic() - t0 < limit
    s.close()


def _hello(name: bytes = b"raw-client") -> bytes:
    return (struct.pack("<IIQII", MAGIC_HELLO, 2, 12345, len(name), 0) + bytes(16)
            + struct.pack("<Q", 0) + bytes(8) + name)


def _tcp(eng):
    return eng._transports["tcp"]


def _data_port(eng) -> int:
    return eng.open_segment(eng.name).descriptor.tcp_data_port


def test_one_address_cannot_take_every_connection():
    target = _engine(data_max_per_peer=32, data_max_connections=64)
    ini = mte.TransferEngine(host="127.0.0.1", protocol="tcp")
    flood = []
    try:
        dst = np.zeros(N, np.uint8)
        r = target.register(dst)
        port = _data_port(target)
        flood = [_connect(port, "127.0.0.2") for _ in range(200)]
        deadline = time.monotonic() + 10
        while _tcp(target).counters()["connections_refused"] < 168 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        c = _tcp(target).counters()
        assert c["connections"] <= 32, c
        assert c["connections_refused"] >= 168, c
        src = np.arange(N, dtype=np.uint64).astype(np.uint8)
        s = ini.register(src)
        ini.write(target.name, s.address, r.address, N)          # from another address
        assert (dst == src).all()
    finally:
        for f in flood:
            f.close()
        ini.close()
        target.close()


def test_addresses_that_never_authenticate_cannot_fill_the_cap():
    """Issue #35: six source addresses, each at max_per_peer and none authenticating,
    filled the whole connection cap, and a peer with the token could not connect until
    the auth deadline passed. Waiting connections now hold at most a quarter of the
    cap, and a newcomer takes the place of the flood's oldest."""
    target = _engine(data_max_per_peer=32, data_max_connections=64, data_auth_timeout_s=60,
                     auth_token="sesame")
    ini = mte.TransferEngine(host="127.0.0.1", protocol="tcp", auth_token="sesame")
    flood = []
    try:
        dst = np.zeros(N, np.uint8)
        r = target.register(dst)
        port = _data_port(target)
        for i in range(6):
            flood += [_connect(port, f"127.0.0.{10 + i}") for _ in range(32)]
        time.sleep(0.5)
        c = _tcp(target).counters()
        assert c["connections"] <= 16 + 1, c
        src = np.arange(N, dtype=np.uint64).astype(np.uint8)
        s = ini.register(src)
        ini.write(target.name, s.address, r.address, N, timeout=5)
        assert (dst == src).all()
    finally:
        for f in flood:
            f.close()
        ini.close()
        target.close()


def test_silent_connection_is_closed_after_the_auth_deadline():
    target = _engine(data_auth_timeout_s=0.5)
    try:
        s = _connect(_data_port(target), "127.0.0.3")
        _assert_closed_soon(s, 5, "a connection that never said hello stayed open")
    finally:
        target.close()


def test_half_sent_request_header_is_closed_after_the_stall_timer():
    target = _engine(timeout_ms=1000)
    try:
        s = _connect(_data_port(target), "127.0.0.4")
        s.sendall(_hello())
        s.settimeout(5)
        reply = b""
        while len(reply) < 72:
            reply += s.recv(72 - len(reply))
        assert struct.unpack_from("<Ii", reply) == (MAGIC_HELLO, 0)
        s.sendall(b"MTE2" + bytes(6))                       # 10 of a header's 32 bytes
        _assert_closed_soon(s, 8, "a half-sent request header held the connection")
    finally:
        target.close()


def test_idle_connections_are_closed_and_lanes_reconnect():
    target = _engine(data_idle_timeout_s=1.0)
    ini = mte.TransferEngine(host="127.0.0.1", protocol="tcp")
    try:
        dst = np.zeros(N, np.uint8)
        r = target.register(dst)
        src = np.full(N, 7, np.uint8)
        s = ini.register(src)
        ini.write(target.name, s.address, r.address, N)
        assert _tcp(target).counters()["connections"] >= 1
        deadline = time.monotonic() + 10
        while _tcp(target).counters()["connections"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _tcp(target).counters()["connections"] == 0, "idle connections stayed open"
        src[:] = 9
        ini.write(target.name, s.address, r.address, N)          # the lanes reconnect
        assert (dst == 9).all()
    finally:
        ini.close()
        target.close()


CHILD = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import mooncake_te as mte
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    eng = mte.TransferEngine(host="127.0.0.1", protocol="tcp")
    buf = np.zeros(1 << 16, np.uint8)
    r = eng.register(buf)
    print(eng.name, r.address, flush=True)
    sys.stdin.read()
    eng.close()
""")


def test_flood_under_a_1024_descriptor_limit_leaves_transfers_working():
    """The default limits under the default descriptor limit: 1,100 idle connections
    from one address, then a READ from another must still work."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    ini = mte.TransferEngine(host="127.0.0.1", protocol="tcp")
    flood = []
    try:
        name, addr = child.stdout.readline().split()
        port = ini.open_segment(name).descriptor.tcp_data_port
        for _ in range(1100):
            try:
                flood.append(_connect(port, "127.0.0.2"))
            except OSError:
                break
        time.sleep(0.5)
        back = np.zeros(N, np.uint8)
        b = ini.register(back)
        ini.read(name, b.address, int(addr), N, timeout=10)      # must not fail
    finally:
        for f in flood:
            f.close()
        ini.close()
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()

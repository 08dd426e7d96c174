# SPDX-License-Identifier: Apache-2.0
"""The listeners above the core (issue #35 items 4, 5 and the Low items about them): the
vLLM pool's lookup socket and the compat ``RpcInterface`` run on the shared hardened
accept loop (``metadata/listener.py``). Each test here failed before: an accept loop that
died on EMFILE, any uid served, a squattable abstract name, a 2^32 key count trusted, no
read deadline, ``0.0.0.0`` by default, no token, the source address taken from the
message."""
from __future__ import annotations

import json
import os
import pwd
import resource
import socket
import struct
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from servers import ROOT
from mooncake_te.integrations.vllm.pool import lookup as lk
from mooncake_te.integrations.vllm.pool.lookup import (PoolLookup, TierCounts, _LookupServer,
                                                      lookup_address)

KEY = bytes(16)


def _answer(keys, remote):
    return TierCounts((len(keys), 0), ("dram", "ssd"))


def _nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another uid (nobody)")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no 'nobody' user on this machine")


class _Child:
    """A forked child running as uid nobody: ``stdout.readline()``, ``communicate()``
    and ``kill()`` like a Popen (the venv's interpreter is not nobody's to exec)."""

    def __init__(self, pid: int, fd: int):
        self.pid = pid
        self.stdout = os.fdopen(fd, "r")

    def communicate(self, timeout: float = 20.0):
        out = self.stdout.read()
        self.kill()
        return out, ""

    def kill(self) -> None:
        if self.pid:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            self.pid = 0


def _as_nobody(code: str, *args: str) -> _Child:
    """Run ``code`` (plain sockets only) in a forked child as uid nobody; what it prints
    comes back on ``stdout``."""
    uid = _nobody()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: never returns
        try:
            os.close(r)
            os.dup2(w, 1)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            sys.stdout = os.fdopen(1, "w")
            sys.argv = ["-c", *args]
            exec(compile(code, "<nobody>", "exec"), {"__name__": "__main__"})
            sys.stdout.flush()
        except SystemExit:
            sys.stdout.flush()
        except BaseException as e:
            os.write(1, f"error {e!r}\n".encode())
        os._exit(0)
    os.close(w)
    return _Child(pid, r)


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        while True:
            if not s.recv(4096):
                return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


ASK = r"""
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(3)
try:
    s.connect(sys.argv[1])
    s.sendall(struct.pack("<IB", 1, 0) + bytes(16))
    print("answered" if s.recv(64) else "closed")
except socket.timeout:
    print("timeout")
except OSError as e:
    print("refused", e.errno)
"""


@pytest.mark.parametrize("where", ["path", "abstract"])
def test_lookup_socket_answers_no_other_uid(where):
    addr = lookup_address(uuid.uuid4().hex) if where == "path" else \
        f"\0mte-test-lookup-{uuid.uuid4().hex}"
    srv = _LookupServer(addr, _answer)
    try:
        assert PoolLookup(addr).lookup([KEY]) == (1, 0)          # our uid: served
        p = _as_nobody(ASK, addr)
        out, err = p.communicate(timeout=20)
        assert out.split()[:1] in (["closed"], ["refused"]), (out, err)
        if where == "abstract":                 # reachable, and refused by SO_PEERCRED
            assert out.split()[1:] in ([], ["104"], ["32"]), out     # EOF, RST or EPIPE
            assert srv.listener.refused_uid == 1
    finally:
        srv.close()


SQUAT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.bind(sys.argv[1])
except OSError as e:
    print("cannot", e.errno, flush=True)
    sys.exit(0)
s.listen(4)
print("squatting", flush=True)
s.settimeout(4)
got = b""
try:
    c, _ = s.accept()
    c.settimeout(2)
    got = c.recv(64)
except OSError:
    pass
print("got", len(got), flush=True)
"""


def test_lookup_name_cannot_be_squatted_by_another_uid():
    addr = lookup_address(uuid.uuid4().hex)
    p = _as_nobody(SQUAT, addr)
    first = p.stdout.readline().split()
    p.kill()
    p.communicate()
    assert first[:1] == ["cannot"], first        # the name lives in a 0700 directory
    srv = _LookupServer(addr, _answer)           # ...so the worker starts
    try:
        assert PoolLookup(addr).lookup([KEY, KEY]) == (2, 0)
    finally:
        srv.close()


def test_lookup_client_detects_a_squatter_and_sends_it_nothing():
    addr = f"\0mte-test-squat-{uuid.uuid4().hex}"
    p = _as_nobody(SQUAT, addr)
    try:
        assert p.stdout.readline().split() == ["squatting"]
        look = PoolLookup(addr, timeout_s=1.0)
        assert look.lookup([KEY]) == TierCounts.zero()        # a miss, not its answer
        assert look.errors == 1
        out, _ = p.communicate(timeout=20)
    finally:
        p.kill()
    assert out.split() == ["got", "0"], out


def test_stale_socket_file_is_replaced_and_a_live_one_is_not():
    addr = lookup_address(uuid.uuid4().hex)
    srv = _LookupServer(addr, _answer)
    with pytest.raises(OSError, match="already served by pid"):
        _LookupServer(addr, _answer)
    srv.close()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(addr)             # a server that died: its file stays, nobody listens
    dead.listen(1)
    dead.close()
    assert os.path.exists(addr)
    srv2 = _LookupServer(addr, _answer)
    try:
        assert PoolLookup(addr).lookup([KEY]) == (1, 0)
    finally:
        srv2.close()


def test_private_dir_of_another_uid_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "rt"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    monkeypatch.setenv("MC_RUNTIME_DIR", str(d))
    with pytest.raises(PermissionError, match="MC_RUNTIME_DIR"):
        lookup_address("x")
    os.chmod(d, 0o700)
    assert lookup_address("x").startswith(str(d) + "/")


def test_lookup_refuses_a_huge_key_count_without_reading_it(monkeypatch):
    addr = lookup_address(uuid.uuid4().hex)
    srv = _LookupServer(addr, _answer)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(addr)
        s.sendall(struct.pack("<IB", 0xFFFFFFFF, 0) + bytes(64))
        assert _closed_within(s, 2.0)           # refused at once, nothing allocated
        s.close()
        assert srv.refused == 1
        assert PoolLookup(addr).lookup([KEY]) == (1, 0)
        # The client looks up at most MAX_KEYS (a prefix of a longer prompt).
        monkeypatch.setattr(lk, "MAX_KEYS", 4)
        assert PoolLookup(addr).lookup([KEY] * 10) == (4, 0)
    finally:
        srv.close()


def test_lookup_slowloris_is_closed_after_the_frame_deadline(monkeypatch):
    monkeypatch.setattr(lk, "FRAME_TIMEOUT", 0.5, raising=False)
    addr = lookup_address(uuid.uuid4().hex)
    srv = _LookupServer(addr, _answer)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(addr)
        s.sendall(struct.pack("<IB", 100, 0) + bytes(20))      # and then nothing more
        t0 = time.monotonic()
        assert _closed_within(s, 5.0)
        assert time.monotonic() - t0 < 2.0
        s.close()
    finally:
        srv.close()


EMFILE = r"""
import resource, socket, sys, time
from mooncake_te.integrations.vllm.pool.lookup import (PoolLookup, TierCounts,
                                                      _LookupServer, lookup_address)
addr = lookup_address(sys.argv[1])
srv = _LookupServer(addr, lambda keys, remote: TierCounts((len(keys),), ("dram",)))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(__import__("os").listdir("/proc/self/fd")) + 6, hard))
clients = []
try:
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        clients.append(c)
        c.setblocking(False)
        try:
            c.connect(addr)
        except BlockingIOError:
            pass
except OSError as e:
    print("client", e.errno, flush=True)
time.sleep(1.0)                  # the server's accept() meets EMFILE meanwhile
for c in clients:
    c.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
time.sleep(0.5)
for _ in range(10):                  # retried a few times, as in the RPC test
    got = list(PoolLookup(addr, timeout_s=1.0).lookup([bytes(16)] * 3))
    if got == [3]:
        break
    time.sleep(0.25)
print("lookup", got, flush=True)
srv.close()
"""


def test_lookup_server_survives_emfile():
    p = subprocess.run([sys.executable, "-c", EMFILE, uuid.uuid4().hex], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    lines = p.stdout.split("\n")
    assert "client 24" in lines, (p.stdout, p.stderr)        # EMFILE was reached
    assert "lookup [3]" in lines, (p.stdout, p.stderr)


# --- compat RpcInterface (item 5) ---------------------------------------------------------
from mooncake_te.compat import RpcInterface, create_rpc_client       # noqa: E402
from mooncake_te.compat import rpc as crpc                           # noqa: E402


def _rpc_server(**kw):
    got = []
    s = RpcInterface()
    assert s.initialize("127.0.0.1:0", 0, kw.pop("timeout_seconds", 30), 10, **kw)
    s.set_data_receive_callback(lambda d: got.append(d))
    assert s.start_server_async()
    return s, got


def _raw_message(port: int, head: dict, payload: bytes = b"", source: str = "127.0.0.1"):
    raw = json.dumps(head).encode()
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(struct.pack("<Q", len(raw)) + raw + payload)
    return s


def test_rpc_server_binds_loopback_unless_told(monkeypatch):
    s = RpcInterface()
    assert s.initialize(":0")
    try:
        assert s._sock.getsockname()[0] == "127.0.0.1"
    finally:
        s.stop_server()
    # create_rpc_server: Mooncake's port, our loopback default.
    bound = []
    real = RpcInterface.initialize

    def spy(self, listen_address="", *a, **k):
        bound.append(listen_address)
        return real(self, listen_address.rsplit(":", 1)[0] + ":0", *a, **k)
    monkeypatch.setattr(RpcInterface, "initialize", spy)
    srv = crpc.create_rpc_server()
    try:
        assert bound == ["127.0.0.1:8080"]
        assert srv._sock.getsockname()[0] == "127.0.0.1"
    finally:
        srv.stop_server()


def test_rpc_source_is_the_peer_not_what_the_message_claims():
    s, got = _rpc_server()
    try:
        c = _raw_message(s.port, {"kind": "data", "size": 2, "source": "10.9.9.9:1"}, b"hi")
        c.settimeout(5)
        assert c.recv(1) == b"\x00"
        port = c.getsockname()[1]
        c.close()
        assert got[0]["data"] == b"hi"
        assert got[0]["source"] == f"127.0.0.1:{port}"
    finally:
        s.stop_server()


def test_rpc_huge_announced_size_is_refused_before_reading():
    s, got = _rpc_server(max_message_bytes=1 << 20)
    try:
        c = _raw_message(s.port, {"kind": "data", "size": 16 << 30})
        c.settimeout(5)
        assert c.recv(1) == b"\x01"            # refused at once, nothing allocated
        c.close()
        c = _raw_message(s.port, {"kind": "data", "size": (1 << 20) + 1})
        c.settimeout(5)
        assert c.recv(1) == b"\x01"
        c.close()
        assert s.refused == 2 and not got
        assert create_rpc_client().send_data(f"127.0.0.1:{s.port}", b"x" * (1 << 20)) == 0
    finally:
        s.stop_server()


def test_rpc_slowloris_is_cut_off_at_the_deadline():
    s, got = _rpc_server(timeout_seconds=1)
    try:
        c = _raw_message(s.port, {"kind": "data", "size": 1000})
        t0 = time.monotonic()
        for _ in range(30):                    # a byte every 0.2 s: never idle 1 s
            try:
                c.sendall(b"\x00")
            except OSError:
                break
            if _closed_within(c, 0.2):
                break
        assert time.monotonic() - t0 < 3.0
        c.close()
        assert not got
    finally:
        s.stop_server()


def test_rpc_token_refuses_a_peer_without_it():
    s, got = _rpc_server(auth_token="sesame")
    try:
        addr = f"127.0.0.1:{s.port}"
        plain = RpcInterface()
        assert plain.initialize("", auth_token="")
        assert plain.send_data(addr, b"forged") == -1
        wrong = RpcInterface()
        assert wrong.initialize("", auth_token="other")
        assert wrong.send_data(addr, b"forged") == -1
        good = RpcInterface()
        assert good.initialize("", auth_token="sesame")
        assert good.send_data(addr, b"real") == 0
        assert [d["data"] for d in got] == [b"real"]
        assert s.refused == 2
    finally:
        s.stop_server()


def test_rpc_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("MC_AUTH_TOKEN", "sesame")
    s, got = _rpc_server()
    try:
        assert create_rpc_client().send_data(f"127.0.0.1:{s.port}", b"ok") == 0
        monkeypatch.delenv("MC_AUTH_TOKEN")
        assert create_rpc_client().send_data(f"127.0.0.1:{s.port}", b"no") == -1
        assert [d["data"] for d in got] == [b"ok"]
    finally:
        s.stop_server()


def test_rpc_connections_are_bounded():
    s, got = _rpc_server()
    flood = []
    try:
        for _ in range(100):                   # silent connections from one address
            flood.append(socket.create_connection(("127.0.0.1", s.port),
                                                 source_address=("127.0.0.2", 0)))
        deadline = time.monotonic() + 5
        while s.shed < 100 - crpc.MAX_PER_PEER and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.shed >= 100 - crpc.MAX_PER_PEER
        assert create_rpc_client().send_data(f"127.0.0.1:{s.port}", b"ok") == 0
    finally:
        for f in flood:
            f.close()
        s.stop_server()


RPC_EMFILE = r"""
import os, resource, socket, sys, time
from mooncake_te.compat import RpcInterface, create_rpc_client
s = RpcInterface()
assert s.initialize("127.0.0.1:0")
got = []
s.set_data_receive_callback(lambda d: got.append(d["data"]))
assert s.start_server_async()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 6, hard))
clients = []
try:
    while True:
        c = socket.socket()
        clients.append(c)
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", s.port))
        except BlockingIOError:
            pass
except OSError as e:
    print("client", e.errno, flush=True)
time.sleep(1.0)
for c in clients:
    c.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
time.sleep(0.5)
# The backlog's dead connections are served (and shed over the limits) first: a client
# retries for a few seconds, as any would; a dead accept loop never answers.
for _ in range(20):
    rc = create_rpc_client().send_data(f"127.0.0.1:{s.port}", b"after")
    if rc == 0:
        break
    time.sleep(0.25)
print("send", rc, got, flush=True)
s.stop_server()
"""


def test_rpc_server_survives_emfile():
    p = subprocess.run([sys.executable, "-c", RPC_EMFILE], capture_output=True, text=True,
                       timeout=90, env=dict(os.environ, PYTHONPATH=ROOT, MC_AUTH_TOKEN=""))
    lines = p.stdout.split("\n")
    assert "client 24" in lines, (p.stdout, p.stderr)
    assert "send 0 [b'after']" in lines, (p.stdout, p.stderr)

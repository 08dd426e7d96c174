# SPDX-License-Identifier: Apache-2.0
"""Mooncake's own Python transfer-engine scenarios (``mooncake-wheel/tests/
transfer_engine_initiator_test.py`` with ``transfer_engine_target.py`` in
kvcache-ai/Mooncake) on mooncake_te.compat, under every metadata server: etcd, redis, our
HTTP server, and a server that behaves like Mooncake's own HTTP metadata server
(``tests/mooncake_http_server.py``, with its duplicate-``rpc_meta`` rule).

The target is a separate process that imports ``mooncake.engine`` through the opt-in
shim (``mooncake-te compat install --target DIR``, DIR on its PYTHONPATH), as
Mooncake's script is written; the initiator is this process. Both name their segments
``127.0.0.1:<port>`` and register after ``initialize`` (which is what broke against
Mooncake's server before rpc_meta was written once).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from servers import ROOT, EtcdServer, HttpMetadataServer, RedisServer, _Server, _serve, free_port
from mooncake_te.compat import TransferEngine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    # With a metadata server an engine's RPC endpoint is MC_TCP_BIND_ADDRESS, else the
    # first LAN address (as in Mooncake); tests stay on loopback (targets inherit it).
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")

HERE = os.path.dirname(os.path.abspath(__file__))
MOONCAKE_LIKE = os.path.join(os.path.dirname(HERE), "mooncake_http_server.py")
CAPACITY = 64 << 20

TARGET = r"""
import json, sys
from mooncake.engine import TransferEngine      # through the shim
import mooncake
assert mooncake.MOONCAKE_TE_SHIM
name, metadata = sys.argv[1], sys.argv[2]
t = TransferEngine()
rc = t.initialize(name, metadata, "tcp", "")
buf = t.get_first_buffer_address(name) if rc == 0 else 0
if rc == 0 and buf == 0:
    buf = t.allocate_managed_buffer(CAPACITY)
print(json.dumps({"rc": rc, "buf": buf}), flush=True)
sys.stdin.read()            # until the test closes stdin
t.close()
""".replace("CAPACITY", str(CAPACITY))


class MooncakeLikeHttpServer(_Server):
    """``tests/mooncake_http_server.py`` in its own process (Mooncake's rules, no TTL)."""

    name = "mooncake-http"
    label = "HTTP"
    extras = (("requests", "http"),)      # the engines' HTTP client (the server: stdlib)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metadata"

    def command(self):
        return [sys.executable, MOONCAKE_LIKE, str(self.port)]

    def ready(self):
        import urllib.request
        import urllib.error
        try:
            urllib.request.urlopen(f"http://{self.host}:{self.port}/metadata?key=probe",
                                   timeout=1)
        except urllib.error.HTTPError as e:
            return e.code == 404
        except OSError:
            return False
        return True


SERVERS = {"etcd": EtcdServer, "redis": RedisServer, "http": HttpMetadataServer,
           "mooncake-http": MooncakeLikeHttpServer}


@pytest.fixture(params=list(SERVERS))
def server(request):
    yield from _serve(SERVERS[request.param])


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("shim"))
    r = subprocess.run([sys.executable, "-m", "mooncake_te", "compat", "install", "--target", d],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    return d


def _target(name, url, shim_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([shim_dir, ROOT]))
    p = subprocess.Popen([sys.executable, "-c", TARGET, name, url], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    assert line, f"target exited (rc {p.wait()})"
    return p, json.loads(line)


def _stop(p):
    p.stdin.close()
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)
    p.stdout.close()


def test_initiator_scenarios(server, shim_dir):
    """The six scenarios of Mooncake's initiator test, under each metadata server."""
    url = server.url if server.name != "etcd" else f"127.0.0.1:{server.port}"  # bare = etcd
    tname, iname = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    proc, hello = _target(tname, url, shim_dir)
    try:
        assert hello["rc"] == 0 and hello["buf"]
        te = TransferEngine()
        assert te.initialize(iname, url, "tcp", "") == 0
        src = te.get_first_buffer_address(iname) or te.allocate_managed_buffer(CAPACITY)
        assert src
        # Registering after initialize: what failed against Mooncake's server before.
        extra = te.allocate_managed_buffer(300 << 20)      # its own registration
        assert extra, "a second registration after initialize failed"
        dst = te.get_first_buffer_address(tname)
        assert dst == hello["buf"]
        rng = random.Random(7)
        # 1. random write, then read back, several rounds
        for i in range(5):
            n = rng.randrange(1, 1 << 20)
            data = rng.randbytes(n)
            assert te.write_bytes_to_buffer(src, data, n) == 0
            assert te.transfer_sync_write(tname, src, dst, n) == 0
            assert te.write_bytes_to_buffer(src, bytes(n), n) == 0
            assert te.transfer_sync_read(tname, src, dst, n) == 0
            assert te.read_bytes_from_buffer(src, n) == data
        # 2. batch write / read
        size, count = 64 << 10, 8
        blocks = [rng.randbytes(size) for _ in range(count)]
        srcs = [src + j * size for j in range(count)]
        dsts = [dst + j * size for j in range(count)]
        for a, b in zip(srcs, blocks):
            te.write_bytes_to_buffer(a, b, size)
        assert te.batch_transfer_sync_write(tname, srcs, dsts, [size] * count) == 0
        te.write_bytes_to_buffer(src, bytes(size * count), size * count)
        assert te.batch_transfer_sync_read(tname, srcs, dsts, [size] * count) == 0
        assert [te.read_bytes_from_buffer(a, size) for a in srcs] == blocks
        # 3. async batch write / read
        bid = te.batch_transfer_async_write(tname, srcs, dsts, [size] * count)
        assert bid != 0 and te.get_batch_transfer_status([bid]) == 0
        te.write_bytes_to_buffer(src, bytes(size * count), size * count)
        bid = te.batch_transfer_async_read(tname, srcs, dsts, [size] * count)
        assert bid != 0 and te.get_batch_transfer_status([bid]) == 0
        assert [te.read_bytes_from_buffer(a, size) for a in srcs] == blocks
        # 4. submit to an unknown peer returns 0 (Mooncake PR #2433)
        assert te.transfer_submit_write("unreachable_peer:9", 0, 0, 16) == 0
        bid = te.transfer_submit_write(tname, src, dst, 16)
        assert bid != 0
        deadline = time.monotonic() + 30
        while (st := te.transfer_check_status(bid)) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st == 1
        # 5./6. probes
        assert te.send_probe(tname) == 0
        assert te.send_probe("unreachable_peer:9") != 0
        te.close()
    finally:
        _stop(proc)


def test_rpc_meta_written_once(server):
    """rpc_meta is PUT once per engine, not on every publish or lease renewal: count the
    PUTs our store client sends while the engine registers and renews."""
    from mooncake_te.metadata.stores import _leased
    url = server.url if server.name != "etcd" else f"etcd://127.0.0.1:{server.port}"
    name = f"127.0.0.1:{free_port()}"
    seen = []
    te = TransferEngine()
    assert te.initialize(name, url + ("&" if "?" in url else "?") + "ttl=1"
                         if server.name != "mooncake-http" else url, "tcp", "") == 0
    backend = te.get_engine().metadata
    orig = backend._put_leased

    def spy(key, value):
        seen.append(key)
        return orig(key, value)
    backend._put_leased = spy
    try:
        for _ in range(3):
            assert te.allocate_managed_buffer(300 << 20)
        time.sleep(1.2)                 # several renewals (TTL 1 s, renewed every 1/3 s)
        assert not [k for k in seen if _leased.is_rpc_meta(k)], seen
        assert backend.get(f"mooncake/rpc_meta/{name}") is not None
    finally:
        backend._put_leased = orig
        te.close()
    assert backend.get(f"mooncake/rpc_meta/{name}") is None if server.name != "etcd" else True


def test_failed_register_leaves_nothing(tmp_path):
    """A registration whose publish fails is rolled back, and the message says what
    happened (the store is down), not that another engine holds the name."""
    import logging
    srv = MooncakeLikeHttpServer()
    srv.start()
    try:
        te = TransferEngine()
        assert te.initialize(f"127.0.0.1:{free_port()}", srv.url, "tcp", "") == 0
        srv.kill()
        buf = bytearray(1 << 20)
        import ctypes
        addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        records = []
        h = logging.Handler()
        h.emit = records.append
        logging.getLogger("mooncake_te.compat").addHandler(h)
        try:
            rc = te.register_memory(addr, len(buf))
        finally:
            logging.getLogger("mooncake_te.compat").removeHandler(h)
        assert rc < 0
        assert not [r for r in te.get_engine().regions if r.address == addr]
        text = " ".join(r.getMessage() for r in records)
        assert "refused" in text or "connect" in text.lower(), text
        assert "another engine" not in text.lower(), text
        assert te.allocate_managed_buffer(1 << 20) == 0
        assert not te.get_engine().regions
        te.close()
    finally:
        srv.close()


def test_live_name_clash_is_refused_dead_one_replaced():
    """Mooncake's server refuses a second rpc_meta PUT. A second engine under a live
    engine's name fails to initialize with a message naming the live holder; once that
    engine is killed (its rpc_meta left behind), a new engine takes the name over."""
    srv = MooncakeLikeHttpServer()
    srv.start()
    try:
        name = f"127.0.0.1:{free_port()}"
        env = dict(os.environ, PYTHONPATH=ROOT)
        holder = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from mooncake_te.compat import TransferEngine as T; t=T(); "
             f"assert t.initialize({name!r}, {srv.url!r}, 'tcp', '') == 0; "
             "print('up', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert holder.stdout.readline().strip() == "up"
        te = TransferEngine()
        assert te.initialize(name, srv.url, "tcp", "") == -1
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
        holder.stdin.close()
        assert te.initialize(name, srv.url, "tcp", "") == 0
        assert te.allocate_managed_buffer(1 << 20)
        te.close()
    finally:
        srv.close()


def test_get_many_on_every_server(server):
    """The owner index asks for a prompt's blocks at once: one round trip where the store
    can (MGET, etcd transaction, our batch route), key by key on Mooncake's server, which
    has no batch route; the answers are the same."""
    from mooncake_te.metadata import open_backend
    b = open_backend(server.url)
    try:
        keys = [f"many/{i}" for i in range(50)]
        b.put_many({keys[i]: bytes([i]) * (i + 1) for i in range(0, 50, 3)})
        assert b.get_many(keys) == [bytes([i]) * (i + 1) if i % 3 == 0 else None
                                    for i in range(50)]
        assert b.get_many([]) == []
        b.delete_many([keys[0], keys[3], keys[3], keys[1]])     # repeats, missing: fine
        assert b.get_many(keys[:4]) == [None, None, None, None]
        assert b.get(keys[6]) == bytes([6]) * 7
        if server.name == "mooncake-http":
            assert b._batch is False         # fell back once, remembers it
        elif server.name == "http":
            assert b._batch is True
    finally:
        for i in range(0, 50, 3):
            b.delete(keys[i])
        b.close()

# SPDX-License-Identifier: Apache-2.0
"""Mooncake's dummy client on mooncake_te (issue 39): ``setup_dummy`` against a real
client (``python -m mooncake_te.compat.dummy``, what ``mooncake_client`` is through the
shim) in another process, over etcd, redis and our HTTP server on 127.0.0.1.

The scenarios are those of Mooncake's ``test_dummy_client.py`` and
``test_multi_dummy_clients.py`` (written here from what they exercise): byte calls, the
pointer calls through ``alloc_from_mem_pool`` buffers the real client maps, ranged
reads, two dummies of one real client seeing each other's objects, and a full store
reading what a dummy put.
"""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from servers import ROOT
from mooncake_te.compat.store import (INVALID_PARAMS, OBJECT_NOT_FOUND,
                                      MooncakeDistributedStore, ReplicateConfig)

pytestmark = pytest.mark.timeout(180)
MIB = 1 << 20


from store_fixtures import _loopback, index_url  # noqa: F401  (fixtures)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def real_client(index_url, tmp_path_factory):
    """A real client process (64 MiB segment); its ``host:port`` for setup_dummy."""
    port = _port()
    logf = tmp_path_factory.mktemp("real") / "real.log"
    env = dict(os.environ, PYTHONPATH=ROOT, MC_TCP_BIND_ADDRESS="127.0.0.1")
    with open(logf, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "mooncake_te.compat.dummy",
                              "--host=127.0.0.1", f"--port={port}",
                              "--global_segment_size=64MB", f"--metadata_server={index_url}"],
                             env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "serving dummy clients" not in logf.read_text():
            assert p.poll() is None, logf.read_text()
            assert time.monotonic() < deadline, logf.read_text()
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        p.terminate()
        p.wait(timeout=30)


@pytest.fixture
def dummy(real_client):
    s = MooncakeDistributedStore()
    assert s.setup_dummy(256 * MIB, 16 * MIB, real_client) == 0
    yield s
    s.close()


def test_setup_dummy_without_a_real_client_fails():
    s = MooncakeDistributedStore()
    assert s.setup_dummy(64 * MIB, 16 * MIB, f"127.0.0.1:{_port()}") == -1
    assert s.setup_dummy(64 * MIB, 16 * MIB, "no-port") == -1


def test_byte_calls(dummy):
    assert dummy.get_hostname() == ""            # as Mooncake's dummy: no segment
    assert dummy.health_check() == 0
    assert dummy.put("d-a", b"Hello, World!") == 0
    assert dummy.is_exist("d-a") == 1 and dummy.get_size("d-a") == 13
    assert dummy.get("d-a") == b"Hello, World!"
    assert dummy.batch_is_exist(["d-a", "d-missing"]) == [1, 0]
    assert dummy.put_batch(["d-b", "d-c"], [b"bb", b"ccc"]) == 0
    assert dummy.get_batch(["d-b", "d-c"]) == [b"bb", b"ccc"]
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    assert dummy.upsert("d-b", b"BBBB", cfg) == 0
    assert dummy.get("d-b") == b"BBBB"
    assert bytes(dummy.get_buffer("d-b")) == b"BBBB"
    assert dummy.put_parts("d-b", b"no") == 0 and dummy.get("d-b") == b"BBBB"
    assert dummy.upsert_parts("d-b", b"BB", memoryview(b"bb"), config=cfg) == 0
    assert dummy.get("d-b") == b"BBbb"
    big = os.urandom(3 * MIB + 7)
    assert dummy.put("d-big", big) == 0 and dummy.get("d-big") == big
    assert dummy.get_replica_desc("d-big")[0].is_memory_replica()
    for k in ("d-a", "d-b", "d-c", "d-big"):
        assert dummy.remove(k) == 0
    assert dummy.get("d-a") == b"" and dummy.get_size("d-a") == OBJECT_NOT_FOUND


def test_pointer_calls_use_shared_memory(dummy):
    data = [b"one " * 500, b"two " * 900, b"three " * 300]
    keys = [f"d-p{i}" for i in range(3)]
    spacing = MIB
    ptr = dummy.alloc_from_mem_pool(3 * spacing)
    assert ptr
    assert dummy.register_buffer(ptr, 3 * spacing) == 0
    try:
        for i, d in enumerate(data):
            ctypes.memmove(ptr + i * spacing, d, len(d))
        ptrs = [ptr + i * spacing for i in range(3)]
        assert dummy.batch_put_from(keys, ptrs, [len(d) for d in data]) == [0, 0, 0]
        assert dummy.get_batch(keys) == data
        ctypes.memset(ptr, 0, 3 * spacing)
        assert dummy.batch_get_into(keys, ptrs, [spacing] * 3) == [len(d) for d in data]
        for i, d in enumerate(data):
            assert ctypes.string_at(ptrs[i], len(d)) == d
        ctypes.memset(ptr, ord("_"), 64)
        res = dummy.get_into_ranges([ptr], [[keys[0], keys[1]]], [[[0, 20], [8]]],
                                    [[[2, 30], [10]]], [[[4, 3], [6]]])
        assert res == [[[4, 3], [6]]]
        assert ctypes.string_at(ptr, 4) == data[0][2:6]
        assert ctypes.string_at(ptr + 8, 6) == data[1][10:16]
        assert ctypes.string_at(ptr + 20, 3) == data[0][30:33]
        # past the registered buffer: refused, nothing of the real client's is touched
        assert dummy.get_into(keys[1], ptr + 3 * spacing - 4, 1000) < 0
        assert dummy.put_from("d-p-out", ptr + 3 * spacing + 4096, 16) != 0
    finally:
        assert dummy.unregister_buffer(ptr) == 0
    # unregistered: the pointer calls are refused
    assert dummy.get_into(keys[0], ptr, spacing) < 0
    for k in keys:
        assert dummy.remove(k) == 0


def test_session_and_metadata_calls_through_a_dummy(dummy):
    from mooncake_te.compat.store import TaskStatus
    """The session calls and ``put_from_with_metadata`` run in the real client, on the
    dummy's shared buffer (both pointers of ``put_from_with_metadata`` translated);
    ``get_offload_rpc_read_count`` is a dummy's own 0, as Mooncake's."""
    ptr = dummy.alloc_from_mem_pool(8192)
    assert ptr and dummy.register_buffer(ptr, 8192) == 0
    try:
        ctypes.memmove(ptr, b"meta" + b"D" * 100, 104)
        assert dummy.put_from_with_metadata("d-wm", ptr + 4, ptr, 100, 4) == 0
        assert dummy.get("d-wm") == b"meta" + b"D" * 100
        assert dummy.put_from_with_metadata("d-wm2", ptr + 8192 - 10, ptr, 100, 4) == -600
        assert dummy.batch_put_session_start(["d-s"], [200]) == [0]
        assert dummy.batch_put_from_multi_buffer_ranges(["d-s"], [[ptr, ptr + 4]],
                                                        [[4, 100]], [[100, 0]]) == [104]
        assert dummy.batch_put_session_end(["d-s"]) == [0]
        assert dummy.get("d-s") == b"D" * 100 + b"meta" + bytes(96)
        assert dummy.batch_get_session_start(["d-s"]) == [0]
        assert dummy.batch_get_into_multi_buffer_ranges(["d-s"], [[ptr + 4096]], [[8]],
                                                        [[98]]) == [8]
        assert ctypes.string_at(ptr + 4096, 8) == b"DDmetaxx".replace(b"xx", bytes(2))
        assert dummy.batch_get_session_end(["d-s"]) == 0
        assert dummy.get_offload_rpc_read_count() == 0
        assert dummy._real_segment                          # the real client's store
        tid, rc = dummy.create_copy_task("d-s", [dummy._real_segment])
        assert rc == 0 and isinstance(tid, tuple) and len(tid) == 2
        resp, rc = dummy.query_task(tid)
        assert rc == 0 and resp.status is TaskStatus.SUCCESS and resp.id == tid
        assert dummy.create_copy_task("d-s", ["nowhere:1"]) == ((0, 0), -600)
        assert dummy.query_task((1, 2)) == (None, -1400)
        assert dummy.batch_get_session_end(["d-s"]) == 0
    finally:
        assert dummy.unregister_buffer(ptr) == 0
    for k in ("d-wm", "d-s"):
        assert dummy.remove(k) == 0


def test_host_mem_allocator_buffers(dummy):
    """``MooncakeHostMemAllocator``: the process's shared buffers, which a dummy
    registers whole and uses in place; ``free`` refuses a registered or unknown one."""
    from mooncake_te.compat.store import MooncakeHostMemAllocator
    alloc = MooncakeHostMemAllocator()
    ptr = alloc.alloc(4096)
    assert ptr
    ctypes.memmove(ptr, b"host-mem", 8)
    assert dummy.register_buffer(ptr, 4096) == 0
    assert dummy.put_from("d-host", ptr, 8) == 0 and dummy.get("d-host") == b"host-mem"
    assert dummy.get_into("d-host", ptr + 100, 8) == 8
    assert ctypes.string_at(ptr + 100, 8) == b"host-mem"
    assert alloc.free(ptr) == -1                            # still registered
    assert dummy.unregister_buffer(ptr) == 0
    assert alloc.free(ptr) == 0 and alloc.free(ptr) == -1
    with pytest.raises(RuntimeError):
        alloc.alloc(0)
    assert dummy.remove("d-host") == 0
    dummy.close()
    assert dummy.health_check() == 1                        # closed (Mooncake's code)


def test_only_whole_pool_buffers_register(dummy):
    local = ctypes.create_string_buffer(4096)
    assert dummy.register_buffer(ctypes.addressof(local), 4096) == INVALID_PARAMS
    ptr = dummy.alloc_from_mem_pool(8192)
    assert dummy.register_buffer(ptr, 4096) == INVALID_PARAMS          # not its size
    assert dummy.register_buffer(ptr + 4096, 4096) == INVALID_PARAMS   # not its start
    assert dummy.unregister_buffer(ptr) == INVALID_PARAMS              # not registered
    assert dummy.alloc_from_mem_pool(0) == 0


def test_two_dummies_and_a_full_store_share_objects(real_client, index_url):
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert a.setup_dummy(64 * MIB, 0, real_client) == 0
    assert b.setup_dummy(64 * MIB, 0, real_client) == 0
    full = MooncakeDistributedStore()
    assert full.setup("127.0.0.1", index_url, 16 * MIB, 16 * MIB, "tcp", "",
                      "127.0.0.1:50051") == 0
    try:
        assert a.put("d-shared", b"from a") == 0
        assert b.is_exist("d-shared") == 1 and b.get("d-shared") == b"from a"
        assert full.get("d-shared") == b"from a"          # through the index
        assert full.put("d-from-full", b"from full") == 0
        assert a.get("d-from-full") == b"from full"
        assert b.remove("d-shared") == 0
        assert a.is_exist("d-shared") == 0
        assert full.remove("d-from-full") == 0
    finally:
        a.close()
        b.close()
        full.close()
    assert a.get("d-shared") == b""                      # closed: a failure, no raise


def test_mooncake_client_entry_point_through_the_shim(index_url, tmp_path):
    """``python -m mooncake.cli_client`` (Mooncake's ``mooncake_client``) from the
    opt-in shim serves dummy clients."""
    site = str(tmp_path / "site")
    r = subprocess.run([sys.executable, "-m", "mooncake_te", "compat", "install", "--target",
                        site], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert r.returncode == 0, r.stderr
    port = _port()
    logf = tmp_path / "client.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, ROOT]),
               MC_TCP_BIND_ADDRESS="127.0.0.1")
    with open(logf, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "mooncake.cli_client", f"--port={port}",
                              "--global_segment_size=32MB", f"--metadata_server={index_url}",
                              "--threads=4"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "serving dummy clients" not in logf.read_text():
            assert p.poll() is None, logf.read_text()
            assert time.monotonic() < deadline, logf.read_text()
            time.sleep(0.1)
        assert f"127.0.0.1:{port}" in logf.read_text()      # loopback by default
        d = MooncakeDistributedStore()
        assert d.setup_dummy(0, 0, f"127.0.0.1:{port}") == 0
        try:
            assert d.put("d-cli", b"via cli_client") == 0
            assert d.get("d-cli") == b"via cli_client"
            assert d.remove("d-cli") == 0
        finally:
            d.close()
    finally:
        p.terminate()
        assert p.wait(timeout=30) == 0                       # SIGTERM: a clean exit


def test_tensor_objects_staged_in_the_dummys_local_buffer(real_client):
    """The tensor puts of a dummy client (here without torch: the objects as arrays)
    stage each object in the dummy's shared local buffer and have the real client store
    it from there, as Mooncake's dummy does: a 16 MiB tensor object goes through a real
    client whose own local buffer (16 MB, mooncake_client's default) refuses it as a
    put; objects go together while they fit; one larger than the dummy's local buffer
    is -200 and nothing is stored; upsert replaces."""
    s = MooncakeDistributedStore()
    assert s.setup_dummy(64 * MIB, 20 * MIB, real_client) == 0
    try:
        big = np.full(16 * MIB + 304, 0xA7, np.uint8)
        assert s.put("dz-put", big.tobytes()) == INVALID_PARAMS   # the real client's bound
        small = np.arange(1000, dtype=np.uint32).view(np.uint8)
        huge = np.zeros(21 * MIB, np.uint8)
        assert s._put_objects(["dz-big", "dz-small", "dz-huge"], [big, small, huge], None,
                              False) == [0, 0, -200]
        assert s.get("dz-big") == big.tobytes() and s.get("dz-small") == small.tobytes()
        assert s.is_exist("dz-huge") == 0
        assert s._put_objects(["dz-small"], [big[:10]], None, True) == [0]
        assert s.get("dz-small") == big[:10].tobytes()
        assert s.batch_remove(["dz-big", "dz-small"]) == [0, 0]
    finally:
        s.close()

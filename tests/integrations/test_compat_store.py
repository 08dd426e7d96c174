# SPDX-License-Identifier: Apache-2.0
"""``mooncake_te.compat.store.MooncakeDistributedStore`` (``mooncake.store`` through the
opt-in) with the semantics Mooncake Store documents
(``docs/source/api-reference/python/mooncake-store.md`` in kvcache-ai/Mooncake), over the
KV pool, with a real redis holding the object index, and a second process holding
objects this one reads one-sided from its DRAM tier.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from servers import ROOT, redis_server, http_metadata_server  # noqa: F401
from mooncake_te.compat import TransferEngine
from mooncake_te.compat.store import (INVALID_PARAMS, NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND,
                                      MooncakeDistributedStore, ReplicateConfig)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    # With a metadata server an engine's RPC endpoint is MC_TCP_BIND_ADDRESS, else the
    # first LAN address (as in Mooncake); tests stay on loopback (targets inherit it).
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
MIB = 1 << 20


def _store(url, **kw):
    s = MooncakeDistributedStore()
    cfg = dict(local_hostname="127.0.0.1", metadata_server=url, global_segment_size=8 * MIB,
               local_buffer_size=MIB, protocol="tcp", master_server_address="127.0.0.1:50051",
               max_object_size=256 << 10)
    cfg.update(kw)
    assert s.setup(cfg) == 0
    return s


def _buf(n, fill=None):
    a = np.zeros(n, np.uint8) if fill is None else np.frombuffer(fill, np.uint8).copy()
    return a, a.ctypes.data


def test_everyday_api(redis_server):
    s = _store(redis_server.url, local_buffer_size=16 * MIB)
    try:
        assert s.put("a", b"hello") == 0
        assert s.get("a") == b"hello"
        assert s.put("a", b"other") == 0            # exists: left as it is, 0
        assert s.get("a") == b"hello"
        assert s.get("missing") == b""
        assert s.is_exist("a") == 1 and s.is_exist("missing") == 0
        assert s.get_size("a") == 5 and s.get_size("missing") == OBJECT_NOT_FOUND
        assert s.put_batch(["b", "c"], [b"bb", b"ccc"]) == 0
        assert s.get_batch(["b", "c", "zz"]) == [b"bb", b"ccc", b""]
        assert s.batch_is_exist(["a", "b", "zz"]) == [1, 1, 0]
        assert s.remove("b") == 0 and s.is_exist("b") == 0
        assert s.remove("b") == OBJECT_NOT_FOUND
        assert s.batch_remove(["c", "nope"]) == [0, OBJECT_NOT_FOUND]
        assert s.put("huge", b"x" * (9 * MIB)) == NO_AVAILABLE_HANDLE   # > the segment
        assert s.put("empty", b"") == INVALID_PARAMS
        assert s.remove_all(force=True) == 1        # "a"
        assert s.is_exist("a") == 0
        assert s.get_hostname().startswith("127.0.0.1:")
    finally:
        assert s.close() == 0
    assert s.put("a", b"x") != 0                    # closed: an error code, no exception


def test_zero_copy_and_multi_buffers(redis_server):
    s = _store(redis_server.url)
    try:
        rng = np.random.default_rng(3)
        src = rng.integers(0, 256, 6 * 4096, dtype=np.uint8)
        dst = np.zeros_like(src)
        assert s.register_buffer(src.ctypes.data, src.nbytes) == 0
        assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        # put_from / get_into
        assert s.put_from("one", src.ctypes.data, 4096) == 0
        assert s.get_into("one", dst.ctypes.data, 4096) == 4096
        assert (dst[:4096] == src[:4096]).all()
        assert s.get_into("one", dst.ctypes.data, 100) == INVALID_PARAMS   # too small
        assert s.get_into("none", dst.ctypes.data, 4096) == OBJECT_NOT_FOUND
        # vLLM's layout: object i = pieces at several addresses (one per layer)
        keys = ["k0", "k1"]
        ptrs = [[src.ctypes.data + 0, src.ctypes.data + 8192],
                [src.ctypes.data + 4096, src.ctypes.data + 12288]]
        sizes = [[4096, 4096], [4096, 8192]]
        cfg = ReplicateConfig()
        cfg.preferred_segment = s.get_hostname()
        cfg.group_ids = ["g0", "g1"]
        assert s.batch_put_from_multi_buffers(keys, ptrs, sizes, cfg) == [0, 0]
        assert s.batch_is_exist(keys) == [1, 1]
        dst[:] = 0
        out = [[dst.ctypes.data + 16384, dst.ctypes.data], [dst.ctypes.data + 4096,
                                                            dst.ctypes.data + 8192]]
        assert s.batch_get_into_multi_buffers(keys, out, sizes) == [8192, 12288]
        assert (dst[16384:20480] == src[0:4096]).all() and (dst[0:4096] == src[8192:12288]).all()
        assert (dst[4096:8192] == src[4096:8192]).all()
        assert (dst[8192:16384] == src[12288:20480]).all()
        assert s.batch_get_into_multi_buffers(["k0", "nope"], [[dst.ctypes.data]] * 2,
                                              [[8192]] * 2) == [8192, OBJECT_NOT_FOUND]
        descs = s.batch_get_replica_desc(keys + ["nope"])
        assert descs["nope"] == []
        d = descs["k0"][0]
        assert d.is_memory_replica() and not d.is_disk_replica() and not d.is_local_disk_replica()
        assert d.get_memory_descriptor().buffer_descriptor.segment_name == s.get_hostname()
        assert s.unregister_buffer(src.ctypes.data) == 0
        assert s.unregister_buffer(src.ctypes.data) != 0
    finally:
        s.close()


def test_raw_pointers_are_checked_never_crash(redis_server):
    """NULL, negative sizes, sizes past the buffer and unregistered ranges are return
    codes (-600), never a segfault or a write past the buffer (issue 35). Run in a child:
    before the checks, these calls killed the process."""
    code = r"""
import ctypes, json, sys
import numpy as np
from mooncake_te.compat.store import MooncakeDistributedStore, INVALID_PARAMS
s = MooncakeDistributedStore()
assert s.setup(dict(local_hostname="127.0.0.1", metadata_server=sys.argv[1],
                    global_segment_size=8 << 20, max_object_size=64 << 10)) == 0
out = {}
mem = np.zeros(3 * 4096, np.uint8)           # [guard | buffer | guard]
buf = mem.ctypes.data + 4096
mem[4096:8192] = 7
out["reg_null"] = s.register_buffer(0, 4096)
out["reg_negative"] = s.register_buffer(buf, -1)
out["reg_zero"] = s.register_buffer(buf, 0)
out["reg_unmapped"] = s.register_buffer(0x1000, 1 << 20)
out["reg_str"] = s.register_buffer("0x1000", 4096)
out["reg_ok"] = s.register_buffer(buf, 4096)
out["put_null"] = s.put_from("k", 0, 4096)
out["put_negative"] = s.put_from("k", buf, -4096)
out["put_past_end"] = s.put_from("k", buf, 8192)
out["put_unregistered"] = s.put_from("k", mem.ctypes.data, 4096)
out["put_ok"] = s.put_from("k", buf, 2048)
out["put_multi"] = s.batch_put_from_multi_buffers(
    ["m1", "m2"], [[buf, 0], [buf]], [[1024, 1024], [1024]])
big = np.full(8192, 9, np.uint8)
assert s.put("big", big.tobytes()) == 0
out["get_null"] = s.get_into("k", 0, 4096)
out["get_negative"] = s.get_into("k", buf, -1)
out["get_past_end"] = s.get_into("big", buf, 8192)
out["get_ok"] = s.get_into("k", buf, 4096)
out["get_multi"] = s.batch_get_into_multi_buffers(
    ["k", "big"], [[buf], [buf, buf + 4096]], [[4096], [4096, 4096]])
out["guards"] = bool((mem[:4096] == 0).all() and (mem[8192:] == 0).all())
out["unreg"] = s.unregister_buffer(buf)
out["get_after_unregister"] = s.get_into("k", buf, 4096)
s.close()
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code, redis_server.url], capture_output=True,
                       text=True, timeout=90, env=dict(os.environ, PYTHONPATH=ROOT,
                                                       MC_TCP_BIND_ADDRESS="127.0.0.1"))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    bad = INVALID_PARAMS
    assert {k: v for k, v in out.items() if k.startswith("reg_")} == dict(
        reg_null=bad, reg_negative=bad, reg_zero=bad, reg_unmapped=bad, reg_str=bad,
        reg_ok=0)
    assert (out["put_null"], out["put_negative"], out["put_past_end"],
            out["put_unregistered"], out["put_ok"]) == (bad, bad, bad, bad, 0)
    assert out["put_multi"] == [bad, 0]            # one bad piece fails its key only
    assert (out["get_null"], out["get_negative"], out["get_past_end"]) == (bad, bad, bad)
    assert out["get_ok"] == 2048
    assert out["get_multi"] == [2048, bad]         # buf + 4096 is past the buffer
    assert out["guards"] is True
    assert out["unreg"] == 0 and out["get_after_unregister"] == bad


def test_ssd_tier_replica_is_local_disk(redis_server, tmp_path):
    # A DRAM share of 4 slots: the fifth object pushes the oldest to the SSD tier.
    s = _store(redis_server.url, global_segment_size=4 * ((64 << 10) + 4096),
               max_object_size=64 << 10, enable_ssd_offload=True,
               ssd_offload_path=str(tmp_path), ssd_offload_size=4 * MIB)
    try:
        blobs = {f"o{i}": os.urandom(60 << 10) for i in range(6)}
        for k, v in blobs.items():
            assert s.put(k, v) == 0
        descs = s.batch_get_replica_desc(list(blobs))
        kinds = {k: ("mem" if d[0].is_memory_replica() else "disk")
                 for k, d in descs.items()}
        assert kinds["o0"] == "disk" and kinds["o5"] == "mem", kinds
        assert descs["o0"][0].is_local_disk_replica()
        disk = descs["o0"][0].get_disk_descriptor()
        assert disk.object_size == 60 << 10 and os.path.isfile(disk.file_path)
        assert disk.file_path.startswith(str(tmp_path))
        for k, v in blobs.items():                  # every object reads back, both tiers
            assert s.get(k) == v
    finally:
        s.close()


def test_engine_shared_through_get_engine_ptr(redis_server):
    te = TransferEngine()
    assert te.initialize("127.0.0.1:%d" % _port(), redis_server.url, "tcp", "") == 0
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", redis_server.url, 4 * MIB, MIB, "tcp", "", "x:1",
                   te.get_engine_ptr()) == 0
    try:
        assert s.get_hostname() == te.get_engine().name
        assert s.put("shared", b"1") == 0 and s.get("shared") == b"1"
    finally:
        s.close()
        te.close()
    bad = MooncakeDistributedStore()
    assert bad.setup("127.0.0.1", redis_server.url, 4 * MIB, MIB, "tcp", "", "x:1", 12345) == -1


def _port():
    from servers import free_port
    return free_port()


HOLDER = r"""
import json, sys
from mooncake.store import MooncakeDistributedStore      # through the shim
s = MooncakeDistributedStore()
assert s.setup(json.loads(sys.argv[1])) == 0
objs = json.loads(sys.argv[2])
for k, v in objs.items():
    assert s.put(k, bytes.fromhex(v)) == 0
print(json.dumps({"name": s.get_hostname()}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "exists":
        print(json.dumps(s.batch_is_exist(cmd["keys"])), flush=True)
s.close()
"""


@pytest.mark.parametrize("which", ["redis", "http"])
def test_objects_shared_between_processes(which, redis_server, http_metadata_server, tmp_path,
                                         monkeypatch):
    """Process B puts; this process finds (is_exist, get_size, replica desc naming B's
    segment) and reads the objects one-sided from B's DRAM tier; removing one here
    removes B's copy too. Neither has a token: objects are shared as Mooncake Store
    shares them, unauthenticated (docs/compat.md)."""
    monkeypatch.delenv("MC_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("MC_KVCACHE_SHARE_WITHOUT_TOKEN", raising=False)
    url = redis_server.url if which == "redis" else http_metadata_server.url
    shim = str(tmp_path / "shim")
    r = subprocess.run([sys.executable, "-m", "mooncake_te", "compat", "install", "--target",
                        shim], capture_output=True, text=True, env=dict(os.environ,
                                                                        PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    objs = {f"obj{i}": os.urandom(1000 + i * 5000) for i in range(5)}
    cfg = dict(local_hostname="127.0.0.1", metadata_server=url,
               global_segment_size=8 * MIB, max_object_size=64 << 10)
    b = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(cfg),
                          json.dumps({k: v.hex() for k, v in objs.items()})],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([shim, ROOT])))
    try:
        b_name = json.loads(b.stdout.readline())["name"]
        a = _store(url, max_object_size=64 << 10)
        try:
            keys = list(objs)
            assert a.batch_is_exist(keys + ["nope"]) == [1] * 5 + [0]
            assert a.get_size("obj3") == len(objs["obj3"])
            d = a.batch_get_replica_desc(["obj1"])["obj1"][0]
            assert d.is_memory_replica()
            assert d.get_memory_descriptor().buffer_descriptor.segment_name == b_name
            dst = np.zeros(64 << 10, np.uint8)
            assert a.register_buffer(dst.ctypes.data, dst.nbytes) == 0
            for k, v in objs.items():
                assert a.get_into(k, dst.ctypes.data, dst.nbytes) == len(v)
                assert dst[:len(v)].tobytes() == v
            assert a.remove("obj0") == 0
            b.stdin.write(json.dumps({"op": "exists", "keys": ["obj0"]}) + "\n")
            b.stdin.flush()
            # A cluster-wide remove, as Mooncake's master does: B's copy is gone too.
            assert json.loads(b.stdout.readline()) == [0]
            assert a.is_exist("obj0") == 0
        finally:
            a.close()
    finally:
        b.stdin.close()
        b.wait(20)
        b.stdout.close()

# SPDX-License-Identifier: Apache-2.0
"""The rest of Mooncake Store's Python API on our store (issue 39, items 2 and 3 of the
issue): the enums and ``ReplicateConfig`` fields, ``put_parts`` and the zero-copy
``get_buffer``/``batch_get_buffer`` that LMCache's ``MooncakestoreConnector`` uses with
``save_chunk_meta`` on, ``upsert``, ``remove_by_regex`` and ``health_check`` across
stores, the keyword names Mooncake's callers pass, ``get_hostname``'s port range, and
``setup_dummy``'s refusal; under etcd, redis and our HTTP metadata server."""
from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mooncake_te.compat.store import (PORT_RANGE, BufferHandle, MooncakeDistributedStore,
                                      ObjectDataType, ReplicaStatus, ReplicateConfig,
                                      SoftPinAction)

pytestmark = pytest.mark.timeout(180)
MIB = 1 << 20


from servers import free_port
from store_fixtures import _loopback, index_url  # noqa: F401  (fixtures)


def _store(url, tenant, segment=32 * MIB):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", url, segment, 32 * MIB, "tcp", "", "127.0.0.1:50051",
                   tenant_id=tenant) == 0
    return s


def test_types_and_config_fields():
    cfg = ReplicateConfig()
    assert cfg.soft_pin_action == SoftPinAction.PRESERVE and cfg.soft_pin_ttl_ms is None
    cfg.soft_pin_action, cfg.soft_pin_ttl_ms = SoftPinAction.ENABLE, 5000
    assert ReplicaStatus.COMPLETE.name == "COMPLETE"
    assert ObjectDataType.KVCACHE != ObjectDataType.TENSOR
    # Mooncake's values (mooncake-store/include/types.h, replica.h), so code that stores
    # them as ints or compares with Mooncake's meaning gets the same answer.
    assert [(m.name, int(m)) for m in SoftPinAction] == [("PRESERVE", 0), ("ENABLE", 1),
                                                         ("DISABLE", 2)]
    assert [m.name for m in ObjectDataType] == [
        "UNKNOWN", "KVCACHE", "TENSOR", "WEIGHT", "SAMPLE", "ACTIVATION", "GRADIENT",
        "OPTIMIZER_STATE", "METADATA", "GENERAL"]
    assert [int(m) for m in ObjectDataType] == list(range(10))
    assert [(m.name, int(m)) for m in ReplicaStatus][3] == ("COMPLETE", 3)
    from mooncake_te.compat import store as store_mod
    assert store_mod.KVCACHE is ObjectDataType.KVCACHE and store_mod.COMPLETE == 3
    cfg.soft_pin_ttl_ms = None
    assert cfg.soft_pin_ttl_ms is None
    for bad in (-1, 1 << 64, 1.5):
        with pytest.raises(TypeError):
            cfg.soft_pin_ttl_ms = bad
    assert cfg.data_type == ObjectDataType.UNKNOWN
    cfg.group_ids = None
    assert "group_ids=0" in repr(cfg)


def test_unclosed_store_does_not_keep_the_process_alive(index_url):
    """A store never closed (Mooncake's own tests leave theirs open) is closed at exit:
    its finalizer, run while the interpreter exits, waited forever on a thread that
    could not start (the process hung after its last line)."""
    code = ("from mooncake_te.compat.store import MooncakeDistributedStore as S\n"
            "a, b = S(), S()\n"
            f"assert a.setup('127.0.0.1', 'P2PHANDSHAKE', 16 << 20, 4 << 20, 'tcp', '', "
            f"'127.0.0.1:50051') == 0\n"
            f"assert b.setup('127.0.0.1', {index_url!r}, 16 << 20, 4 << 20, 'tcp', '', "
            f"'127.0.0.1:50051', tenant_id='exit') == 0\n"
            "assert b.put('k', b'v') == 0\n"
            "print('done', flush=True)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-3000:]
    assert time.monotonic() - t0 < 30


# LMCache 0.5.6's chunk metadata ahead of the KV bytes (save_chunk_meta): a fixed header
# (shape, dtype, format, length) packed by the connector; its exact fields do not matter to
# the store, which sees two parts concatenated.
_META = struct.Struct("<4iii")


def test_lmcache_mooncakestore_connector_sequence(index_url):
    """What LMCache's connector calls, in its order: exists check, ``put_parts(key,
    meta, kv, config=)`` per chunk, ``batch_is_exist``, ``batch_get_buffer`` and
    parsing the meta back out of the buffer, ``remove``; a second store (another
    LMCache instance) reads the same chunks."""
    tenant = "lm-" + os.urandom(4).hex()
    a = _store(index_url, tenant)
    b = _store(index_url, tenant)
    try:
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        cfg.preferred_segment = a.get_hostname()
        rng = np.random.default_rng(1)
        chunks = {f"lmcache@model@{i:04x}": rng.standard_normal((2, 4, 256, 64)).astype(
            np.float16) for i in range(6)}
        keys = list(chunks)
        assert a.batch_is_exist(keys) == [0] * 6
        for k, kv in chunks.items():
            meta = _META.pack(*kv.shape, 1, kv.nbytes)
            assert a.put_parts(k, meta, memoryview(kv).cast("B"), config=cfg) == 0
        for store in (a, b):
            assert store.batch_is_exist(keys + ["lmcache@model@none"]) == [1] * 6 + [0]
            bufs = store.batch_get_buffer(keys + ["lmcache@model@none"])
            assert bufs[-1] is None
            for k, buf in zip(keys, bufs):
                assert isinstance(buf, BufferHandle)
                assert buf.size() == _META.size + chunks[k].nbytes
                mv = memoryview(buf)                       # zero-copy view
                *shape, fmt, n = _META.unpack(mv[:_META.size])
                kv = np.frombuffer(mv, np.float16, offset=_META.size).reshape(shape)
                assert n == chunks[k].nbytes and (kv == chunks[k]).all()
                # ptr()/size() describe the same bytes (what a C++ consumer reads)
                raw = (ctypes.c_uint8 * buf.size()).from_address(buf.ptr())
                assert bytes(raw[:_META.size]) == bytes(mv[:_META.size])
        assert b.get_buffer(keys[0]).size() == _META.size + chunks[keys[0]].nbytes
        assert a.remove(keys[0]) == 0 and b.get_buffer(keys[0]) is None
    finally:
        a.close()
        b.close()


def test_upsert_parts_replaces_the_object(index_url):
    """``upsert_parts``: the parts concatenated, replacing what ``put_parts`` (which
    keeps an existing object) stored, at another size too; another store reads it."""
    tenant = "parts-" + os.urandom(4).hex()
    a = _store(index_url, tenant)
    b = _store(index_url, tenant)
    try:
        assert a.upsert_parts("p", b"Hello, ", b"World") == 0           # a new key
        assert b.get("p") == b"Hello, World"
        assert a.put_parts("p", b"kept? ", b"no") == 0
        assert b.get("p") == b"Hello, World"
        assert a.upsert_parts("p", b"x" * 70000, memoryview(b"yz"), config=ReplicateConfig()) == 0
        assert b.get("p") == b"x" * 70000 + b"yz"
    finally:
        a.close()
        b.close()


def test_upsert_regex_health_and_keywords(index_url):
    tenant = "api-" + os.urandom(4).hex()
    a = _store(index_url, tenant)
    b = _store(index_url, tenant)
    try:
        assert a.health_check() == 0
        assert a.put("k", b"old") == 0 and a.put("k", b"ignored") == 0
        assert b.get("k") == b"old"
        assert b.upsert("k", b"new, longer value") == 0        # replaces a's copy too
        assert a.get("k") == b"new, longer value" and b.get("k") == b"new, longer value"
        src = np.frombuffer(b"from a buffer", np.uint8).copy()
        assert a.register_buffer(src.ctypes.data, src.nbytes) == 0
        assert a.upsert_from("k", src.ctypes.data, src.nbytes) == 0
        assert b.get("k") == b"from a buffer"
        assert a.batch_upsert_from(["k"], [src.ctypes.data], [4]) == [0]
        assert b.get("k") == b"from"
        for i in range(3):
            assert a.put(f"layer/{i}", b"a%d" % i) == 0
            assert b.put(f"layer/{i}x", b"b%d" % i) == 0
        assert a.put("other", b"o") == 0
        assert b.remove_by_regex(r"^layer/") == 6              # both stores' objects
        assert a.batch_is_exist(["layer/0", "layer/1x", "other"]) == [0, 0, 1]
        assert a.remove_by_regex("([") < 0                      # not a regex
        # Mooncake's keyword for the same-node preference
        dst = np.zeros(16, np.uint8)
        assert a.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        assert a.batch_get_into_multi_buffers(["other"], [[dst.ctypes.data]], [[16]],
                                              prefer_alloc_in_same_node=True) == [1]
        host, port = a.get_hostname().rsplit(":", 1)
        assert host == "127.0.0.1" and PORT_RANGE[0] <= int(port) <= PORT_RANGE[1]
        b.close()
        assert a.health_check() == 0                # b left the directory: none to miss
    finally:
        a.close()
        b.close()
    d = MooncakeDistributedStore()
    # no real client there (a free port, not Mooncake's default 50052: another test run
    # on this host may have one listening on that)
    assert d.setup_dummy(64 * MIB, 16 * MIB, f"127.0.0.1:{free_port()}") != 0


def test_shim_submodules(tmp_path, monkeypatch):
    """``mooncake.mooncake_config`` through the opt-in shim reads Mooncake's JSON config;
    ``mooncake.allocator`` refuses with the reason."""
    import json
    import subprocess
    import sys
    from servers import ROOT
    shim = str(tmp_path / "shim")
    r = subprocess.run([sys.executable, "-m", "mooncake_te", "compat", "install", "--target",
                        shim], capture_output=True, text=True, env=dict(os.environ,
                                                                        PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server":
                               "P2PHANDSHAKE", "master_server_address": "127.0.0.1:50051",
                               "global_segment_size": "64MB", "local_buffer_size": 0,
                               "protocol": "tcp", "device_name": ""}))
    code = r"""
import os
from mooncake.mooncake_config import MooncakeConfig
from mooncake.store import MooncakeDistributedStore, ReplicaStatus, SoftPinAction, ObjectDataType
c = MooncakeConfig.load_from_env()
assert c.global_segment_size == 64 << 20 and c.local_buffer_size == 0
s = MooncakeDistributedStore()
assert s.setup(c.local_hostname, c.metadata_server, c.global_segment_size,
               c.local_buffer_size, c.protocol, c.device_name,
               c.master_server_address) == 0
assert s.put("k", b"v") != 0              # local_buffer_size 0, as in Mooncake
s.close()
try:
    import mooncake.allocator
except ImportError as e:
    assert "NVLink" in str(e), e
else:
    raise SystemExit("mooncake.allocator imported")
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([shim, ROOT]),
                                MOONCAKE_CONFIG_PATH=str(cfg)), timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_port_choice_ignores_the_seeded_random_module():
    """vLLM seeds ``random`` (seed=0) in every process; two stores with a bare
    local_hostname must not then name their segments with the same port."""
    import random
    from mooncake_te.compat.store import _free_port
    picks = set()
    for _ in range(5):
        random.seed(0)
        picks.add(_free_port("127.0.0.1"))
    assert len(picks) > 1, picks


def test_get_into_ranges_across_clients(index_url):
    """Mooncake's ``get_into_ranges`` scenario: ranges of two objects another client put,
    buffer by buffer, with the failures it defines (mismatched lists, past the object,
    past the buffer, a missing key)."""
    a, b = _store(index_url, "ranges"), _store(index_url, "ranges")
    try:
        d1, d2 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz0123456789"
        assert a.put("r1", d1) == 0 and a.put("r2", d2) == 0
        n = 32
        b0, b1 = (ctypes.c_ubyte * n)(), (ctypes.c_ubyte * n)()
        p0, p1 = ctypes.addressof(b0), ctypes.addressof(b1)
        assert b.register_buffer(p0, n) == 0 and b.register_buffer(p1, n) == 0
        res = b.get_into_ranges([p0, p1], [["r1", "r2"], ["r2", "r1"]],
                                [[[0, 20], [8]], [[4], [16]]], [[[1, 30], [2]], [[0], [10]]],
                                [[[4, 3], [5]], [[6], [4]]])
        assert res == [[[4, 3], [5]], [[6], [4]]]
        assert bytes(b0[0:4]) == d1[1:5] and bytes(b0[8:13]) == d2[2:7]
        assert bytes(b0[20:23]) == d1[30:33]
        assert bytes(b1[4:10]) == d2[0:6] and bytes(b1[16:20]) == d1[10:14]
        bad = b.get_into_ranges([p0], [["r1", "r2"]], [[[0], []]], [[[0, 1], []]], [[[], []]])
        assert bad == [[[-600], []]]
        assert b.get_into_ranges([p0], [["r1"]], [[[0]]], [[[len(d1) - 1]]], [[[4]]]) == \
            [[[-600]]]                                      # past the object
        assert b.get_into_ranges([p0], [["r1"]], [[[n - 1]]], [[[0]]], [[[4]]]) == \
            [[[-600]]]                                      # past the buffer
        assert b.get_into_ranges([p0], [["nope", "r1"]], [[[0], [8]]], [[[0], [0]]],
                                 [[[4], [4]]]) == [[[-704], [4]]]
        unreg = (ctypes.c_ubyte * 8)()
        assert b.get_into_ranges([ctypes.addressof(unreg)], [["r1"]], [[[0]]], [[[0]]],
                                 [[[4]]]) == [[[-600]]]     # not registered: nothing copied
        assert bytes(unreg) == bytes(8)
    finally:
        a.close()
        b.close()


def test_batch_replica_clear_leases_and_segments(index_url, monkeypatch):
    """Mooncake's ``batch_replica_clear``: keys whose lease (put, read) still runs are
    skipped; the others are cleared everywhere, or only in the segment named, the other
    replica still serving reads."""
    monkeypatch.setenv("MC_STORE_KV_LEASE_TTL", "400")
    tenant = "clear-" + os.urandom(3).hex()
    a, b = _store(index_url, tenant), _store(index_url, tenant)
    try:
        assert a.batch_replica_clear([]) == [] and a.batch_replica_clear(["none"]) == []
        assert a.put("old", b"o") == 0
        time.sleep(0.5)
        assert a.put("new", b"n") == 0                      # lease running
        assert sorted(a.batch_replica_clear(["old", "new", "none"])) == ["old"]
        assert a.get("old") == b"" and a.get("new") == b"n"
        time.sleep(0.5)
        assert b.get("new") == b"n"                         # a read renews the lease...
        assert a.batch_replica_clear(["new"]) == []         # ...in the reader's store too
        time.sleep(0.5)
        assert a.batch_replica_clear(["new"], segment_name="nowhere:1") == []
        assert a.is_exist("new") == 1
        assert a.batch_replica_clear(["new"], segment_name=a.get_hostname()) == ["new"]
        assert a.get("new") == b"" and b.get("new") == b""
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        assert a.put("two", b"2" * 1000, config=cfg) == 0
        time.sleep(0.5)
        assert a.batch_replica_clear(["two"], segment_name=a.get_hostname()) == ["two"]
        assert b.get("two") == b"2" * 1000                  # b's replica serves it
        time.sleep(0.5)
        assert a.batch_replica_clear(["two"]) == ["two"]
        assert a.get("two") == b"" and b.get("two") == b""
    finally:
        a.close()
        b.close()


def test_buffer_pool_leases(index_url):
    """Mooncake's BufferPool: regions of the local buffer, then registered overflow;
    exhaustion, a blocked acquire woken by a release, views that pin their lease, and
    the refusals Mooncake makes. Data written in a lease goes out with put_from."""
    import threading
    from mooncake_te.compat.store import BufferPool
    s = _store(index_url, "bp-" + os.urandom(3).hex())
    try:
        pool = BufferPool(s)
        lease = pool.acquire(32 * MIB)                      # the whole local buffer
        over = pool.acquire(1024, block=False)              # overflow: registered memory
        over.buffer[:5] = b"hello"
        assert s.put_from("bp", over.ptr, 5) == 0 and s.get("bp") == b"hello"
        view = lease.buffer
        with pytest.raises(RuntimeError, match="exported views"):
            lease.release()
        del view
        lease.release()
        over.release()
        with pytest.raises(RuntimeError, match="active leases"):
            held = pool.acquire(1)
            pool.close()
        held.release()
        pool.close()
        one = BufferPool(s, max_regions=1, block_on_exhaustion=False)
        a = one.acquire(1)
        with pytest.raises(RuntimeError, match="exhausted"):
            one.acquire(1)
        got = []
        t = threading.Thread(target=lambda: got.append(one.acquire(1, block=True, timeout=5)))
        t.start()
        time.sleep(0.1)
        a.release()
        t.join(10)
        assert got and got[0].size == 1
        got[0].release()
        with pytest.raises(RuntimeError, match="capacity"):
            one.acquire((1 << 64) - 1)
        with pytest.raises(RuntimeError, match="alignment"):
            BufferPool(s, alignment=12345)
    finally:
        s.close()
    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(MooncakeDistributedStore())


def test_soft_pin_ttl_goes_only_with_enable(index_url):
    """Mooncake refuses (-600) a soft-pin TTL with PRESERVE or DISABLE."""
    s = _store(index_url, "pin-" + os.urandom(3).hex())
    try:
        on = ReplicateConfig()
        on.soft_pin_action, on.soft_pin_ttl_ms = SoftPinAction.ENABLE, 1000
        assert s.put("p", b"x", on) == 0
        for action in (SoftPinAction.PRESERVE, SoftPinAction.DISABLE):
            c = ReplicateConfig()
            c.soft_pin_action, c.soft_pin_ttl_ms = action, 1000
            assert s.upsert("p", b"y", c) == -600
        assert s.get("p") == b"x"
        off = ReplicateConfig()
        off.soft_pin_action = SoftPinAction.DISABLE
        assert s.upsert("p", b"z", off) == 0 and s.get("p") == b"z"
    finally:
        s.close()

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
    from mooncake_te.compat.store import Descriptor, QueryTaskResponse, TaskStatus, TaskType
    d = Descriptor()                                   # Mooncake's field names
    d.size, d.buffer_address, d.transport_endpoint = 8, 4096, "h:1"
    assert (d.size, d.buffer_address, d.transport_endpoint) == (8, 4096, "h:1")
    assert [(m.name, int(m)) for m in TaskStatus] == [("PENDING", 0), ("PROCESSING", 1),
                                                      ("FAILED", 2), ("SUCCESS", 3)]
    assert store_mod.REPLICA_MOVE is TaskType.REPLICA_MOVE == 1
    assert QueryTaskResponse().status is TaskStatus.PENDING


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


# Mooncake Store's Python names at Mooncake commit 3b5a594
# (mooncake-integration/store/store_py.cpp): every ``.def("name", ...)`` on the
# MooncakeDistributedStore class, and the module-level functions and classes (besides
# MooncakeDistributedStore itself) of ``mooncake.store``. Facts about Mooncake, held as data so this runs without a checkout.
MOONCAKE_COMMIT = "3b5a594"
MOONCAKE_STORE_METHODS = """
_get_pyclient_capsule alloc_from_mem_pool allocate_and_mount_segment batch_get_buffer
batch_get_into batch_get_into_multi_buffer_ranges batch_get_into_multi_buffers
batch_get_replica_desc batch_get_session_end batch_get_session_start batch_get_tensor
batch_get_tensor_into batch_get_tensor_into_cuda batch_get_tensor_with_parallelism
batch_get_tensor_with_parallelism_into batch_get_tensor_with_tp
batch_get_tensor_with_tp_into batch_is_exist batch_pub_tensor batch_pub_tensor_with_tp
batch_put_from batch_put_from_multi_buffer_ranges batch_put_from_multi_buffers
batch_put_session_end batch_put_session_revoke batch_put_session_start batch_put_tensor
batch_put_tensor_from batch_put_tensor_with_parallelism
batch_put_tensor_with_parallelism_from batch_put_tensor_with_tp
batch_put_tensor_with_tp_from batch_remove batch_replica_clear batch_upsert_from
batch_upsert_pub_tensor batch_upsert_tensor batch_upsert_tensor_from
batch_upsert_tensor_with_parallelism batch_upsert_tensor_with_parallelism_from close
create_copy_task create_move_task get get_batch get_buffer get_hostname get_into
get_into_ranges get_offload_rpc_read_count get_replica_desc get_size get_tensor
get_tensor_into get_tensor_into_cuda get_tensor_with_parallelism
get_tensor_with_parallelism_into get_tensor_with_tp get_tensor_with_tp_into
health_check init_all is_exist load_tensor_from_safetensor mount_segment pub_tensor
pub_tensor_with_tp put put_batch put_from put_from_with_metadata put_parts put_tensor
put_tensor_from put_tensor_with_parallelism put_tensor_with_parallelism_from
put_tensor_with_tp put_tensor_with_tp_from query_task register_buffer remove remove_all
remove_by_regex save_tensor_to_safetensor setup setup_dummy unmount_and_free_segment
unmount_local_disk_segment unmount_segment unregister_buffer upsert upsert_batch
upsert_from upsert_parts upsert_pub_tensor upsert_tensor upsert_tensor_from
upsert_tensor_with_parallelism upsert_tensor_with_parallelism_from
""".split()
MOONCAKE_STORE_FUNCTIONS = """
_serialize_tensor _tensor_metadata_size _deserialize_tensor _get_pyclient_from_wrapper
bind_to_numa_node get_alloc_func_addr get_free_func_addr
""".split()
MOONCAKE_STORE_CLASSES = """
ObjectDataType SoftPinAction ReplicateConfig ReplicaStatus MemoryDescriptor
DiskDescriptor ReplicaDescriptor Descriptor TaskType TaskStatus QueryTaskResponse
BufferHandle MooncakeHostMemAllocator ParallelAxis TensorParallelism ReadTarget
MooncakeDistributedNoFRegister
""".split()


def _store_table() -> list:
    """docs/compat.md's store table: ``(names in the method column, status, follows)``
    per row."""
    import re
    text = open(os.path.join(ROOT, "docs", "compat.md")).read()
    start = text.index("Status of Mooncake Store's Python methods")
    lines = text[start:].splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("| method |"))
    rows = []
    for ln in lines[first + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split(" | ")]
        names = {w for span in re.findall(r"`([^`]*)`", cells[0])
                 for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}
        rows.append((names, cells[1], cells[-1]))
    return rows


def test_every_mooncake_store_name_is_here_and_in_the_docs():
    """Every method Mooncake binds on MooncakeDistributedStore is a method of ours
    (implemented, or refusing with Mooncake's code and a log line), and every one, with
    the module's functions, has a row in docs/compat.md's store table saying its status
    and the Mooncake commit it follows."""
    from mooncake_te.compat import store as store_mod
    assert len(MOONCAKE_STORE_METHODS) == 98 == len(set(MOONCAKE_STORE_METHODS))
    missing = [n for n in MOONCAKE_STORE_METHODS
               if not callable(getattr(MooncakeDistributedStore, n, None))]
    assert not missing, f"Mooncake methods missing on our store: {missing}"
    missing = [n for n in MOONCAKE_STORE_FUNCTIONS if not callable(getattr(store_mod, n,
                                                                           None))]
    assert not missing, f"mooncake.store functions missing: {missing}"
    rows = _store_table()
    status_of = {n: st for names, st, _ in rows for n in names}
    counts = {st: sum(status_of.get(n) == st for n in MOONCAKE_STORE_METHODS)
              for st in ("done", "partly", "refused")}
    doc = " ".join(open(os.path.join(ROOT, "docs", "compat.md")).read().split())
    assert f"98 methods, {counts['done']} done, {counts['partly']} partly, " \
        f"{counts['refused']} refused" in doc, counts
    for names, status, follows in rows:
        assert status in ("done", "partly", "refused"), (names, status)
        assert MOONCAKE_COMMIT in follows, (names, follows)
    listed = set().union(*(names for names, _, _ in rows))
    unlisted = [n for n in MOONCAKE_STORE_METHODS + MOONCAKE_STORE_FUNCTIONS
                + MOONCAKE_STORE_CLASSES if n not in listed]
    assert not unlisted, f"not in docs/compat.md's store table: {unlisted}"
    for name in MOONCAKE_STORE_CLASSES:
        provided = hasattr(store_mod, name)
        row = next(st for names, st, _ in rows if name in names)
        assert provided or row == "refused", (name, row)


def _buf(n):
    b = (ctypes.c_ubyte * n)()
    return b, ctypes.addressof(b)


def test_put_and_get_sessions_across_clients(index_url):
    """Mooncake's session calls (its ``TestPutGetSession`` scenario): objects reserved
    with ``batch_put_session_start``, written layer by layer with
    ``batch_put_from_multi_buffer_ranges``, made readable by ``batch_put_session_end``;
    another client reads them back range by range in a get session. Objects span
    several pool chunks, so ranges cross chunk boundaries."""
    tenant = "sess-" + os.urandom(3).hex()
    a, b = _store(index_url, tenant), _store(index_url, tenant)
    try:
        layers, page, nkeys = 4, 50_000, 3
        size = layers * page
        src_b, src = _buf(size * nkeys)
        dst_b, dst = _buf(size * nkeys)
        src_b[:] = np.random.default_rng(3).integers(0, 256, size * nkeys, np.uint8)
        assert a.register_buffer(src, size * nkeys) == 0
        assert b.register_buffer(dst, size * nkeys) == 0
        keys = [f"session_{i}" for i in range(nkeys)]
        assert a.batch_put_session_start(keys, [size] * nkeys) == [0] * nkeys
        assert a.batch_is_exist(keys) == [0] * nkeys            # not readable yet
        for layer in reversed(range(layers)):
            rc = a.batch_put_from_multi_buffer_ranges(
                keys, [[src + i * size + layer * page] for i in range(nkeys)],
                [[page]] * nkeys, [[layer * page]] * nkeys)
            assert rc == [page] * nkeys
        assert a.batch_put_session_end(keys) == [0] * nkeys
        assert b.batch_is_exist(keys) == [1] * nkeys
        assert b.batch_get_session_start(keys) == [0] * nkeys
        for layer in range(layers):
            rc = b.batch_get_into_multi_buffer_ranges(
                keys, [[dst + i * size + layer * page] for i in range(nkeys)],
                [[page]] * nkeys, [[layer * page]] * nkeys)
            assert rc == [page] * nkeys
        assert b.batch_get_session_end(keys) == 0
        assert bytes(dst_b) == bytes(src_b)
        assert b.get("session_1") == bytes(src_b[size:2 * size])
        # several ranges of one key in one call, and a range of 0 bytes
        out_b, out = _buf(64)
        assert b.register_buffer(out, 64) == 0
        assert b.batch_get_session_start(["session_2"]) == [0]
        assert b.batch_get_into_multi_buffer_ranges(
            ["session_2"], [[out, out + 10, out + 20]], [[10, 0, 7]],
            [[65_530, 0, size - 7]]) == [17]
        assert bytes(out_b[:10]) == bytes(src_b[2 * size + 65_530:2 * size + 65_540])
        assert bytes(out_b[20:27]) == bytes(src_b[3 * size - 7:3 * size])
        # revoke: nothing stored, the key free again
        assert a.batch_put_session_start(["revoked"], [100]) == [0]
        assert a.batch_put_from_multi_buffer_ranges(["revoked"], [[src]], [[100]],
                                                    [[0]]) == [100]
        assert a.batch_put_session_revoke(["revoked"]) == [0]
        assert b.batch_get_session_start(["revoked"]) == [-704]
        assert a.is_exist("revoked") == 0
    finally:
        a.close()
        b.close()


def test_session_calls_refuse_bad_input(index_url, monkeypatch):
    """Mooncake's abnormal session cases, and bad pointers: -600 for ranges, ends and
    revokes without a session, unequal lists, a second start, a range past the object
    (nothing written), NULL or unregistered pointers and ranges running out of the
    registered buffer (never a write out of bounds); -705 for a key that exists, -704
    for a missing one, -707 once a get session's lease ended."""
    monkeypatch.setenv("MC_STORE_KV_LEASE_TTL", "300")
    s = _store(index_url, "sessbad-" + os.urandom(3).hex())
    try:
        n = 128
        buf_b, buf = _buf(n)
        assert s.register_buffer(buf, n) == 0
        ctypes.memset(buf, 0x78, n)
        k = ["no_session"]
        assert s.batch_put_from_multi_buffer_ranges(k, [[buf]], [[64]], [[0]]) == [-600]
        assert s.batch_put_session_end(k) == [-600]
        assert s.batch_put_session_revoke(k) == [-600]
        assert s.batch_get_into_multi_buffer_ranges(k, [[buf]], [[64]], [[0]]) == [-600]
        assert s.batch_put_session_start(["a", "b"], [n]) == [-600, -600]
        assert s.batch_put_session_start(["zero"], [0]) == [-600]
        assert s.batch_put_session_start(["huge"], [1 << 40]) == [-200]
        assert s.batch_put_session_start(["half1"], [20 * MIB]) == [0]
        assert s.batch_put_session_start(["half2"], [20 * MIB]) == [-200]  # 32 MiB segment
        assert s.batch_put_session_revoke(["half1", "half2"]) == [0, -600]
        assert s.batch_put_session_start(["dup"], [n]) == [0]
        assert s.batch_put_session_start(["dup"], [n]) == [-600]
        assert s.batch_put_from_multi_buffer_ranges(["dup"], [[buf]], [[64]], [[n]]) == \
            [-600]                                           # offset == size
        assert s.batch_put_from_multi_buffer_ranges(["dup"], [[buf, buf + 64]], [[64]],
                                                    [[0]]) == [-600]     # arity
        assert s.batch_put_from_multi_buffer_ranges(["dup"], [[0]], [[64]], [[0]]) == \
            [-600]                                           # NULL
        other_b, other = _buf(64)
        assert s.batch_put_from_multi_buffer_ranges(["dup"], [[other]], [[64]], [[0]]) \
            == [-600]                                        # not registered
        assert s.batch_put_from_multi_buffer_ranges(["dup"], [[buf + 100]], [[64]],
                                                    [[0]]) == [-600]   # past the buffer
        assert s.batch_put_from_multi_buffer_ranges(["dup"], [[buf]], [[-1]], [[0]]) == \
            [-600]
        assert s.batch_put_from_multi_buffer_ranges(["dup", "x"], [[buf]], [[64]],
                                                    [[0]]) == [-600, -600]
        assert s.batch_put_session_end(["dup"]) == [0]
        assert s.get("dup") == bytes(n)                     # nothing was written
        assert s.batch_put_session_end(["dup"]) == [-600]   # ended once
        assert s.batch_put_from_multi_buffer_ranges(["dup"], [[buf]], [[64]], [[0]]) == \
            [-600]
        assert s.batch_put_session_start(["dup"], [n]) == [-705]     # exists now
        assert s.put("obj", b"o" * n) == 0
        assert s.batch_get_session_start(["missing_obj", "obj"]) == [-704, 0]
        ctypes.memset(buf, 0, n)
        assert s.batch_get_into_multi_buffer_ranges(["obj"], [[buf]], [[64, 64]],
                                                    [[0]]) == [-600]     # arity
        assert s.batch_get_into_multi_buffer_ranges(["obj"], [[buf]], [[64]],
                                                    [[n - 63]]) == [-600]  # past object
        assert s.batch_get_into_multi_buffer_ranges(["obj"], [[buf + 100]], [[64]],
                                                    [[0]]) == [-600]     # past buffer
        assert s.batch_get_into_multi_buffer_ranges(["obj"], [[other]], [[8]], [[0]]) \
            == [-600]
        assert s.batch_get_into_multi_buffer_ranges(["obj"], [[0]], [[8]], [[0]]) == \
            [-600]
        assert bytes(buf_b) == bytes(n) and bytes(other_b) == bytes(64)
        assert s.batch_get_into_multi_buffer_ranges(["obj"], [[buf]], [[8]], [[0]]) == [8]
        assert bytes(buf_b[:8]) == b"o" * 8
        time.sleep(0.4)
        assert s.batch_get_into_multi_buffer_ranges(["obj"], [[buf]], [[8]], [[0]]) == \
            [-707]                                           # lease ended: dropped
        assert s.batch_get_into_multi_buffer_ranges(["obj"], [[buf]], [[8]], [[0]]) == \
            [-600]
        assert s.batch_get_session_start(["obj"]) == [0]
        assert s.batch_get_session_end(["obj"]) == 0
        assert s.batch_get_into_multi_buffer_ranges(["obj"], [[buf]], [[8]], [[0]]) == \
            [-600]
    finally:
        s.close()
    assert s.health_check() == 1                            # closed (Mooncake's code)
    fresh = MooncakeDistributedStore()                      # not set up: Mooncake's []
    assert fresh.health_check() == 1
    assert fresh.batch_put_session_start(["k"], [1]) == []
    assert fresh.batch_get_session_start(["k"]) == []
    assert fresh.batch_get_session_end(["k"]) == -1


def test_put_from_with_metadata(index_url):
    """``put_from_with_metadata``: the metadata bytes, then the data, as one object;
    -600 for a NULL or unregistered pointer or a range out of the registered buffer;
    size 0 stores nothing and answers 0 (as Mooncake)."""
    tenant = "meta-" + os.urandom(3).hex()
    a, b = _store(index_url, tenant), _store(index_url, tenant)
    try:
        data_b, data = _buf(100_000)
        meta_b, meta = _buf(24)
        data_b[:] = np.arange(100_000, dtype=np.uint8)
        ctypes.memmove(meta, b"M" * 24, 24)
        assert a.register_buffer(data, 100_000) == 0 and a.register_buffer(meta, 24) == 0
        assert a.put_from_with_metadata("wm", data, meta, 100_000, 24) == 0
        assert b.get("wm") == b"M" * 24 + bytes(data_b)
        assert a.put_from_with_metadata("wm0", data, 0, 10, 0) == 0       # no metadata
        assert b.get("wm0") == bytes(data_b[:10])
        assert a.put_from_with_metadata("empty", data, meta, 0, 24) == 0
        assert a.is_exist("empty") == 0
        assert a.put_from_with_metadata("bad", data, 0, 10, 24) == -600   # NULL metadata
        assert a.put_from_with_metadata("bad", 0, meta, 10, 24) == -600
        loose_b, loose = _buf(16)
        assert a.put_from_with_metadata("bad", data, loose, 10, 16) == -600
        assert a.put_from_with_metadata("bad", data, meta, 10, 25) == -600  # past buffer
        assert a.put_from_with_metadata("bad", data + 99_990, meta, 11, 24) == -600
        assert a.is_exist("bad") == 0
    finally:
        a.close()
        b.close()


def test_offload_read_count_init_all_and_refusals(index_url, tmp_path, caplog):
    """``get_offload_rpc_read_count`` counts reads that went to the SSD offload tier;
    ``init_all`` on a set-up store is -600; ``alloc_from_mem_pool`` is 0 on a real
    client (as Mooncake's); the segment-mount calls and the C++ handles are refused
    (-1012, None, 0) with a log line saying why and what to do instead."""
    import logging
    from mooncake_te.compat import store as store_mod
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", index_url, 1 * MIB, 4 * MIB, "tcp", "", "127.0.0.1:50051",
                   enable_ssd_offload=True, ssd_offload_path=str(tmp_path),
                   tenant_id="off-" + os.urandom(3).hex()) == 0
    try:
        assert s.get_offload_rpc_read_count() == 0
        vals = {f"o{i}": bytes([i]) * 50_000 for i in range(40)}
        for k, v in vals.items():
            assert s.put(k, v) == 0
        assert s.get("o39") == vals["o39"]                  # in DRAM
        assert s.get_offload_rpc_read_count() == 0
        assert s.get("o0") == vals["o0"]                    # evicted to the SSD tier
        assert s.get_offload_rpc_read_count() == 1
        assert s.init_all("tcp", "") == -600
        assert s.alloc_from_mem_pool(4096) == 0
        caplog.set_level(logging.ERROR, logger="mooncake_te.compat.store")
        assert s.mount_segment("/dev/shm/x", 1 << 20) == {"ret": -1012, "segment_ids": []}
        assert s.allocate_and_mount_segment(1 << 20)["ret"] == -1012
        assert s.unmount_segment(["seg"]) == -1012
        assert s.unmount_and_free_segment(["seg"], grace_period_seconds=1) == -1012
        assert s.unmount_local_disk_segment() == -1012
        assert s._get_pyclient_capsule() is None
        assert store_mod._get_pyclient_from_wrapper(s) is None
        assert store_mod.get_alloc_func_addr() == 0 == store_mod.get_free_func_addr()
        assert "master" in caplog.text and "global_segment_size" in caplog.text
        assert s.get("o1") == vals["o1"]                    # nothing was touched
    finally:
        s.close()


def test_bind_to_numa_node(caplog):
    """The calling thread runs on the node's CPUs (sysfs cpulist) afterwards; an
    unknown node is a warning and changes nothing (as Mooncake's)."""
    import logging
    import threading
    from mooncake_te.compat.store import _cpulist, bind_to_numa_node
    assert _cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    root = "/sys/devices/system/node"
    if not os.path.isdir(f"{root}/node0"):
        pytest.skip("no NUMA nodes in sysfs")
    want = _cpulist(open(f"{root}/node0/cpulist").read()) & os.sched_getaffinity(0)
    got: dict = {}

    def run():
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(before)})
        bind_to_numa_node(0)
        got["after"] = os.sched_getaffinity(0)
        bind_to_numa_node(4096)
        got["unknown"] = os.sched_getaffinity(0)
    caplog.set_level(logging.WARNING, logger="mooncake_te.compat.store")
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert got["after"] == want and got["unknown"] == want
    assert "Invalid NUMA node: 4096" in caplog.text


def test_copy_and_move_tasks(index_url):
    """``create_copy_task`` copies an object into other stores, ``create_move_task``
    moves a replica (the source no longer holds it, the target serves it);
    ``query_task`` reports them; bad requests get Mooncake's codes."""
    from mooncake_te.compat.store import QueryTaskResponse, TaskStatus, TaskType
    tenant = "task-" + os.urandom(3).hex()
    a, b, c = _store(index_url, tenant), _store(index_url, tenant), _store(index_url, tenant)
    try:
        big = os.urandom(300_000)
        assert a.put("t1", big) == 0 and a.put("t2", b"two" * 1000) == 0
        assert a.put("t3", b"three") == 0
        tid, rc = a.create_copy_task("t1", [b.get_hostname(), c.get_hostname()])
        assert rc == 0 and tid != (0, 0)
        resp, rc = a.query_task(tid)
        assert rc == 0 and isinstance(resp, QueryTaskResponse)
        assert (resp.id, resp.type, resp.status) == (tid, TaskType.REPLICA_COPY,
                                                      TaskStatus.SUCCESS)
        tid2, rc = a.create_move_task("t2", a.get_hostname(), b.get_hostname())
        assert rc == 0 and a.query_task(tid2)[0].status == TaskStatus.SUCCESS
        assert c.get("t2") == b"two" * 1000                  # found through the index
        for s in (a, c):                                    # a no longer holds it
            desc = s.get_replica_desc("t2")
            assert [d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                    for d in desc] == [b.get_hostname()]
        assert a.create_copy_task("t1", []) == ((0, 0), -600)
        assert a.create_copy_task("t1", ["nowhere:1"]) == ((0, 0), -600)
        assert a.create_copy_task("none", [b.get_hostname()]) == ((0, 0), -704)
        assert a.create_move_task("t3", a.get_hostname(), a.get_hostname()) == \
            ((0, 0), -600)
        assert a.create_move_task("t3", b.get_hostname(), c.get_hostname()) == \
            ((0, 0), -600)                                  # b holds no replica of t3
        assert a.query_task((1, 2)) == (None, -1400)
        a.close()                                           # the copies outlive a
        assert b.get("t1") == big and c.get("t1") == big
        assert c.get("t2") == b"two" * 1000
        b.close()                                           # the moved replica was b's
        assert c.get("t2") == b"" and c.get("t1") == big
    finally:
        a.close()
        b.close()
        c.close()


# --- raw pointers in CUDA device memory (Mooncake's local copy path: cudaMemcpy) -----------
class _FakeDevice:
    """Host memory that a patched ``mooncake_te.cuda`` calls device memory of cuda:0 (one
    allocation): the store's CUDA path, run on a machine without a GPU. Records which
    addresses CUDA was asked about and which copies went through ``cuda.memcpy``."""

    def __init__(self, monkeypatch, n=64):
        import contextlib

        from mooncake_te import cuda
        from mooncake_te.compat import store as S
        self.mem, self.base = _buf(n)
        self.n = n
        self.asked: list = []
        self.copies: list = []
        self.syncs = 0
        monkeypatch.setattr(S, "_cuda_usable", lambda: True)
        monkeypatch.setattr(cuda, "pointer_info", self.pointer_info)
        monkeypatch.setattr(cuda, "allocation_range", lambda p: (self.base, self.n))
        monkeypatch.setattr(cuda, "device", lambda o: contextlib.nullcontext())
        monkeypatch.setattr(cuda, "memcpy", self.memcpy)
        monkeypatch.setattr(cuda, "synchronize_stream", self.sync)

    def pointer_info(self, p):
        self.asked.append(p)
        return (True, 0) if self.base <= p < self.base + self.n else (False, -1)

    def memcpy(self, dst, src, n):
        self.copies.append((dst, src, n))
        ctypes.memmove(dst, src, n)

    def sync(self, handle, ordinal=0):
        self.syncs += 1


def test_pointer_calls_copy_cuda_memory_with_cuda_memcpy(index_url, monkeypatch):
    """A pointer in no registered buffer that CUDA calls device memory is taken, as
    Mooncake's cudaMemcpy takes it: copied with cuda.memcpy (never memmove), in the
    byte, multi-buffer, ranged and session calls; a range past its allocation is -600
    with nothing written; CUDA is never asked about registered host buffers, and an
    unregistered host pointer is still -600. (The GPU itself: the gpu test below.)"""
    s = _store(index_url, "cudafake-" + os.urandom(3).hex())
    try:
        dev = _FakeDevice(monkeypatch)
        host_b, host = _buf(64)
        assert s.register_buffer(host, 64) == 0
        raw = bytes(range(32))
        assert s.put("raw", raw) == 0
        assert s.get_into("raw", dev.base, 32) == 32
        assert bytes(dev.mem[:32]) == raw and dev.copies == [(dev.base, dev.copies[0][1], 32)]
        assert dev.syncs == 1                              # in place when get_into answers
        ctypes.memset(dev.base, 0x5A, 64)
        assert s.get_into("raw", dev.base + 40, 32) == -600        # past the allocation
        assert bytes(dev.mem) == b"\x5a" * 64 and len(dev.copies) == 1
        assert s.put_from("from", dev.base, 64) == 0
        assert s.get("from") == b"\x5a" * 64
        assert s.put_from("over", dev.base + 1, 64) == -600 and s.is_exist("over") == 0
        # a piece in a registered host buffer beside one in device memory
        ctypes.memmove(host, b"h" * 16, 16)
        assert s.batch_put_from_multi_buffers(["mix"], [[host, dev.base]], [[16, 8]]) == [0]
        assert s.get("mix") == b"h" * 16 + b"\x5a" * 8
        assert s.batch_get_into_multi_buffers(["raw"], [[host, dev.base]], [[8, 24]]) == [32]
        assert bytes(host_b[:8]) == raw[:8] and bytes(dev.mem[:24]) == raw[8:]
        res = s.get_into_ranges([dev.base], [["raw"]], [[[60, 0]]], [[[0, 4]]], [[[8, 4]]])
        assert res == [[[-600, 4]]] and bytes(dev.mem[:4]) == raw[4:8]   # 60 + 8 > 64
        head = bytes(dev.mem[:8])
        assert s.batch_put_session_start(["sess"], [16]) == [0]
        assert s.batch_put_from_multi_buffer_ranges(["sess"], [[dev.base]], [[8]],
                                                    [[8]]) == [8]
        assert s.batch_put_session_end(["sess"]) == [0]
        assert s.get("sess") == bytes(8) + head
        assert s.batch_get_session_start(["raw"]) == [0]
        assert s.batch_get_into_multi_buffer_ranges(["raw"], [[dev.base + 56]], [[8]],
                                                    [[24]]) == [8]
        assert bytes(dev.mem[56:]) == raw[24:]
        assert not any(host <= p < host + 64 for p in dev.asked)  # registered: not asked
        other_b, other = _buf(32)
        assert s.get_into("raw", other, 32) == -600                # neither: refused
        assert bytes(other_b) == bytes(32)
        assert all(d != other and sr != other for d, sr, _ in dev.copies)
    finally:
        s.close()


def test_pointer_calls_never_ask_cuda_without_it(index_url, monkeypatch):
    """In a process that has not loaded CUDA (this one, unless a GPU test ran first:
    then the registered half still holds), registered host buffers work and an
    unregistered pointer is -600, and the driver is never asked about either."""
    from mooncake_te import cuda

    def refuse(*a):
        raise AssertionError("CUDA was asked about a pointer")

    monkeypatch.setattr(cuda, "pointer_info", refuse)
    monkeypatch.setattr(cuda, "memcpy", refuse)
    s = _store(index_url, "nocuda-" + os.urandom(3).hex())
    try:
        b, p = _buf(32)
        assert s.register_buffer(p, 32) == 0
        assert s.put("k", b"k" * 32) == 0
        assert s.get_into("k", p, 32) == 32 and bytes(b) == b"k" * 32
        assert s.put_from("k2", p, 32) == 0 and s.get("k2") == b"k" * 32
        if not cuda.loaded():
            other_b, other = _buf(32)
            assert s.get_into("k", other, 32) == -600 and bytes(other_b) == bytes(32)
            assert s.put_from("k3", other, 32) == -600
    finally:
        s.close()


@pytest.mark.gpu
def test_pointer_calls_take_cuda_memory(index_url):
    """On a GPU: get_into an unregistered CUDA buffer (Mooncake's
    test_cuda_local_copy_paths: ``get_into(key, dst.data_ptr(), n)``), put_from one,
    ranges and a multi-buffer get into device memory, a range past the CUDA allocation
    -600 with nothing written."""
    import cupy as cp

    from mooncake_te import cuda
    s = _store(index_url, "cuda-" + os.urandom(3).hex())
    try:
        raw = bytes(range(32))
        assert s.put("raw", raw) == 0
        dst = cp.zeros(32, cp.uint8)
        assert s.get_into("raw", dst.data.ptr, 32) == 32
        assert cp.asnumpy(dst).tobytes() == raw
        src = cp.arange(64, dtype=cp.uint8)
        assert s.put_from("from", src.data.ptr, 64) == 0
        assert s.get("from") == bytes(range(64))
        two = cp.zeros(64, cp.uint8)
        assert s.batch_get_into_multi_buffers(["from"], [[two.data.ptr, two.data.ptr + 40]],
                                              [[40, 24]]) == [64]
        assert cp.asnumpy(two).tobytes() == bytes(range(64))
        assert s.get_into_ranges([dst.data.ptr], [["from"]], [[[0]]], [[[8]]],
                                 [[[4]]]) == [[[4]]]
        assert cp.asnumpy(dst)[:4].tobytes() == bytes(range(8, 12))
        base, size = cuda.allocation_range(dst.data.ptr)
        tail = base + size - 16
        before = np.empty(16, np.uint8)
        cuda.memcpy(before.ctypes.data, tail, 16)
        assert s.get_into("from", tail, 64) == -600               # 48 bytes past its end
        after = np.empty(16, np.uint8)
        cuda.memcpy(after.ctypes.data, tail, 16)
        assert after.tobytes() == before.tobytes()
        assert s.put_from("over", tail, 64) == -600 and s.is_exist("over") == 0
    finally:
        s.close()

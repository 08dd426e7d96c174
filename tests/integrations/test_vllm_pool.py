# SPDX-License-Identifier: Apache-2.0
"""The connector's KV pool without vLLM: the key scheme, the lookup the scheduler makes
through the worker's socket, the worker's save and load of real blocks through a real
KVCache (DRAM and SSD), the async save queue's bounds, the [kvcache] settings and the
scheduler-side pool protocol. The end-to-end scenarios with vLLM are in
tests/integrations/test_vllm_e2e.py."""
from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import replace

import numpy as np
import pytest

from mooncake_te.errors import ConfigError
from mooncake_te.integrations.vllm.counters import hit_rate_line
from mooncake_te.integrations.vllm.layout import KVLayout
from mooncake_te.integrations.vllm.pool import (
    BlockCopier, PoolLoadSpec, PoolLookup, PoolSettings, PoolWorker, SaveQueue, SaveSpec,
    block_keys, lookup_address, namespace_root, pool_settings)
from mooncake_te.integrations.vllm.scheduler import SchedulerSide
from mooncake_te.integrations.vllm.settings import parse_extra_config
from mooncake_te.integrations.vllm.worker import rank_pool_settings
from mooncake_te.kvcache import prefix_hashes
from test_vllm_connector import Blocks  # noqa: E402  (KVCacheBlocks accessors)

BS = 32


# --- keys ------------------------------------------------------------------------------------
def test_keys_chain_over_the_prefix_and_are_namespaced():
    root = namespace_root("tiny-llama|float32", BS)
    assert root == namespace_root("tiny-llama|float32", BS)          # any process
    toks = list(range(100))
    ks = block_keys(toks, BS, root)
    assert len(ks) == 3 and all(len(k) == 16 for k in ks)             # full blocks only
    assert ks == prefix_hashes(toks[:96], BS, parent=root)
    # A key names its block and everything before it.
    other = toks[:32] + [7] + toks[33:]
    ko = block_keys(other, BS, root)
    assert ko[0] == ks[0] and ko[1] != ks[1] and ko[2] != ks[2]
    same_start = toks[:64] + [5] * 36
    assert block_keys(same_start, BS, root)[:2] == ks[:2]
    # Other model, other block size, other adapter: nothing shared.
    assert block_keys(toks, BS, namespace_root("other|float32", BS))[0] != ks[0]
    assert block_keys(toks, 16, namespace_root("tiny-llama|float32", 16))[0] != ks[0]
    assert block_keys(toks, BS, namespace_root("tiny-llama|float32", BS, "lora-a"))[0] != ks[0]
    # Slices: start/stop.
    assert block_keys(toks, BS, root, start=1, stop=3) == ks[1:3]
    assert block_keys(toks, BS, root, stop=99) == ks and block_keys(toks[:31], BS, root) == []


# --- a host KV cache the worker copies from and to ---------------------------------------------
class HostKV:
    """Two layers of ``[num_blocks, 2, 32, 64]`` fp32 (vLLM's CPU layout) in numpy."""

    def __init__(self, num_blocks=16, layers=2, seed=0):
        rng = np.random.default_rng(seed)
        self.layers = [rng.standard_normal((num_blocks, 2, BS, 64), dtype=np.float32)
                       for _ in range(layers)]
        blk = self.layers[0][0].nbytes
        self.layout = KVLayout.from_regions(
            [f"l{i}" for i in range(layers)], [a.ctypes.data for a in self.layers],
            [blk] * layers, [blk] * layers, num_blocks)

    def block(self, b):
        return [a[b].copy() for a in self.layers]


def test_block_copier_gathers_and_scatters_every_layer():
    kv = HostKV()
    cp = BlockCopier(kv.layout)
    assert cp.block_bytes == 2 * kv.layers[0][0].nbytes
    img = np.empty(cp.block_bytes, np.uint8)
    cp.gather(3, img)
    want = kv.block(3)
    cp.scatter(9, img)
    assert all(np.array_equal(kv.layers[i][9], want[i]) for i in range(2))
    cp.gather(5, img)
    want = kv.block(5)
    cp.scatter_held(1, img)                               # memmove with the GIL held
    assert all(np.array_equal(kv.layers[i][1], want[i]) for i in range(2))
    with pytest.raises(IndexError):
        cp.scatter_held(kv.layout.num_blocks, img)
    with pytest.raises(ValueError):
        cp.scatter_held(1, img[:-1])


def _settings(tmp_path=None, dram_blocks=8, ssd_blocks=0, **kw):
    slot = 2 * 2 * BS * 64 * 4 + 4096                      # block + header, 4 KiB aligned
    return PoolSettings(dram_bytes=dram_blocks * slot, ssd_bytes=ssd_blocks * slot,
                        cache_dir=str(tmp_path / "kv") if tmp_path else "", **kw)


def _pool(settings, kv, tag=None):
    addr = lookup_address(tag or uuid.uuid4().hex)
    return PoolWorker(settings, kv.layout, None, "test-ns", addr), addr


def _wait(pred, timeout=10):
    t = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < t, "timed out"
        time.sleep(0.01)


def test_save_lookup_load_round_trip_through_the_socket(tmp_path):
    kv = HostKV()
    pool, addr = _pool(_settings(tmp_path, dram_blocks=4, ssd_blocks=8), kv)
    look = PoolLookup(addr)
    try:
        root = namespace_root("m", BS)
        keys = block_keys(list(range(6 * BS)), BS, root)
        assert look.lookup(keys) == (0, 0, 0)
        want = [kv.block(b) for b in range(6)]
        assert pool.save(SaveSpec("r1", keys, list(range(6))))
        _wait(lambda: "r1" in pool.collect()[0])
        # 4 DRAM slots: the two oldest blocks went to SSD; the prefix spans both tiers.
        assert look.lookup(keys) == (0, 2, 0) or sum(look.lookup(keys)) == 6
        d, s, r = look.lookup(keys)
        assert (d + s, r) == (6, 0) and s >= 2
        assert look.lookup(keys[:2] + [b"\x00" * 16] + keys[3:]) == (0, 2, 0)
        # Load into other blocks: the bytes are the saved ones, every layer.
        pool.load(PoolLoadSpec("r2", keys, [10, 11, 12, 13, 14, 15]))
        loaded = {}
        _wait(lambda: loaded.update(pool.collect()[1]) or "r2" in loaded)
        assert loaded["r2"] is True
        for i, b in enumerate(range(10, 16)):
            assert all(np.array_equal(kv.layers[j][b], want[i][j]) for j in range(2))
        c = pool.take_counters()
        assert c["blocks_saved"] == 6 and c["blocks_loaded"] == 6 and c["failed_loads"] == 0
        assert c["loaded_ssd"] >= 2 and c["loaded_dram"] + c["loaded_ssd"] == 6
        # Saving what the DRAM tier holds costs nothing.
        pool.save(SaveSpec("r3", keys[-2:], [4, 5]))
        _wait(lambda: "r3" in pool.collect()[0])
        assert pool.take_counters()["blocks_save_skipped"] == 2
        # A key the pool does not hold (evicted since the lookup): failed, not served.
        before = kv.block(7)
        pool.load(PoolLoadSpec("r4", [b"\x01" * 16], [7]))
        loaded = {}
        _wait(lambda: loaded.update(pool.collect()[1]) or "r4" in loaded)
        assert loaded["r4"] is False and pool.take_counters()["failed_loads"] == 1
        assert all(np.array_equal(kv.layers[j][7], before[j]) for j in range(2))
    finally:
        look.close()
        pool.close()


def test_restart_finds_blocks_on_ssd_and_a_corrupt_one_is_not_served(tmp_path):
    kv = HostKV()
    keys = block_keys(list(range(3 * BS)), BS, namespace_root("m", BS))
    pool, _ = _pool(_settings(tmp_path, dram_blocks=4, ssd_blocks=8), kv)
    pool.save(SaveSpec("r", keys, [0, 1, 2]))
    pool.flush()
    pool.close()                                          # persists the DRAM blocks
    kv2 = HostKV(seed=1)
    pool2, addr = _pool(_settings(tmp_path, dram_blocks=4, ssd_blocks=8), kv2)
    look = PoolLookup(addr)
    try:
        assert look.lookup(keys) == (0, 3, 0)
        # Flip a byte of the second block's data on disk.
        slab = tmp_path / "kv" / "kvcache.slab"
        raw = bytearray(slab.read_bytes())
        off = pool2.cache.ssd.index[keys[1]][0] * pool2.cache.slot_size + 64 + 100
        raw[off] ^= 0xFF
        slab.write_bytes(bytes(raw))
        pool2.load(PoolLoadSpec("x", keys, [5, 6, 7]))
        loaded = {}
        _wait(lambda: loaded.update(pool2.collect()[1]) or "x" in loaded)
        assert loaded["x"] is False
        c = pool2.take_counters()
        assert c["failed_loads"] == 1 and c["corrupt_dropped"] == 1
        assert look.lookup(keys) == (1, 0, 0)            # block 0 promoted, block 1 gone
    finally:
        look.close()
        pool2.close()


def test_tp2_ranks_share_one_cache_dir_each_in_its_own_subdirectory(tmp_path):
    # What WorkerSide.register_kv_caches does for TP rank r of 2: the pool's settings with
    # cache_dir/tp<r>-of-2, and a namespace naming the rank.
    base = _settings(tmp_path, dram_blocks=4, ssd_blocks=8)
    keys = block_keys(list(range(3 * BS)), BS, namespace_root("m", BS))
    # One cache_dir given to two pools: the second takes a subdirectory of its own
    # (issue 35, item 9; it used to be refused by the SSD tier's flock).
    p0, _ = _pool(base, HostKV(seed=10))
    try:
        p1, _ = _pool(base, HostKV(seed=11))
        assert (p0.cache.ssd.dir, p1.cache.ssd.dir) == (str(tmp_path / "kv"),
                                                        str(tmp_path / "kv" / "instance-1"))
        p1.close()
    finally:
        p0.close()
    ranks = [rank_pool_settings(base, r, 2) for r in (0, 1)]
    assert [s.cache_dir for s in ranks] == [str(tmp_path / "kv" / "tp0-of-2"),
                                            str(tmp_path / "kv" / "tp1-of-2")]
    assert all(os.path.isdir(s.cache_dir) for s in ranks)         # created at start
    kvs = [HostKV(seed=20 + r) for r in (0, 1)]
    want = [[kv.block(b) for b in range(3)] for kv in kvs]
    pools = [PoolWorker(s, kv.layout, None, f"test-ns-tp{r}", lookup_address(uuid.uuid4().hex))
             for r, (s, kv) in enumerate(zip(ranks, kvs))]
    for p in pools:                                              # both started
        p.save(SaveSpec("r", keys, [0, 1, 2]))
        p.flush()
        p.close()                                                # persisted to SSD
    # A restart of both ranks finds each rank's own blocks.
    for r in (0, 1):
        kv, addr = HostKV(seed=30 + r), lookup_address(uuid.uuid4().hex)
        pool = PoolWorker(rank_pool_settings(base, r, 2), kv.layout, None, f"test-ns-tp{r}",
                          addr)
        look = PoolLookup(addr)
        try:
            assert look.lookup(keys) == (0, 3, 0)
            pool.load(PoolLoadSpec("x", keys, [7, 8, 9]))
            loaded = {}
            _wait(lambda: loaded.update(pool.collect()[1]) or "x" in loaded)
            assert loaded["x"] is True
            for i, b in enumerate((7, 8, 9)):
                assert all(np.array_equal(kv.layers[j][b], want[r][i][j]) for j in range(2))
        finally:
            look.close()
            pool.close()


def test_tp1_keeps_cache_dir_and_a_bad_subdirectory_is_refused(tmp_path):
    base = _settings(tmp_path, dram_blocks=4, ssd_blocks=8)
    assert rank_pool_settings(base, 0, 1) is base                 # no migration for TP=1
    assert rank_pool_settings(_settings(dram_blocks=4), 1, 2).cache_dir == ""   # DRAM only
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"cache_dir = .*a-file' is not a directory"):
        rank_pool_settings(replace(base, cache_dir=str(f)), 1, 4)


def test_lookup_of_a_worker_that_is_not_there_is_a_miss():
    look = PoolLookup(lookup_address("nobody-" + uuid.uuid4().hex), timeout_s=0.5)
    assert look.lookup([b"\x00" * 16]) == (0, 0, 0) and look.errors == 1


# --- the save queue ------------------------------------------------------------------------------
def test_save_queue_never_blocks_and_drops_over_its_bound():
    gate = threading.Event()
    ran, done = [], []
    q = SaveQueue(100, run=lambda j: (gate.wait(5), ran.append(j)),
                  done=lambda j, ok: done.append((j, ok)))
    try:
        t0 = time.monotonic()
        assert q.submit(60, "a") and q.submit(40, "b")
        assert not q.submit(1, "c")                       # full: refused at once
        assert time.monotonic() - t0 < 1.0
        assert q.inflight_bytes == 100 and q.refused == 1 and q.max_inflight_seen == 100
        gate.set()
        assert q.flush(5)
        assert ran == ["a", "b"] and done == [("a", True), ("b", True)]
        assert q.inflight_bytes == 0 and q.submit(100, "d")
        assert q.flush(5)
    finally:
        q.close()


def test_wait_progress_returns_when_a_save_finishes_or_at_once_when_none_is_queued():
    gate = threading.Event()
    q = SaveQueue(10, run=lambda j: gate.wait(30))
    try:
        t0 = time.monotonic()
        q.wait_progress(30)                               # nothing queued: at once
        assert time.monotonic() - t0 < 10
        q.submit(1, "a")
        threading.Timer(0.05, gate.set).start()
        q.wait_progress(30)                               # woken by the job's end
        assert time.monotonic() - t0 < 10 and q.inflight_bytes == 0
    finally:
        gate.set()
        q.close()


def test_a_failing_save_is_counted_and_the_queue_goes_on():
    q = SaveQueue(10, run=lambda j: 1 / 0 if j == "bad" else None)
    try:
        q.submit(1, "bad")
        q.submit(1, "good")
        assert q.flush(5) and q.failed == 1 and q.accepted == 2
    finally:
        q.close()


def test_pool_drops_and_counts_saves_when_the_queue_is_full(tmp_path):
    kv = HostKV()
    pool, _ = _pool(_settings(dram_blocks=8, save_queue_bytes=0), kv)
    try:
        keys = block_keys(list(range(2 * BS)), BS, namespace_root("m", BS))
        assert pool.save(SaveSpec("r", keys, [0, 1])) is False
        assert pool.take_counters()["blocks_dropped"] == 2
    finally:
        pool.close()


# --- settings ------------------------------------------------------------------------------------
def test_settings_from_the_seed_skeleton_and_extra_config(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('[kvcache]\ncache_dir = "%s"\ndram_cache_gb = 0.5\nssd_cache_gb = 2\n'
                   'eviction_policy = "lfu"\nblock_size = 32\n' % (tmp_path / "c"))
    s = parse_extra_config({"mooncake_config_path": str(cfg)}).pool
    assert s.enabled and s.dram_bytes == 1 << 29 and s.ssd_bytes == 2 << 30
    assert s.policy == "lfu" and s.block_size == 32 and s.block_size_set
    s.check(32)
    with pytest.raises(ConfigError, match=r"block size mismatch: \[kvcache\] block_size = 32"
                                          r".*vLLM runs with block_size = 128"):
        s.check(128)
    # No block_size given: vLLM's is used; keys in the extra config override the file.
    s = parse_extra_config({"kvcache": {"dram_cache_gb": 0.25, "save_queue_mb": 8}}).pool
    assert s.enabled and not s.block_size_set and s.save_queue_bytes == 8 << 20
    s.check(128)
    assert not parse_extra_config({}).pool.enabled
    with pytest.raises(ConfigError, match="unknown key 'dram_gb'"):
        parse_extra_config({"kvcache": {"dram_gb": 1}})
    with pytest.raises(ConfigError, match="expected a table"):
        parse_extra_config({"kvcache": 3})


def test_unwritable_cache_dir_is_refused_at_start(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    s = pool_settings(parse_extra_config({}).config, None,
                      {"dram_cache_gb": 0.01, "ssd_cache_gb": 0.1, "cache_dir": str(f / "kv")})
    with pytest.raises(ConfigError, match=r"cache_dir = .*a-file/kv.* cannot be a directory: "
                                          r".*a-file' is a file"):
        s.check(32)


# --- the scheduler side with a pool ------------------------------------------------------------
class FakeLookupAnswer:
    """A PoolLookup stand-in answering from a set of keys (scheduler logic only)."""

    def __init__(self, dram=(), ssd=()):
        self.dram, self.ssd, self.asked = set(dram), set(ssd), []

    def lookup(self, keys, remote=True):
        self.asked.append(list(keys))
        d = s = 0
        for k in keys:
            if k in self.dram and not s:
                d += 1
            elif k in self.ssd:
                s += 1
            else:
                break
        return (d, s, 0)

    def close(self):
        pass


class Req:
    def __init__(self, rid, toks, params=None, computed=0, status="FINISHED_STOPPED"):
        self.request_id, self.prompt_token_ids = rid, list(toks)
        self.all_token_ids = list(toks)
        self.kv_transfer_params, self.status = params, status
        self.num_computed_tokens = computed


def test_scheduler_loads_the_pools_prefix_after_vllms_own_hit():
    root = namespace_root("m", BS)
    toks = list(range(200))                                # 6 full blocks, 8 tokens more
    keys = block_keys(toks, BS, root)
    look = FakeLookupAnswer(dram=keys[:3], ssd=keys[3:5])
    sch = SchedulerSide(block_size=BS, is_producer=False, is_consumer=False, engine_name="e",
                        host="h", port=1, pool=look, pool_root=root)
    r = Req("r", toks)
    # vLLM had block 0; the pool has blocks 1..4 (block 5 is not in it).
    assert sch.get_num_new_matched_tokens(r, 32) == (4 * BS, True)
    assert look.asked[-1] == keys[1:6]
    sch.update_state_after_alloc(r, Blocks([9, 10, 11, 12, 13, 14, 15], cached=1), 4 * BS)
    w = sch.take_work()
    (spec,) = w.pool_loads
    assert spec.keys == keys[1:5] and spec.block_ids == [10, 11, 12, 13]
    assert w.lookups == [(6, 1, (2, 2, 0))]            # blocks by tier: a TierCounts
    # The whole prompt in the pool, prompt a multiple of the block: the last block is
    # computed (vLLM needs at least one token to compute).
    r2 = Req("r2", toks[:192])
    look.dram |= set(keys)
    assert sch.get_num_new_matched_tokens(r2, 0) == (5 * BS, True)
    # Finished: its computed full blocks are stored, its blocks held until then.
    r.num_computed_tokens = 199
    assert sch.request_finished(r, ([9, 10, 11, 12, 13, 14, 15],)) == (True, None)
    (save,) = sch.take_work().saves
    assert save.keys == keys and save.block_ids == [9, 10, 11, 12, 13, 14]


def test_scheduler_does_not_plan_a_failed_pool_load_again():
    # A peer killed with its blocks still in the owner index: the load fails, vLLM
    # (kv_load_failure_policy "recompute") asks again for the same request. Reporting the
    # same hit again looped the request through failing loads (found by
    # tests/integrations/test_conductor_e2e.py, an instance killed mid-trace).
    root = namespace_root("m", BS)
    toks = list(range(200))
    keys = block_keys(toks, BS, root)
    look = FakeLookupAnswer(dram=keys)
    sch = SchedulerSide(block_size=BS, is_producer=False, is_consumer=False, engine_name="e",
                        host="h", port=1, pool=look, pool_root=root)
    r = Req("r", toks)
    assert sch.get_num_new_matched_tokens(r, 0) == (6 * BS, True)
    sch.update_state_after_alloc(r, Blocks(list(range(7)), cached=0), 6 * BS)
    assert len(sch.take_work().pool_loads) == 1
    # the load failed: asked again, the request is computed, no load planned
    assert sch.get_num_new_matched_tokens(r, 0) == (0, False)
    sch.update_state_after_alloc(r, Blocks(list(range(7)), cached=0), 0)
    assert sch.take_work().pool_loads == []
    r.num_computed_tokens = 199
    sch.request_finished(r, (list(range(7)),))
    # a new request of the same id (vLLM reuses none, but the set is cleared) loads again
    assert sch.get_num_new_matched_tokens(Req("r", toks), 0) == (6 * BS, True)


def test_scheduler_pd_takes_the_pool_first_and_the_rest_from_the_producer():
    root = namespace_root("m", BS)
    toks = list(range(150))                                # 4 full blocks + 22 tokens
    keys = block_keys(toks, BS, root)
    look = FakeLookupAnswer(dram=keys[:2])
    cons = SchedulerSide(block_size=BS, is_producer=False, is_consumer=True,
                         engine_name="d", host="h", port=1, pool=look, pool_root=root)
    params = {"do_remote_prefill": True, "remote_engine": "p:1", "remote_request_id": "p1",
              "remote_block_ids": [20, 21, 22, 23, 24], "remote_num_tokens": 150}
    r = Req("d1", toks, dict(params))
    assert cons.get_num_new_matched_tokens(r, 0) == (150, True)
    cons.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 150)
    w = cons.take_work()
    (pl,) = w.pool_loads
    (ld,) = w.loads
    assert pl.block_ids == [1, 2] and pl.keys == keys[:2]
    assert (ld.local_block_ids, ld.remote_block_ids) == ([3, 4, 5], [22, 23, 24])


def test_hit_rate_line():
    line = hit_rate_line({"lookups": 2, "lookup_blocks": 10, "vllm_hit_blocks": 2,
                          "hit_dram": 3, "hit_ssd": 1, "hit_remote": 0, "blocks_saved": 7})
    assert line.startswith("kv cache hit rate: 60.0% of 10 prompt blocks in 2 requests "
                           "(vllm 20.0%, dram 30.0%, ssd 10.0%, remote 0.0%, miss 40.0%)")
    assert "blocks stored 7" in line


def test_prefault_keeps_every_byte():
    from mooncake_te.integrations.vllm.worker import _prefault
    import mmap
    mm = mmap.mmap(-1, 64 * 4096)
    buf = np.frombuffer(mm, dtype=np.uint8)[100:]          # not page aligned
    rng = np.random.default_rng(3)
    buf[:] = rng.integers(0, 256, len(buf), dtype=np.uint8)
    want = buf.copy()
    assert _prefault(buf) == len(buf)
    assert np.array_equal(buf, want)
    del buf


def test_a_process_that_exits_without_closing_still_persists(tmp_path):
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys, pathlib, uuid; sys.path.insert(0, {here!r})\n"
            "from test_vllm_pool import HostKV, _settings\n"
            "from mooncake_te.integrations.vllm.pool import (PoolWorker, SaveSpec, "
            "block_keys, namespace_root, lookup_address)\n"
            "kv = HostKV()\n"
            f"p = PoolWorker(_settings(pathlib.Path({str(tmp_path)!r}), dram_blocks=4, "
            "ssd_blocks=8), kv.layout, None, 'test-ns', lookup_address(uuid.uuid4().hex))\n"
            "p.save(SaveSpec('r', block_keys(list(range(96)), 32, namespace_root('m', 32)), "
            "[0, 1, 2]))\np.flush()\n")                        # no close(): exit
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    pool, addr = _pool(_settings(tmp_path, dram_blocks=4, ssd_blocks=8), HostKV())
    look = PoolLookup(addr)
    try:
        keys = block_keys(list(range(96)), BS, namespace_root("m", BS))
        assert look.lookup(keys) == (0, 3, 0)
    finally:
        look.close()
        pool.close()


# --- layer-wise saves: the scheduler side ------------------------------------------------------
def _sched_out(new=(), cached=(), resumed=(), scheduled=None):
    from types import SimpleNamespace as NS
    new_reqs = [NS(req_id=r, prompt_token_ids=toks, block_ids=(ids,), num_computed_tokens=c)
                for r, toks, ids, c in new]
    cr = NS(req_ids=[r for r, _, _ in cached], new_block_ids=[(b,) if b else None
                                                              for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached], resumed_req_ids=set(resumed))
    return NS(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cr,
              num_scheduled_tokens=dict(scheduled or {}))


def test_scheduler_hands_out_the_blocks_each_step_fills_for_layer_saves():
    root = namespace_root("m", BS)
    s = SchedulerSide(block_size=BS, is_producer=False, is_consumer=False, engine_name="e",
                      host="h", port=1, pool=object(), pool_root=root)
    toks = list(range(5 * BS + 7))                      # 5 full prompt blocks
    keys = block_keys(toks, BS, root)
    # Step 1: a chunked prefill of 2 blocks and a half; vLLM's prefix cache had block 0.
    s.layer_saves(_sched_out(new=[("r", toks, [10, 11, 12], BS)],
                             scheduled={"r": BS + BS + BS // 2}))
    w = s.take_work()
    assert [(x.request_id, x.keys, x.block_ids) for x in w.layer_saves] == \
        [("r", keys[1:3], [11, 12])]
    # Step 2: the rest of the prompt with three more blocks; blocks 3 and 4 fill.
    s.layer_saves(_sched_out(cached=[("r", [13, 14, 15], 3 * BS + BS // 2)],
                             scheduled={"r": len(toks) - 3 * BS - BS // 2}))
    w = s.take_work()
    assert [(x.keys, x.block_ids) for x in w.layer_saves] == [(keys[3:5], [13, 14])]
    # Decoding: nothing more (the whole prompt was handed out, the entry is gone).
    s.layer_saves(_sched_out(cached=[("r", None, len(toks))], scheduled={"r": 1}))
    assert s.take_work().layer_saves == [] and "r" not in s._layered
    # Preempted and resumed: a new block list, from what was computed.
    s.layer_saves(_sched_out(new=[("q", toks, [1, 2], 0)], scheduled={"q": BS}))
    assert [x.block_ids for x in s.take_work().layer_saves] == [[1]]
    s.layer_saves(_sched_out(cached=[("q", [7, 8, 9, 6, 5], 0)], resumed=["q"],
                             scheduled={"q": 4 * BS}))
    assert [(x.keys, x.block_ids) for x in s.take_work().layer_saves] == \
        [(keys[0:4], [7, 8, 9, 6])]
    # A finished request is forgotten; without a pool nothing is handed out.
    s.request_finished(type("R", (), {"request_id": "q", "kv_transfer_params": None,
                                      "prompt_token_ids": toks, "all_token_ids": toks,
                                      "num_computed_tokens": 0})(), [])
    assert "q" not in s._layered
    s2 = SchedulerSide(block_size=BS, is_producer=False, is_consumer=False, engine_name="e",
                       host="h", port=1)
    s2.layer_saves(_sched_out(new=[("r", toks, [1, 2, 3], 0)], scheduled={"r": 3 * BS}))
    assert s2.take_work().layer_saves == []


def test_a_host_copier_leaves_layer_saves_to_the_request_end(tmp_path):
    kv = HostKV()
    pool, _ = _pool(_settings(dram_blocks=8), kv)
    try:
        pool.begin_layer_saves([SaveSpec("r", [b"k" * 16], [1])])
        pool.save_layer("l0")
        pool.end_layer_saves()
        assert pool.flush() and pool.collect() == (set(), {})
        assert pool.take_counters()["blocks_saved"] == 0
    finally:
        pool.close()


def test_two_instances_share_one_cache_dir_without_set_up(tmp_path):
    """Two vLLM instances given the same cache_dir (issue 35, item 9): both start, each
    in a directory of its own (cache_dir, cache_dir/instance-1), and after a restart of
    both each finds its blocks again; an instance of another model (namespace) on the
    same cache_dir takes a fresh directory instead of being refused or reading theirs."""
    base = _settings(tmp_path, dram_blocks=4, ssd_blocks=8)
    keys = block_keys(list(range(3 * BS)), BS, namespace_root("m", BS))
    kvs = [HostKV(seed=40 + i) for i in (0, 1)]
    want = [[kv.block(b) for b in range(3)] for kv in kvs]
    pools = [_pool(base, kv)[0] for kv in kvs]               # both start
    dirs = [p.cache.ssd.dir for p in pools]
    assert dirs == [str(tmp_path / "kv"), str(tmp_path / "kv" / "instance-1")]
    for p in pools:
        p.save(SaveSpec("r", keys, [0, 1, 2]))
        p.flush()
        p.close()                                            # persisted to SSD
    # Both restarted (in the same order): each takes a directory of its layout again.
    restarted = []
    try:
        for i in (0, 1):
            kv, addr = HostKV(seed=50 + i), lookup_address(uuid.uuid4().hex)
            restarted.append((PoolWorker(base, kv.layout, None, "test-ns", addr), kv, addr))
        for i, (pool, kv, addr) in enumerate(restarted):
            assert pool.cache.ssd.dir == dirs[i]
            look = PoolLookup(addr)
            try:
                assert look.lookup(keys) == (0, 3, 0)
            finally:
                look.close()
            pool.load(PoolLoadSpec("x", keys, [7, 8, 9]))
            loaded: dict = {}
            _wait(lambda: loaded.update(pool.collect()[1]) or "x" in loaded)
            assert loaded["x"] is True
            for j, b in enumerate((7, 8, 9)):
                assert all(np.array_equal(kv.layers[n][b], want[i][j][n]) for n in range(2))
        other = PoolWorker(base, HostKV(seed=60).layout, None, "another-model",
                           lookup_address(uuid.uuid4().hex))
        try:        # cache_dir and instance-1 held: a fresh instance-2, none of their blocks
            assert other.cache.ssd.dir == str(tmp_path / "kv" / "instance-2")
            assert other.cache.stats()["ssd_recovered_blocks"] == 0
        finally:
            other.close()
    finally:
        for pool, _, _ in restarted:
            pool.close()
    # Another model alone on the cache_dir later: the two directories hold another
    # layout, so it goes back to its own instance-2 rather than reading theirs.
    other = PoolWorker(base, HostKV(seed=61).layout, None, "another-model",
                       lookup_address(uuid.uuid4().hex))
    try:
        assert other.cache.ssd.dir == str(tmp_path / "kv" / "instance-2")
    finally:
        other.close()

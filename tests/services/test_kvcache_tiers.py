# SPDX-License-Identifier: Apache-2.0
"""The tier interface (mooncake_te/kvcache/tiers.py): a toy tier registered here, in the
test, and nowhere else, shows up in the cache's lookups, reads, counters, stats, log
line and metrics, and through the vLLM pool in the lookup reply, the worker's counters
and the ``kv cache hit rate`` line, without a line of those modules naming it."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from mooncake_te.kvcache import KVCache
from mooncake_te.kvcache import tiers
from mooncake_te.kvcache.record import HEADER_SIZE, crc32_held, pack_header

BB = 4096 - HEADER_SIZE


class ObjStore(tiers.Tier):
    """An object store in a dict: shared by every cache of the process (as a bucket is
    by every instance), not local (one query per batch, with ``remote=True``)."""

    name = "objstore"
    description = "the object store"
    local = False
    failed_counter = "objstore_failed"
    objects: dict = {}           # key -> payload bytes (the "bucket")
    broken: set = set()          # keys whose read fails
    queries = 0

    @classmethod
    def open(cls, cache, args):
        return cls() if args.get("bucket") else None

    @classmethod
    def blank_stats(cls):
        return {"objects": 0}

    def lookup_prefix(self, keys):
        ObjStore.queries += 1
        n = 0
        for k in keys:
            if k not in self.objects:
                break
            n += 1
        return n

    def locate(self, keys):
        ObjStore.queries += 1
        return [(len(self.objects[k]), None) if k in self.objects else None for k in keys]

    def read_into(self, items):
        ok = []
        for key, _, n, view, _ in items:
            data = self.objects.get(key)
            if data is None or len(data) != n or key in self.broken:
                ok.append(False)
                continue
            view[HEADER_SIZE:HEADER_SIZE + n] = data
            view[:HEADER_SIZE] = pack_header(key, n, 1, crc32_held(data))
            ok.append(True)
        return ok

    def stats(self):
        return {"objects": len(self.objects)}


@pytest.fixture
def objstore():
    tiers.register(ObjStore)
    ObjStore.objects, ObjStore.broken, ObjStore.queries = {}, set(), 0
    try:
        yield ObjStore
    finally:
        tiers.unregister("objstore")


def block(i: int, n: int = BB) -> bytes:
    return bytes([i % 251]) * n


def test_registry_order_and_names(objstore):
    assert tiers.names() == ("dram", "ssd", "remote", "objstore")
    assert tiers.local_names() == ("dram", "ssd")
    with pytest.raises(ValueError, match="registered already"):
        tiers.register(ObjStore)
    with pytest.raises(ValueError, match="lower-case identifier"):
        tiers.register(type("Bad", (tiers.Tier,), {"name": "Bad Name"}))


def test_a_registered_tier_is_looked_up_read_counted_and_reported(objstore, tmp_path):
    keys = [bytes([i]) * 16 for i in range(6)]
    with KVCache(BB, 2 * 4096, 4 * 4096, str(tmp_path / "kv"), log_interval_s=0,
                 tiers={"objstore": {"bucket": "b"}}) as c:
        assert c.tier_names == ("dram", "ssd", "remote", "objstore") and c.can_remote
        c.put(keys[:3], [block(i) for i in range(3)])       # 2 in DRAM, 1 demoted to SSD
        for i in (3, 4):
            objstore.objects[keys[i]] = block(i)
        # The prefix: DRAM and SSD key by key, then the object store in one query.
        assert c.lookup_tiers(keys) == {"dram": 2, "ssd": 1, "remote": 0, "objstore": 0}
        got = c.lookup_tiers(keys, remote=True)
        assert got == {"dram": 2, "ssd": 1, "remote": 0, "objstore": 2}
        assert list(got) == list(tiers.names()) and objstore.queries == 1
        assert c.lookup(keys, remote=True) == 5
        where: list = []
        res = c.get(keys[3:6], remote=True, where=where)
        assert [bytes(r) for r in res[:2]] == [block(3), block(4)] and res[2] is None
        assert where == ["objstore", "objstore", None]
        assert c.tier(keys[3]) == "dram"                    # now in the hub
        s = c.stats()
        assert s["tiers"] == ["dram", "ssd", "remote", "objstore"]
        assert s["hit_blocks_objstore"] == 4 and s["served_objstore"] == 2
        assert s["served_objstore_bytes"] == 2 * BB and s["objstore_objects"] == 2
        assert s["block_hit_rate_objstore"] == 4 / 18 and "objstore_read_gbps" in s
        assert "remote 0.0%, objstore 22.2%" in c.log_stats()
        # A block the store cannot produce is a miss, counted by the tier's counter.
        objstore.objects[keys[5]] = block(5)
        objstore.broken.add(keys[5])
        assert c.get([keys[5]], remote=True) == [None] and keys[5] not in c
        assert c.stats()["objstore_failed"] == 1
    # Without its options the tier is not opened, but still counted (as zeros).
    with KVCache(BB, 2 * 4096, log_interval_s=0) as c:
        assert not c.can_remote
        assert c.lookup_tiers(keys) == {"dram": 0, "ssd": 0, "remote": 0, "objstore": 0}
        assert c.stats()["objstore_objects"] == 0


def test_a_registered_tier_is_exported_to_prometheus(objstore):
    pytest.importorskip("prometheus_client")
    from mooncake_te import metrics
    from metrics_names import samples, total            # tests/ (pytest's pythonpath)
    keys = [bytes([i]) * 16 for i in range(3)]
    objstore.objects.update({k: block(i) for i, k in enumerate(keys)})
    with KVCache(BB, 2 * 4096, namespace="tier-test", log_interval_s=0,
                 tiers={"objstore": {"bucket": "b"}}) as c:
        c.lookup(keys, remote=True)
        c.get(keys[:1], remote=True)
        got = samples(metrics.exposition().decode())
        lab = {"cache": "tier-test"}
        assert total(got, "mooncake_te_kvcache_hit_blocks_total", tier="objstore", **lab) == 3
        assert total(got, "mooncake_te_kvcache_served_bytes_total", tier="objstore",
                     **lab) == BB


# --- through the vLLM pool -----------------------------------------------------------------
class _Blocks:
    """The two KVCacheBlocks accessors the scheduler side uses."""

    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)

    def get_unhashed_block_ids(self):
        return list(self.ids)


class _Req:
    def __init__(self, rid, toks):
        self.request_id, self.prompt_token_ids = rid, list(toks)
        self.all_token_ids = list(toks)
        self.kv_transfer_params, self.status = None, "FINISHED_STOPPED"
        self.num_computed_tokens = 0


def test_a_registered_tier_goes_through_the_vllm_pool(objstore, monkeypatch):
    from mooncake_te.integrations.vllm import counters
    from mooncake_te.integrations.vllm.layout import KVLayout
    from mooncake_te.integrations.vllm.pool import (
        COUNTER_NAMES, PoolLookup, PoolSettings, PoolWorker, block_keys, lookup_address,
        namespace_root)
    from mooncake_te.integrations.vllm.scheduler import SchedulerSide
    from mooncake_te.integrations.vllm.settings import parse_extra_config
    from mooncake_te.integrations.vllm.worker import WorkerSide
    # The pool makes its cache without tier options: open the toy tier for any cache.
    monkeypatch.setattr(ObjStore, "open", classmethod(lambda cls, cache, args: cls()))
    bs, nb, blen = 16, 8, 2048
    layers = [np.zeros((nb, blen), np.uint8) for _ in range(2)]
    layout = KVLayout.from_regions(["a", "b"], [a.ctypes.data for a in layers],
                                   [blen] * 2, [blen] * 2, nb)
    addr = lookup_address(uuid.uuid4().hex)
    pool = PoolWorker(PoolSettings(dram_bytes=8 * 8192), layout, None, "tier-ns", addr)
    look = PoolLookup(addr)
    ws = WorkerSide(parse_extra_config({}), {}, "127.0.0.1", 0, is_producer=False,
                    is_consumer=False)
    ws.pool = pool
    try:
        assert pool.remote and "loaded_objstore" in COUNTER_NAMES
        root = namespace_root("m", bs)
        toks = list(range(4 * bs))                          # 4 blocks: 3 loadable
        keys = block_keys(toks, bs, root)[:3]
        for i, k in enumerate(keys):
            objstore.objects[k] = bytes([i + 1]) * (2 * blen)
        # The reply names its tiers: the registry's, the toy one included.
        rep = look.lookup(keys)
        assert rep == (0, 0, 0, 3) and rep.names == ("dram", "ssd", "remote", "objstore")
        # The scheduler: the pool's prefix, loaded into the blocks vLLM allocated.
        sch = SchedulerSide(block_size=bs, is_producer=False, is_consumer=False,
                            engine_name="e", host="h", port=1, pool=look, pool_root=root)
        r = _Req("r1", toks)
        assert sch.get_num_new_matched_tokens(r, 0) == (3 * bs, True)
        sch.update_state_after_alloc(r, _Blocks([1, 2, 3]), 3 * bs)
        work = sch.take_work()
        (spec,) = work.pool_loads
        assert spec.tiers.as_dict() == {"dram": 0, "ssd": 0, "remote": 0, "objstore": 3}
        assert work.lookups == [(4, 0, (0, 0, 0, 3))]
        # The worker: the load from the toy tier, counted as such.
        ws.start(work)
        assert ws.collect()[1] == {"r1"}
        assert layers[0][2, 0] == 2 and layers[1][3, -1] == 3
        d = ws.take_pool_stats()                            # what take_worker_stats reads
        assert d["hit_objstore"] == d["loaded_objstore"] == d["blocks_loaded"] == 3
        assert d["lookup_blocks"] == 4 and d["dram_blocks"] == 3
        assert "hit_objstore" in counters.sums() and "hit_objstore" in counters.SUMS
        assert counters.hit_rates(d)["objstore"] == 0.75
        line = counters.hit_rate_line(d)
        assert line.startswith("kv cache hit rate: 75.0% of 4 prompt blocks in 1 requests "
                               "(vllm 0.0%, dram 0.0%, ssd 0.0%, remote 0.0%, objstore "
                               "75.0%, miss 25.0%)"), line
        assert pool.take_counters()["loaded_objstore"] == 0  # taken by take_worker_stats
    finally:
        look.close()
        pool.close()

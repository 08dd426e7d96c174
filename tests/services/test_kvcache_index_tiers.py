# SPDX-License-Identifier: Apache-2.0
"""The owner index says where a block is (issue 37): a block demoted from its owner's
DRAM pool to its SSD tier keeps its record, marked ``"tier": "ssd"``, instead of losing
it, so the conductor routes its prefix back to the owner; peers' remote reads skip it
(another engine's SSD is private) and keep working for DRAM records; a promotion makes
the record DRAM again, and the record goes when the block leaves the SSD tier too.

On every store kind the index lives in: etcd, redis and our HTTP metadata server."""
from __future__ import annotations

import json

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.conductor import Cluster
from mooncake_te.kvcache import KVCache, prefix_hashes
from mooncake_te.kvcache.record import HEADER_SIZE
from servers import EtcdServer, HttpMetadataServer, RedisServer, _serve

BB = 8192 - HEADER_SIZE
SLOT = 8192
TOKEN = "kv-tier-test-token"
NS = "t-tiers"


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BB, dtype=np.uint8)


@pytest.fixture(params=["etcd", "redis", "http"])
def store_server(request):
    """Each store kind; our HTTP server with the cluster token (an engine with a token
    believes only replies signed with it)."""
    if request.param == "http":
        yield from _serve(HttpMetadataServer, token=TOKEN)
    else:
        yield from _serve({"etcd": EtcdServer, "redis": RedisServer}[request.param])


def test_ssd_moves_update_the_record(store_server, tmp_path):
    url = store_server.url
    keys = prefix_hashes(np.arange(16 * 16), 16)
    with mte.TransferEngine(name="kv-tier-a", metadata=url, host="127.0.0.1",
                            auth_token=TOKEN) as ea, \
            mte.TransferEngine(name="kv-tier-b", metadata=url, host="127.0.0.1",
                               auth_token=TOKEN) as eb, \
            KVCache(BB, 2 * SLOT, 4 * SLOT, str(tmp_path / "a"), engine=ea, namespace=NS,
                    log_interval_s=0) as a, \
            KVCache(BB, 4 * SLOT, 0, None, engine=eb, namespace=NS, log_interval_s=0) as b:
        store = eb.metadata
        # a's DRAM holds 2 blocks: putting 4 demotes the first 2 (LRU) to its SSD.
        a.put(keys[:4], [block(i) for i in range(4)])
        assert [a.tier(k) for k in keys[:4]] == ["ssd", "ssd", "dram", "dram"]
        assert a.flush_index()
        raw = json.loads(store.get(a._index._key(keys[0])))
        assert raw["owner"] == ea.name and raw["tier"] == "ssd" and raw["addr"] == 0
        assert raw["length"] == BB and "mac" in raw
        assert "tier" not in json.loads(store.get(a._index._key(keys[2])))   # DRAM: as was
        a_at = [(ea.name, "ssd")] * 2 + [(ea.name, "dram")] * 2
        assert b._index.lookup_tiers(keys[:4]) == a_at
        # What the conductor reads from the same store: the owner and the tier.
        c = Cluster(store=store)
        assert c.owners(NS, keys[:5]) == a_at + [None]

        # Peers' remote reads: the SSD records are no remote hit (no wasted read), the
        # DRAM ones are read as before.
        assert b.lookup(keys[:4], remote=True) == 0
        assert b.get(keys[:1], remote=True) == [None]
        assert b.stats()["remote_failed"] == 0 and b.stats()["remote_rejected_records"] == 0
        got = b.get(keys[2:4], remote=True)
        assert all(np.array_equal(g, block(i + 2)) for i, g in enumerate(got))
        assert b.flush_index()

        # A promotion (a reads keys[0] from its SSD) makes the record DRAM again; the
        # block it displaced (keys[3], the LRU one in a's DRAM) becomes an SSD record.
        # b re-published keys[2:4] as its own when it read them: a's demotion leaves a
        # peer's record alone.
        assert np.array_equal(a.get(keys[:1])[0], block(0))
        assert a.flush_index()
        assert b._index.lookup_tiers(keys[:1]) == [(ea.name, "dram")]
        assert a.tier(keys[2]) == "ssd"
        assert b._index.lookup_tiers(keys[2:3]) == [(eb.name, "dram")]

        # Out of both tiers: a's SSD holds 4 blocks; 8 new ones push the first out of
        # every tier, and their records go.
        a.put(keys[4:12], [block(i) for i in range(4, 12)])
        assert a.flush_index()
        gone = [k for k in keys[:12] if a.tier(k) is None]
        assert gone
        for k in gone:
            rec = store.get(a._index._key(k))
            assert rec is None or json.loads(rec)["owner"] != ea.name, k.hex()
        held = [k for k in keys[:12] if a.tier(k) is not None]
        tiers = dict(zip(held, b._index.lookup_tiers(held)))
        for k in held:
            if tiers[k] is not None and tiers[k][0] == ea.name:
                assert tiers[k][1] == a.tier(k), k.hex()

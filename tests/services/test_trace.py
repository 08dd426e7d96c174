# SPDX-License-Identifier: Apache-2.0
"""The trace simulator and ``mooncake-te trace``: the issue's numbers on the sample traces,
exactly; the fast policies against a brute-force model; the CLI's outputs and errors."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from mooncake_te.cli.main import main
from mooncake_te.errors import InvalidArgumentError
from mooncake_te.kvcache.trace import Trace, load_trace, simulate, sweep, trace_stats

# The sample traces ship with the repository (data/traces/README.md: source and checksums).
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "data", "traces")
CONV = os.path.join(DATA, "conversation_trace.jsonl")
SYN = os.path.join(DATA, "synthetic_trace.jsonl")



def test_sample_traces_ship_with_the_repository():
    """The traces are part of the checkout (never skipped) and match the recorded sums."""
    import hashlib
    with open(os.path.join(DATA, "SHA256SUMS")) as f:
        sums = dict(reversed(line.split()) for line in f if line.strip())
    assert sorted(sums) == ["conversation_trace.jsonl", "synthetic_trace.jsonl"]
    for name, want in sums.items():
        with open(os.path.join(DATA, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == want, name
        assert want in open(os.path.join(DATA, "README.md")).read()


@pytest.fixture(scope="module")
def conv():
    return load_trace(CONV)


@pytest.fixture(scope="module")
def syn():
    return load_trace(SYN)


# --- the issue's numbers (and traces.md 5.2's exact counts) ------------------------------
@pytest.mark.parametrize("which,cap,policy,hit_blocks,hit_tokens,rate", [
    ("conv", 10_000, "lru", 60_921, 31_174_981, 0.2112),
    ("conv", None, "lru", 105_710, 54_098_411, 0.3664),
    ("syn", 10_000, "lru", 51_614, 26_393_500, 0.4235),
    ("syn", None, "lru", 77_953, 39_852_661, 0.6396),
    ("conv", 10_000, "lfu", 38_013, 19_455_609, 0.1318),
    ("conv", 1_000, "lfu", 13_871, 7_100_235, 0.0481),
    ("syn", 1_000, "lfu", 4_885, 2_500_248, 0.0401),
    ("syn", 30_000, "lfu", 76_290, 39_004_152, 0.6260),
    ("conv", 5_859, "lru", 39_101, 20_006_915, 0.1355),
])
def test_sample_traces_reproduce_the_issue(request, which, cap, policy, hit_blocks,
                                           hit_tokens, rate):
    t = request.getfixturevalue(which)
    r = simulate(t, policy, cap)
    assert (r.hit_blocks, r.hit_tokens) == (hit_blocks, hit_tokens)
    assert round(r.block_hit_rate, 4) == rate
    assert r.blocks == (288_500 if which == "conv" else 121_877)
    assert r.tokens == (144_793_823 if which == "conv" else 61_194_628)


def test_stats_of_the_sample_traces(conv, syn):
    s = trace_stats(conv)
    assert (s["requests"], s["block_references"], s["unique_blocks"]) == (12_031, 288_500, 182_790)
    assert round(s["unlimited_token_hit_rate"], 4) == 0.3736
    s = trace_stats(syn)
    assert (s["requests"], s["unique_blocks"], s["input_tokens"]) == (3_993, 43_924, 61_194_628)
    assert round(s["unlimited_block_hit_rate"], 4) == 0.6396


def test_sweep_is_monotone_and_ends_at_the_plateau(syn):
    rs = sweep(syn, "lru")
    rates = [r.token_hit_rate for r in rs]
    # LRU has the inclusion property (Mattson et al. 1970): a larger cache holds a superset.
    assert rates == sorted(rates)
    assert rs[-1].capacity_blocks is None and round(rs[-1].token_hit_rate, 4) == 0.6512
    at3m = next(r for r in rs if r.extra["capacity_tokens"] == 3_000_000)
    assert round(at3m.token_hit_rate, 3) == 0.315           # traces.md 5.3


def test_warmup_counts_only_the_rest(conv):
    r = simulate(conv, "lru", None, warmup=0.5)
    assert r.measured_from == 6015 and r.requests == 12_031 - 6015
    assert r.token_hit_rate > simulate(conv, "lru", None).token_hit_rate


# --- the fast policies against a brute-force model ---------------------------------------
def brute_force(requests, policy, cap, bt=512):
    """The issue's definition written the slow, obvious way."""
    cache = {}              # key -> [freq, last access time]
    clock = 0
    hit_blocks = hit_tokens = 0
    for ids, length in requests:
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        hit_blocks += k
        hit_tokens += max(0, min(length, bt * k))
        for h in ids:
            clock += 1
            if h in cache:
                cache[h][0] += 1
                cache[h][1] = clock
                continue
            while cap is not None and len(cache) >= cap:
                if policy == "lru":
                    victim = min(cache, key=lambda x: cache[x][1])
                else:
                    victim = min(cache, key=lambda x: (cache[x][0], cache[x][1]))
                del cache[victim]
            cache[h] = [1, clock]
    return hit_blocks, hit_tokens


@st.composite
def traces(draw):
    n = draw(st.integers(1, 40))
    reqs = []
    for _ in range(n):
        # Prefix-structured ids: a request shares a prefix with a few "conversations".
        conv = draw(st.integers(0, 4))
        depth = draw(st.integers(1, 8))
        ids = [conv * 100 + i for i in range(depth)]
        tail = draw(st.lists(st.integers(1000, 1030), max_size=3, unique=True))
        ids += tail
        length = draw(st.integers(512 * (len(ids) - 1) + 1, 512 * len(ids)))
        reqs.append((ids, length))
    return reqs


@settings(max_examples=150, deadline=None)
@given(traces(), st.sampled_from(["lru", "lfu"]), st.one_of(st.none(), st.integers(1, 12)))
def test_simulation_matches_brute_force(reqs, policy, cap):
    t = Trace("<random>", [r[0] for r in reqs], [r[1] for r in reqs], [0] * len(reqs),
              list(range(len(reqs))))
    r = simulate(t, policy, cap)
    assert (r.hit_blocks, r.hit_tokens) == brute_force(reqs, policy, cap)
    assert r.peak_blocks <= (cap or 10 ** 9)


def test_bad_inputs(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n'
                 '{"timestamp": 1, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(InvalidArgumentError, match=r"t.jsonl:2: .*input_length"):
        load_trace(p)
    with pytest.raises(InvalidArgumentError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")
    t = Trace("x", [[1]], [3], [1], [0])
    with pytest.raises(InvalidArgumentError, match="positive number of blocks"):
        simulate(t, "lru", 0)
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy"):
        simulate(t, "fifo", 1)


# --- the command line --------------------------------------------------------------------
def test_cli_stats_replay_sweep(capsys):
    assert main(["trace", "stats", SYN, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["unique_blocks"] == 43_924
    assert main(["trace", "replay", CONV, "--policy", "lru", "--capacity-blocks", "10000"]) == 0
    out = capsys.readouterr().out
    assert "block hit rate  0.2112  (60,921 / 288,500)" in out
    assert main(["trace", "replay", SYN, "--capacity-tokens", "5120000", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["capacity_blocks"] == 10_000 and round(d["block_hit_rate"], 4) == 0.4235
    assert main(["trace", "sweep", SYN, "--capacities-tokens", "1e6,3e6", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)[SYN]
    assert [x["capacity_blocks"] for x in d] == [1953, 5859, None]


def test_cli_errors(tmp_path, capsys):
    assert main(["trace", "stats", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n')
    assert main(["trace", "replay", str(p), "--capacity-tokens", "100"]) == 2
    assert "less than one 512-token block" in capsys.readouterr().err
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["trace", "sweep", str(p), "--plot", str(tmp_path / "x.png")]) == 2
        assert "needs matplotlib" in capsys.readouterr().err
    else:
        assert main(["trace", "sweep", str(p), "--plot", str(tmp_path / "x.png")]) == 0
        assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_replay_real_dram_only_equals_the_simulation(capsys, tmp_path):
    # 600 blocks of 4 KiB slots (8 B/token x 512 tokens = 4096 B + header = 8 KiB slot).
    gib = 600 * 8192 / (1 << 30)
    assert main(["trace", "replay", SYN, "--real", "--requests", "600", "--dram-gb", repr(gib),
                 "--ssd-gb", "0", "--bytes-per-token", "8", "--verify", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    sim = simulate(load_trace(SYN).head(600), "lru", 600)
    assert d["dram_capacity_blocks"] == 600
    assert (d["hit_blocks"], d["hit_tokens"]) == (sim.hit_blocks, sim.hit_tokens)
    assert d["verify_mismatches"] == 0 and d["served_dram"] == sim.hit_blocks


def test_cli_replay_real_tiered_from_a_config(capsys, tmp_path):
    slot = 8192
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[kvcache]\ncache_dir = "{tmp_path / "kv"}"\n'
                   f'dram_cache_gb = {50 * slot / 2**30!r}\n'
                   f'ssd_cache_gb = {400 * slot / 2**30!r}\n'
                   f'eviction_policy = "lfu"\n')
    assert main(["trace", "replay", CONV, "--real", "--config", str(cfg), "--requests", "300",
                 "--bytes-per-token", "8", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "real cache, LFU, 300 requests" in out and "verify: 0 mismatching blocks" in out
    assert "DRAM tier  50 blocks" in out and "SSD tier  400 blocks" in out
    assert "kv cache hit rate" in out
    assert (tmp_path / "kv" / "kvcache.slab").stat().st_blocks > 0
    assert main(["trace"]) == 2                         # no subcommand: help

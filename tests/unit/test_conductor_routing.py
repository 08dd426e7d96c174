# SPDX-License-Identifier: Apache-2.0
"""The conductor's routing decisions on a fake cluster *state* (data only: instance
records, load, the owner index's answer as a list), and its measured terms."""
from __future__ import annotations

import numpy as np
import pytest

from mooncake_te.conductor import (Cluster, GpuShadow, InstanceRecord, Priors, Sample,
                                   expected_ttft, prefix_by_tier, refit, static_root)
from mooncake_te.conductor.cost import InstanceState, outstanding, rank_decode, rank_prefill
from mooncake_te.conductor.metrics import Counters, parse_vllm_metrics
from mooncake_te.integrations.vllm.pool.keys import block_keys, namespace_root

BS = 16


class FakeIndexStore:
    """The owner index's answer as data: ``{key string: owner}`` (the store's only
    question is get_many; this is the cluster state, not a server)."""

    cluster_id = None

    def __init__(self, owners=None):
        self.owners = owners or {}
        self.asked = 0

    def get_many(self, keys):
        self.asked += 1
        out = []
        for k in keys:
            o = self.owners.get(k)
            if o is None:
                out.append(None)
            elif isinstance(o, tuple):      # (owner, tier): the record says its tier
                out.append(b'{"owner": "%s", "tier": "%s", "addr": 0, "length": 1}'
                           % (o[0].encode(), o[1].encode()))
            else:                           # a record without a tier: DRAM
                out.append(b'{"owner": "%s", "addr": 4096, "length": 1}' % o.encode())
        return out


def cluster(n=3, store=None, role="plain"):
    c = Cluster(Priors(), store=store, default_root=namespace_root("m|torch.float32|auto", BS),
                default_namespace="ns", gpu_blocks=1000)
    for i in range(n):
        c.add(InstanceRecord(url=f"http://127.0.0.1:81{i:02d}", role=role, engine=f"e{i}",
                             block_size=BS), static=True)
    return c


def own(store, keys, owner):
    for k in keys:
        store.owners[f"mooncake/kvcache/ns/{k.hex()}"] = owner


def test_keys_are_the_connectors():
    # static_root is the connector's pool_root for `--model m --dtype float32`.
    assert static_root("m", "float32", "auto", BS) == namespace_root("m|torch.float32|auto", BS)
    c = cluster(1)
    toks = list(range(100))
    assert c.keys_for(toks, ["e0"])["e0"] == block_keys(toks, BS, c.default_root)
    assert len(c.keys_for(toks, ["e0"])["e0"]) == 6


def test_prefix_by_tier_order_and_stop():
    keys = [bytes([i]) * 16 for i in range(6)]
    gpu = {keys[0], keys[1]}
    owners = [None, None, "me", "other", None, "me"]
    # gpu, gpu, own pool, another's pool, then nothing: the prefix ends at key 4
    assert prefix_by_tier(keys, gpu, owners, "me") == {"gpu": 2, "dram": 1, "ssd": 0,
                                                        "remote": 1}
    assert prefix_by_tier(keys, set(), owners, "me") == {"gpu": 0, "dram": 0, "ssd": 0,
                                                         "remote": 0}
    # records with tiers: our SSD counts, another's SSD is private (the prefix ends)
    owners = [("me", "dram"), ("me", "ssd"), ("other", "dram"), ("other", "ssd"), None]
    assert prefix_by_tier(keys, set(), owners, "me") == {"gpu": 0, "dram": 1, "ssd": 1,
                                                         "remote": 1}
    # an instance that does not read other pools (kvcache.remote = false)
    assert prefix_by_tier(keys, set(), owners, "me", remote=False) == {
        "gpu": 0, "dram": 1, "ssd": 1, "remote": 0}


def test_routes_to_the_instance_holding_the_prefix():
    store = FakeIndexStore()
    c = cluster(3, store)
    toks = list(range(1000, 1000 + 512))
    keys = block_keys(toks, BS, c.default_root)
    own(store, keys, "e2")
    est, _, hits = c.rank_prefill(toks, ("plain",))
    assert est[0].name == "e2"
    assert hits["e2"] == {"gpu": 0, "dram": 32, "ssd": 0, "remote": 0}
    # the others could read e2's blocks remotely: cheaper than computing, dearer than local
    assert hits["e0"] == {"gpu": 0, "dram": 0, "ssd": 0, "remote": 32}
    assert est[0].ttft_s < est[1].ttft_s
    assert store.asked == 1                      # one index query for all instances


def test_gpu_shadow_beats_pool_and_bounded():
    c = cluster(2, FakeIndexStore())
    toks = list(range(320))
    keys = block_keys(toks, BS, c.default_root)
    c.shadows["e1"].add(keys)
    est, _, hits = c.rank_prefill(toks, ("plain",))
    assert est[0].name == "e1" and hits["e1"]["gpu"] == 20
    s = GpuShadow(3)
    s.add(keys[:5])
    assert len(s) == 3 and keys[0] not in s and keys[4] in s


def test_queue_outweighs_a_short_hit():
    c = cluster(2, FakeIndexStore())
    toks = list(range(64))                              # 4 blocks
    c.shadows["e0"].add(block_keys(toks, BS, c.default_root))
    c.states["e0"].inflight = 10
    c.states["e0"].queued_tokens = 20000                # a long prompt queued there
    est, _, _ = c.rank_prefill(toks, ("plain",))
    assert est[0].name == "e1"


def test_unhealthy_and_full_are_skipped():
    c = cluster(3, FakeIndexStore())
    c.states["e0"].healthy = False
    c.states["e1"].kv_usage = 0.99
    est, _, _ = c.rank_prefill(list(range(40)), ("plain",))
    assert [e.name for e in est] == ["e2"]
    c.states["e2"].inflight = c.priors.max_inflight
    assert c.rank_prefill(list(range(40)), ("plain",))[0] == []
    c.states["e2"].inflight = 0
    c.states["e2"].cooldown_until = 10.0
    assert c.rank_prefill(list(range(40)), ("plain",), now=5.0)[0] == []
    assert [e.name for e in c.rank_prefill(list(range(40)), ("plain",), now=11.0)[0]] == ["e2"]


def test_roles_prefill_and_decode():
    c = cluster(2, FakeIndexStore(), role="prefill")
    for i, (usage, running) in enumerate([(0.5, 1), (0.1, 30), (0.1, 2), (0.99, 0)]):
        c.add(InstanceRecord(url=f"http://127.0.0.1:82{i:02d}", role="decode",
                             engine=f"d{i}", block_size=BS))
        c.states[f"d{i}"].kv_usage = usage
        c.states[f"d{i}"].running = running
    assert c.rank_decode() == ["d2", "d1", "d0"]          # d3 is full
    est, _, _ = c.rank_prefill(list(range(40)), ("prefill",))
    assert {e.name for e in est} == {"e0", "e1"}


def test_expected_ttft_terms():
    p = Priors(base_s=0.01, prefill_s_per_token=1e-4,
               load_s_per_block={"gpu": 0.0, "dram": 1e-3, "remote": 2e-3})
    s = InstanceState("x", inflight=1, queued_tokens=100)
    e = expected_ttft(s, 160, {"gpu": 2, "dram": 3, "remote": 4}, 16, p)
    # queue 100*1e-4 + 1*0.01; base 0.01; uncached max(1, 160-9*16)=16; loads 3e-3 + 8e-3
    assert e.uncached == 16
    assert e.queue_s == pytest.approx(0.02)
    assert e.ttft_s == pytest.approx(0.02 + 0.01 + 16e-4 + 3e-3 + 8e-3)
    # a fully cached prompt still computes one token
    assert expected_ttft(s, 32, {"gpu": 2}, 16, p).uncached == 1


def test_refit_learns_the_instance_terms():
    p = Priors(min_samples=12)
    s = InstanceState("x")
    rng = np.random.default_rng(1)
    assert refit(s, p) is None
    for _ in range(40):
        u = int(rng.integers(1, 2000))
        d = int(rng.integers(0, 30))
        r = int(rng.integers(0, 30))
        s.samples.append((u, {"dram": d, "remote": r}, 0.004 + u * 3e-4 + d * 1e-3 + r * 4e-3))
    fit = refit(s, p)
    assert fit["tok"] == pytest.approx(3e-4, rel=1e-6)
    assert fit["load_dram"] == pytest.approx(1e-3, rel=1e-5)
    assert fit["load_remote"] == pytest.approx(4e-3, rel=1e-5)
    assert fit["base"] == pytest.approx(0.004, rel=1e-4)
    s.fit = fit
    assert s.terms(p)["tok"] == fit["tok"]


def test_refit_measures_the_queue_terms():
    """What a request ahead adds is fitted from the whole TTFT, not assumed: samples
    of an engine that batches (a request ahead adds 5 ms, whatever its own TTFT) give
    ``wait`` 5 ms and ``ahead_tok``; until then the priors assume one request at a time
    (what is ahead is done first: ``wait`` = ``base``, ``ahead_tok`` = ``tok``; not the
    served time, which holds the tokens ahead a second time). A few stalls of the shared
    host do not move the fit."""
    p = Priors(min_samples=12)
    s = InstanceState("x", served_s=0.08)
    assert s.terms(p)["wait"] == p.base_s and s.terms(p)["ahead_tok"] == p.prefill_s_per_token
    rng = np.random.default_rng(2)
    for i in range(100):
        u, ahead = int(rng.integers(1, 1000)), int(rng.integers(0, 4))
        at = ahead * int(rng.integers(0, 800))
        y = 0.01 + u * 2e-5 + ahead * 0.005 + at * 1e-6
        if i % 25 == 7:
            y += 0.9                                     # a stall
        s.samples.append(Sample(u, {}, y, ahead, at))
    fit = refit(s, p)
    assert fit["wait"] == pytest.approx(0.005, rel=1e-3)
    assert fit["ahead_tok"] == pytest.approx(1e-6, rel=1e-2)
    assert fit["tok"] == pytest.approx(2e-5, rel=1e-3)
    assert fit["base"] == pytest.approx(0.01, rel=1e-3)
    s.fit = fit
    assert s.terms(p)["wait"] == fit["wait"]
    # no request ever had one ahead: ``wait`` is not identifiable and keeps the prior
    q = InstanceState("q", served_s=0.03)
    for u in range(1, 40):
        q.samples.append(Sample(u * 10, {}, 0.01 + u * 1e-4))
    assert "wait" not in refit(q, p) and "ahead_tok" not in refit(q, p)


def test_shared_compute_is_measured_and_lets_the_cached_prefix_win():
    """Instances on one host's cores: a TTFT grows with the tokens in flight anywhere,
    not only ahead on its own instance. The fit finds ``shared_tok`` about equal to
    ``ahead_tok`` there, so an idle instance is no longer priced as faster than a busy
    one that holds the prompt's prefix; with compute of their own (``shared_tok`` 0) the
    same state sends the prompt to the idle one."""
    p = Priors(min_samples=12, load_bound=0)
    rng = np.random.default_rng(4)

    def fitted(shared: float) -> dict:
        s = InstanceState("x")
        for _ in range(120):
            u, own, other = (int(rng.integers(1, 1000)), int(rng.integers(0, 1500)),
                             int(rng.integers(0, 3000)))
            y = 0.01 + u * 6e-5 + own * 3e-4 + other * shared
            s.samples.append(Sample(u, {}, y, int(own > 0), own, other))
        return refit(s, p)

    fit = fitted(3e-4)
    assert fit["shared_tok"] == pytest.approx(3e-4, rel=1e-3)
    assert fit["ahead_tok"] == pytest.approx(3e-4, rel=1e-3)
    assert InstanceState("y").terms(p)["shared_tok"] == 0.0      # the prior: own compute
    busy = InstanceState("busy", inflight=1, queued_tokens=1000, fit=fit)
    idle = InstanceState("idle", fit=fit)
    hits = {"busy": {"gpu": 28}}                                  # 896 of 1024 tokens
    assert [e.name for e in rank_prefill([busy, idle], 1024, hits, 32, p)][0] == "busy"
    own = fitted(0.0)
    assert own.get("shared_tok", 0.0) == pytest.approx(0.0, abs=1e-9)
    busy.fit = idle.fit = own
    assert [e.name for e in rank_prefill([busy, idle], 1024, hits, 32, p)][0] == "idle"


def test_a_term_seen_in_too_few_samples_keeps_its_prior():
    """One request routed where another was ahead, stalled 1 s by the shared host, must
    not set what every request ahead costs: a column non-zero in fewer than
    ``min_samples // 2`` samples is left out; from that many on it is fitted."""
    p = Priors(min_samples=12)
    s = InstanceState("x")
    for u in range(1, 40):
        s.samples.append(Sample(u * 20, {}, 0.01 + u * 20 * 5e-5))
    s.samples.append(Sample(32, {}, 1.09, 1, 32))
    fit = refit(s, p)
    assert "wait" not in fit and "ahead_tok" not in fit
    s.fit = fit
    assert s.terms(p)["ahead_tok"] == fit["tok"]
    for i in range(5):
        s.samples.append(Sample(100, {}, 0.015 + 0.02, 1, 400 + 100 * i))
    assert "wait" in refit(s, p)


def test_nnls_keeps_every_term_non_negative():
    from mooncake_te.conductor.cost import _nnls
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0, 0.0])                  # slope -1: clipped at 0
    assert _nnls(a, y).tolist() == pytest.approx([1.5, 0.0])
    assert _nnls(a, 1.0 + 2.0 * a[:, 1]).tolist() == pytest.approx([1.0, 2.0])


def test_a_measured_small_wait_lets_a_busy_holder_keep_its_prefix():
    """With the priors what is ahead is done first (its 4,000 tokens at ``tok`` each), so
    an idle instance beats a busy one holding the prompt's prefix; once the samples show
    a request ahead adds little (vLLM batches), the holder keeps the prompt."""
    def first(fit):
        c = cluster(2, FakeIndexStore())
        c.priors.load_bound = 0
        toks = list(range(6000, 6000 + 1024))                # 64 blocks, all on e0
        c.shadows["e0"].add(block_keys(toks, BS, c.default_root))
        for n in ("e0", "e1"):
            c.states[n].served_s = 0.2
            c.states[n].fit = fit
        c.states["e0"].inflight = 1
        c.states["e0"].queued_tokens = 4000
        return c.rank_prefill(toks, ("plain",))[0][0].name

    assert first(None) == "e1"
    assert first({"base": 0.01, "tok": 5e-5, "wait": 0.01, "ahead_tok": 1e-6}) == "e0"


def test_index_outage_is_a_miss():
    class Down(FakeIndexStore):
        def get_many(self, keys):
            raise ConnectionError("store down")
    c = cluster(2, Down())
    est, _, hits = c.rank_prefill(list(range(64)), ("plain",))
    assert len(est) == 2 and hits["e0"] == {"gpu": 0, "dram": 0, "ssd": 0, "remote": 0}
    assert c.index_errors == 1


def test_sync_join_leave_keeps_static():
    c = cluster(1)
    new = {"d9": InstanceRecord(url="http://127.0.0.1:8999", role="decode", engine="d9")}
    assert c.sync(new) == (["d9"], [])
    assert c.sync({}) == ([], ["d9"])
    assert list(c.records) == ["e0"]


def test_record_validation():
    with pytest.raises(ValueError, match="role 'both'"):
        InstanceRecord(url="http://h:1", role="both")
    with pytest.raises(ValueError, match="expected http://host:port"):
        InstanceRecord(url="h:1")
    r = InstanceRecord(url="http://h:1/", role="decode", engine="h:2", root="ab")
    assert InstanceRecord.decode(r.encode()) == r and r.url == "http://h:1"


def test_vllm_metrics_parse_and_exposition():
    text = ('# HELP x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="64",x="y"} 1.0\n')
    assert parse_vllm_metrics(text) == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25,
                                        "num_gpu_blocks": 64}
    k = Counters()
    k.inc("mooncake_te_conductor_requests_total", instance='a"b', role="plain")
    out = k.exposition([("mooncake_te_conductor_instance_healthy", {"instance": "a"}, 1)])
    assert b'mooncake_te_conductor_requests_total{instance="a\\"b",role="plain"} 1' in out
    assert b"# TYPE mooncake_te_conductor_instance_healthy gauge" in out


def test_config_errors():
    from mooncake_te.conductor.config import build
    from mooncake_te.config import Config
    from mooncake_te.errors import ConfigError
    with pytest.raises(ConfigError, match="no instances"):
        build(Config.load(None, env={}), tokenizer=object())
    bad = Config.load(None, env={}).with_overrides({"conductor": {"decode": ["http://h:1"]}})
    with pytest.raises(ConfigError, match="prefill instance"):
        build(bad, tokenizer=object())
    with pytest.raises(ConfigError, match="full_kv_usage"):
        Config.load(None, env={}).with_overrides({"conductor": {"full_kv_usage": 2.0}})


def test_connector_api_url_setting():
    from mooncake_te.integrations.vllm.settings import parse_extra_config
    from mooncake_te.conductor import role_of
    assert parse_extra_config({"api_url": "http://10.0.0.1:8100/"}, env={}).api_url == \
        "http://10.0.0.1:8100"
    with pytest.raises(Exception, match="api_url = '10.0.0.1:8100'"):
        parse_extra_config({"api_url": "10.0.0.1:8100"}, env={})
    assert (role_of(True, False), role_of(False, True), role_of(True, True)) == \
        ("prefill", "decode", "plain")


def test_blocks_of_a_dead_instance_do_not_count():
    store = FakeIndexStore()
    c = cluster(2, store)
    toks = list(range(5000, 5000 + 320))
    own(store, block_keys(toks, BS, c.default_root), "e1")
    assert c.rank_prefill(toks, ("plain",))[2]["e0"]["remote"] == 20
    c.states["e1"].healthy = False
    est, _, hits = c.rank_prefill(toks, ("plain",))
    assert [e.name for e in est] == ["e0"] and hits["e0"]["remote"] == 0


def test_top_shows_the_conductor():
    from prometheus_client.parser import text_string_to_metric_families
    from mooncake_te.metrics.top import render, summarize
    k = Counters()
    k.inc("mooncake_te_conductor_requests_total", 3, instance="e0", role="plain")
    k.inc("mooncake_te_conductor_retries_total")
    k.inc("mooncake_te_conductor_ttft_expected_seconds_total", 0.3, instance="e0")
    k.inc("mooncake_te_conductor_ttft_measured_seconds_total", 0.6, instance="e0")
    k.inc("mooncake_te_conductor_ttft_samples_total", 3, instance="e0")
    text = k.exposition([("mooncake_te_conductor_instance_healthy", {"instance": "e0"}, 1),
                         ("mooncake_te_conductor_instance_inflight", {"instance": "e0"}, 2)])
    snap = {f.name: [(dict(s.labels), s.name, s.value) for s in f.samples]
            for f in text_string_to_metric_families(text.decode())}
    view = summarize(snap)
    assert view["conductor"] == {"retries": 1, "instances": {"e0": {
        "routed": 3, "expected_s": 0.3, "measured_s": 0.6, "samples": 3, "inflight": 2,
        "healthy": 1}}}
    render(view, "http://x/metrics")


def test_a_request_ahead_costs_what_requests_there_take():
    # Requests on one instance share its compute: one in flight with 6,000 uncached
    # tokens (300 ms at the prior's 50 us) outweighs a 20-block hit (the synthetic-trace
    # run stacked requests on hit holders while least-loaded spread them).
    c = cluster(2, FakeIndexStore())
    toks = list(range(640))
    c.shadows["e0"].add(block_keys(toks, BS, c.default_root)[:20])
    assert c.rank_prefill(toks, ("plain",))[0][0].name == "e0"
    c.states["e0"].inflight = 1
    assert c.rank_prefill(toks, ("plain",))[0][0].name == "e0"     # priors: worth it
    c.states["e0"].queued_tokens = 6000
    assert c.rank_prefill(toks, ("plain",))[0][0].name == "e1"


def test_like_instances_share_their_terms():
    """Samples of all instances of one model make one fit: an instance whose own few
    samples were slow (a noisy neighbour on a shared machine) is not shunned while it is
    idle; with fit_per_instance it is (the old behaviour, for unlike hardware)."""
    rng = np.random.default_rng(3)

    def run(per_instance: bool) -> str:
        c = cluster(3, FakeIndexStore())
        c.priors.fit_per_instance = per_instance
        for i in range(60):
            name = f"e{i % 3}"
            u = int(rng.integers(100, 2000))
            tok = 1e-3 if name == "e0" else 1e-5         # e0's samples: slow by chance
            c.measured(name, u, {}, 0.01 + u * tok, 0.0)
        c.states["e1"].inflight = c.states["e2"].inflight = 1
        est, _, _ = c.rank_prefill(list(range(1000)), ("plain",))
        return est[0].name

    assert run(False) == "e0"            # idle: least-loaded's choice too
    assert run(True) != "e0"
    c = cluster(2, FakeIndexStore())
    for i in range(20):
        c.measured(f"e{i % 2}", 100, {}, 0.05, 0.0)
    assert c.states["e0"].fit == c.states["e1"].fit
    assert c.states["e0"].served_s == c.states["e1"].served_s


def test_ssd_records_route_to_their_owner():
    """The owner index says a block moved to its owner's SSD (issue 37): the owner can
    serve the prefix from SSD, the others cannot read it (an SSD is private), so the
    prompt goes to the owner; before, the record was withdrawn and nobody had a hit."""
    store = FakeIndexStore()
    c = cluster(3, store)
    toks = list(range(2000, 2000 + 512))
    keys = block_keys(toks, BS, c.default_root)
    own(store, keys[:24], ("e1", "ssd"))
    own(store, keys[24:], ("e1", "dram"))
    est, _, hits = c.rank_prefill(toks, ("plain",))
    assert hits["e1"] == {"gpu": 0, "dram": 8, "ssd": 24, "remote": 0}
    assert hits["e0"] == {"gpu": 0, "dram": 0, "ssd": 0, "remote": 0}
    # with the priors (1 ms an SSD block, 0.8 ms to compute its 16 tokens) computing is
    # cheaper; where the SSD is faster than the model, the owner gets the prompt
    assert est[0].name == "e0"
    c.priors.load_s_per_block["ssd"] = 1e-4
    assert c.rank_prefill(toks, ("plain",))[0][0].name == "e1"
    # an SSD block costs its load term: more than DRAM, less than computing it
    p = c.priors
    e = expected_ttft(c.states["e1"], 512, {"ssd": 32}, BS, p)
    assert e.ttft_s == pytest.approx(p.base_s + p.prefill_s_per_token
                                     + 32 * p.load_s_per_block["ssd"])


def test_an_instance_without_remote_reads_has_no_remote_hits():
    """An instance whose connector does not read other pools (``kvcache.remote =
    false``, announced in its record) gets no hit from another instance's blocks, so the
    prompt goes where its blocks are; before, every instance counted them as a remote
    hit and routing followed the queues only."""
    store = FakeIndexStore()
    c = cluster(3, store)
    for r in c.records.values():
        r.remote = False
    c.priors.load_bound = 0            # the hits alone (the bound: test_load_bound_...)
    toks = list(range(3000, 3000 + 640))
    keys = block_keys(toks, BS, c.default_root)
    own(store, keys, "e2")
    c.states["e2"].inflight = 1                      # one request ahead there
    c.states["e2"].served_s = 0.02
    est, _, hits = c.rank_prefill(toks, ("plain",))
    assert hits["e0"] == {"gpu": 0, "dram": 0, "ssd": 0, "remote": 0}
    assert est[0].name == "e2"
    assert InstanceRecord.decode(InstanceRecord(url="http://h:1", remote=False).encode()
                                 ).remote is False
    assert InstanceRecord.decode(b'{"url": "http://h:1"}').remote is True   # older records


def test_affinity_keeps_a_prefix_family_where_it_is():
    """Near-tied instances (expected TTFT within ``affinity`` of the best): the one
    holding most of the prefix itself wins, so a conversation's next turn lands where
    its earlier turns are cached; past the tie the queue wins, and where nobody holds
    more than another (a prompt cached nowhere) the choice is the cost model's."""
    def route(inflight0, affinity=1.0, cached=True):
        c = cluster(2, FakeIndexStore())
        c.priors.affinity = affinity
        toks = list(range(4000, 4000 + 640))            # 40 blocks
        if cached:
            c.shadows["e0"].add(block_keys(toks, BS, c.default_root)[:20])
        c.states["e0"].inflight = inflight0
        c.states["e0"].queued_tokens = 800 * inflight0          # 40 ms each at 50 us
        est, _, _ = c.rank_prefill(toks, ("plain",))
        return [e.name for e in est]

    # one request ahead on e0 (10 + 40 ms) against a 20-block hit (16 ms of prefill saved):
    # the cost model alone prefers the idle e1, affinity keeps the family on e0
    assert route(1, affinity=0.0) == ["e1", "e0"]
    assert route(1) == ["e0", "e1"]
    # three requests ahead: no longer a tie
    assert route(3) == ["e1", "e0"]
    # nothing cached anywhere: least-loaded's choice, whatever the affinity
    assert route(1, cached=False) == ["e1", "e0"]
    assert route(0, cached=False) == ["e0", "e1"]


def test_estimates_within_the_fits_error_are_a_tie_the_holder_wins():
    """Two estimates closer than ``affinity_residuals`` times the fit's median absolute
    residual cannot be told apart: the instance holding more of the prefix gets the
    prompt. Past that margin, or with the margin off, the lower estimate wins; a holder
    past the load bound, or with more requests ahead while ``wait`` is still a prior,
    takes no part."""
    def route(residual, queued=600, bound=0.0, margin=2.0, fit_wait=True):
        c = cluster(2, FakeIndexStore())
        c.priors.load_bound = bound
        c.priors.affinity_residuals = margin
        toks = list(range(9000, 9000 + 640))                # 40 blocks
        c.shadows["e0"].add(block_keys(toks, BS, c.default_root)[:10])
        fit = {"base": 0.01, "tok": 5e-5, "wait": 0.01, "ahead_tok": 5e-5,
               "residual": residual}
        if not fit_wait:
            fit.pop("wait")                                 # the prior: base
        for n in ("e0", "e1"):
            c.states[n].fit = fit
        c.states["e0"].inflight, c.states["e0"].queued_tokens = 1, queued
        est, _, _ = c.rank_prefill(toks, ("plain",))
        return [e.name for e in est]

    # e0: 10 + 30 ms ahead, 480 uncached tokens (24 ms) = 74 ms; e1 idle: 42 ms
    assert route(0.005) == ["e1", "e0"]                     # 32 ms apart: not a tie
    assert route(0.020) == ["e0", "e1"]                     # within 2 x 20 ms
    assert route(0.020, margin=0) == ["e1", "e0"]
    assert route(0.020, queued=2000) == ["e1", "e0"]        # 100 ms ahead: no tie
    assert route(0.020, bound=1.0) == ["e1", "e0"]          # e0 over the bound
    # until a request ahead has been measured there, a tie puts none behind one
    assert route(0.020, fit_wait=False) == ["e1", "e0"]


def test_a_tie_goes_to_saved_compute_not_to_blocks():
    """A holder whose blocks are in a pool that loads slower than computing them (the
    tiny model on shared cores: 11.8 ms a block read against 1.5 ms computed) saves
    nothing, and a tie stays with the lower estimate; with a load cheaper than the
    compute, the holder wins the same tie."""
    def route(load_dram):
        c = cluster(2, FakeIndexStore())
        c.priors.load_bound = 0
        toks = list(range(12000, 12000 + 640))
        c.pool_shadows["e0"].capacity = 100
        c.pool_shadows["e0"].add(block_keys(toks, BS, c.default_root)[:4])
        fit = {"base": 0.01, "tok": 5e-5, "wait": 0.0, "ahead_tok": 5e-5,
               "load_dram": load_dram, "residual": 0.05}
        for n in ("e0", "e1"):
            c.states[n].fit = fit
        c.states["e0"].inflight, c.states["e0"].queued_tokens = 1, 200
        est, _, hits = c.rank_prefill(toks, ("plain",))
        assert hits["e0"]["dram"] == 4
        return [e.name for e in est]

    assert route(0.0118) == ["e1", "e0"]
    assert route(0.0002) == ["e0", "e1"]


def test_load_bound_keeps_a_cached_prefix_from_stacking_requests():
    """A cached prefix pulls requests to its holder only while the holder stays within
    ``load_bound`` times the mean load (consistent hashing with bounded loads); past
    it the others come first, the holder stays last for a retry. Without the bound the
    cost policy stacked 81 of 150 requests on one of three instances in a benchmark run
    (its TTFT p90 2-3x least-loaded's)."""
    def route(inflight, bound=1.25):
        c = cluster(3, FakeIndexStore())
        c.priors.load_bound = bound
        toks = list(range(5000, 5000 + 640))            # 40 blocks, all cached on e0
        c.shadows["e0"].add(block_keys(toks, BS, c.default_root))
        for n, k in zip(("e0", "e1", "e2"), inflight):
            c.states[n].inflight = k
            c.states[n].served_s = 0.01
        return [e.name for e in c.rank_prefill(toks, ("plain",))[0]]

    assert route((0, 0, 0))[0] == "e0"                  # idle: the hit wins
    assert route((1, 1, 1))[0] == "e0"                  # even load: still the hit
    # e0 one ahead of idle instances: 2 > ceil(1.25 * 2 / 3) = 1, the idle ones first
    assert route((1, 0, 0)) == ["e1", "e2", "e0"]
    assert route((1, 0, 0), bound=0)[0] == "e0"         # unbounded: the model's choice
    # busier cluster, more room: 3 <= ceil(1.25 * 6 / 3) = 3
    assert route((2, 2, 1))[0] == "e0"
    assert route((3, 1, 1))[0] != "e0"
    # vLLM's waiting count includes the conductor's own requests: the larger, not the sum
    c = cluster(1, FakeIndexStore())
    s = c.states["e0"]
    s.inflight, s.waiting = 2, 3
    assert outstanding(s) == 3


def test_a_pool_keeps_what_was_sent_to_it_after_another_publishes_it():
    """The owner index keeps one owner per block, the last to publish it: after e1
    computes (and publishes) a prefix e0 already holds, the index names e1 only. e0's
    pool still holds the prefix; what the conductor sent e0 (bounded by the capacity e0
    announced) says so, and with local pools the prompt may go to either holder; before,
    e0 had no hit at all."""
    store = FakeIndexStore()
    c = cluster(3, store)
    for n, r in c.records.items():
        r.remote = False
        r.pool_blocks = 1000 if n == "e0" else 0
        c.add(r)
    c.priors.load_bound = 0
    toks = list(range(7000, 7000 + 640))
    keys = block_keys(toks, BS, c.default_root)
    c.pool_shadows["e0"].add(keys)                  # routed to e0 earlier
    own(store, keys, "e1")                          # then e1 published the same blocks
    _, _, hits = c.rank_prefill(toks, ("plain",))
    assert hits["e0"]["dram"] == len(keys)
    assert hits["e1"]["dram"] == len(keys)
    assert hits["e2"] == {"gpu": 0, "dram": 0, "ssd": 0, "remote": 0}
    # the capacity announced bounds it (least recently sent first out)
    c.pool_shadows["e0"].add(block_keys(list(range(9000, 9000 + 16 * 1000)), BS,
                                        c.default_root))
    assert c.rank_prefill(toks, ("plain",))[2]["e0"]["dram"] == 0
    # a restart empties it
    c.pool_shadows["e0"].add(keys)
    c.pool_restarted("e0")
    assert c.rank_prefill(toks, ("plain",))[2]["e0"]["dram"] == 0
    assert InstanceRecord.decode(InstanceRecord(url="http://h:1", pool_blocks=7).encode()
                                 ).pool_blocks == 7

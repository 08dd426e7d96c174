# SPDX-License-Identifier: Apache-2.0
"""The pool's copier for a KV cache in GPU memory (vLLM on GPUs): the copier interface of
:mod:`.pool.copier` over :class:`mooncake_te.cuda.kvcopy.DeviceBlockCopier`.

- A save never builds a host image: ``fill(ids)`` is :meth:`KVCache.put`'s ``fill=``, which
  gathers the blocks on the GPU and DMAs each block image straight into its pool slot
  (page-locked once, :meth:`attach_pool`), on the copier's own stream, after a fence on
  vLLM's compute stream taken when the save was queued (:meth:`fence`, on the step
  thread), so the copy never reads a block before the forward pass that wrote it, and
  the forward pass never waits for the copy.
- A load queues each block image ``get(copy=)`` hands over (``scatter_held``) and moves
  them all in :meth:`flush`: one batched DMA into GPU staging and one scatter launch,
  done before the cache lets go of the slots. The blocks are written before the load is
  reported finished, so vLLM never schedules the request before its KV is there.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ...cuda.kvcopy import DeviceBlockCopier


def is_gpu_layout(layout) -> bool:
    """Whether a KV layout's first region is GPU memory (only then is CUDA asked: a host
    cache in a process that never used CUDA stays that way)."""
    from ... import cuda
    if not len(layout) or not cuda.loaded():
        return False
    try:
        return cuda.pointer_info(int(layout.base[0]))[0]
    except Exception:                   # no usable driver: a host cache
        return False


class GpuBlockCopier:
    """Blocks of a GPU KV cache to and from the pool's slots, batched (see the module).

    Parameters
    ----------
    layout : KVLayout
    staging_bytes : int
        GPU memory for staging block images (two halves used in turn).
    """

    def __init__(self, layout, staging_bytes: int = 64 << 20,
                 host_staging_bytes: int = 256 << 20):
        self.layout = layout
        self.dev = DeviceBlockCopier.from_layout(layout, staging_bytes)
        self.block_bytes = self.dev.block_bytes
        self.device = self.dev.device
        self._queued: list = []           # (block id, slot address) for flush
        self._pool: "int | None" = None
        # Layer-wise saves: page-locked block images (allocated on first use), handed
        # out by row; a layer's regions by the layer's name (vLLM's save_kv_layer).
        self._rows_total = max(0, int(host_staging_bytes) // self.block_bytes)
        self._host: Any = None            # cuda.PinnedBuffer
        self._free_rows: list = []
        self._rows_lock = threading.Lock()
        self._layers: dict = {}
        for r, name in enumerate(layout.names):
            self._layers.setdefault(name.split("#", 1)[0], []).append(r)

    # -- the pool -------------------------------------------------------------------------
    def attach_pool(self, cache) -> None:
        """Page-lock ``cache``'s DRAM pool so block images move by DMA."""
        self._pool = int(cache.base)
        self.dev.pin_host(cache.base, cache.dram_slots * cache.slot_size)

    def detach_pool(self) -> None:
        """Undo :meth:`attach_pool` (before the pool is unmapped)."""
        if self._pool is not None:
            self.dev.unpin_host(self._pool)
            self._pool = None

    # -- saves ----------------------------------------------------------------------------
    def fence(self):
        """An event on the calling thread's current CUDA stream (vLLM's forward pass), for
        :meth:`fill`'s ``after``; None when PyTorch is not there to say which stream."""
        try:
            import torch
        except ImportError:               # pragma: no cover - vLLM always has torch
            return None
        return self.dev.fence(torch.cuda.current_stream(self.device).cuda_stream)

    def fill(self, block_ids, after=None):
        """``KVCache.put(fill=)`` for blocks ``block_ids`` (``ids[i]`` for key ``i``)."""
        ids = list(block_ids)

        def fill(items):
            self.dev.gather_to([ids[i] for i, _ in items],
                               [v.ctypes.data for _, v in items], after=after)
        return fill

    def gather_many(self, block_ids, out: np.ndarray) -> None:
        """Blocks into the rows of ``out`` (host memory; page-locked is fastest)."""
        bb = self.block_bytes
        base = out.ctypes.data
        self.dev.gather_to(block_ids, [base + i * bb for i in range(len(block_ids))])

    # -- layer-wise saves ---------------------------------------------------------------
    def layer_begin(self, block_ids) -> "_LayerJob | None":
        """Staging rows for (the first of) ``block_ids``, or None when none is free; the
        job's ``blocks`` says how many it covers."""
        with self._rows_lock:
            if self._host is None and self._rows_total:
                from ... import cuda
                self._host = cuda.PinnedBuffer(self._rows_total * self.block_bytes,
                                               self.device)
                self._free_rows = list(range(self._rows_total - 1, -1, -1))
            n = min(len(block_ids), len(self._free_rows))
            if n == 0:
                return None
            rows = [self._free_rows.pop() for _ in range(n)]
        return _LayerJob(list(block_ids[:n]), rows)

    def _current_stream(self) -> int:
        import torch
        return torch.cuda.current_stream(self.device).cuda_stream

    def layer_copy(self, job: "_LayerJob", layer_name: str) -> None:
        """Queue ``layer_name``'s pieces of the job's blocks (after the work queued so far
        on vLLM's stream: the layer's attention that wrote them)."""
        regions = self._layers.get(layer_name)
        if regions is None or layer_name in job.copied:
            return
        job.copied.add(layer_name)
        self._copy(job, regions)

    def _copy(self, job: "_LayerJob", regions) -> None:
        fence = self.dev.fence(self._current_stream())
        try:
            base = self._host.address
            self.dev.copy_regions_async(regions, job.block_ids,
                                        [base + r * self.block_bytes for r in job.rows],
                                        after=fence)
        finally:
            fence.close()

    def layer_end(self, job: "_LayerJob") -> None:
        """The layers not announced are queued now; an event marks the job's end, and
        vLLM's stream waits for it on the GPU (its next kernels may not overwrite a
        block still being copied out), the host not at all."""
        rest = [r for name, rs in self._layers.items() if name not in job.copied for r in rs]
        if rest:
            job.copied.update(self._layers)
            self._copy(job, rest)
        job.done = self.dev.record()
        from ... import cuda
        cuda._check(cuda._lib().cuStreamWaitEvent(self._current_stream(), job.done.handle, 0),
                    "cuStreamWaitEvent(vLLM's stream)")

    def layer_fill(self, job: "_LayerJob", rows):
        """``KVCache.put(fill=)`` from the job's staged rows ``rows[i]`` for key ``i``
        (on the saver thread: waits here, before the cache is locked, for the copies to
        land)."""
        if job.done is not None:
            job.done.synchronize()

        def fill(items):
            host = self._host.array
            bb = self.block_bytes
            for i, view in items:
                r = job.rows[rows[i]]
                view[:] = host[r * bb:(r + 1) * bb]
        return fill

    def layer_release(self, job: "_LayerJob") -> None:
        """Give the job's rows back (after its copies ended)."""
        if job.done is not None:
            job.done.synchronize()
            job.done.close()
            job.done = None
        with self._rows_lock:
            self._free_rows.extend(job.rows)
            job.rows = []

    # -- loads ----------------------------------------------------------------------------
    def scatter_held(self, block_id: int, src: np.ndarray) -> None:
        """Queue a block image (a pool slot's view) for block ``block_id``; :meth:`flush`
        copies every queued one."""
        b = int(block_id)
        if not 0 <= b < self.layout.num_blocks:
            raise IndexError(f"block id {b} is outside vLLM's {self.layout.num_blocks} "
                             f"blocks")
        self._queued.append((b, src.ctypes.data))

    def discard(self) -> None:
        """Forget queued block images (a load that failed before its flush)."""
        self._queued = []

    def flush(self) -> None:
        q, self._queued = self._queued, []
        if q:
            self.dev.scatter_from([a for _, a in q], [b for b, _ in q])

    def close(self) -> None:
        self.detach_pool()
        self.dev.close()
        if self._host is not None:
            self._host.close()
            self._host = None


class _LayerJob:
    """Blocks being copied out layer by layer into staging rows."""

    def __init__(self, block_ids: list, rows: list):
        self.block_ids, self.rows = block_ids, rows
        self.blocks = len(block_ids)
        self.copied: set = set()
        self.done: Any = None             # cuda.Event after the last copy

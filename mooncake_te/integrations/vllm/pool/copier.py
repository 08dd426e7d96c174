# SPDX-License-Identifier: Apache-2.0
"""Copies between vLLM's KV blocks and the pool's block images, and :func:`make_copier`,
which picks the copier for a KV layout.

What the pool asks of a copier: ``block_bytes``; ``gather_many(ids, out)`` (a save:
blocks into the rows of a host array, then :meth:`KVCache.put`); ``scatter_held(id,
view)`` (a load: one block image, a read-only view of a pool slot, into vLLM's block, as
:meth:`KVCache.get`'s ``copy=``). Two optional methods let a copier skip host images:
``fill(ids)``, when present, returns a ``put(fill=)`` callback that writes the blocks
straight into the pool's slots (the save then uses it instead of ``gather_many``), and
``flush()``, when present, is called by ``get(copy=)`` after each batch of
``scatter_held`` calls, while the slots are still valid (a copier may queue its copies
and run them there as one batch). A GPU copier also has ``attach_pool(cache)`` (page-lock
the pool), ``fence()`` (taken when a save is queued, on the step thread: the copy waits
for the forward pass queued so far), ``discard()`` (drop queued copies after a failed
load) and ``close()``.
"""
from __future__ import annotations

import ctypes

import numpy as np


def make_copier(layout, gpu_staging_bytes: int = 64 << 20,
                host_staging_bytes: int = 256 << 20):
    """The copier for ``layout``: :class:`~..gpu_copier.GpuBlockCopier` when its regions
    are GPU memory (vLLM on GPUs: batched DMA through ``fill``/``flush`` above, with GPU
    staging of ``gpu_staging_bytes``), else :class:`BlockCopier` (host memory, numpy
    views). :class:`~.worker.PoolWorker` needs no other change for either."""
    from ..gpu_copier import GpuBlockCopier, is_gpu_layout
    if is_gpu_layout(layout):
        return GpuBlockCopier(layout, gpu_staging_bytes, host_staging_bytes)
    return BlockCopier(layout)


# libc's memmove through ctypes.PyDLL, whose calls keep the GIL (CDLL's and ctypes.memmove
# let go of it): see BlockCopier.scatter_held.
_memmove_held = ctypes.PyDLL(None).memmove
_memmove_held.restype = ctypes.c_void_p
_memmove_held.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class BlockCopier:
    """Copies vLLM blocks (R regions, ``block_len[r]`` bytes each) to and from flat block
    images (the regions one after another), through numpy views of host memory."""

    def __init__(self, layout):
        self.layout = layout
        self.offsets = np.concatenate(([0], np.cumsum(layout.block_len.astype(np.int64))))
        self.block_bytes = int(self.offsets[-1])
        self._views = []
        for base, stride, blen in zip(layout.base, layout.stride, layout.block_len):
            nbytes = int(stride) * (layout.num_blocks - 1) + int(blen)
            buf = (ctypes.c_uint8 * nbytes).from_address(int(base))
            self._views.append((np.frombuffer(buf, dtype=np.uint8), int(stride), int(blen)))
        self._regions = [(int(base), int(stride), int(blen), int(off)) for base, stride, blen,
                         off in zip(layout.base, layout.stride, layout.block_len, self.offsets)]

    def scatter_held(self, block_id: int, src: np.ndarray) -> None:
        """A block image (``block_bytes`` contiguous bytes, say a slot of the pool's DRAM
        tier) into block ``block_id`` of every region, one ``memmove`` per region with
        the GIL held: numpy's copies let go of it, and beside vLLM's engine loop each
        let-go costs a switch interval (see :meth:`scatter_many`), so a block at a time
        is only cheap this way. For :meth:`KVCache.get`'s ``copy=``."""
        b = int(block_id)
        if not 0 <= b < self.layout.num_blocks:
            raise IndexError(f"block id {b} is outside vLLM's {self.layout.num_blocks} "
                             f"blocks")
        if src.nbytes < self.block_bytes or not src.flags.c_contiguous:
            raise ValueError(f"a block image must be {self.block_bytes} contiguous bytes, "
                             f"got {src.nbytes}")
        a = src.ctypes.data
        for base, stride, blen, off in self._regions:
            _memmove_held(base + b * stride, a + off, blen)

    def gather(self, block_id: int, out: np.ndarray) -> None:
        """Block ``block_id`` of every region into ``out`` (``block_bytes`` bytes)."""
        b = int(block_id)
        for (v, stride, blen), off in zip(self._views, self.offsets):
            out[off:off + blen] = v[b * stride:b * stride + blen]

    def scatter(self, block_id: int, src) -> None:
        """A block image (from :meth:`gather`) into block ``block_id`` of every region."""
        b = int(block_id)
        for (v, stride, blen), off in zip(self._views, self.offsets):
            v[b * stride:b * stride + blen] = src[off:off + blen]

    # The many-block forms copy with one numpy operation per region, not one per block
    # and region. That matters beyond the per-call cost: each copy releases the GIL, and
    # beside vLLM's engine loop (a busy Python thread) every release costs this thread a
    # switch interval (5 ms) before it runs again. Block by block, a 61-block load took
    # 50 s there; region by region it is 8 hand-offs.
    def _rows(self, v: np.ndarray, stride: int, blen: int) -> np.ndarray:
        return np.lib.stride_tricks.as_strided(v, shape=(self.layout.num_blocks, blen),
                                               strides=(stride, 1), writeable=True)

    def gather_many(self, block_ids, out: np.ndarray) -> None:
        """Blocks ``block_ids`` into the rows of ``out`` (``[len(block_ids), block_bytes]``)."""
        ids = np.asarray(block_ids, dtype=np.intp)
        for (v, stride, blen), off in zip(self._views, self.offsets):
            out[:, off:off + blen] = self._rows(v, stride, blen)[ids]

    def scatter_many(self, block_ids, images: np.ndarray) -> None:
        """The rows of ``images`` into blocks ``block_ids`` of every region."""
        ids = np.asarray(block_ids, dtype=np.intp)
        for (v, stride, blen), off in zip(self._views, self.offsets):
            self._rows(v, stride, blen)[ids] = images[:, off:off + blen]



# SPDX-License-Identifier: Apache-2.0
"""Batched copies between a paged KV cache in GPU memory and flat block images anywhere
(a KV pool's page-locked slots, mostly).

A paged KV cache holds block ``b`` of region ``r`` (a layer, or a layer's K or V plane) at
``base[r] + b * stride[r]``, ``block_len[r]`` bytes; a *block image* is one block of every
region, one after another (:class:`~mooncake_te.integrations.vllm.layout.KVLayout` in the
vLLM connector). Moving n blocks between the two is n x R small pieces (R = 64 for a
32-layer model with K and V planes, a piece 32 KiB at 16 tokens x 8 heads x 128 dims x
bf16). Copying each piece with its own ``cudaMemcpyAsync`` costs a driver call, and the
PCIe copy engine runs small copies far below its rate. So the pieces move in two steps:

1. one launch of ``mte_copy_pieces`` (``src/cuda/kvcopy.cu``, shipped as PTX) gathers the
   pieces from the KV cache into block images in a GPU staging buffer (or scatters them
   back), at HBM speed, every piece in one launch;
2. one batched copy (``cuMemcpyBatchAsync`` where the driver has it, CUDA 12.8+) moves
   each whole block image between staging and its destination, so the copy engine sees
   large copies only.

The staging buffer is two halves used in turn, so gathering chunk k+1 overlaps the PCIe
copy of chunk k. Everything runs on a stream of the copier's own; :meth:`fence` makes
that stream wait for work on another stream (vLLM's forward pass) without blocking the
host. Page-locking the host side once (:meth:`pin_host`) lets the copy engine DMA
straight into it.
"""
from __future__ import annotations

import ctypes
import os
import threading
from ctypes import byref

import numpy as np

from .. import errors as E
from . import (Event, PinnedBuffer, Stream, _check, _lib, device, host_register,
               host_unregister, pointer_info)
from . import _driver as D

_PTX = os.path.join(os.path.dirname(__file__), "kvcopy.ptx")
_modules: dict = {}                     # ordinal -> (module, function)
_mod_lock = threading.Lock()

THREADS = 512                           # per thread block: a 32 KiB piece is 4 passes


def _kernel(ordinal: int):
    """``mte_copy_pieces`` loaded into device ``ordinal``'s primary context (the driver
    JIT-compiles the PTX for this GPU once per process)."""
    with _mod_lock:
        f = _modules.get(ordinal)
        if f is not None:
            return f
        with open(_PTX, "rb") as fh:
            image = ctypes.create_string_buffer(fh.read() + b"\0")
        lib = _lib()
        mod, fn = D.CUmodule(), D.CUfunction()
        with device(ordinal):
            _check(lib.cuModuleLoadData(byref(mod), image), f"load {_PTX}")
            _check(lib.cuModuleGetFunction(byref(fn), mod, b"mte_copy_pieces"),
                   "cuModuleGetFunction(mte_copy_pieces)")
            sms = ctypes.c_int(0)
            dev = D.CUdevice()
            _check(lib.cuDeviceGet(byref(dev), ordinal), f"cuDeviceGet({ordinal})")
            _check(lib.cuDeviceGetAttribute(byref(sms), D.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                            dev), "multiprocessor count")
        _modules[ordinal] = f = (mod, fn, max(1, sms.value))
        return f


def batch_copy_kind() -> str:
    """How :func:`copy_many` issues its copies on this driver: ``"batch"``
    (``cuMemcpyBatchAsync``, one call) or ``"loop"`` (one ``cuMemcpyAsync`` a copy)."""
    lib = _lib()
    if getattr(lib, "cuMemcpyBatchAsync_v2", None) is not None or \
            getattr(lib, "cuMemcpyBatchAsync", None) is not None:
        return "batch"
    return "loop"


_ATTR = D.CUmemcpyAttributes()
_ATTR.srcAccessOrder = D.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_ATTR_IDX = (ctypes.c_size_t * 1)(0)


def copy_many(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: Stream,
              batched: bool = True) -> None:
    """Copies ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` on ``stream`` (uint64
    arrays; unified addressing: device, page-locked host, or either with the other).
    ``batched=False`` forces one ``cuMemcpyAsync`` a copy (pageable host memory). The
    caller makes the stream's device current."""
    n = len(dsts)
    if n == 0:
        return
    lib = _lib()
    d = np.ascontiguousarray(dsts, dtype=np.uint64)
    s = np.ascontiguousarray(srcs, dtype=np.uint64)
    z = np.ascontiguousarray(sizes, dtype=np.uint64)
    pd = d.ctypes.data_as(ctypes.POINTER(D.CUdeviceptr))
    ps = s.ctypes.data_as(ctypes.POINTER(D.CUdeviceptr))
    pz = z.ctypes.data_as(ctypes.POINTER(ctypes.c_size_t))
    fn = getattr(lib, "cuMemcpyBatchAsync_v2", None) if batched else None
    if fn is not None:
        _check(fn(pd, ps, pz, n, byref(_ATTR), _ATTR_IDX, 1, stream.handle),
               f"cuMemcpyBatchAsync({n} copies)")
        return
    fn = getattr(lib, "cuMemcpyBatchAsync", None) if batched else None
    if fn is not None:
        fail = ctypes.c_size_t(0)
        rc = fn(pd, ps, pz, n, byref(_ATTR), _ATTR_IDX, 1, byref(fail), stream.handle)
        _check(rc, f"cuMemcpyBatchAsync({n} copies; copy {fail.value} failed)")
        return
    for i in range(n):                  # drivers before CUDA 12.8: one call a block image
        _check(lib.cuMemcpyAsync(int(d[i]), int(s[i]), int(z[i]), stream.handle),
               "cuMemcpyAsync")


SPLIT = 64 << 10                        # pieces longer than this are cut for the kernel


def copy_pieces_async(ordinal: int, dst: np.ndarray, src: np.ndarray, lens: np.ndarray,
                      stream: Stream) -> bool:
    """Queue ``mte_copy_pieces`` on ``stream`` for pieces ``src[i] -> dst[i]``
    (``lens[i]`` bytes; device memory of one GPU, IPC-mapped memory of a peer, or
    page-locked host memory): one launch for all of them, long pieces cut into 64 KiB
    parts so every SM has work. The piece table lives in stream-ordered device memory
    freed after the launch, so nothing waits here. False when the driver lacks
    stream-ordered allocation (CUDA < 11.2): then use :func:`copy_many`. The caller makes
    the stream's device current."""
    lib = _lib()
    alloc = getattr(lib, "cuMemAllocAsync", None)
    if alloc is None or getattr(lib, "cuMemcpyHtoDAsync_v2", None) is None:
        return False
    dst = np.asarray(dst, np.uint64)
    src = np.asarray(src, np.uint64)
    lens = np.asarray(lens, np.uint64)
    if not len(lens) or int(lens.max()) <= SPLIT:  # vLLM's pieces (32 KiB): as they are
        k = len(lens)
        table = np.stack((src, dst, lens))
    else:
        parts = (lens + np.uint64(SPLIT - 1)) // np.uint64(SPLIT)
        parts = np.maximum(parts, 1).astype(np.int64)
        k = int(parts.sum())
        first = np.repeat(np.cumsum(parts) - parts, parts)
        off = (np.arange(k, dtype=np.int64) - first).astype(np.uint64) * np.uint64(SPLIT)
        table = np.empty((3, k), np.uint64)
        table[0] = np.repeat(src, parts) + off
        table[1] = np.repeat(dst, parts) + off
        table[2] = np.minimum(np.repeat(lens, parts) - off, np.uint64(SPLIT))
    p = D.CUdeviceptr(0)
    _check(alloc(byref(p), table.nbytes, stream.handle), "cuMemAllocAsync(piece table)")
    try:
        # From pageable memory the driver has taken the bytes when this returns.
        _check(lib.cuMemcpyHtoDAsync_v2(p.value, table.ctypes.data, table.nbytes,
                                        stream.handle), "piece table to the GPU")
        _mod, fn, sms = _kernel(ordinal)
        args = [ctypes.c_uint64(p.value), ctypes.c_uint64(p.value + 8 * k),
                ctypes.c_uint64(p.value + 16 * k), ctypes.c_uint64(k)]
        params = (ctypes.c_void_p * 4)(*[ctypes.cast(byref(a), ctypes.c_void_p) for a in args])
        _check(lib.cuLaunchKernel(fn, max(1, min(k, 4 * sms)), 1, 1, THREADS, 1, 1, 0,
                                  stream.handle, params, None),
               "cuLaunchKernel(mte_copy_pieces)")
    finally:
        lib.cuMemFreeAsync(p.value, stream.handle)
    return True


def _pairs(block_ids, addrs, what: str):
    """(ids, addresses) as uint64 arrays of one length each."""
    ids = np.asarray(block_ids, dtype=np.uint64).reshape(-1)
    a = np.asarray(addrs, dtype=np.uint64).reshape(-1)
    if len(ids) != len(a):
        raise E.InvalidArgumentError(f"{len(ids)} blocks but {len(a)} {what}")
    return ids, a


class _Half:
    """One half of the staging: device memory for block images, the piece table on the
    device and in page-locked host memory, and an event marking when its last use ended."""

    def __init__(self, ordinal: int, stage_bytes: int, max_pieces: int):
        lib = _lib()
        p = D.CUdeviceptr(0)
        _check(lib.cuMemAlloc_v2(byref(p), stage_bytes), f"cuMemAlloc({stage_bytes}) for "
               f"KV staging (lower gpu_staging_mb if the GPU is full)")
        self.stage = p.value
        t = D.CUdeviceptr(0)
        _check(lib.cuMemAlloc_v2(byref(t), 24 * max_pieces), "cuMemAlloc(piece table)")
        self.table = t.value
        self.host_table = PinnedBuffer(24 * max_pieces, ordinal)
        self.table_view = self.host_table.array.view(np.uint64).reshape(3, max_pieces)
        self.done = Event(ordinal)
        self.used = False

    def close(self) -> None:
        lib = _lib()
        for a in (self.stage, self.table):
            if a:
                lib.cuMemFree_v2(a)
        self.stage = self.table = 0
        self.host_table.close()
        self.done.close()


class DeviceBlockCopier:
    """Moves blocks of a GPU KV cache to and from block images, batched.

    Parameters
    ----------
    base, stride, block_len : sequence of int
        Per region: address of block 0 (GPU memory, one device), bytes between blocks,
        bytes in one block.
    num_blocks : int
    staging_bytes : int
        GPU memory for staging (two halves); each half holds at least one block image.
    """

    def __init__(self, base, stride, block_len, num_blocks: int,
                 staging_bytes: int = 64 << 20):
        self.base = np.asarray(base, dtype=np.uint64)
        self.stride = np.asarray(stride, dtype=np.uint64)
        self.block_len = np.asarray(block_len, dtype=np.uint64)
        self.num_blocks = int(num_blocks)
        if not len(self.base):
            raise E.InvalidArgumentError("a KV cache of no regions")
        self.offsets = np.concatenate(([0], np.cumsum(self.block_len))).astype(np.uint64)
        self.block_bytes = int(self.offsets[-1])
        ords = {pointer_info(int(b)) for b in self.base}
        if len(ords) != 1 or not next(iter(ords))[0]:
            raise E.InvalidArgumentError(
                f"the KV cache's regions must all be GPU memory of one device, got "
                f"{sorted(ords)} ((is GPU, device) per region)")
        self.device = next(iter(ords))[1]
        self.regions = len(self.base)
        half = max(int(staging_bytes) // 2, self.block_bytes)
        self.blocks_per_half = max(1, half // self.block_bytes)
        half = self.blocks_per_half * self.block_bytes
        self.staging_bytes = 2 * half
        self._lock = threading.Lock()
        self._pinned: list = []
        with device(self.device):
            self._mod, self._fn, self._sms = _kernel(self.device)
            self.stream = Stream(self.device)
            self._halves = [_Half(self.device, half, self.blocks_per_half * self.regions)
                            for _ in range(2)]
        self._next = 0
        self.batch_kind = batch_copy_kind()
        # Row offsets of the block image inside a staging half: [blocks_per_half, R].
        self._img = (np.arange(self.blocks_per_half, dtype=np.uint64)[:, None]
                     * np.uint64(self.block_bytes) + self.offsets[None, :-1])

    @classmethod
    def from_layout(cls, layout, staging_bytes: int = 64 << 20) -> "DeviceBlockCopier":
        return cls(layout.base, layout.stride, layout.block_len, layout.num_blocks,
                   staging_bytes)

    # -- host memory ------------------------------------------------------------------------
    def pin_host(self, address: int, nbytes: int) -> bool:
        """Page-lock ``[address, +nbytes)`` (a KV pool) so block images move by DMA; False
        when it was pinned already (then it stays as it is)."""
        if host_register(int(address), int(nbytes), self.device):
            self._pinned.append(int(address))
            return True
        return False

    def unpin_host(self, address: int) -> None:
        """Undo :meth:`pin_host` (before that memory is unmapped: the driver would
        otherwise keep the range, and a later mapping at the same address fails)."""
        a = int(address)
        if a in self._pinned:
            self._pinned.remove(a)
            host_unregister(a, self.device)

    # -- ordering -------------------------------------------------------------------------
    def fence(self, stream_handle: int) -> Event:
        """An event recorded now on ``stream_handle`` (vLLM's compute stream): pass it to
        :meth:`gather_to` so the copies start only after the work queued there so far,
        the forward pass that wrote the blocks; the host never waits for it."""
        ev = Event(self.device)
        _check(_lib().cuEventRecord(ev.handle, int(stream_handle)), "cuEventRecord(fence)")
        return ev

    # -- copies ---------------------------------------------------------------------------
    def _pieces(self, h: _Half, ids: np.ndarray, to_stage: bool) -> int:
        """Fill ``h``'s piece table for blocks ``ids`` (region-major within a block) and
        copy it to the device; returns the piece count."""
        n = len(ids)
        if n and int(ids.max()) >= self.num_blocks:
            raise E.InvalidArgumentError(f"block id {int(ids.max())} is outside the KV "
                                         f"cache's {self.num_blocks} blocks")
        cache = (self.base[None, :] + ids[:, None] * self.stride[None, :]).reshape(-1)
        stage = (np.uint64(h.stage) + self._img[:n]).reshape(-1)
        k = n * self.regions
        t = h.table_view
        t[0, :k], t[1, :k] = (cache, stage) if to_stage else (stage, cache)
        t[2, :k] = np.tile(self.block_len, n)
        # Three rows of the table, each max_pieces long: one copy of the used prefix each.
        m = t.shape[1]
        copy_many(np.array([h.table + 8 * i * m for i in range(3)], np.uint64),
                  np.array([h.host_table.address + 8 * i * m for i in range(3)], np.uint64),
                  np.full(3, 8 * k, np.uint64), self.stream)
        return k

    def _launch(self, h: _Half, k: int) -> None:
        m = h.table_view.shape[1]
        args = [ctypes.c_uint64(h.table), ctypes.c_uint64(h.table + 8 * m),
                ctypes.c_uint64(h.table + 16 * m), ctypes.c_uint64(k)]
        params = (ctypes.c_void_p * 4)(*[ctypes.cast(byref(a), ctypes.c_void_p) for a in args])
        grid = max(1, min(k, 2 * self._sms))
        _check(_lib().cuLaunchKernel(self._fn, grid, 1, 1, THREADS, 1, 1, 0,
                                     self.stream.handle, params, None),
               "cuLaunchKernel(mte_copy_pieces)")

    def _chunks(self, n: int):
        for lo in range(0, n, self.blocks_per_half):
            h = self._halves[self._next]
            self._next ^= 1
            if h.used:
                # Its table and staging were last used by a chunk still possibly in flight.
                h.done.synchronize()
            yield h, lo, min(n, lo + self.blocks_per_half)

    def gather_to(self, block_ids, dst_addrs, after: "Event | None" = None) -> None:
        """Blocks ``block_ids`` of the GPU cache into block images at ``dst_addrs`` (one
        address per block, ``block_bytes`` each: page-locked host memory for full speed,
        or GPU memory); returns when the bytes are there."""
        ids, dst = _pairs(block_ids, dst_addrs, "destinations")
        bb = np.uint64(self.block_bytes)
        with self._lock, device(self.device):
            if after is not None:
                _check(_lib().cuStreamWaitEvent(self.stream.handle, after.handle, 0),
                       "cuStreamWaitEvent")
            for h, lo, hi in self._chunks(len(ids)):
                k = self._pieces(h, ids[lo:hi], to_stage=True)
                self._launch(h, k)
                rows = np.uint64(h.stage) + np.arange(hi - lo, dtype=np.uint64) * bb
                copy_many(dst[lo:hi], rows, np.full(hi - lo, bb, np.uint64), self.stream)
                h.done.record(self.stream)
                h.used = True
            self.stream.synchronize()

    def copy_regions_async(self, regions, block_ids, dst_rows, after: "Event | None" = None
                           ) -> None:
        """Queue (no wait) the pieces of ``regions`` (region indices) of blocks
        ``block_ids`` into block images at ``dst_rows`` (each at its region's offset),
        one batched copy-engine call, after ``after``; for layer-wise saves, where a
        layer's pieces move while the next layer computes. The caller keeps the rows
        until an event recorded after this (:meth:`record`) completes."""
        r = np.asarray(regions, dtype=np.int64).reshape(-1)
        ids = np.asarray(block_ids, dtype=np.uint64).reshape(-1)
        rows = np.asarray(dst_rows, dtype=np.uint64).reshape(-1)
        if not len(r) or not len(ids):
            return
        if int(ids.max()) >= self.num_blocks:
            raise E.InvalidArgumentError(f"block id {int(ids.max())} is outside the KV "
                                         f"cache's {self.num_blocks} blocks")
        src = (self.base[r][None, :] + ids[:, None] * self.stride[r][None, :]).reshape(-1)
        dst = (rows[:, None] + self.offsets[r][None, :]).reshape(-1)
        lens = np.tile(self.block_len[r], len(ids))
        with self._lock, device(self.device):
            if after is not None:
                _check(_lib().cuStreamWaitEvent(self.stream.handle, after.handle, 0),
                       "cuStreamWaitEvent")
            copy_many(dst, src, lens, self.stream)

    def record(self) -> Event:
        """An event after everything queued on the copier's stream so far."""
        ev = Event(self.device)
        with self._lock:
            ev.record(self.stream)
        return ev

    def scatter_from(self, src_addrs, block_ids) -> None:
        """Block images at ``src_addrs`` into blocks ``block_ids`` of the GPU cache;
        returns when the images have been read and the blocks written."""
        ids, src = _pairs(block_ids, src_addrs, "block images")
        bb = np.uint64(self.block_bytes)
        with self._lock, device(self.device):
            for h, lo, hi in self._chunks(len(ids)):
                rows = np.uint64(h.stage) + np.arange(hi - lo, dtype=np.uint64) * bb
                copy_many(rows, src[lo:hi], np.full(hi - lo, bb, np.uint64), self.stream)
                k = self._pieces(h, ids[lo:hi], to_stage=False)
                self._launch(h, k)
                h.done.record(self.stream)
                h.used = True
            self.stream.synchronize()

    def close(self) -> None:
        with self._lock:
            halves, self._halves = getattr(self, "_halves", []), []
            if not halves:
                return
            with device(self.device):
                self.stream.synchronize()
                for h in halves:
                    h.close()
                self.stream.close()
            for a in self._pinned:
                try:
                    host_unregister(a, self.device)
                except E.MooncakeError:
                    pass
            self._pinned = []

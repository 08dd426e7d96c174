# SPDX-License-Identifier: Apache-2.0
"""``mooncake.store.BufferPool``: leases of registered memory for the zero-copy calls.

Mooncake's pool (``mooncake-integration/store/buffer_pool.cpp``) hands out regions of the
store client's local buffer (``local_buffer_size`` bytes, registered), and, when that
is full, "overflow" regions it allocates and registers with ``register_buffer``. The
same here: a store's local buffer is allocated and registered the first time a pool is
made on it (a store with ``local_buffer_size = 0`` has none and is refused), regions
are 64-byte aligned first-fit, overflow regions are aligned to ``alignment``. The
capacity is ``max_bytes`` (at least the local buffer; 0: twice the local buffer);
``max_regions`` bounds the live leases; a full pool blocks (``block_on_exhaustion``,
``timeout``) or raises. Errors are ``RuntimeError`` with Mooncake's messages.
"""
from __future__ import annotations

import ctypes
import threading
import time
import weakref

import numpy as np

_ALIGN = 64


class _Arena:
    """First-fit allocator over one registered buffer."""

    def __init__(self, store, size: int):
        self.mem = np.zeros(size + _ALIGN, np.uint8)
        base = self.mem.ctypes.data
        self.base = base + (-base) % _ALIGN
        self.size = size
        if store.register_buffer(self.base, size) != 0:
            raise RuntimeError("the store's local buffer could not be registered")
        self.free = [(0, size)]                   # (offset, length), sorted
        self.lock = threading.Lock()

    def alloc(self, n: int) -> "int | None":
        n = -(-n // _ALIGN) * _ALIGN
        with self.lock:
            for i, (off, ln) in enumerate(self.free):
                if ln >= n:
                    self.free[i:i + 1] = [(off + n, ln - n)] if ln > n else []
                    return self.base + off
        return None

    def release(self, ptr: int, n: int) -> None:
        n = -(-n // _ALIGN) * _ALIGN
        with self.lock:
            self.free.append((ptr - self.base, n))
            self.free.sort()
            merged: list = []
            for off, ln in self.free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + ln)
                else:
                    merged.append((off, ln))
            self.free = merged


class _View(np.ndarray):
    """A lease's bytes; holds the lease (a live view keeps it from being released)."""
    _lease: "BufferLease | None" = None


class BufferLease:
    """One acquired region: ``ptr``, ``size`` (the bytes asked for), ``buffer`` (a
    writable memoryview), ``release()``; a context manager."""

    def __init__(self, pool, ptr: int, size: int, alloc: int, owner, arena: bool):
        self._pool, self.ptr, self.size = pool, ptr, size
        self._alloc, self._owner, self._arena = alloc, owner, arena
        self._views: list = []                   # weak references to exported views
        self._closed = False

    @property
    def buffer(self) -> memoryview:
        if self._closed:
            raise RuntimeError("buffer lease is closed")
        arr = np.ctypeslib.as_array((ctypes.c_ubyte * max(self.size, 1))
                                    .from_address(self.ptr))[:self.size].view(_View)
        arr._lease = self
        self._views = [r for r in self._views if r() is not None] + [weakref.ref(arr)]
        return memoryview(arr)  # type: ignore[arg-type]

    def release(self) -> None:
        if self._closed:
            return
        if any(r() is not None for r in self._views):
            raise RuntimeError("cannot release buffer while exported views exist")
        self._release()

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool._give_back(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            self._release()
        except Exception:
            pass


BufferLeaseView = memoryview


class BufferPool:
    """Mooncake's ``BufferPool(store, max_bytes=0, min_size_class=65536,
    max_size_class=None, alignment=8 MiB, block_on_exhaustion=True,
    default_timeout=None, max_regions=None, prewarm_size=None, prewarm_count=0)``."""

    def __init__(self, store, max_bytes: int = 0, min_size_class: int = 64 * 1024,
                 max_size_class=None, alignment: int = 8 * 1024 * 1024,
                 block_on_exhaustion: bool = True, default_timeout=None, max_regions=None,
                 prewarm_size=None, prewarm_count: int = 0):
        if store is None or getattr(store, "_cache", None) is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class <= 0 or alignment <= 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < 8 or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local = int(getattr(store, "_local_buffer", 0))
        if local <= 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        arena = getattr(store, "_arena", None)
        if arena is None:
            arena = store._arena = _Arena(store, local)
        self._store, self._a = store, arena
        self.max_bytes = max(max_bytes, local) if max_bytes else 2 * local
        self.max_size_class = self.max_bytes if max_size_class is None else max_size_class
        self.alignment, self.block = alignment, bool(block_on_exhaustion)
        self.timeout, self.max_regions = default_timeout, max_regions
        self._cv = threading.Condition()
        self._live: set = set()
        self._total = 0
        self._closed = False

    def _try(self, n: int):
        if n > self.max_bytes - self._total or (
                self.max_regions is not None and len(self._live) >= self.max_regions):
            return None
        ptr = self._a.alloc(n)
        if ptr is not None:
            return BufferLease(self, ptr, 0, n, None, True)
        mem = np.zeros(n + self.alignment, np.uint8)
        p = mem.ctypes.data + (-mem.ctypes.data) % self.alignment
        if self._store.register_buffer(p, n) != 0:
            raise RuntimeError("overflow buffer registration failed")
        return BufferLease(self, p, 0, n, mem, False)

    def acquire(self, size: int, block=None, timeout=None) -> BufferLease:
        block = self.block if block is None else bool(block)
        timeout = self.timeout if timeout is None else timeout
        if timeout is not None and timeout < 0:
            raise RuntimeError("timeout must be non-negative")
        n = max(int(size), 1)
        if n > self.max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if self._closed:
                    raise RuntimeError("buffer pool is closed")
                lease = self._try(n)
                if lease is not None:
                    lease.size = int(size)
                    self._live.add(id(lease))
                    self._total += n
                    return lease
                if not block:
                    raise RuntimeError("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cv.wait(left)

    def prewarm(self, size: int, count: int) -> None:
        """Accepted; regions are made on demand (Mooncake's is a no-op too)."""

    def _give_back(self, lease: BufferLease) -> None:
        if lease._arena:
            self._a.release(lease.ptr, lease._alloc)
        else:
            self._store.unregister_buffer(lease.ptr)
        with self._cv:
            self._live.discard(id(lease))
            self._total -= lease._alloc
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            if self._live:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView

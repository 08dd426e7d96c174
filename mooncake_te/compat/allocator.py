# SPDX-License-Identifier: Apache-2.0
"""The managed-buffer allocator behind ``allocate_managed_buffer``.

Mooncake's Python wrapper hands out registered host memory from a buddy allocator:
16 size classes from 8 KiB to 256 MiB, carved from 2 GiB chunks that are registered
once with location ``"*"``; a request above 256 MiB is allocated and registered on its
own (``kSlabSizeKB``, ``allocateManagedBuffer``, ``freeManagedBuffer`` in
``mooncake-integration/transfer_engine/transfer_engine_py.{h,cpp}``, kvcache-ai/Mooncake).

Ours keeps the same classes and chunk size, and adds what the original leaves out:

- freed blocks merge with their free buddy, so a freed 256 MiB area can serve one large
  request again (Mooncake only ever splits);
- the lowest free address is handed out first, so the first block of a fresh chunk is
  the chunk's base, the address ``get_first_buffer_address`` reports;
- ``free`` checks its argument: an address it did not hand out, or one freed twice, is
  refused instead of corrupting the free lists.

Chunks are anonymous private mappings with ``MAP_NORESERVE`` (mmap(2)): a 2 GiB chunk
costs address space, not memory, until its pages are touched.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Callable

KIB = 1 << 10
MIB = 1 << 20
NUM_CLASSES = 16
CLASS_SIZES = tuple((8 * KIB) << i for i in range(NUM_CLASSES))   # 8 KiB ... 256 MiB
MAX_CLASS = NUM_CLASSES - 1
CHUNK_SIZE = 2 << 30                                                # kDefaultBufferCapacity

# linux/mman.h; the mmap module does not export MAP_NORESERVE on every Python.
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def map_anonymous(length: int) -> int:
    """Map ``length`` bytes of zeroed private memory; return its address.

    Raises
    ------
    MemoryError
        mmap(2) failed (the errno is in the message).
    """
    addr = _libc.mmap(None, length, _PROT_RW, _MAP_FLAGS, -1, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise MemoryError(f"mmap of {length} bytes failed: {os.strerror(err)}")
    return int(addr)


def unmap(address: int, length: int) -> None:
    _libc.munmap(address, length)


def class_of(length: int) -> int:
    """Size class serving ``length`` bytes, or -1 when it is above 256 MiB (Mooncake's
    ``findClassId``: the smallest class that holds it; 0 bytes get the 8 KiB class)."""
    if length > CLASS_SIZES[MAX_CLASS]:
        return -1
    for c, size in enumerate(CLASS_SIZES):
        if length <= size:
            return c
    return MAX_CLASS      # not reached


class ManagedAllocator:
    """A buddy allocator over registered chunks.

    Parameters
    ----------
    register : callable(address, length)
        Registers fresh memory with the engine; raises on failure.
    unregister : callable(address)
        Withdraws it again.
    chunk_size : int
        Bytes mapped and registered at a time for the size classes; a multiple of
        256 MiB (Mooncake: 2 GiB).
    """

    def __init__(self, register: Callable[[int, int], object],
                 unregister: Callable[[int], object], chunk_size: int = CHUNK_SIZE):
        top = CLASS_SIZES[MAX_CLASS]
        if chunk_size <= 0 or chunk_size % top:
            raise ValueError(f"chunk_size must be a positive multiple of {top}, "
                             f"got {chunk_size}")
        self._register = register
        self._unregister = unregister
        self.chunk_size = chunk_size
        self._lock = threading.Lock()
        self._free: list[set[int]] = [set() for _ in range(NUM_CLASSES)]
        self._chunks: list[int] = []                    # chunk base addresses
        self._used: dict[int, tuple[int, int]] = {}     # block -> (class, chunk base)
        self._large: dict[int, int] = {}                # block -> mapped length

    # --- queries ------------------------------------------------------------------------
    @property
    def chunks(self) -> list:
        """``(address, length)`` of every chunk mapped so far."""
        with self._lock:
            return [(c, self.chunk_size) for c in self._chunks]

    def allocated(self) -> dict:
        """``{address: usable length}`` of every block handed out and not yet freed."""
        with self._lock:
            out = {a: CLASS_SIZES[c] for a, (c, _) in self._used.items()}
            out.update(self._large)
            return out

    # --- allocation ---------------------------------------------------------------------
    def allocate(self, length: int) -> int:
        """Address of a registered block of at least ``length`` bytes.

        Raises
        ------
        MemoryError
            No memory could be mapped.
        MooncakeError
            The engine refused to register it.
        """
        c = class_of(length)
        with self._lock:
            if c < 0:
                return self._allocate_large(length)
            k = c
            while k < NUM_CLASSES and not self._free[k]:
                k += 1
            if k == NUM_CLASSES:
                self._add_chunk()
                k = MAX_CLASS
            addr = min(self._free[k])
            self._free[k].remove(addr)
            while k > c:               # split, keeping the lower half
                k -= 1
                self._free[k].add(addr + CLASS_SIZES[k])
            self._used[addr] = (c, self._chunk_of(addr))
            return addr

    def _chunk_of(self, addr: int) -> int:
        for base in self._chunks:
            if base <= addr < base + self.chunk_size:
                return base
        raise AssertionError(f"{addr:#x} is in no chunk")

    def _add_chunk(self) -> None:
        base = map_anonymous(self.chunk_size)
        try:
            self._register(base, self.chunk_size)
        except BaseException:
            unmap(base, self.chunk_size)
            raise
        self._chunks.append(base)
        top = CLASS_SIZES[MAX_CLASS]
        self._free[MAX_CLASS].update(range(base, base + self.chunk_size, top))

    def _allocate_large(self, length: int) -> int:
        size = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
        addr = map_anonymous(size)
        try:
            self._register(addr, size)
        except BaseException:
            unmap(addr, size)
            raise
        self._large[addr] = size
        return addr

    def free(self, address: int, length: int) -> str | None:
        """Give a block back. Returns None, or a warning when ``length`` does not match
        what was allocated (the block is still freed: we know its class).

        Raises
        ------
        KeyError
            ``address`` is not a block this allocator handed out (or it was freed already).
        """
        with self._lock:
            if address in self._large:
                size = self._large.pop(address)
                try:
                    self._unregister(address)
                finally:
                    unmap(address, size)
                return None if class_of(length) < 0 else \
                    f"length {length} does not match the {size}-byte block at {address:#x}"
            entry = self._used.pop(address, None)
            if entry is None:
                raise KeyError(address)
            c, base = entry
            note = None if class_of(length) == c else \
                f"length {length} does not match the {CLASS_SIZES[c]}-byte block at {address:#x}"
            while c < MAX_CLASS:        # merge with the buddy while it is free
                buddy = base + ((address - base) ^ CLASS_SIZES[c])
                if buddy not in self._free[c]:
                    break
                self._free[c].remove(buddy)
                address = min(address, buddy)
                c += 1
            self._free[c].add(address)
            return note

    def release_all(self) -> list:
        """Forget every block and return ``(address, length)`` of all mappings, for the
        owner to unmap once the engine no longer serves them."""
        with self._lock:
            maps = [(c, self.chunk_size) for c in self._chunks] + list(self._large.items())
            self._chunks.clear()
            self._large.clear()
            self._used.clear()
            for s in self._free:
                s.clear()
            return maps

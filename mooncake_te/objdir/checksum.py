# SPDX-License-Identifier: Apache-2.0
"""The object directory's checksum: CRC-32 (zlib's value, ISO-HDLC polynomial), in two
flavours, both giving ``zlib.crc32``'s answer.

:func:`crc32_held` keeps the GIL: ``zlib.crc32`` lets go of it for buffers over 5 KiB
(CPython ``Modules/zlibmodule.c``), and beside a busy Python thread (vLLM's engine loop)
each let-go costs the caller up to a switch interval (5 ms) before it runs again, per
block. The KV cache checks its blocks with it.

:func:`crc32_released` lets go of the GIL (ISA-L's ``isal_zlib.crc32`` where the ``isal``
package is installed, else ``zlib.crc32``), so several threads checksum in parallel: a
P2P store's manifest of a large object, :func:`crc32_many` over a batch of large blocks.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import zlib

import numpy as np

__all__ = ["crc32_held", "crc32_released", "crc32_many", "CRC32_IMPL"]


def _address(buf) -> "tuple[int, int]":
    a = np.frombuffer(buf, dtype=np.uint8)
    return a.ctypes.data, a.nbytes


def _load_isal():
    """ISA-L's ``crc32_gzip_refl`` (the same CRC as zlib's, several times faster) from the
    optional ``isal`` package (the ``[kvcache]`` extra), called through
    :class:`ctypes.PyDLL` so the GIL stays held. Not ``isal_zlib.crc32`` itself: like
    ``zlib.crc32`` it lets go of the GIL above 5 KiB (python-isal 1.9.1's
    ``isal_zlib_crc32`` calls ``PyEval_SaveThread`` for buffers over 0x1400 bytes)."""
    try:
        from isal import isal_zlib
        fn = ctypes.PyDLL(isal_zlib.__file__).crc32_gzip_refl
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]

    def crc32(buf, value: int = 0) -> int:
        addr, n = _address(buf)
        return fn(value, addr, n) if n else value
    return crc32


def _load_libz():
    """libz's ``crc32_z`` (else ``crc32``) through :class:`ctypes.PyDLL`, whose calls keep
    the GIL (unlike :class:`ctypes.CDLL`'s)."""
    name = ctypes.util.find_library("z") or "libz.so.1"
    try:
        lib = ctypes.PyDLL(name)
    except OSError:
        return None
    fn = getattr(lib, "crc32_z", None)
    wide = fn is not None
    if fn is None:
        fn = lib.crc32
    fn.restype = ctypes.c_ulong
    fn.argtypes = [ctypes.c_ulong, ctypes.c_void_p, ctypes.c_size_t if wide else ctypes.c_uint]
    step = (1 << 62) if wide else (1 << 30)

    def crc32(buf, value: int = 0) -> int:
        addr, n = _address(buf)
        if n == 0:
            return value            # libz answers 0 for a NULL buffer, whatever value is
        while n > step:
            value = fn(value, addr, step)
            addr, n = addr + step, n - step
        return fn(value, addr, n) & 0xFFFFFFFF
    return crc32


_crc_isal = _load_isal()
_crc_libz = _load_libz()
#: CRC-32 of a buffer (zlib's value), computed with the GIL held: ISA-L where the ``isal``
#: package is installed, else libz through ctypes, else ``zlib.crc32`` (which then lets go
#: of the GIL for buffers over 5 KiB).
crc32_held = _crc_isal or _crc_libz or zlib.crc32
#: Which of the three :func:`crc32_held` is: ``"isal"``, ``"libz"`` or ``"zlib"``.
CRC32_IMPL = "isal" if _crc_isal else "libz" if _crc_libz else "zlib"


def _released():
    try:
        from isal import isal_zlib
        return isal_zlib.crc32
    except ImportError:
        return zlib.crc32


#: CRC-32 of a buffer (zlib's value) that lets go of the GIL on large buffers.
crc32_released = _released()


_pool_lock = threading.Lock()
_pool: list = []


def crc32_many(buffers) -> list:
    """CRC-32 of each buffer, on several threads when there is enough to share: the
    functions that let go of the GIL (``isal_zlib.crc32`` where installed, else
    ``zlib.crc32``) over at most 8 threads. For a batch of large blocks that a GPU copied
    into the pool at PCIe speed, where one core's checksums would take several times
    the copy; a single block, or few small ones, stay on :func:`crc32_held`."""
    bufs = list(buffers)
    total = sum(memoryview(b).nbytes for b in bufs)
    workers = min(8, os.cpu_count() or 1, len(bufs))
    if workers < 2 or total < (8 << 20):
        return [crc32_held(b) for b in bufs]
    fn = crc32_released
    with _pool_lock:
        if not _pool:
            from concurrent.futures import ThreadPoolExecutor
            _pool.append(ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                            thread_name_prefix="mte-crc"))
        ex = _pool[0]
    step = -(-len(bufs) // workers)
    parts = ex.map(lambda lo: [fn(b) for b in bufs[lo:lo + step]], range(0, len(bufs), step))
    return [c for part in parts for c in part]

# SPDX-License-Identifier: Apache-2.0
"""The block record: a 64-byte header, then the block's bytes, padded to a slot.

The same image sits in a DRAM slot and in an SSD slot, so demotion is one aligned write
straight from the registered pool and promotion one aligned read into it, and a peer that
reads a slot over the transfer engine gets the header too and can check what it read.

Header, little-endian (``struct`` format ``<4sHH16sQQII``, then zero padding)::

    magic "MKV1" | version u16 | flags u16 | key 16 B | length u64 | seq u64 |
    data crc32 u32 | header crc32 u32

``data crc32`` covers the ``length`` payload bytes, ``header crc32`` the 44 bytes before
it (zlib's CRC-32, ISO-HDLC polynomial, as in ``zlib.crc32``). A record whose header or
data checksum does not match (a torn write after a crash, a flipped bit, a slot a peer
overwrote while we read it) is dropped, never served.

Checksums are computed by :func:`crc32_held`, which keeps the GIL: ``zlib.crc32`` lets go
of it for buffers over 5 KiB (CPython ``Modules/zlibmodule.c``), and beside a busy Python
thread (vLLM's engine loop) each let-go costs the caller up to a switch interval (5 ms)
before it runs again, per block. The values are zlib's either way.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import threading
import zlib

import numpy as np

__all__ = ["HEADER_SIZE", "ALIGN", "MAGIC", "slot_size_for", "pack_header",
           "parse_header", "Header", "crc32_held", "crc32_many", "CRC32_IMPL", "MAX_SEQ"]

MAGIC = b"MKV1"
VERSION = 1
HEADER_SIZE = 64
#: O_DIRECT needs buffer address, file offset and length aligned to the logical block
#: size of the device (open(2), "O_DIRECT"); 4096 covers 512e and 4Kn drives.
ALIGN = 4096
_HDR = struct.Struct("<4sHH16sQQI")            # 44 bytes, then the header crc
#: Largest ``seq`` a valid record has. A cache numbers its writes from the highest
#: ``seq`` it finds on SSD; 2^62 writes would take a century at 10^9 a second, so a
#: record above this was not written by us (issue 35: ``seq = 2^64-1`` made every later
#: ``put`` overflow the header) and is treated as corrupt.
MAX_SEQ = 1 << 62
_CRC = struct.Struct("<I")


# --- CRC-32 without letting go of the GIL ---------------------------------------------------
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
    try:
        from isal import isal_zlib
        fn = isal_zlib.crc32
    except ImportError:
        fn = zlib.crc32
    with _pool_lock:
        if not _pool:
            from concurrent.futures import ThreadPoolExecutor
            _pool.append(ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                            thread_name_prefix="kvcache-crc"))
        ex = _pool[0]
    step = -(-len(bufs) // workers)
    parts = ex.map(lambda lo: [fn(b) for b in bufs[lo:lo + step]], range(0, len(bufs), step))
    return [c for part in parts for c in part]


def round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def slot_size_for(block_bytes: int) -> int:
    """Bytes one slot takes: header + block, rounded up to :data:`ALIGN`."""
    return round_up(HEADER_SIZE + block_bytes)


class Header(tuple):
    """``(key, length, seq, data_crc)`` of a valid header."""

    __slots__ = ()
    key = property(lambda self: self[0])
    length = property(lambda self: self[1])
    seq = property(lambda self: self[2])
    crc = property(lambda self: self[3])


def pack_header(key: bytes, length: int, seq: int, data_crc: int) -> bytes:
    head = _HDR.pack(MAGIC, VERSION, 0, key, length, seq, data_crc)
    return head + _CRC.pack(zlib.crc32(head)) + bytes(HEADER_SIZE - _HDR.size - 4)


def parse_header(buf) -> "Header | None":
    """The header in the first 64 bytes of ``buf``, or None if it is not a valid one."""
    raw = bytes(buf[:_HDR.size + 4])
    if len(raw) < _HDR.size + 4 or raw[:4] != MAGIC:
        return None
    if zlib.crc32(raw[:_HDR.size]) != _CRC.unpack_from(raw, _HDR.size)[0]:
        return None
    magic, version, flags, key, length, seq, crc = _HDR.unpack_from(raw)
    if version != VERSION or seq > MAX_SEQ:
        return None
    return Header((key, length, seq, crc))

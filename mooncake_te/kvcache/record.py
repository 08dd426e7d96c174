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

Checksums are computed by :func:`~mooncake_te.objdir.checksum.crc32_held` (the object
directory's checksum, re-exported here), which keeps the GIL. The values are zlib's.
"""
from __future__ import annotations

import struct
import zlib

from ..objdir.checksum import CRC32_IMPL, _crc_isal, _crc_libz, crc32_held, crc32_many

__all__ = ["HEADER_SIZE", "ALIGN", "MAGIC", "slot_size_for", "pack_header",
           "parse_header", "Header", "crc32_held", "crc32_many", "CRC32_IMPL", "MAX_SEQ",
           "_crc_isal", "_crc_libz"]


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

# SPDX-License-Identifier: Apache-2.0
"""What an object is: its size, its chunking and a checksum per chunk.

The manifest is written once, by the publisher, at ``register`` time; getters verify
every chunk against it before they serve that chunk onward, so one corrupted copy
cannot spread through the fan-out. The checksum is CRC-32 (zlib): about 2.4 GB/s on one
core here, against about 1 GB/s for BLAKE2b; it detects damage (bit flips, a buffer
reused too early, a torn read), not a malicious holder, which would need a keyed hash.

With the engines' ``auth_token`` (issue #35 item 8) the manifest also carries that keyed
hash: a 128-bit HMAC-SHA256 tag per chunk (over the object id, the chunk's index and its
bytes) and a seal (an HMAC over the whole manifest), so a holder without the token can
neither forge a manifest nor serve a chunk that passes (a CRC can be matched at will).
Getters with the token accept only sealed manifests and check every chunk's tag.
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import ERR_MALFORMED_JSON, AuthenticationError, MetadataError
from ..objdir.checksum import crc32_released

#: default chunk size: big enough that one control round trip (~0.1 ms) is small next to
#: the data (4 MiB is ~1 ms over loopback TCP), small enough that a 1 GiB object has 256
#: chunks to spread over holders.
DEFAULT_CHUNK_SIZE = 4 << 20
MIN_CHUNK_SIZE = 4 << 10


def view(address: int, length: int) -> memoryview:
    """A writable byte view of host memory at ``address`` (registered, kept alive by
    its region's owner)."""
    return memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")


def pieces_in(pieces, offset: int, length: int):
    """Yield ``(address, length)`` covering object bytes ``[offset, offset+length)``.

    ``pieces`` is the object's memory in order: a list of ``(address, length)``.
    """
    pos = 0
    end = offset + length
    for addr, n in pieces:
        lo, hi = max(pos, offset), min(pos + n, end)
        if lo < hi:
            yield addr + (lo - pos), hi - lo
        pos += n
        if pos >= end:
            return


def crc_of(pieces, offset: int, length: int) -> int:
    """CRC-32 of object bytes ``[offset, offset+length)`` (the object directory's
    checksum, letting go of the GIL so chunks are checked in parallel)."""
    crc = 0
    for addr, n in pieces_in(pieces, offset, length):
        crc = crc32_released(view(addr, n), crc)
    return crc & 0xFFFFFFFF


TAG_BYTES = 16
#: the longest name, address, segment or instance a holder may announce
MAX_FIELD = 300


def tag_of(token: bytes, object_id: str, index: int, pieces, offset: int,
           length: int) -> bytes:
    """The keyed tag of one chunk: HMAC-SHA256(token, label | object id | index | bytes),
    truncated to 128 bits (hashlib releases the GIL on large updates)."""
    h = hmac.new(token, b"mte-p2p-chunk\0" + object_id.encode() + b"\0"
                 + index.to_bytes(8, "little"), hashlib.sha256)
    for addr, n in pieces_in(pieces, offset, length):
        h.update(view(addr, n))
    return h.digest()[:TAG_BYTES]


def transfer_plan(dst_pieces, src_pieces, offset: int, length: int):
    """``(local addresses, remote addresses, lengths)`` moving object bytes
    ``[offset, offset+length)`` between two differently split copies."""
    local = list(pieces_in(dst_pieces, offset, length))
    remote = list(pieces_in(src_pieces, offset, length))
    out_l, out_r, out_n = [], [], []
    i = j = 0
    la, ln = local[0]
    ra, rn = remote[0]
    while True:
        n = min(ln, rn)
        out_l.append(la)
        out_r.append(ra)
        out_n.append(n)
        la, ln, ra, rn = la + n, ln - n, ra + n, rn - n
        if ln == 0:
            i += 1
            if i == len(local):
                break
            la, ln = local[i]
        if rn == 0:
            j += 1
            ra, rn = remote[j]
    return out_l, out_r, out_n


@dataclass
class HolderRef:
    """Where a holder of an object is reached.

    ``name`` is the holder's store name (its engine's segment name by default), used in
    stats; ``address`` is its control port ``host:port``; ``segment`` the engine
    segment its chunks are read from; ``instance`` changes when the store restarts.
    """

    name: str
    address: str
    segment: str
    instance: str

    @property
    def key(self) -> str:
        return f"{self.address}#{self.instance}"

    def to_json(self) -> dict:
        return {"name": self.name, "address": self.address, "segment": self.segment,
                "instance": self.instance}

    @classmethod
    def from_json(cls, d: dict) -> "HolderRef":
        """From a peer's JSON; ValueError for a field longer than ``MAX_FIELD`` (issue #35
        item 8: a few announcements of huge names made holder lists exceed a frame)."""
        ref = cls(str(d["name"]), str(d["address"]), str(d["segment"]), str(d["instance"]))
        for what in (ref.name, ref.address, ref.segment, ref.instance):
            if len(what) > MAX_FIELD:
                raise ValueError(f"holder field of {len(what)} characters (at most "
                                 f"{MAX_FIELD})")
        return ref


@dataclass
class Manifest:
    """One published object.

    Attributes
    ----------
    name : str
    object_id : str
        Random per ``register``: a name unregistered and published again is another
        object, and a getter of the old one must not mix their chunks.
    size, chunk_size : int
    checksums : list of int
        CRC-32 of each chunk.
    origin : HolderRef
        The publisher.
    """

    name: str
    object_id: str
    size: int
    chunk_size: int
    checksums: list
    origin: HolderRef
    created: float = field(default_factory=time.time)
    tags: list = field(default_factory=list)     # keyed tag per chunk (with a token)
    seal: str = ""                               # HMAC over the manifest (with a token)

    @property
    def chunks(self) -> int:
        return len(self.checksums)

    def chunk_range(self, i: int) -> tuple[int, int]:
        off = i * self.chunk_size
        return off, min(self.chunk_size, self.size - off)

    @classmethod
    def build(cls, name: str, pieces, chunk_size: int, origin: HolderRef,
              progress=None, token: bytes | None = None) -> "Manifest":
        size = sum(n for _, n in pieces)
        offsets = range(0, size, chunk_size)
        object_id = secrets.token_hex(8)
        done = 0

        def sums_of(o: int):
            n = min(chunk_size, size - o)
            crc = crc_of(pieces, o, n)
            return crc, (tag_of(token, object_id, o // chunk_size, pieces, o, n)
                         if token else b"")
        # crc32_released releases the GIL for large buffers, so threads checksum chunks in
        # parallel: a 64 GiB checkpoint is ~27 s on one core, a few seconds on eight.
        workers = max(1, min(8, os.cpu_count() or 1, len(offsets)))
        with ThreadPoolExecutor(workers, thread_name_prefix="mte-p2p-crc") as pool:
            sums, tags = [], []
            for off, (crc, tag) in zip(offsets, pool.map(sums_of, offsets)):
                sums.append(crc)
                tags.append(tag)
                done = off + min(chunk_size, size - off)
                if progress is not None:
                    progress(done, size)
        m = cls(name, object_id, size, chunk_size, sums, origin,
                tags=tags if token else [])
        if token:
            m.seal = m._seal_with(token)
        return m

    def _seal_with(self, token: bytes) -> str:
        d = self.to_json()
        d.pop("seal", None)
        return hmac.new(token, b"mte-p2p-manifest\0" + json.dumps(
            d, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()

    def check_sealed(self, token: bytes | None) -> "Manifest":
        """Itself, when there is no token or its seal proves the token; else
        :class:`AuthenticationError` (a manifest from a store without the token, or
        forged)."""
        if token is None:
            return self
        if not self.seal or len(self.tags) != self.chunks or not hmac.compare_digest(
                self.seal, self._seal_with(token)):
            raise AuthenticationError(
                f"the manifest of {self.name!r} (published by {self.origin.name}) is not "
                f"sealed with this cluster's auth_token: its publisher has no token or "
                f"another one, or it was forged; publish it again from a store whose "
                f"engine has the token")
        return self

    def chunk_ok(self, pieces, c: int, token: bytes | None = None) -> bool:
        """Chunk ``c`` of the copy at ``pieces`` matches its CRC and, with a token and a
        sealed manifest, its keyed tag."""
        off, length = self.chunk_range(c)
        if crc_of(pieces, off, length) != self.checksums[c]:
            return False
        if token and self.tags:
            return hmac.compare_digest(tag_of(token, self.object_id, c, pieces, off, length),
                                       self.tags[c])
        return True

    def to_json(self) -> dict:
        return {"name": self.name, "object_id": self.object_id, "size": self.size,
                "chunk_size": self.chunk_size, "checksum": "crc32",
                "checksums": "".join(f"{c:08x}" for c in self.checksums),
                "origin": self.origin.to_json(), "created": self.created,
                **({"tags": b"".join(self.tags).hex(), "seal": self.seal}
                   if self.tags else {})}

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        try:
            if d.get("checksum", "crc32") != "crc32":
                raise ValueError(f"unknown checksum {d.get('checksum')!r}")
            hx = d["checksums"]
            sums = [int(hx[i:i + 8], 16) for i in range(0, len(hx), 8)]
            raw_tags = bytes.fromhex(str(d.get("tags", "")))
            tags = [raw_tags[i:i + TAG_BYTES] for i in range(0, len(raw_tags), TAG_BYTES)]
            m = cls(str(d["name"]), str(d["object_id"]), int(d["size"]), int(d["chunk_size"]),
                    sums, HolderRef.from_json(d["origin"]), float(d.get("created", 0)),
                    tags, str(d.get("seal", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise MetadataError(f"malformed P2P store manifest ({e!r}); written by an "
                                f"incompatible version?", status=ERR_MALFORMED_JSON) from None
        if m.chunks != -(-m.size // m.chunk_size):
            raise MetadataError(f"manifest of {m.name!r} lists {m.chunks} checksums for "
                                f"{m.size} bytes in chunks of {m.chunk_size}",
                                status=ERR_MALFORMED_JSON)
        return m

    @classmethod
    def decode(cls, raw: bytes) -> "Manifest":
        try:
            d = json.loads(raw)
        except ValueError as e:
            raise MetadataError(f"P2P store manifest is not JSON: {e}",
                                status=ERR_MALFORMED_JSON) from None
        return cls.from_json(d)

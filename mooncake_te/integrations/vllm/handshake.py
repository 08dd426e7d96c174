# SPDX-License-Identifier: Apache-2.0
"""The handshake: what a KV producer publishes so consumers can read its blocks, and the
compatibility check a consumer runs before the first read.

The producer registers one small read-only buffer *before* its KV cache, so it is
``buffers[0]`` of the segment descriptor every peer gets from ``open_segment``. It holds
``MAGIC``, a length and a JSON document: the compatibility fields and their hash, the
region layout (names, base addresses, block strides and lengths) and the engine name.
A consumer reads it with one READ, compares hashes and, when they differ, names every
field that differs; it never reads KV blocks from a peer it has not accepted.
"""
from __future__ import annotations

import hashlib
import json
import struct

MAGIC = b"MTEVLLM1"
_HEADER = struct.Struct("<8sQ")          # magic, JSON length
MAX_BYTES = 1 << 20                      # a larger document is refused, not truncated
PROTOCOL = 1                             # bump when the blob or request protocol changes


def compat_fields(*, model: str, dtype: str, block_size: int, layout: str, num_layers: int,
                  tp_size: int, vllm_version: str, connector_version: str) -> dict:
    """The fields two instances must agree on before KV moves between them."""
    return {"model": str(model), "dtype": str(dtype), "block_size": int(block_size),
            "kv_layout": str(layout), "num_layers": int(num_layers), "tp_size": int(tp_size),
            "vllm_version": str(vllm_version),
            "connector_version": f"{connector_version} (protocol {PROTOCOL})"}


def compat_hash(fields: dict) -> str:
    """sha256 of the fields in a canonical JSON form (first 16 hex digits)."""
    canon = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon).hexdigest()[:16]


def differences(ours: dict, theirs: dict) -> list:
    """``[(field, our value, their value)]`` for every field that differs."""
    keys = sorted(set(ours) | set(theirs))
    return [(k, ours.get(k), theirs.get(k)) for k in keys if ours.get(k) != theirs.get(k)]


def mismatch_message(peer: str, ours: dict, theirs: dict) -> str:
    diffs = differences(ours, theirs)
    what = "; ".join(f"{k}: {a!r} here, {b!r} at the peer" for k, a, b in diffs)
    hint = (" (start both instances with the same --block-size)"
            if any(k == "block_size" for k, _, _ in diffs) else "")
    return (f"refusing KV from {peer}: the instances are not compatible ({what}){hint}; "
            f"the request's prompt is recomputed locally")


def encode(doc: dict) -> bytes:
    """``MAGIC``, length, JSON; padded to a multiple of 4 KiB."""
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    raw = _HEADER.pack(MAGIC, len(body)) + body
    if len(raw) > MAX_BYTES:
        raise ValueError(f"handshake document is {len(raw)} bytes; at most {MAX_BYTES}")
    return raw + b"\0" * (-len(raw) % 4096)


def decode(raw, peer: str = "the peer") -> dict:
    """Parse what :func:`encode` wrote; ``ValueError`` says what is wrong."""
    raw = bytes(raw)
    if len(raw) < _HEADER.size:
        raise ValueError(f"{peer}: handshake buffer is {len(raw)} bytes, too short")
    magic, n = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"{peer}: its first buffer is not a mooncake_te vLLM handshake "
                         f"(magic {magic!r}); is the peer running MooncakeTEConnector?")
    if _HEADER.size + n > len(raw):
        raise ValueError(f"{peer}: handshake says {n} bytes but the buffer has "
                         f"{len(raw) - _HEADER.size}")
    return json.loads(raw[_HEADER.size:_HEADER.size + n])

# SPDX-License-Identifier: Apache-2.0
"""Block keys: prefix hashes, stable across processes and machines.

A key names a block *and every block before it*, as vLLM's prefix caching and
Mooncake's traces do (FAST'25 Appendix A: "prefix hash values that include both the
current and all preceding blocks"), so the longest cached prefix of a request is found by
looking keys up in order, and equal keys mean equal KV bytes for the same model.

The hash: BLAKE2b with a 16-byte digest (RFC 7693; ``hashlib.blake2b``), personalised with
``b"mooncake-kv"`` so these digests never collide by construction with other BLAKE2b uses,
over ``parent digest || block tokens as little-endian int64``; the first block's parent is
16 zero bytes. Python's built-in ``hash()`` is salted per process (PYTHONHASHSEED) and so
cannot name a block another process or machine must find.
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["KEY_BYTES", "ROOT", "prefix_hashes", "as_key"]

KEY_BYTES = 16
ROOT = bytes(KEY_BYTES)
_PERSON = b"mooncake-kv"


def prefix_hashes(tokens, block_tokens: int, parent: bytes = ROOT,
                  include_partial: bool = False) -> list:
    """Keys of the blocks of ``tokens``, ``block_tokens`` tokens each.

    Parameters
    ----------
    tokens : sequence of int or numpy array
        Token ids of the prompt.
    block_tokens : int
        Tokens per block (``[kvcache] block_size``).
    parent : bytes
        Key of the block before ``tokens[0]`` (to continue a prefix); 16 zero bytes for the
        start of a sequence.
    include_partial : bool
        Also key a last block shorter than ``block_tokens`` (Mooncake's traces do; vLLM
        caches full blocks only, the default).

    Returns
    -------
    list of bytes
        One 16-byte key per block.

    Examples
    --------
    >>> ks = prefix_hashes(range(40), 16)
    >>> len(ks), len(ks[0])
    (2, 16)
    >>> prefix_hashes(range(32), 16) == ks       # the third, partial block is not keyed
    True
    """
    if block_tokens < 1:
        raise InvalidArgumentError(f"block_tokens must be positive, got {block_tokens!r}")
    arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i8"))
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be one-dimensional, got shape {arr.shape}")
    n = len(arr) // block_tokens + (1 if include_partial and len(arr) % block_tokens else 0)
    if len(parent) != KEY_BYTES:
        raise InvalidArgumentError(f"parent must be a {KEY_BYTES}-byte key, got {len(parent)}")
    out = []
    h = bytes(parent)
    for i in range(n):
        blk = arr[i * block_tokens:(i + 1) * block_tokens]
        h = hashlib.blake2b(h + blk.tobytes(), digest_size=KEY_BYTES, person=_PERSON).digest()
        out.append(h)
    return out


def as_key(key) -> bytes:
    """The 16-byte form of a key: 16 bytes as they are; a non-negative int (a trace's
    ``hash_id``) big-endian; other bytes or str hashed with BLAKE2b-128.

    Raises
    ------
    InvalidArgumentError
        For a negative or too large int, or another type.
    """
    if isinstance(key, bytes) and len(key) == KEY_BYTES:
        return key
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        try:
            return int(key).to_bytes(KEY_BYTES, "big")
        except OverflowError:
            raise InvalidArgumentError(f"int key {key!r} must be in 0 .. 2**128-1") from None
    if isinstance(key, (bytes, bytearray, memoryview)):
        return hashlib.blake2b(bytes(key), digest_size=KEY_BYTES, person=_PERSON).digest()
    if isinstance(key, str):
        return hashlib.blake2b(key.encode(), digest_size=KEY_BYTES, person=_PERSON).digest()
    raise InvalidArgumentError(f"a block key is 16 bytes, bytes, str or a non-negative int; "
                               f"got {type(key).__name__}")

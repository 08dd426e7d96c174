# SPDX-License-Identifier: Apache-2.0
"""Deterministic fill patterns for ``--verify``, identical on every host.

Both sides must compute the same bytes without exchanging them, so the pattern is pure
integer arithmetic (not a numpy Generator, whose streams may change between numpy
versions). Every 8-byte word depends on its offset and the seed, so a block that lands at
the wrong address, a torn slice or a stale buffer all show up as a mismatch.
"""
from __future__ import annotations

import numpy as np

_CHUNK = 8 << 20            # bytes per step: bounded temporary memory on huge buffers
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)     # Fibonacci hashing multiplier (Knuth)


def _words(first_word: int, n: int, seed: int) -> np.ndarray:
    w = np.arange(first_word, first_word + n, dtype=np.uint64)
    w += np.uint64((seed & 0xFFFFFFFF) << 32)
    w *= _GOLDEN
    w ^= w >> np.uint64(29)             # mix high bits down so low bytes vary too
    return w


def fill(buf: np.ndarray, seed: int, length: int | None = None) -> None:
    """Write the pattern for ``seed`` into the first ``length`` bytes of ``buf``.

    Parameters
    ----------
    buf : numpy.ndarray
        A writable ``uint8`` array.
    seed : int
        Which pattern; different seeds give different bytes everywhere.
    length : int, optional
        How many bytes (default all); must be a multiple of 8 or the tail is patterned
        from the last word's bytes.
    """
    length = buf.nbytes if length is None else min(length, buf.nbytes)
    for off in range(0, length, _CHUNK):
        end = min(off + _CHUNK, length)
        nw = (end - off + 7) // 8
        w = _words(off // 8, nw, seed).view(np.uint8)
        buf[off:end] = w[:end - off]


def first_mismatch(buf: np.ndarray, seed: int, length: int | None = None) -> int:
    """Offset of the first byte of ``buf[:length]`` that differs from the pattern, or -1.

    Every byte is compared (not a checksum), so the offset is exact.
    """
    length = buf.nbytes if length is None else min(length, buf.nbytes)
    for off in range(0, length, _CHUNK):
        end = min(off + _CHUNK, length)
        nw = (end - off + 7) // 8
        want = _words(off // 8, nw, seed).view(np.uint8)[:end - off]
        diff = np.flatnonzero(buf[off:end] != want)
        if diff.size:
            return off + int(diff[0])
    return -1


def expected_byte(seed: int, offset: int) -> int:
    """The pattern's byte at ``offset`` (for error messages)."""
    return int(_words(offset // 8, 1, seed).view(np.uint8)[offset % 8])

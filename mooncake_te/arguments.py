# SPDX-License-Identifier: Apache-2.0
"""Checks of the integers, arrays and timeouts callers hand the engine (issue #20 item 11,
issue #23 item 1).

Addresses and lengths are unsigned 64-bit integers in the native core. Anything
integral is accepted (Python ints, numpy integer scalars and integer arrays: users build
addresses with numpy), through ``operator.index`` as the language defines "integral";
``bool`` (an int subclass, but never meant as a length), floats (``16.9`` would become 16,
``-1.0`` 0xffff...) and strings are refused, as are values outside [0, 2**64). Every
refusal is an :class:`~mooncake_te.errors.InvalidArgumentError` naming the argument and
the value.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from .errors import InvalidArgumentError

U64_MAX = (1 << 64) - 1
#: longest accepted timeout, seconds (the deadline is kept in int64 nanoseconds)
MAX_TIMEOUT = 1e6


def _describe(value) -> str:
    text = repr(value)
    return f"{text[:80]}..." if len(text) > 80 else text


def integer(value, what: str, minimum: int = 0, maximum: int = U64_MAX) -> int:
    """``value`` as an int in [minimum, maximum]; InvalidArgumentError otherwise."""
    if isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{what} must be an integer, got the bool {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must be an integer (int or numpy integer), got "
            f"{type(value).__name__} {_describe(value)}") from None
    if v < minimum:
        raise InvalidArgumentError(f"{what} must be non-negative, got {v}" if minimum == 0
                                   else f"{what} must be at least {minimum}, got {v}")
    if v > maximum:
        raise InvalidArgumentError(f"{what} must be below 2**64 (an unsigned 64-bit value), "
                                   f"got {v:#x}" if maximum == U64_MAX else
                                   f"{what} must be at most {maximum:#x} here, got {v:#x}")
    return v


def u64_array(values, what: str) -> np.ndarray:
    """A contiguous 1-D uint64 array of ``values`` (an integer array, a sequence of
    integers or one integer); InvalidArgumentError for anything else."""
    if isinstance(values, np.ndarray):
        arr = values
    elif isinstance(values, (str, bytes, bytearray)):
        raise InvalidArgumentError(f"{what} must be integers, got {type(values).__name__} "
                                   f"{_describe(values)}")
    else:
        if np.isscalar(values) or isinstance(values, np.generic):
            values = [values]
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError, OverflowError):
            arr = np.asarray(values, dtype=object)
    kind = arr.dtype.kind
    if kind == "u":
        out = arr
    elif kind == "i":
        if arr.size and arr.min() < 0:
            k = int(np.argmin(arr.reshape(-1)))
            raise InvalidArgumentError(f"{what}[{k}] must be non-negative, got "
                                       f"{int(arr.reshape(-1)[k])}")
        out = arr
    elif kind == "O":
        # Python ints beyond int64 (or a mixture): check each one.
        flat = arr.reshape(-1)
        out = np.fromiter((integer(v, f"{what}[{k}]") for k, v in enumerate(flat)),
                          dtype=np.uint64, count=len(flat))
    else:
        name = {"b": "bools", "f": "floats", "c": "complex numbers", "U": "strings",
                "S": "bytes"}.get(kind, f"{arr.dtype} values")
        hint = "; floats are not rounded for you (16.9 is not a length)" if kind == "f" else ""
        raise InvalidArgumentError(
            f"{what} must be integers (an integer numpy array or ints), got {name} "
            f"{_describe(values)}{hint}")
    out = np.ascontiguousarray(out, dtype=np.uint64)
    return out.reshape(-1) if out.ndim != 1 else out


def timeout(value, default: float, what: str = "timeout") -> float:
    """Seconds: ``default`` for None, else a finite number in (0, MAX_TIMEOUT]."""
    if value is None:
        return float(default)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise InvalidArgumentError(f"{what} must be a number of seconds, got "
                                   f"{type(value).__name__} {_describe(value)}")
    t = float(value)
    if not (math.isfinite(t) and 0 < t <= MAX_TIMEOUT):
        raise InvalidArgumentError(f"{what} must be a finite number of seconds in "
                                   f"(0, {MAX_TIMEOUT:g}], got {value!r}")
    return t


def wait_timeout(value, what: str = "timeout") -> float:
    """Seconds one wait may take: a finite number in [0, MAX_TIMEOUT] (0: just look);
    negative values count as 0, as before."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise InvalidArgumentError(f"{what} must be a number of seconds, got "
                                   f"{type(value).__name__} {_describe(value)}")
    t = float(value)
    if not math.isfinite(t) or t > MAX_TIMEOUT:
        raise InvalidArgumentError(f"{what} must be a finite number of seconds, at most "
                                   f"{MAX_TIMEOUT:g}, got {value!r}")
    return max(t, 0.0)

# SPDX-License-Identifier: Apache-2.0
"""Bad input through the Python API is a typed error naming the argument; numpy integers
are integers (issue #20 item 11, issue #23 item 1)."""
from __future__ import annotations

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.errors import InvalidArgumentError


@pytest.fixture
def pair(engine_pair):
    a, b = engine_pair
    src = np.arange(65536, dtype=np.uint8)
    dst = np.zeros(65536, np.uint8)
    return a, b, src, dst, a.register(src), b.register(dst)


def test_numpy_integers_are_accepted(pair):
    a, b, src, dst, ms, md = pair
    blocks = np.arange(4, dtype=np.uint64) * 1024
    # As the README builds addresses: region address + numpy offsets.
    a.write(b.name, ms.address + blocks[1], md.address + blocks[2], np.int64(1024))
    assert (dst[2048:3072] == src[1024:2048]).all()
    a.read(b.name, np.uint64(ms.address) + np.uint64(8192), np.int64(md.address),
           np.uint16(512))
    a.write(b.name, ms.address, md.address, 16, timeout=np.float32(5))
    a.submit_arrays(mte.WRITE, b.name, ms.address + blocks, md.address + blocks.astype(np.int64),
                    np.int32(1024)).wait()
    a.submit_arrays(mte.WRITE, b.name, [ms.address + int(o) for o in blocks],
                    [np.uint64(md.address) + o for o in blocks],
                    [1024] * 4).wait(timeout=np.int64(10))
    a.submit([mte.TransferRequest(mte.WRITE, np.uint64(ms.address), b.name,
                                  np.uint64(md.address), np.int64(64))]).wait()
    assert (dst[:4096] == src[:4096]).all()


@pytest.mark.parametrize("field,value,match", [
    ("source", 2**64, "source_address must be below 2\\*\\*64"),
    ("target", 2**64 + 5, "target_address must be below 2\\*\\*64"),
    ("length", 2**64, "length must be below 2\\*\\*64"),
    ("length", True, "length must be an integer, got the bool True"),
    ("length", "16", "length must be an integer .* str '16'"),
    ("length", 16.0, "length must be an integer .* float 16.0"),
    ("source", 1.5e9, "source_address must be an integer"),
    ("length", np.float64(16.9), "length must be an integer"),
])
def test_bad_integers_name_the_argument(pair, field, value, match):
    a, b, src, dst, ms, md = pair
    args = {"source": ms.address, "target": md.address, "length": 16}
    args[field] = value
    for call in (a.write, a.read):
        with pytest.raises(InvalidArgumentError, match=match):
            call(b.name, args["source"], args["target"], args["length"])


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e12, -1, 0, "5", True])
def test_bad_timeouts(pair, value):
    a, b, src, dst, ms, md = pair
    with pytest.raises(InvalidArgumentError, match="timeout"):
        a.write(b.name, ms.address, md.address, 16, timeout=value)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        a.submit_arrays(mte.WRITE, b.name, [ms.address], [md.address], 16, timeout=value)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e12, "1"])
def test_bad_wait_timeouts(pair, value):
    a, b, src, dst, ms, md = pair
    batch = a.submit_arrays(mte.WRITE, b.name, [ms.address], [md.address], 16)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        batch.wait(timeout=value)
    batch.wait()


@pytest.mark.parametrize("lengths,match", [
    (np.array([16.0]), "floats"),
    (np.array([-1.0]), "floats"),
    (np.array([16.9]), "floats"),
    ([True], "bools"),
    (True, "bools"),
    (["16"], "strings"),
    ("16", "str"),
    ([2**64], r"lengths\[0\] must be below 2\*\*64"),
    (np.array([-1], np.int64), r"lengths\[0\] must be non-negative"),
])
def test_bad_arrays_are_refused_not_cast(pair, lengths, match):
    a, b, src, dst, ms, md = pair
    with pytest.raises(InvalidArgumentError, match=match):
        a.submit_arrays(mte.WRITE, b.name, np.array([ms.address], np.uint64),
                        np.array([md.address], np.uint64), lengths)
    with pytest.raises(InvalidArgumentError, match="target_addresses"):
        a.submit_arrays(mte.WRITE, b.name, np.array([ms.address], np.uint64),
                        np.array([float(md.address)]), 16)
    assert not dst.any()


def test_register_address_bounds(engine):
    mem = np.zeros(4096, np.uint8)
    with pytest.raises(InvalidArgumentError, match="length"):
        engine.register_address(mem.ctypes.data, 2**64, owner=mem)
    with pytest.raises(InvalidArgumentError, match="length"):
        engine.register_address(mem.ctypes.data, 2**64 - 1, owner=mem)     # wraps around
    with pytest.raises(InvalidArgumentError, match="address must be"):
        engine.register_address(2**64, 16)
    with pytest.raises(InvalidArgumentError, match="bool"):
        engine.register_address(mem.ctypes.data, True, owner=mem)
    with pytest.raises(InvalidArgumentError, match="length must be an integer"):
        engine.register_address(mem.ctypes.data, 4096.0, owner=mem)
    mr = engine.register_address(np.uint64(mem.ctypes.data), np.int64(4096), owner=mem)
    assert mr.address == mem.ctypes.data and mr.length == 4096

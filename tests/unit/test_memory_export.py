# SPDX-License-Identifier: Apache-2.0
"""A registered buffer cannot move under the engine (issue #20 item 2).

The region table keeps the address the buffer had at registration; peers write there.
So the buffer export is held while registered: resizing the owner fails with
BufferError, and works again once the region is unregistered (or the engine closed).
"""
from __future__ import annotations

import array
import mmap

import pytest

import mooncake_te as mte


def _grow(obj):
    if isinstance(obj, mmap.mmap):
        obj.resize(16 << 20)
    else:
        obj.extend(bytes(16 << 20))


@pytest.mark.parametrize("make", [lambda: bytearray(64 << 10),
                                  lambda: array.array("b", bytes(64 << 10)),
                                  lambda: mmap.mmap(-1, 64 << 10)],
                         ids=["bytearray", "array", "mmap"])
def test_registered_buffer_refuses_resize_until_unregistered(engine, make):
    buf = make()
    mr = engine.register(buf)
    with pytest.raises(BufferError):
        _grow(buf)
    # Still at the registered address and length.
    assert len(buf) == 64 << 10
    engine.unregister(mr)
    _grow(buf)              # released: the owner may resize again
    assert len(buf) > 64 << 10


def test_close_releases_exports():
    eng = mte.TransferEngine(host="127.0.0.1")
    buf = bytearray(4096)
    eng.register(buf)
    eng.close()
    buf.extend(b"x")
    assert len(buf) == 4097


def test_register_many_failure_releases_exports(engine):
    a, b = bytearray(4096), bytearray(4096)
    with pytest.raises(mte.errors.InvalidArgumentError):
        engine.register_many([a, bytes(10), b])     # bytes is read-only: refused for "rw"
    a.extend(b"x")                                   # a was added, then removed again
    assert len(a) == 4097


def test_peer_writes_land_in_the_registered_buffer(engine_pair):
    a, b = engine_pair
    src, dst = bytearray(b"\x5a" * 65536), bytearray(65536)
    ms, md = a.register(src), b.register(dst)
    with pytest.raises(BufferError):
        dst.extend(bytes(16 << 20))
    a.write(b.name, ms.address, md.address, 65536)
    assert dst == src

# SPDX-License-Identifier: Apache-2.0
"""A registered buffer cannot move under the engine (issue #20 item 2).

The region table keeps the address the buffer had at registration; peers write there.
So the buffer export is held while registered: resizing the owner fails with
BufferError, and works again once the region is unregistered (or the engine closed).
"""
from __future__ import annotations

import array
import mmap

import numpy as np
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


def _address_of(buf) -> int:
    """The address of buf's memory, without keeping a buffer export alive."""
    arr = np.frombuffer(buf, np.uint8)
    address = int(arr.ctypes.data)
    del arr
    return address


def test_register_address_pins_a_resizable_owner(engine_pair):
    """register_address(owner=bytearray) pins the owner as register() does (issue 35,
    item 6): a resize while registered raises BufferError instead of moving the memory
    a peer writes into; a peer WRITE lands in the owner; unregistering lets it resize."""
    a, b = engine_pair
    src = bytearray(b"\xa7" * 65536)
    dst = bytearray(65536)
    ms = a.register(src)
    md = b.register_address(_address_of(dst), len(dst), owner=dst)
    with pytest.raises(BufferError):
        dst.extend(bytes(16 << 20))
    with pytest.raises(BufferError):
        del dst[:]
    assert len(dst) == 65536
    a.write(b.name, ms.address, md.address, 65536)
    assert dst == src
    b.unregister(md)
    dst.extend(b"x")                    # released: the owner may resize again
    assert len(dst) == 65537


def test_register_address_refused_releases_the_owner(engine):
    """A register_address that fails (overlap) does not leave the owner pinned."""
    buf = bytearray(8192)
    mr = engine.register(buf)
    other = bytearray(4096)
    with pytest.raises(mte.AddressOverlappedError):
        engine.register_address(mr.address, 4096, owner=other)
    other.extend(b"x")
    assert len(other) == 4097

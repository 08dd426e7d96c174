# SPDX-License-Identifier: Apache-2.0
"""Every transport's native submit returns 0 or a status code of src/core/status.h,
never an errno (issue 40, item 1): TCP's Peer.submit and the storage Device.submit here;
RDMA's in the fabric lab (tests/fabric)."""
from __future__ import annotations

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import errors as E
from mooncake_te.core import NativeBatch, Regions, now_ns

U64 = np.uint64


def _arrays(*values):
    return [np.array([v], U64) for v in values]


def test_storage_submit_returns_status_codes(tmp_path):
    nv = pytest.importorskip("mooncake_te.transports.nvmeof._nvmeof")
    path = tmp_path / "disk"
    path.write_bytes(bytes(1 << 16))
    regions = Regions()
    buf = np.zeros(4096, np.uint8)
    assert regions.add(buf.ctypes.data, buf.nbytes, 3, -1) == 0
    dev = nv.Device(str(path), regions, 1 << 16, 2)
    try:
        b = NativeBatch(1, now_ns() + 10**9)
        local, off, n = _arrays(buf.ctypes.data, 0, 4096)
        assert dev.submit(b, 7, local, off, n, 0) == E.ERR_INVALID_ARGUMENT   # bad op
        local, off, n = _arrays(buf.ctypes.data, 1 << 16, 4096)
        assert dev.submit(b, 1, local, off, n, 0) == E.ERR_OUT_OF_RANGE       # past the end
        b.abandon(0, 1)
        b.seal()
    finally:
        dev.close()
    b = NativeBatch(1, now_ns() + 10**9)
    assert dev.submit(b, 1, *_arrays(buf.ctypes.data, 0, 4096), 0) == E.ERR_CLOSED
    b.abandon(0, 1)
    b.seal()
    assert regions.remove(buf.ctypes.data) == 0


def test_tcp_submit_returns_status_codes():
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp") as a, \
            mte.TransferEngine(host="127.0.0.1", protocol="tcp") as b:
        src = np.zeros(4096, np.uint8)
        dst = np.zeros(4096, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        t = a._transports["tcp"]
        peer = t._peer(a.internal.resolve(b.name))
        batch = NativeBatch(1, now_ns() + 10**9)
        local, remote, n = _arrays(ra.address, rb.address, 64)
        assert peer.submit(batch, 7, local, remote, n, 0, False) == E.ERR_INVALID_ARGUMENT
        assert peer.submit(batch, 1, local, remote, n, 5, False) == E.ERR_INVALID_ARGUMENT
        batch.abandon(0, 1)
        batch.seal()

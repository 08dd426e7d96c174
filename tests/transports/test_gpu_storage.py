# SPDX-License-Identifier: Apache-2.0
"""GPU memory to and from storage through the core's staging ring (src/core/stage.h), the
one TCP uses: the NVMe-oF storage workers on a plain file (the data path is the same for
a connected namespace's block device). Needs a CUDA GPU and CuPy (conftest.py skips
otherwise)."""
from __future__ import annotations

import numpy as np
import pytest

from mooncake_te.core import NativeBatch, OP_READ, OP_WRITE, Regions, ST_COMPLETED, now_ns
from mooncake_te.transports.nvmeof._nvmeof import Device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("length, offset", [(8 << 20, 0), (3 * (1 << 20) + 777, 4096 + 5),
                                            (4096, 512)])
def test_gpu_memory_round_trips_through_storage(tmp_path, length, offset):
    cp = pytest.importorskip("cupy")
    path = tmp_path / "disk.img"
    path.write_bytes(b"\0" * (16 << 20))
    src = cp.arange(length, dtype=cp.uint8) * 7 + 3
    dst = cp.zeros(length, dtype=cp.uint8)
    regions = Regions()
    for a in (src, dst):
        assert regions.add(a.data.ptr, a.nbytes, 0, a.device.id) == 0
    with Device(str(path), regions, threads=4) as dev:
        for op, arr in ((OP_WRITE, src), (OP_READ, dst)):
            b = NativeBatch(1, now_ns() + 30 * 10**9)
            rc = dev.submit(b, op, np.array([arr.data.ptr], np.uint64),
                            np.array([offset], np.uint64), np.array([length], np.uint64), 0)
            assert rc == 0
            b.seal()
            assert b.wait(now_ns() + 30 * 10**9)
            states, nbytes, errs = b.status()
            assert states[0] == ST_COMPLETED, errs
            assert int(nbytes[0]) == length
        # The one-request path on the calling thread stages too.
        dst.fill(0)
        rc = dev.transfer(OP_READ, dst.data.ptr, offset, length, now_ns() + 30 * 10**9)
        assert rc == 0
    assert bool((dst == src).all())
    on_disk = np.fromfile(path, np.uint8)[offset:offset + length]
    assert (on_disk == cp.asnumpy(src)).all()

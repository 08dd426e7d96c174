# SPDX-License-Identifier: Apache-2.0
"""Fabric tier: a real NVMe-oF namespace (the lab guest's nvmet target over TCP)."""
from __future__ import annotations

import json
import mmap
import os
import secrets

import pytest

pytestmark = pytest.mark.nvmeof


@pytest.fixture
def lab_namespace():
    """The namespace the lab connected (``MOONCAKE_LAB_NVMEOF``).

    Only a namespace the lab made for us is written to: on a machine with real NVMe
    devices, guessing a device to overwrite would be destructive.
    """
    raw = os.environ.get("MOONCAKE_LAB_NVMEOF")
    if not raw:
        pytest.skip("no lab NVMe-oF namespace (MOONCAKE_LAB_NVMEOF unset): these tests "
                    "write to it, so they only run where the lab made one")
    return json.loads(raw)


def test_namespace_is_connected_over_tcp(lab_namespace):
    """The block device belongs to an NVMe-oF controller on the tcp transport, reached
    at the lab's target address, for the lab's subsystem NQN."""
    dev = os.path.basename(lab_namespace["device"])
    ctrls = [c for c in os.listdir("/sys/class/nvme")
             if open(f"/sys/class/nvme/{c}/subsysnqn").read().strip() == lab_namespace["nqn"]]
    assert ctrls, os.listdir("/sys/class/nvme")
    c = ctrls[0]
    assert open(f"/sys/class/nvme/{c}/transport").read().strip() == "tcp"
    addr = open(f"/sys/class/nvme/{c}/address").read()
    assert f"traddr={lab_namespace['traddr']}" in addr and \
        f"trsvcid={lab_namespace['trsvcid']}" in addr, addr
    sectors = int(open(f"/sys/block/{dev}/size").read())
    assert sectors * 512 == lab_namespace["size"]


def test_namespace_write_read_back(lab_namespace):
    """8 MiB written with O_DIRECT (past any page cache, through nvme-tcp to nvmet) at
    an offset, read back equal; the bytes before it stay untouched."""
    size, offset = 8 << 20, 16 << 20
    data = mmap.mmap(-1, size)             # page-aligned, as O_DIRECT requires
    data.write(secrets.token_bytes(size))
    back = mmap.mmap(-1, size)
    zero = mmap.mmap(-1, 4096)
    fd = os.open(lab_namespace["device"], os.O_RDWR | os.O_DIRECT)
    try:
        os.pwritev(fd, [zero], offset - 4096)
        assert os.pwritev(fd, [data], offset) == size
        os.fsync(fd)
        assert os.preadv(fd, [back], offset) == size
        before = mmap.mmap(-1, 4096)
        os.preadv(fd, [before], offset - 4096)
    finally:
        os.close(fd)
    assert back[:] == data[:]
    assert before[:] == bytes(4096)

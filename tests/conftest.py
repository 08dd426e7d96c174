# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures and hardware probes.

Hardware-dependent tests carry a marker (rdma, nvmeof, gpu, multi_gpu); each is probed
once here and skipped with the reason when the machine lacks it.
"""
from __future__ import annotations

import glob
import os
import shutil

import numpy as np
import pytest

import mooncake_te as mte
from peers import PeerProcess

pytest_plugins = ["fabric"]   # tests/fabric.py: rdma/nvmeof tests run in the fabric lab guest


def _probe_gpu() -> str | None:
    if not os.path.exists("/dev/nvidiactl"):
        return "no NVIDIA GPU on this machine (/dev/nvidiactl missing)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install cupy-cuda12x or cupy-cuda13x; '.[cuda12]' or '.[cuda13]' in a clone)"
    return None


def _probe_rdma() -> str | None:
    if not glob.glob("/sys/class/infiniband/*"):
        return "no RDMA devices in /sys/class/infiniband (try the fabric lab: mooncake-te lab)"
    return None


def _probe_nvmeof() -> str | None:
    if not os.path.isdir("/sys/kernel/config/nvmet"):
        return "no nvmet configfs (/sys/kernel/config/nvmet); needs the fabric lab guest"
    if not shutil.which("nvme"):
        return "nvme-cli is not installed"
    return None


_REASONS = {}


def pytest_configure(config):
    _REASONS["gpu"] = _probe_gpu()
    _REASONS["multi_gpu"] = _REASONS["gpu"] or (
        None if len(glob.glob("/dev/nvidia[0-9]*")) >= 2 else "fewer than two GPUs")
    _REASONS["rdma"] = _probe_rdma()
    _REASONS["nvmeof"] = _probe_nvmeof()


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, reason in _REASONS.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"{marker}: {reason}"))


@pytest.fixture
def engine():
    eng = mte.TransferEngine(host="127.0.0.1")
    yield eng
    eng.close()


@pytest.fixture
def engine_pair():
    """Two engines in this process: quick for API-level tests."""
    a = mte.TransferEngine(host="127.0.0.1")
    b = mte.TransferEngine(host="127.0.0.1")
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def peer():
    """An engine in another process with a 4 MiB registered buffer."""
    p = PeerProcess(4 << 20)
    yield p
    p.close()


@pytest.fixture
def local_buf(engine):
    buf = np.zeros(8 << 20, dtype=np.uint8)
    region = engine.register(buf)
    return buf, region

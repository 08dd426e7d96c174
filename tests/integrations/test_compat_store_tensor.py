# SPDX-License-Identifier: Apache-2.0
"""Mooncake Store's tensor calls on our store (issue 39): the header layout without
torch, the error a torch-less Python gets, and every tensor call under etcd, redis and
our HTTP metadata server in a Python that has torch (``store_tensor_driver.py``: this
Python when it has torch, else ``MTE_VLLM_VENV``'s; skipped, saying so, when neither
has)."""
from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from mooncake_te.compat import tensor as T
from mooncake_te.compat.store import MooncakeDistributedStore

from store_fixtures import _loopback, index_url  # noqa: F401  (fixtures)
from torch_env import overlay, torch_python, why_no_torch

pytestmark = pytest.mark.timeout(300)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_header_layout_matches_mooncakes_offsets():
    """The offsets of Mooncake's ``TensorMetadata`` (integration_utils.h): a 40-byte
    ``TensorObjectHeader``, two 8 x int64 shapes, axis_count, reserved0, 4 x 32-byte
    ``LayoutAxis``: 304 bytes."""
    h = T.pack_header(12, (4, 6), (4, 3), 24, axes=[(T.AXIS_TP, 1, 2, 1, 0, 3)])
    assert len(h) == 304 == T.HEADER_SIZE
    assert struct.unpack_from("<IHH", h, 0) == (0x4D4F4F4E, 1, 304)
    assert struct.unpack_from("<iiII", h, 8) == (12, 2, 1, 0)      # dtype, ndim, SHARD
    assert struct.unpack_from("<QQ", h, 24) == (304, 24)
    assert struct.unpack_from("<8q", h, 40) == (4, 6) + (-1,) * 6
    assert struct.unpack_from("<8q", h, 104) == (4, 3) + (-1,) * 6
    assert struct.unpack_from("<II", h, 168) == (1, 0)
    assert struct.unpack_from("<iiiiiiq", h, 176) == (1, 0, 1, 2, 1, 0, 3)
    assert h[208:] == bytes(96)
    parsed = T.parse_header(h + bytes(24), 328)
    assert parsed is not None and parsed["local_shape"] == (4, 3)
    assert parsed["dtype"] == 12 and T.DTYPES[12] == ("bfloat16", 2)
    # what Mooncake's ValidateTensorMetadata refuses
    assert T.parse_header(h + bytes(23), 327) is None                # data_bytes off
    assert T.parse_header(b"\0" * 304, 304) is None                  # no magic
    assert T.parse_header(h[:100], 100) is None                      # short
    bad = bytearray(h)
    struct.pack_into("<i", bad, 8, 15)                               # NR_DTYPES
    assert T.parse_header(bytes(bad) + bytes(24), 328) is None
    zero_d = T.pack_header(0, (), (), 4)
    assert struct.unpack_from("<8q", zero_d, 40) == (-1,) * 8
    assert T.parse_header(zero_d + bytes(4), 308)["ndim"] == 0


def test_without_torch_the_call_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)        # import torch -> ImportError
    s = MooncakeDistributedStore()
    for call in (lambda: s.put_tensor("k", object()), lambda: s.get_tensor("k"),
                 lambda: s.put_tensor_with_tp("k", object(), tp_size=2),
                 lambda: s.batch_get_tensor_into(["k"], [1], [1])):
        with pytest.raises(ModuleNotFoundError, match="pip install torch") as ei:
            call()
        assert isinstance(ei.value, T.TorchNotInstalledError)
    # the byte calls do not need torch
    assert s.get("k") == b""


def test_tensor_calls_under_torch(index_url, tmp_path):
    py = torch_python()
    if py is None:
        pytest.skip(why_no_torch())
    libs = overlay(py, str(tmp_path / "libs"), dists=("etcd3gw", "redis"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, libs]),
               MC_TCP_BIND_ADDRESS="127.0.0.1")
    r = subprocess.run([py, os.path.join(HERE, "store_tensor_driver.py"), index_url],
                       capture_output=True, text=True, env=env, timeout=240)
    oks = [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")]
    print(f"{len(oks)} checks passed under {py}")
    assert r.returncode == 0 and len(oks) == 14, r.stdout[-8000:] + r.stderr[-4000:]


def test_importing_the_store_does_not_import_torch():
    """torch is imported on the first tensor call, never by ``import mooncake.store``."""
    py = torch_python()
    if py is None:
        pytest.skip(why_no_torch())
    r = subprocess.run([py, "-c", "import sys, mooncake_te.compat.store as s\n"
                        "assert 'torch' not in sys.modules\n"
                        "s.MooncakeDistributedStore().get_tensor('k')\n"
                        "assert 'torch' in sys.modules\n"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]

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

from mooncake_te.compat import parallelism as P
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


def test_parallelism_request_objects_are_mooncakes():
    """``mooncake.store.ParallelAxis`` / ``TensorParallelism`` / ``ReadTarget``: Mooncake's
    fields, defaults, string modes and copy semantics (pybind ``def_readwrite``)."""
    import mooncake_te.compat.store as S
    a = S.ParallelAxis()
    assert (a.kind, a.rank, a.size, a.split_dim, a.expert_id, a.stage_id) == \
        ("", 0, 1, None, None, None)
    a.kind, a.rank, a.size, a.split_dim = "tp", 1, 2, 0
    with pytest.raises(TypeError):
        a.rank = "1"
    with pytest.raises(TypeError):
        a.kind = 3
    with pytest.raises(AttributeError):
        a.colour = 1                                         # no such field
    p = S.TensorParallelism()
    assert p.axes == []
    p.axes = [a]
    a.rank = 0                                               # the assignment copied it
    assert p.axes[0].rank == 1
    p.axes[0].rank = 0                                       # elements are the stored ones
    assert p.axes[0].rank == 0
    p.axes.append(S.ParallelAxis())                          # the list is a copy
    assert len(p.axes) == 1
    with pytest.raises(TypeError):
        p.axes = [object()]
    t = S.ReadTarget()
    assert (t.mode, t.parallelism) == ("as_stored", None)
    for m in ("SHARD", "Full", "as_stored"):
        t.mode = m
        assert t.mode == m.lower()
    with pytest.raises(RuntimeError, match="Unsupported ReadTarget mode"):
        t.mode = "replicated"
    t.parallelism = p
    assert t.parallelism == p and t.parallelism is not p


def test_parallelism_keys_and_manifest_are_mooncakes():
    """Object keys (``get_parallelism_key_name``, writer shards) and the 96-byte
    ``WriterShardManifest`` at Mooncake's offsets."""
    tp = P.Axis(T.AXIS_TP, 1, 4, split_dim=1)
    dp = P.Axis(T.AXIS_DP, 0, 2)
    ep = P.Axis(T.AXIS_EP, 3, 8, expert_id=11)
    pp = P.Axis(T.AXIS_PP, 1, 2, stage_id=7)
    assert P.axes_key("w", [tp]) == "w_tp_1"                 # the *_with_tp key
    assert P.axes_key("w", [tp, dp]) == "w__dp_0of2__tp_1of4_sd1"
    assert P.axes_key("w", [pp, ep, tp]) == "w__tp_1of4_sd1__ep_3of8_eid11__pp_1of2_sid7"
    assert P.axes_key("w", [ep]) == "w__ep_3of8_eid11"
    assert P.writer_key("w", P.Writer(2, 3, 1)) == "w__writer_2of3_sd1"
    assert P.writer_manifest_key("w") == "w__writer_manifest"
    assert P.parallelism_manifest_key("w") == "w__parallelism_manifest"
    m = P.pack_manifest(12, (4, 9), 1, 3)
    assert len(m) == 96
    assert struct.unpack_from("<IHHiiiii", m, 0) == (0x574D414E, 1, 96, 12, 2, 1, 3, 0)
    assert m[28:32] == bytes(4)
    assert struct.unpack_from("<8q", m, 32) == (4, 9) + (-1,) * 6
    assert P.parse_manifest(m) == {"dtype": 12, "global_shape": (4, 9), "split_dim": 1,
                                   "shard_count": 3}
    assert P.parse_manifest(m[:95]) is None
    assert P.parse_manifest(P.pack_manifest(0, (4,), 1, 2)) is None      # split_dim >= ndim
    assert P.parse_manifest(P.pack_manifest(0, (4,), 0, 0)) is None      # no shards
    # the header axes: order given; reserved0 the expert / stage id, reserved1 the extent
    assert P.layout_axes([pp, tp], (6, 2)) == [(3, 1, 2, -1, 7, 0), (1, 1, 4, 1, 0, 2)]


def test_parallelism_requests_are_checked_as_mooncake(caplog):
    """What Mooncake's ``validate_parallelism_spec`` / ``parse_writer_partition_spec``
    refuse (the log says why); the checks need no torch."""
    def axes(*a):
        return P.TensorParallelism([P.ParallelAxis(**x) for x in a])
    ok = axes({"kind": "TP", "rank": 1, "size": 2, "split_dim": 0},
              {"kind": "ep", "rank": 0, "size": 4, "expert_id": 3})
    assert P.parse_axes(ok, "t") == [P.Axis(T.AXIS_TP, 1, 2, 0),
                                     P.Axis(T.AXIS_EP, 0, 4, None, 3)]
    bad = {"rank 2 of size 2": axes({"kind": "tp", "rank": 2, "size": 2, "split_dim": 0}),
           "TP axis requires split_dim": axes({"kind": "tp", "size": 2}),
           "DP axis must not provide split_dim": axes({"kind": "dp", "size": 2,
                                                       "split_dim": 0}),
           "EP axis requires expert_id": axes({"kind": "ep", "size": 2}),
           "PP axis requires stage_id": axes({"kind": "pp", "size": 2}),
           "duplicate axis kinds": axes({"kind": "dp"}, {"kind": "DP"}),
           "cannot be empty": axes(),
           "unsupported parallel axis kind": axes({"kind": "sp"}),
           "must provide axes": object()}
    for why, p in bad.items():
        caplog.clear()
        assert P.parse_axes(p, "t") is None, why
        assert why in caplog.text, (why, caplog.text)

    class W:
        def __init__(self, rank, size, split_dim):
            self.rank, self.size, self.split_dim = rank, size, split_dim
    assert P.parse_writer(W(1, 2, 0), "t") == P.Writer(1, 2, 0)
    for w in (W(2, 2, 0), W(0, 0, 0), W(0, 2, -1), object()):
        assert P.parse_writer(w, "t") is None


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
    assert r.returncode == 0 and len(oks) == 24, r.stdout[-8000:] + r.stderr[-4000:]


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

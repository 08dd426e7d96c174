# SPDX-License-Identifier: Apache-2.0
"""The RDMA transport's pieces that run anywhere: build and import without verbs, the
reasons it gives, device errors, GID choice, error texts, config keys, the RPC hook."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import errors as E
from mooncake_te.batch import error_for
from mooncake_te.config import Config
from mooncake_te.metadata import framing
from mooncake_te.metadata.descriptor import BufferInfo, SegmentDescriptor
from mooncake_te.metadata.rpc import RpcServer
from mooncake_te.transports import probe, rdma
from mooncake_te.transports.base import TransportContext

ROOT = Path(__file__).resolve().parents[2]


def test_probe_says_why_rdma_is_unavailable_here():
    if rdma.unavailable_reason() is None:
        pytest.skip("this machine has RDMA devices")
    t = probe()["rdma"]
    assert not t.available and t.reason
    with pytest.raises(E.TransportUnavailableError, match="rdma"):
        mte.TransferEngine(host="127.0.0.1", protocol="rdma")
    with mte.TransferEngine(host="127.0.0.1") as eng:     # auto: TCP, nothing missing
        assert eng.protocol == "tcp" and "rdma" not in eng._transports


def test_without_the_extension_everything_else_imports(monkeypatch):
    monkeypatch.setattr(rdma, "_verbs", None)
    monkeypatch.setattr(rdma, "_IMPORT_ERROR", "No module named '_verbs'")
    why = rdma.unavailable_reason()
    assert "libibverbs-dev" in why and "not built" in why
    t = probe()["rdma"]
    assert not t.available and "libibverbs-dev" in t.reason
    with pytest.raises(E.TransportUnavailableError, match="libibverbs-dev"):
        mte.TransferEngine(host="127.0.0.1", protocol="rdma")


def test_build_skips_rdma_without_verbs_headers():
    """setup.py builds the RDMA extension only where infiniband/verbs.h is; forced off
    (as on a machine without the header) it says so and builds the rest."""
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, MTE_WITH_RDMA="0"), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "native build: core, tcp" in out.stderr
    assert "skipped: rdma (no infiniband/verbs.h" in out.stderr


def test_unknown_device_is_named_with_the_ones_that_exist(monkeypatch):
    verbs = pytest.importorskip("mooncake_te.transports.rdma._verbs")
    monkeypatch.setattr(verbs, "device_names", lambda: ["rxe0", "rxe1"])
    ctx = TransportContext(regions=None, host="127.0.0.1", name="x", instance=1,
                           config=Config.load()["transfer_engine"], devices=["mlx5_bond0"])
    with pytest.raises(E.DeviceNotFoundError) as ei:
        rdma.RdmaTransport(ctx)
    assert "no RDMA device named 'mlx5_bond0'" in str(ei.value)
    assert "found: rxe0, rxe1" in str(ei.value)
    # Through the engine too: asked for by name, never a silent fallback.
    with pytest.raises(E.DeviceNotFoundError, match="found: rxe0, rxe1"):
        mte.TransferEngine(host="127.0.0.1", protocol="rdma", devices="mlx5_bond0")


def test_rdma_error_texts():
    e = error_for(-1110, "peer", 0, 1, 0x1000, 0x2000, 64)
    assert isinstance(e, E.AddressNotRegisteredError)
    assert "refused by the NIC" in str(e) and "remote access error" in str(e)
    e = error_for(-1112, "peer", 3, 2, 0x1000, 0x2000, 64)
    assert isinstance(e, E.TransferError) and "transport retry counter exceeded" in str(e)
    assert e.status == -1112
    assert "no RDMA rail" in str(error_for(-1150, "peer", 0, 1, 0, 0, 1))
    verbs = pytest.importorskip("mooncake_te.transports.rdma._verbs")
    for st in (5, 10, 12):    # our table matches libibverbs' own words
        assert verbs.wc_status_str(st).lower() in str(error_for(-1100 - st, "p", 0, 1, 0, 0, 1)).lower()


def test_config_keys_and_mooncake_variables():
    cfg = Config.load(env={"MC_SLICE_SIZE": "131072", "MC_GID_INDEX": "3", "MC_MTU": "1024",
                           "MC_NUM_QP_PER_EP": "4", "MC_RDMA_RAIL_PAUSE_SECONDS": "5",
                           "NCCL_IB_GID_INDEX": "7"})
    te = cfg["transfer_engine"]
    assert (te["rdma_slice_size"], te["rdma_gid_index"], te["rdma_mtu"],
            te["rdma_qps_per_endpoint"], te["rdma_rail_pause_s"]) == (131072, 3, 1024, 4, 5.0)
    assert Config.load(env={})["transfer_engine"]["rdma_slice_size"] == 64 << 10
    with pytest.raises(E.ConfigError):
        Config.load(env={"MC_MTU": "1500"})


def test_rpc_server_serves_a_transport_handler():
    calls = []

    def handler(payload):
        calls.append(payload)
        if payload == b"boom":
            raise ValueError("bad endpoint")
        return json.dumps({"echo": payload.decode()}).encode()

    srv = RpcServer("127.0.0.1", 0, lambda: b"{}", lambda s, m: None, token=b"secret")
    try:
        srv.add_handler(framing.RDMA_CONNECT, handler)
        r = framing.request("127.0.0.1", srv.port, framing.RDMA_CONNECT, b"hi", 5, b"secret")
        assert json.loads(r) == {"echo": "hi"}
        r = framing.request("127.0.0.1", srv.port, framing.RDMA_CONNECT, b"boom", 5, b"secret")
        assert "bad endpoint" in json.loads(r)["reply_msg"]
        with pytest.raises(E.AuthenticationError):
            framing.request("127.0.0.1", srv.port, framing.RDMA_CONNECT, b"x", 5, b"wrong")
        assert calls == [b"hi", b"boom"]
        with pytest.raises(ValueError):
            srv.add_handler(framing.METADATA, handler)
        srv.remove_handler(framing.RDMA_CONNECT)
        r = framing.request("127.0.0.1", srv.port, framing.RDMA_CONNECT, b"hi", 5, b"secret")
        assert "unsupported" in json.loads(r)["reply_msg"]
    finally:
        srv.close()


def test_remote_coverage_check():
    d = SegmentDescriptor("p", "rdma", "h", 1, "1",
                          buffers=[BufferInfo(0x1000, 0x1000, rkey=(1,)),
                                   BufferInfo(0x4000, 0x100, rkey=(2,))])
    u = lambda *v: np.array(v, np.uint64)                          # noqa: E731
    assert rdma._covers(d, u(0x1000, 0x1ff0, 0x4000), u(16, 16, 0x100))
    assert not rdma._covers(d, u(0x1ff8), u(16))
    assert not rdma._covers(d, u(0x3000), u(1))
    assert not rdma._covers(d, u(0x10), u(1))
    assert rdma._covers(d, u(0x1000, 0x4000), u(0x10))


def test_descriptor_carries_rkeys_devices_and_matrix_mooncake_style():
    d = SegmentDescriptor("p", "rdma", "h", 1, "1",
                          buffers=[BufferInfo(0x1000, 0x1000, "cpu:0", "rw", (5, 6), (7, 8))],
                          devices=[{"name": "mlx5_0", "lid": 0, "gid": "00"}],
                          priority_matrix={"cpu:0": [["mlx5_0"], []]})
    j = d.to_json()
    assert j["buffers"][0]["rkey"] == [5, 6] and j["buffers"][0]["lkey"] == [7, 8]
    back = SegmentDescriptor.decode(d.encode())
    assert back.buffers[0].rkey == (5, 6) and back.devices[0]["name"] == "mlx5_0"
    assert back.priority_matrix == {"cpu:0": [["mlx5_0"], []]}


class _FakeTransport:
    use_gpu_direct = True
    devices = []
    _nomr = {}


def test_gpu_registration_says_which_path_failed_and_how_to_fix_it(monkeypatch):
    """No dma-buf (the CUDA helper is missing or raises) and no nvidia-peermem: a
    TransportUnavailableError naming both and the fixes."""
    import types
    from mooncake_te.memory import MemoryRegion
    region = MemoryRegion(0x7000_0000_0000, 1 << 20, "cuda:0", "rw")
    fake_cuda = types.ModuleType("mooncake_te.cuda")

    def dmabuf_fd(address, length):
        raise RuntimeError("cuMemGetHandleForAddressRange: CUDA_ERROR_NOT_SUPPORTED")

    fake_cuda.dmabuf_fd = dmabuf_fd
    monkeypatch.setitem(sys.modules, "mooncake_te.cuda", fake_cuda)
    monkeypatch.setattr(mte, "cuda", fake_cuda, raising=False)
    real_exists = os.path.exists
    monkeypatch.setattr(rdma.os.path, "exists",
                        lambda p: False if p == "/sys/module/nvidia_peermem" else real_exists(p))
    with pytest.raises(E.TransportUnavailableError) as ei:
        rdma.RdmaTransport._register_gpu(_FakeTransport(), region, 0)
    msg = str(ei.value)
    assert "CUDA_ERROR_NOT_SUPPORTED" in msg and "nvidia-peermem is not loaded" in msg
    assert "modprobe nvidia-peermem" in msg and "dma-buf" in msg
    off = _FakeTransport()
    off.use_gpu_direct = False
    with pytest.raises(E.TransportUnavailableError, match="use_gpu_direct"):
        rdma.RdmaTransport._register_gpu(off, region, 0)

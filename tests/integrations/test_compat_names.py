# SPDX-License-Identifier: Apache-2.0
"""The rest of ``mooncake.engine`` on mooncake_te.compat: topology output as Mooncake's,
the ``*_on_cuda`` methods' refusal without CUDA, ``get_engine_ptr``, the RPC names
(``RpcInterface`` between two real processes), ``SharedSegment``'s typed refusal, and the
opt-in shim (install, status, uninstall, refusal next to the real Mooncake).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from servers import ROOT, free_port
from mooncake_te import cuda
from mooncake_te.compat import (CoroRPCInterface, CudaUnavailableError, InnerTransferEngine,
                                ReceivedData, ReceivedTensor, RpcInterface, SharedSegment,
                                TransferEngine, create_rpc_client)
from mooncake_te.compat import engine as compat_engine
from mooncake_te.compat import shim
from mooncake_te.topology.discover import discover

pytestmark = pytest.mark.timeout(60)


# --- topology -------------------------------------------------------------------------
def test_topology_lists_every_numa_node_without_nics(monkeypatch):
    monkeypatch.delenv("MC_CUSTOM_TOPO_JSON", raising=False)
    got = json.loads(TransferEngine().get_local_topology())
    topo = discover()
    if topo.nics:
        pytest.skip("this machine has RDMA NICs; the no-NIC form does not apply")
    assert got == {n.location: [[], []] for n in topo.numa_nodes}
    assert got and all(k.startswith("cpu:") for k in got)
    # A device filter naming no NIC here gives the same (discoverCpuTopology with none).
    assert json.loads(TransferEngine().get_local_topology("mlx5_9")) == got


def test_custom_topology_naming_absent_nic_is_echoed(monkeypatch, tmp_path):
    matrix = {"cpu:0": [["mlx5_7"], ["mlx5_8"]], "cuda:0": [["mlx5_8"], []]}
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(matrix))
    monkeypatch.setenv("MC_CUSTOM_TOPO_JSON", str(path))
    assert json.loads(TransferEngine().get_local_topology()) == matrix


def test_malformed_custom_topology_falls_back_to_discovery(monkeypatch, tmp_path):
    path = tmp_path / "topo.json"
    path.write_text('{"cpu:0": [["a"]]}')          # not [preferred, available]
    monkeypatch.setenv("MC_CUSTOM_TOPO_JSON", str(path))
    got = json.loads(TransferEngine().get_local_topology())
    assert "cpu:0" in got and got != {"cpu:0": [["a"]]}


# --- CUDA-stream methods and engine handles ---------------------------------------------
@pytest.mark.skipif(cuda.available()[0], reason="this machine has CUDA")
def test_on_cuda_methods_refuse_without_cuda():
    with TransferEngine() as te:
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        buf = te.allocate_managed_buffer(4096)
        for call in (lambda: te.transfer_write_on_cuda("x:1", buf, 0, 16),
                     lambda: te.transfer_read_on_cuda("x:1", buf, 0, 16, 0),
                     lambda: te.batch_transfer_write_on_cuda("x:1", [buf], [0], [16]),
                     lambda: te.batch_transfer_read_on_cuda("x:1", [buf], [0], [16], 0)):
            with pytest.raises(CudaUnavailableError) as ei:
                call()
            assert isinstance(ei.value, RuntimeError) and "CUDA" in str(ei.value)
            assert "transfer_sync_write" in str(ei.value)


def test_get_engine_ptr_resolves_to_the_engine():
    te = TransferEngine()
    assert te.get_engine_ptr() == 0                        # before initialize
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    h = te.get_engine_ptr()
    assert h and compat_engine.engine_from_ptr(h) is te.get_engine()
    assert isinstance(te.get_engine(), InnerTransferEngine)
    te.close()
    assert compat_engine.engine_from_ptr(12345) is None


# --- RPC names ---------------------------------------------------------------------------
SERVER = r"""
import json, sys, threading
from mooncake_te.compat import RpcInterface
got = []
done = threading.Event()
s = RpcInterface()
assert s.initialize_server(sys.argv[1])
s.set_data_receive_callback(lambda d: got.append(["data", d["source"], d["data"].hex()]))
def on_tensor(t):
    got.append(["tensor", t.shape, t.dtype, t.total_bytes, t.get_data_as_bytes().hex()])
    done.set()
s.set_tensor_receive_callback(on_tensor)
assert s.start_server_async()
print("ready", flush=True)
done.wait(30)
print(json.dumps(got), flush=True)
s.stop_server()
"""


def test_rpc_interface_between_processes():
    addr = f"127.0.0.1:{free_port()}"
    p = subprocess.Popen([sys.executable, "-c", SERVER, addr], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert p.stdout.readline().strip() == "ready"
        c = create_rpc_client()
        assert c.send_data(addr, b"\x00hello") == 0
        t = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert c.send_tensor(addr, t) == 0
        got = json.loads(p.stdout.readline())
    finally:
        p.wait(20)
        p.stdout.close()
    assert got[0][0] == "data" and bytes.fromhex(got[0][2]) == b"\x00hello"
    assert got[1][:4] == ["tensor", [3, 4], "float32", 48]
    assert bytes.fromhex(got[1][4]) == t.tobytes()
    assert create_rpc_client().send_data(f"127.0.0.1:{free_port()}", b"x") == -1
    assert CoroRPCInterface is RpcInterface


def test_rpc_async_and_received_types():
    import asyncio
    s = RpcInterface()
    assert s.initialize("127.0.0.1:0")
    seen = threading.Event()
    s.set_data_receive_callback(lambda d: seen.set())
    assert s.start_server_async()
    try:
        c = RpcInterface()
        assert c.initialize_client()

        async def go():
            return await c.send_data_async(f"127.0.0.1:{s.port}", b"abc",
                                           asyncio.get_running_loop())
        assert asyncio.run(go()) == 0 and seen.wait(5)
        bad = np.zeros(2, np.complex64)
        assert c.send_tensor(f"127.0.0.1:{s.port}", bad) == -1
    finally:
        s.stop_server()
    r = ReceivedData("a:1", b"xyz")
    assert (r.data_size, r.get_bytes(), bytes(r.get_memory_view())) == (3, b"xyz", b"xyz")
    t = ReceivedTensor("a:1", np.ones(4, np.int32).tobytes(), [2, 2], "int32")
    assert t.get_data_size() == 16 and t.to_numpy().tolist() == [[1, 1], [1, 1]]


def test_shared_segment_is_a_typed_refusal():
    assert SharedSegment.supported() is False
    with pytest.raises(RuntimeError, match="not implemented by mooncake_te"):
        SharedSegment.create("seg", 1 << 20, 2, 0)


# --- the opt-in shim ----------------------------------------------------------------------
def _cli(*args, pythonpath=ROOT):
    return subprocess.run([sys.executable, "-m", "mooncake_te", "compat", *args],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=pythonpath))


def test_shim_install_status_uninstall(tmp_path):
    site = str(tmp_path)
    r = _cli("install", "--target", site)
    assert r.returncode == 0, r.stderr
    assert shim.is_shim_dir(os.path.join(site, "mooncake"))
    code = ("import mooncake, mooncake.engine as e, mooncake.store as s, json; "
            "from mooncake.engine import TransferEngine; from mooncake.store import "
            "MooncakeDistributedStore, ReplicateConfig; print(json.dumps([e.__name__, "
            "s.__name__, mooncake.MOONCAKE_TE_SHIM]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([site, ROOT])))
    assert json.loads(out.stdout) == ["mooncake_te.compat.engine",
                                      "mooncake_te.compat.store", True], out.stderr
    st = _cli("status", "--json", pythonpath=os.pathsep.join([site, ROOT]))
    assert json.loads(st.stdout)["kind"] == "shim"
    ver = subprocess.run([sys.executable, "-m", "mooncake_te", "version"], capture_output=True,
                         text=True, env=dict(os.environ,
                                             PYTHONPATH=os.pathsep.join([site, ROOT])))
    assert "mooncake    mooncake_te shim" in ver.stdout
    assert _cli("install", "--target", site).returncode == 0          # again: idempotent
    r = _cli("uninstall", "--target", site)
    assert r.returncode == 0 and "removed" in r.stdout
    assert os.listdir(site) == []
    assert "not installed" in _cli("uninstall", "--target", site).stdout


def test_shim_refuses_next_to_real_mooncake(tmp_path):
    site = str(tmp_path)
    info = tmp_path / "mooncake_transfer_engine-0.3.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mooncake-transfer-engine\n"
                                   "Version: 0.3.9\n")
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("# the real one\n")
    r = _cli("install", "--target", site)
    assert r.returncode == 1 and "mooncake-transfer-engine 0.3.9" in r.stdout
    assert "refusing" in r.stdout
    assert (tmp_path / "mooncake" / "__init__.py").read_text() == "# the real one\n"
    r = _cli("uninstall", "--target", site)
    assert r.returncode == 1 and "not the mooncake-te shim" in r.stdout
    assert (tmp_path / "mooncake").exists()
    # A foreign `mooncake` package without the distribution is not replaced either.
    info.joinpath("METADATA").unlink()
    info.rmdir()
    r = _cli("install", "--target", site)
    assert r.returncode == 1 and "was not written by" in r.stdout

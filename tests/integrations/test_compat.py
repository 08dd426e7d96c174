# SPDX-License-Identifier: Apache-2.0
"""mooncake_te.compat.TransferEngine used the way Mooncake's own Python tests use
``mooncake.engine.TransferEngine`` (``mooncake-wheel/tests/transfer_engine_initiator_test.py``
and ``transfer_engine_target.py`` in kvcache-ai/Mooncake), with the target in a separate
process on 127.0.0.1, P2PHANDSHAKE metadata, and every byte checked on both sides.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from peers import sigstop
from servers import http_metadata_server  # noqa: F401
from mooncake_te.compat import (P2PHANDSHAKE, Read, TransferEngine, TransferNotify,
                                TransferOpcode, Write)
from mooncake_te.compat import engine as compat_engine
from mooncake_te.compat.allocator import CHUNK_SIZE, CLASS_SIZES, class_of

pytestmark = pytest.mark.timeout(60)

KIB, MIB = 1 << 10, 1 << 20
TARGET_CAPACITY = 64 * MIB       # DEFAULT_BUFFER_CAPACITY of Mooncake's target script

# The target: Mooncake's transfer_engine_target.py (initialize, get_first_buffer_address,
# allocate_managed_buffer as fallback), plus a line-based command loop on stdin so the
# test can look at the target's memory and notifications from its own side.
TARGET_SCRIPT = r"""
import hashlib, json, random, sys
from mooncake_te.compat import TransferEngine

def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()

te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
name = "127.0.0.1:%d" % te.get_rpc_port()
first = te.get_first_buffer_address(name)
buf = first or te.allocate_managed_buffer(CAPACITY)
assert buf
reply({"name": name, "first": first, "buf": buf})
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "sha":
        out = hashlib.sha256(te.read_bytes_from_buffer(cmd["addr"], cmd["len"])).hexdigest()
    elif op == "fill":
        data = random.Random(cmd["seed"]).randbytes(cmd["len"])
        out = te.write_bytes_to_buffer(cmd["addr"], data, len(data))
    elif op == "notifies":
        out = [[n.name, n.msg] for n in te.get_notifies()]
    elif op == "exit":
        break
    reply({"ok": out})
te.close()
""".replace("CAPACITY", str(TARGET_CAPACITY))


class Target:
    """The target process and a request/reply channel to it (every wait bounded)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", TARGET_SCRIPT],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self._lines: queue.Queue = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        hello = self._get(timeout=30)
        self.name, self.first, self.buf = hello["name"], hello["first"], hello["buf"]

    def _pump(self):
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _get(self, timeout=15):
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"target did not answer within {timeout} s") from None
        if line is None:
            raise AssertionError(f"target exited (rc {self.proc.wait()})")
        return json.loads(line)

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._get()["ok"]

    def sha(self, addr, n):
        return self.call(op="sha", addr=addr, len=n)

    def fill(self, addr, n, seed):
        assert self.call(op="fill", addr=addr, len=n, seed=seed) == 0
        return random.Random(seed).randbytes(n)

    def notifies(self):
        return [tuple(x) for x in self.call(op="notifies")]

    def stop(self):
        try:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            try:
                self.proc.stdin.close()
            except OSError:
                pass          # the pipe is broken when the target was killed
        self._pump_thread.join(timeout=10)
        self.proc.stdout.close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dead_segment() -> str:
    """A loopback address where nothing listens (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def target():
    t = Target()
    yield t
    t.stop()


class Initiator:
    """Mooncake's initiator test set-up: the engine, its segment name, its buffer."""

    def __init__(self):
        self.te = te = TransferEngine()
        # A host:port name, as there; with P2PHANDSHAKE the segment is then named after
        # the RPC port.
        assert te.initialize("127.0.0.1:12347", P2PHANDSHAKE, "tcp", "") == 0
        self.name = "127.0.0.1:12347".rpartition(":")[0] + ":" + str(te.get_rpc_port())
        assert te.get_first_buffer_address(self.name) == 0      # nothing registered yet
        self.src = te.allocate_managed_buffer(TARGET_CAPACITY)
        assert self.src
        assert te.get_first_buffer_address(self.name) == self.src

    def __getattr__(self, method):
        return getattr(self.te, method)

    def close(self):
        assert self.te.free_managed_buffer(self.src, TARGET_CAPACITY) == 0
        self.te.close()


@pytest.fixture(scope="module")
def initiator():
    i = Initiator()
    yield i
    i.close()


@pytest.fixture
def local():
    te = TransferEngine()
    assert te.initialize("127.0.0.1", P2PHANDSHAKE, "tcp", "") == 0
    yield te
    te.close()


def random_text(rng, n):
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&()*+,-./:;<=>?@"
    return "".join(rng.choices(chars, k=n)).encode()


# --- the module surface -------------------------------------------------------------------
def test_module_surface():
    assert TransferOpcode.Read == 0 and TransferOpcode.Write == 1
    assert Read is TransferOpcode.Read and Write is TransferOpcode.Write
    assert TransferEngine.TransferOpcode is TransferOpcode
    assert compat_engine.TransferEngine is TransferEngine
    assert compat_engine.SUPPORT_CUDA is False
    n = TransferNotify("a", "b")
    assert (n.name, n.msg) == ("a", "b") and n == TransferNotify("a", "b")
    for method in ("initialize", "initialize_ext", "get_rpc_port", "register_memory",
                   "unregister_memory", "batch_register_memory", "batch_unregister_memory",
                   "transfer_sync_write", "transfer_sync_read", "transfer_sync",
                   "batch_transfer_sync_write", "batch_transfer_sync_read",
                   "batch_transfer_sync", "batch_transfer_async_write",
                   "batch_transfer_async_read", "batch_transfer_async",
                   "get_batch_transfer_status", "transfer_submit_write",
                   "transfer_check_status", "allocate_managed_buffer", "free_managed_buffer",
                   "write_bytes_to_buffer", "read_bytes_from_buffer",
                   "get_first_buffer_address", "get_local_topology", "get_notifies",
                   "send_probe", "get_engine", "get_engine_ptr", "transfer_write_on_cuda",
                   "transfer_read_on_cuda", "batch_transfer_write_on_cuda",
                   "batch_transfer_read_on_cuda"):
        assert callable(getattr(TransferEngine, method)), method


# --- Mooncake's initiator test, against a target process ----------------------------------
def test_target_fell_back_to_a_managed_buffer(target, initiator):
    assert target.first == 0                       # nothing registered at start
    assert initiator.get_first_buffer_address(target.name) == target.buf
    assert initiator.send_probe(target.name) == 0


def test_random_write_read_circles(target, initiator):
    rng = random.Random(1)
    src, dst = initiator.src, target.buf
    for i in range(200):
        data = random_text(rng, rng.randint(16, 256))
        n = len(data)
        assert initiator.write_bytes_to_buffer(src, data, n) == 0
        assert initiator.transfer_sync_write(target.name, src, dst, n) == 0, i
        assert initiator.write_bytes_to_buffer(src, bytes(n), n) == 0
        assert initiator.transfer_sync_read(target.name, src, dst, n) == 0, i
        assert initiator.read_bytes_from_buffer(src, n) == data, i
    assert target.sha(dst, n) == sha(data)         # and the target holds the last one


@pytest.mark.parametrize("n", [4 * KIB + 3, 1 * MIB, 16 * MIB - 1])
def test_large_blocks_every_byte(target, initiator, n):
    rng = random.Random(n)
    data = rng.randbytes(n)
    src, dst = initiator.src, target.buf + 4096
    assert initiator.write_bytes_to_buffer(src, data, n) == 0
    assert initiator.transfer_sync_write(target.name, src, dst, n) == 0
    assert target.sha(dst, n) == sha(data)
    # READ of bytes the target wrote itself
    theirs = target.fill(dst, n, seed=n + 1)
    assert initiator.transfer_sync(target.name, src + 8, dst, n, TransferOpcode.Read) == 0
    assert initiator.read_bytes_from_buffer(src + 8, n) == theirs


def test_batch_sync_write_read(target, initiator):
    rng = random.Random(2)
    offset, batch = 1024, 100
    srcs = [initiator.src + i * offset for i in range(batch)]
    dsts = [target.buf + i * offset for i in range(batch)]
    for _ in range(3):
        datas = [random_text(rng, rng.randint(32, 128)) for _ in range(batch)]
        lens = [len(d) for d in datas]
        for s, d in zip(srcs, datas):
            assert initiator.write_bytes_to_buffer(s, d, len(d)) == 0
        assert initiator.batch_transfer_sync_write(target.name, srcs, dsts, lens) == 0
        for d, data in zip(dsts[::17], datas[::17]):
            assert target.sha(d, len(data)) == sha(data)
        for s, n in zip(srcs, lens):
            assert initiator.write_bytes_to_buffer(s, bytes(n), n) == 0
        assert initiator.batch_transfer_sync_read(target.name, srcs, dsts, lens) == 0
        for s, data in zip(srcs, datas):
            assert initiator.read_bytes_from_buffer(s, len(data)) == data


def test_async_batches_and_status(target, initiator):
    rng = random.Random(3)
    offset, batch = 1024, 100
    srcs = [initiator.src + i * offset for i in range(batch)]
    dsts = [target.buf + 1 * MIB + i * offset for i in range(batch)]
    datas = [random_text(rng, rng.randint(32, 128)) for _ in range(batch)]
    lens = [len(d) for d in datas]
    for s, d in zip(srcs, datas):
        assert initiator.write_bytes_to_buffer(s, d, len(d)) == 0
    half = batch // 2
    b1 = initiator.batch_transfer_async_write(target.name, srcs[:half], dsts[:half], lens[:half])
    b2 = initiator.batch_transfer_async(target.name, srcs[half:], dsts[half:], lens[half:],
                                        TransferOpcode.Write)
    assert b1 != 0 and b2 != 0 and b1 != b2
    assert initiator.get_batch_transfer_status([b1, b2]) == 0
    assert initiator.get_batch_transfer_status([b1]) == -1        # released once reported
    for d, data in zip(dsts[::25], datas[::25]):
        assert target.sha(d, len(data)) == sha(data)
    for s, n in zip(srcs, lens):
        assert initiator.write_bytes_to_buffer(s, bytes(n), n) == 0
    b3 = initiator.batch_transfer_async_read(target.name, srcs, dsts, lens)
    assert b3 != 0
    assert initiator.get_batch_transfer_status([b3]) == 0
    for s, data in zip(srcs, datas):
        assert initiator.read_bytes_from_buffer(s, len(data)) == data


def test_submit_write_and_check_status(target, initiator):
    n = 8 * MIB
    data = random.Random(4).randbytes(n)
    assert initiator.write_bytes_to_buffer(initiator.src, data, n) == 0
    tid = initiator.transfer_submit_write(target.name, initiator.src, target.buf, n)
    assert tid > 0
    deadline = time.monotonic() + 20
    status = 0
    while status == 0 and time.monotonic() < deadline:
        status = initiator.transfer_check_status(tid)
    assert status == 1
    assert initiator.transfer_check_status(tid) == -1             # released once completed
    assert target.sha(target.buf, n) == sha(data)


def test_notify_after_data(target, initiator):
    target.notifies()                                             # drain
    data = b"kv block 7"
    assert initiator.write_bytes_to_buffer(initiator.src, data, len(data)) == 0
    assert initiator.transfer_sync(target.name, initiator.src, target.buf, len(data),
                                   TransferOpcode.Write, TransferNotify("req-7", "done ✓")) == 0
    assert target.sha(target.buf, len(data)) == sha(data)
    assert initiator.batch_transfer_sync(target.name, [initiator.src], [target.buf + 64],
                                         [len(data)], Write,
                                         notify=TransferNotify("req-8", "")) == 0
    assert target.notifies() == [("req-7", "done ✓"), ("req-8", "")]


# --- return codes on bad input --------------------------------------------------------------
def test_unregistered_local_memory_is_refused(target, initiator):
    scratch = bytearray(4096)
    import ctypes
    addr = ctypes.addressof((ctypes.c_char * len(scratch)).from_buffer(scratch))
    assert initiator.transfer_sync_write(target.name, addr, target.buf, 64) == -1
    assert initiator.transfer_sync_read(target.name, addr, target.buf, 64) == -1
    assert initiator.batch_transfer_sync_write(target.name, [addr], [target.buf], [64]) == -1
    assert initiator.batch_transfer_async_write(target.name, [addr], [target.buf], [64]) == 0
    # 0 on a failed submit (Mooncake PR #2433; ids are unsigned)
    assert initiator.transfer_submit_write(target.name, addr, target.buf, 64) == 0
    # Registering it makes it usable; unregistering twice is ERR_ADDRESS_NOT_REGISTERED.
    assert initiator.register_memory(addr, len(scratch)) == 0
    scratch[:5] = b"12345"
    assert initiator.transfer_sync_write(target.name, addr, target.buf, 5) == 0
    assert target.sha(target.buf, 5) == sha(b"12345")
    assert initiator.unregister_memory(addr) == 0
    assert initiator.unregister_memory(addr) == -3
    assert initiator.transfer_sync_write(target.name, addr, target.buf, 5) == -1


def test_remote_outside_registered_memory_is_refused(target, initiator):
    end = target.buf + CHUNK_SIZE                       # the target's registered chunk ends here
    before = target.sha(end - 100, 100)
    assert initiator.transfer_sync_write(target.name, initiator.src, end - 100, 200) == -1
    assert initiator.transfer_sync_read(target.name, initiator.src, end - 100, 200) == -1
    assert target.sha(end - 100, 100) == before        # the in-region part is unchanged
    bid = initiator.batch_transfer_async_write(target.name, [initiator.src], [end], [8])
    assert bid != 0                                     # refused by the peer, not at submit
    assert initiator.get_batch_transfer_status([bid]) == -1
    tid = initiator.transfer_submit_write(target.name, initiator.src, end - 4, 8)
    assert tid > 0
    deadline = time.monotonic() + 20
    status = 0
    while status == 0 and time.monotonic() < deadline:
        status = initiator.transfer_check_status(tid)
    assert status == -1
    assert initiator.transfer_sync_write(target.name, initiator.src, target.buf, 8) == 0


def test_unknown_segment(initiator):
    nobody = dead_segment()
    src = initiator.src
    assert initiator.transfer_sync_write(nobody, src, 0x1000, 8) == -1
    assert initiator.transfer_sync_read(nobody, src, 0x1000, 8) == -1
    assert initiator.batch_transfer_sync_write(nobody, [src], [0x1000], [8]) == -1
    assert initiator.batch_transfer_async_read(nobody, [src], [0x1000], [8]) == 0
    assert initiator.transfer_submit_write(nobody, src, 0x1000, 8) == 0     # PR #2433
    assert initiator.get_first_buffer_address(nobody) == 0
    assert initiator.send_probe(nobody) == -1
    assert initiator.transfer_sync_write("no-port-here", src, 0x1000, 8) == -1


def test_bad_lengths_and_ids(target, initiator):
    src, dst = initiator.src, target.buf
    assert initiator.transfer_sync_write(target.name, src, dst, 0) == -1
    assert initiator.transfer_submit_write(target.name, src, dst, 0) == 0
    assert initiator.batch_transfer_sync_write(target.name, [src, src], [dst], [8, 8]) == -1
    assert initiator.batch_transfer_async_write(target.name, [src], [dst], [8, 8]) == 0
    assert initiator.batch_transfer_sync_write(target.name, [src], [dst], [0]) == -1
    assert initiator.get_batch_transfer_status([987654321]) == -1
    assert initiator.transfer_check_status(987654321) == -1
    # Empty batches complete at once.
    assert initiator.batch_transfer_sync_write(target.name, [], [], []) == 0
    empty = initiator.batch_transfer_async_write(target.name, [], [], [])
    assert empty != 0 and initiator.get_batch_transfer_status([empty]) == 0
    # Wrong Python types are TypeErrors, as pybind11 makes them.
    with pytest.raises(TypeError):
        initiator.transfer_sync_write(target.name, "not an address", dst, 8)
    with pytest.raises(TypeError):
        initiator.transfer_sync_write(target.name, src, dst, -8)
    with pytest.raises(TypeError):
        initiator.transfer_sync(target.name, src, dst, 8, 7)
    with pytest.raises(TypeError):
        initiator.batch_transfer_sync_write(target.name, [1.5], [dst], [8])
    # write_bytes_to_buffer never reads past the data it is given
    assert initiator.write_bytes_to_buffer(src, b"abc", 4) == -1


def test_register_memory_codes(local):
    import ctypes
    raw = (ctypes.c_char * (64 * KIB))()
    base = ctypes.addressof(raw)
    assert local.register_memory(base, 0) == -1                    # zero length
    assert local.register_memory(0, 4096) == -1                    # null
    assert local.register_memory(base, 16 * KIB) == 0
    assert local.register_memory(base + 4 * KIB, 4 * KIB) == -7    # ERR_ADDRESS_OVERLAPPED
    assert local.register_memory(base + 16 * KIB, 4 * KIB, "cuda:0") == -1
    assert local.unregister_memory(base) == 0
    assert local.unregister_memory(base) == -3                     # ERR_ADDRESS_NOT_REGISTERED
    # batch: all or nothing
    addrs = [base, base + 8 * KIB, base + 12 * KIB]
    assert local.batch_register_memory(addrs, [8 * KIB, 8 * KIB, 4 * KIB]) == -7
    assert local.get_engine().regions == []
    assert local.batch_register_memory(addrs, [8 * KIB, 4 * KIB, 4 * KIB]) == 0
    assert len(local.get_engine().regions) == 3
    assert local.get_first_buffer_address(local.get_engine().name) == base
    assert local.batch_unregister_memory(addrs) == 0
    assert local.batch_unregister_memory(addrs[:1]) == -3
    assert local.get_engine().regions == []


def test_not_initialized():
    te = TransferEngine()
    assert te.get_rpc_port() == -1
    assert te.transfer_sync_write("127.0.0.1:1", 4096, 4096, 8) == -1
    assert te.batch_transfer_async_write("127.0.0.1:1", [4096], [4096], [8]) == 0
    assert te.allocate_managed_buffer(4096) == 0
    assert te.register_memory(4096, 4096) == -1
    assert te.get_notifies() == []
    assert te.get_engine() is None
    te.close()


def test_stalled_then_dead_peer(local):
    """A stopped peer turns into -2 / -1 at the deadline, a killed one into -1: no hangs."""
    t = Target()
    try:
        src = local.allocate_managed_buffer(64 * KIB)
        assert local.transfer_sync_write(t.name, src, t.buf, 4096) == 0
        # Test-only shortcut: MC_TRANSFER_TIMEOUT cannot go below 5 s (as in Mooncake).
        local._timeout = 1.0
        sigstop(t.proc.pid)
        tid = local.transfer_submit_write(t.name, src, t.buf, 64 * KIB)
        assert tid > 0 and local.transfer_check_status(tid) == 0
        start = time.monotonic()
        status = 0
        while status == 0 and time.monotonic() - start < 10:
            status = local.transfer_check_status(tid)
            time.sleep(0.01)
        assert status == -2 and 0.9 < time.monotonic() - start < 5
        assert local.transfer_check_status(tid) == -2               # kept, as in Mooncake
        bid = local.batch_transfer_async_write(t.name, [src], [t.buf], [4096])
        assert bid != 0 and local.get_batch_transfer_status([bid]) == -1
        start = time.monotonic()
        assert local.transfer_sync_write(t.name, src, t.buf, 4096) == -1
        assert time.monotonic() - start < 5
        os.kill(t.proc.pid, signal.SIGKILL)
        t.proc.wait(timeout=10)
        start = time.monotonic()
        assert local.transfer_sync_write(t.name, src, t.buf, 4096) == -1
        assert local.send_probe(t.name) == -1
        assert time.monotonic() - start < 5
    finally:
        if t.proc.poll() is None:
            os.kill(t.proc.pid, signal.SIGKILL)
        t.stop()


# --- initialize -------------------------------------------------------------------------
def test_initialize_variants(monkeypatch):
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("localhost", P2PHANDSHAKE, "tcp", "") == 0
        assert a.get_engine().name == f"localhost:{a.get_rpc_port()}"
        assert b.initialize_ext("127.0.0.1:12345", P2PHANDSHAKE, "rdma", "", "") == 0
        assert b.get_engine().name == f"127.0.0.1:{b.get_rpc_port()}"
        buf = a.allocate_managed_buffer(8 * KIB)
        assert b.get_first_buffer_address(f"localhost:{a.get_rpc_port()}") == buf
        assert b.send_probe(f"127.0.0.1:{a.get_rpc_port()}") == 0
    finally:
        a.close()
        b.close()
    c = TransferEngine()
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")   # never bind beyond loopback
    assert c.initialize("127.0.0.1", "bogus://127.0.0.1:1", "tcp", "") == -1
    assert c.initialize("127.0.0.1", P2PHANDSHAKE, "xgmi", "") == -1
    assert c.get_engine() is None


def test_loopback_local_hostname_listens_on_loopback_only(monkeypatch, http_metadata_server):
    """Issue #35: with a metadata store, Mooncake's RPC mapping puts the engine on the
    first LAN address whatever local_hostname says; a loopback local_hostname must keep
    every port of the engine on loopback."""
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    te = TransferEngine()
    try:
        assert te.initialize("127.0.0.1", http_metadata_server.url, "tcp", "") == 0
        d = te.get_engine().descriptor()
        assert d.host == "127.0.0.1", d
        rpc = te.get_engine()._rpc._sock.getsockname()[0]
        assert rpc == "127.0.0.1"
    finally:
        te.close()


def _numa_locations() -> list:
    try:
        nodes = [d for d in os.listdir("/sys/devices/system/node")
                 if d.startswith("node") and d[4:].isdigit()]
    except OSError:
        nodes = []
    return sorted(f"cpu:{d[4:]}" for d in nodes) or ["cpu:0"]


def test_get_local_topology(local, monkeypatch, tmp_path):
    """One ``cpu:N`` entry per NUMA node sysfs lists, each [[preferred], [available]]
    naming only RDMA devices this host has (none: ``[[], []]``), as Mooncake's
    discoverCpuTopology; an empty ``{}`` fails (issue 35: it used to pass)."""
    monkeypatch.delenv("MC_CUSTOM_TOPO_JSON", raising=False)
    nodes = _numa_locations()
    try:
        nics = set(os.listdir("/sys/class/infiniband"))
    except OSError:
        nics = set()
    topo = json.loads(local.get_local_topology())
    assert sorted(topo) == nodes
    for location, lists in topo.items():
        assert isinstance(lists, list) and len(lists) == 2, (location, lists)
        assert all(isinstance(x, list) for x in lists), (location, lists)
        assert set(lists[0]) | set(lists[1]) <= nics, (location, lists, nics)
        if not nics:
            assert lists == [[], []]
    # A device name that matches no NIC filters every NIC out: still every NUMA node.
    assert json.loads(TransferEngine().get_local_topology("no_such_nic")) == {
        n: [[], []] for n in nodes}
    # MC_CUSTOM_TOPO_JSON is echoed as written (its NICs need not exist here).
    custom = {"cpu:0": [["mlx5_9"], ["mlx5_8"]], "cuda:0": [["mlx5_9"], []]}
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(custom))
    monkeypatch.setenv("MC_CUSTOM_TOPO_JSON", str(path))
    assert json.loads(TransferEngine().get_local_topology()) == custom


# --- managed buffers ----------------------------------------------------------------------
def _regions(te):
    return [(r.address, r.length) for r in te.get_engine().regions]


def test_class_of_matches_mooncake():
    assert class_of(0) == 0 and class_of(8 * KIB) == 0 and class_of(8 * KIB + 1) == 1
    assert class_of(256 * MIB) == 15 and class_of(256 * MIB + 1) == -1
    assert CLASS_SIZES[0] == 8 * KIB and CLASS_SIZES[-1] == 256 * MIB and len(CLASS_SIZES) == 16


def test_managed_buffers_many_sizes_no_overlap(local):
    rng = random.Random(5)
    sizes = [0, 1, 8 * KIB - 1, 8 * KIB, 8 * KIB + 1, 100 * KIB, 1 * MIB, 3 * MIB, 64 * MIB,
             256 * MIB] + [rng.randint(1, 4 * MIB) for _ in range(60)]
    blocks = []
    for n in sizes:
        addr = local.allocate_managed_buffer(n)
        assert addr, n
        blocks.append((addr, CLASS_SIZES[class_of(n)], n))
    spans = sorted((a, a + size) for a, size, _ in blocks)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "managed buffers overlap"
    regions = _regions(local)
    assert len(regions) == 1 and regions[0][1] == CHUNK_SIZE    # one registered chunk
    for a, size, n in blocks:
        assert any(r <= a and a + size <= r + ln for r, ln in regions)
        tag = a.to_bytes(8, "little")
        assert local.write_bytes_to_buffer(a, tag, 8) == 0
        assert local.write_bytes_to_buffer(a + size - 8, tag, 8) == 0
    for a, size, _ in blocks:           # no block's writes landed in another block
        assert local.read_bytes_from_buffer(a, 8) == a.to_bytes(8, "little")
        assert local.read_bytes_from_buffer(a + size - 8, 8) == a.to_bytes(8, "little")
    for a, _, n in blocks:
        assert local.free_managed_buffer(a, n) == 0
    assert local.free_managed_buffer(blocks[0][0], 0) == -1        # double free


def test_managed_buffers_reuse_and_merge(local):
    a = local.allocate_managed_buffer(8 * KIB)
    b = local.allocate_managed_buffer(8 * KIB)
    assert b == a + 8 * KIB
    assert local.free_managed_buffer(a, 8 * KIB) == 0
    assert local.allocate_managed_buffer(5000) == a                 # reuse after free
    assert local.free_managed_buffer(a, 5000) == 0
    assert local.free_managed_buffer(b, 8 * KIB) == 0
    assert local.allocate_managed_buffer(16 * KIB) == a             # buddies merged
    # the whole chunk merges back: one 256 MiB block fits at the base again
    assert local.free_managed_buffer(a, 16 * KIB) == 0
    assert local.allocate_managed_buffer(256 * MIB) == a
    assert local.free_managed_buffer(a, 256 * MIB) == 0
    assert local.free_managed_buffer(a + 1, 8 * KIB) == -1          # not a block


def test_managed_buffer_above_256_mib_is_its_own_region(local):
    n = 300 * MIB
    addr = local.allocate_managed_buffer(n)
    assert addr and (addr, n) in _regions(local)
    assert local.write_bytes_to_buffer(addr + n - 3, b"end", 3) == 0
    assert local.read_bytes_from_buffer(addr + n - 3, 3) == b"end"
    assert local.free_managed_buffer(addr, n) == 0
    assert (addr, n) not in _regions(local)
    assert local.free_managed_buffer(addr, n) == -1

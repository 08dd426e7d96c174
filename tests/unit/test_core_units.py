# SPDX-License-Identifier: Apache-2.0
"""Unit tests of the pieces under the engine: region table, descriptors, framing,
errors, memory intake."""
from __future__ import annotations

import errno
import mmap
import pickle
import socket
import threading

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.core import Regions, ACC_READ as READ, ACC_WRITE as WRITE
from mooncake_te.memory import MemoryRegion, intake
from mooncake_te.metadata import BufferInfo, SegmentDescriptor, framing, ram_key, rpc_meta_key
from mooncake_te.metadata.p2p import split_host_port


# --- region table --------------------------------------------------------------------
def test_regions_reject_overlap_and_zero_length():
    t = Regions()
    assert t.add(1000, 100, READ | WRITE) == 0
    assert t.add(1099, 10, READ) == -errno.EEXIST
    assert t.add(990, 11, READ) == -errno.EEXIST
    assert t.add(1100, 10, READ) == 0             # adjacent is fine
    assert t.add(5000, 0, READ) == -errno.EINVAL
    assert t.remove(1234) == -errno.ENOENT
    assert t.remove(1000) == 0 and t.add(990, 20, READ) == 0


def test_regions_check_containment_and_rights():
    t = Regions()
    t.add(1000, 100, READ | WRITE)
    t.add(1100, 100, READ)
    addrs = np.array([1000, 1050, 1100], np.uint64)
    assert t.check_many(addrs, np.array([100, 50, 100], np.uint64), 0) == (-1, 0)
    # Crossing from one region into the next is not inside one region.
    assert t.check_many(np.array([1090], np.uint64), np.array([20], np.uint64), 0) == \
        (0, -errno.ENOENT)
    assert t.check_many(addrs, np.array([10], np.uint64), WRITE) == (2, -errno.EACCES)
    assert t.check_many(addrs, np.array([0], np.uint64), 0)[1] == -errno.EINVAL


# --- descriptors and keys ------------------------------------------------------------
def test_descriptor_round_trip_in_mooncake_layout():
    d = SegmentDescriptor(name="10.0.0.2:15003", protocol="tcp", host="10.0.0.2",
                          rpc_port=15003, instance_id="00ff", tcp_data_port=16000,
                          buffers=[BufferInfo(4096, 8192, "cpu:1", "r")])
    j = d.to_json()
    assert j["buffers"][0] == {"name": "cpu:1", "addr": 4096, "length": 8192, "rkey": [],
                               "lkey": [], "access": "r"}
    assert j["tcp_data_port"] == 16000 and j["protocol"] == "tcp"
    back = SegmentDescriptor.decode(d.encode())
    assert back.buffers == d.buffers and back.instance_id == "00ff"


@pytest.mark.parametrize("raw", [b"not json", b"[1,2]", b'{"name": 1}', b'{"protocol":"tcp"}'])
def test_descriptor_garbage_is_a_metadata_error(raw):
    with pytest.raises(mte.MetadataError):
        SegmentDescriptor.decode(raw)


def test_keys_follow_mooncake(monkeypatch):
    monkeypatch.delenv("MC_METADATA_CLUSTER_ID", raising=False)
    assert ram_key("a:1") == "mooncake/ram/a:1"
    assert rpc_meta_key("a:1") == "mooncake/rpc_meta/a:1"
    assert ram_key("nvmeof/x") == "mooncake/nvmeof/x"
    monkeypatch.setenv("MC_METADATA_CLUSTER_ID", "c7")
    assert ram_key("a:1") == "mooncake/c7/ram/a:1"


def test_split_host_port():
    assert split_host_port("127.0.0.1:15003") == ("127.0.0.1", 15003)
    assert split_host_port("[::1]:80") == ("::1", 80)
    with pytest.raises(mte.InvalidArgumentError, match="host:port"):
        split_host_port("mlx5_0")


# --- framing -------------------------------------------------------------------------
def test_framing_round_trip_and_limit():
    a, b = socket.socketpair()
    with a, b:
        framing.send_frame(a, framing.METADATA, b'{"x":1}')
        assert framing.recv_frame(b) == (framing.METADATA, b'{"x":1}')
        a.sendall((framing.MAX_FRAME + 1).to_bytes(8, "little") + b"\x01")
        with pytest.raises(mte.MetadataError, match="exceeds the limit"):
            framing.recv_frame(b)


def test_rpc_probe_and_unknown_type(engine):
    host, port = split_host_port(engine.name)
    assert framing.request(host, port, framing.PROBE, b"", 2.0) == b'{"status":"success"}'
    assert b"unsupported" in framing.request(host, port, 9, b"", 2.0)


# --- errors --------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [mte.InvalidArgumentError, mte.AddressNotRegisteredError,
                                 mte.TransferTimeoutError, mte.MetadataError, mte.ConfigError,
                                 mte.DeviceNotFoundError, mte.SegmentNotFoundError])
def test_errors_pickle_with_status(cls):
    e = cls("what failed", errno=5)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == "what failed"
    assert back.status == e.status and back.errno == 5
    assert isinstance(back, mte.MooncakeError)


def test_error_codes_and_builtin_bases():
    assert mte.InvalidArgumentError("x").status == -1
    assert mte.AddressNotRegisteredError("x").status == -3
    assert mte.DeviceNotFoundError("x").status == -6
    assert issubclass(mte.TransferTimeoutError, TimeoutError)
    assert issubclass(mte.TransferTimeoutError, mte.TransferError)
    assert issubclass(mte.InvalidArgumentError, ValueError)


# --- memory intake -------------------------------------------------------------------
def test_intake_of_buffer_protocol_objects():
    ba = bytearray(100)
    assert intake(ba).length == 100 and not intake(ba).readonly
    arr = np.zeros((4, 8), np.float32)
    it = intake(arr)
    assert (it.address, it.length) == (arr.ctypes.data, 128)
    assert intake(b"abc").readonly
    with mmap.mmap(-1, 8192) as m:
        assert intake(m).length == 8192
    with pytest.raises(mte.InvalidArgumentError, match="non-contiguous"):
        intake(np.zeros((8, 8))[:, ::2])
    with pytest.raises(mte.InvalidArgumentError, match="neither the buffer protocol"):
        intake(object())
    with pytest.raises(mte.InvalidArgumentError, match="empty"):
        intake(bytearray())


def test_cuda_array_interface_is_recognised(engine):
    class FakeCudaArray:      # only the interface dict: what cupy/torch expose
        __cuda_array_interface__ = {"shape": (16,), "typestr": "<f4", "data": (0x7000, False),
                                    "version": 3, "strides": None}
    from mooncake_te import cuda
    from mooncake_te.memory import parse_cai
    assert parse_cai(FakeCudaArray.__cuda_array_interface__) == (0x7000, 64, False, None)
    if cuda.available()[0]:
        # The driver, not the object, says where memory is: 0x7000 is no device memory.
        assert intake(FakeCudaArray()).device == "cpu"
    else:
        with pytest.raises(mte.TransportUnavailableError, match="GPU memory, but CUDA"):
            engine.register(FakeCudaArray())


def test_memory_region_from_address_validates():
    with pytest.raises(mte.InvalidArgumentError):
        MemoryRegion.from_address(0, 10)
    with pytest.raises(mte.InvalidArgumentError):
        MemoryRegion.from_address(4096, -1)


def test_gather_blocks_matches_numpy_and_reports_the_bad_id():
    from mooncake_te.core._core import gather_blocks
    rng = np.random.default_rng(3)
    table = rng.integers(0, 1 << 63, (5, 40), dtype=np.uint64)
    ids = rng.choice(40, 12, replace=False).astype(np.int64)
    assert (gather_blocks(table, ids) == table[:, ids].ravel()).all()
    assert gather_blocks(table, np.array([1, 40, 2], np.int64)) == 1
    assert gather_blocks(table, np.array([0, 3, -1], np.int64)) == 2
    assert len(gather_blocks(table, np.array([], np.int64))) == 0
    with pytest.raises(TypeError, match="int64"):
        gather_blocks(table, ids.astype(np.int32))
    with pytest.raises(TypeError, match="uint64"):
        gather_blocks(table[:, ::2], ids[:1])

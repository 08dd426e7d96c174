# SPDX-License-Identifier: Apache-2.0
"""The engine's API contract: names, lifetimes and a clear typed error for bad input."""
from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

import mooncake_te as mte


def test_contract_names_exist():
    for n in ["TransferEngine", "TransferRequest", "TransferStatus", "Notification", "READ",
              "WRITE", "Op", "BufferInfo", "MemoryRegion", "Batch", "Segment", "Config"]:
        assert hasattr(mte, n), n
    assert mte.READ in mte.Op and mte.WRITE in mte.Op


def test_engine_basics(engine):
    host, port = engine.name.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert engine.protocol == "tcp"
    assert engine.regions == []
    buf = bytearray(4096)
    r = engine.register(buf)
    assert (r.address, r.length, r.access) == (engine.regions[0].address, 4096, "rw")
    assert r.location.startswith("cpu:")
    engine.unregister(r)
    assert engine.regions == []


def test_context_manager_and_idempotent_close():
    with mte.TransferEngine(host="127.0.0.1") as eng:
        eng.register(bytearray(64))
    eng.close()
    with pytest.raises(mte.InvalidArgumentError, match="closed"):
        eng.register(bytearray(64))


def test_unclosed_engine_warns():
    eng = mte.TransferEngine(host="127.0.0.1")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del eng
        gc.collect()
    assert any(issubclass(x.category, ResourceWarning) for x in w)


def test_register_errors(engine):
    buf = np.zeros(8192, np.uint8)
    engine.register(buf)
    with pytest.raises(mte.AddressOverlappedError):
        engine.register(buf[100:200])
    with pytest.raises(mte.InvalidArgumentError, match="read-only"):
        engine.register(b"immutable bytes")
    engine.register(b"immutable bytes", access="r")
    with pytest.raises(mte.InvalidArgumentError, match="access"):
        engine.register(bytearray(10), access="write")
    with pytest.raises(mte.AddressNotRegisteredError):
        engine.unregister(12345)


def test_bad_transfer_arguments(engine_pair):
    a, b = engine_pair
    buf = np.zeros(8192, np.uint8)
    r = a.register(buf)
    rb = b.register(np.zeros(8192, np.uint8))
    with pytest.raises(mte.InvalidArgumentError, match="length must be positive"):
        a.write(b.name, r.address, rb.address, 0)
    with pytest.raises(mte.InvalidArgumentError, match="non-negative"):
        a.write(b.name, -5, rb.address, 10)
    with pytest.raises(mte.InvalidArgumentError, match="same length"):
        a.submit_arrays(mte.WRITE, b.name, np.array([r.address], np.uint64),
                        np.array([1, 2], np.uint64), 8)
    with pytest.raises(mte.InvalidArgumentError, match="op must be"):
        a.submit_arrays(7, b.name, [r.address], [rb.address], 8)
    with pytest.raises(mte.InvalidArgumentError, match="host:port"):
        a.write("no-such-name", r.address, rb.address, 8)
    with pytest.raises(mte.SegmentNotFoundError, match="cannot reach"):
        a.write("127.0.0.1:1", r.address, rb.address, 8)
    with pytest.raises(mte.InvalidArgumentError, match="timeout"):
        a.write(b.name, r.address, rb.address, 8, timeout=0)
    with pytest.raises(mte.InvalidArgumentError, match="empty batch"):
        a.submit([])


def test_unknown_or_unavailable_protocol():
    with pytest.raises(mte.InvalidArgumentError, match="unknown protocol"):
        mte.TransferEngine(host="127.0.0.1", protocol="carrier-pigeon")
    with pytest.raises(mte.TransportUnavailableError, match="rdma"):
        mte.TransferEngine(host="127.0.0.1", protocol="rdma")


def test_config_file_sets_timeout(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('[transfer_engine]\nprotocol = "tcp"\ntimeout_ms = 1234\n')
    with mte.TransferEngine(host="127.0.0.1", config=str(cfg)) as eng:
        assert eng.timeout == pytest.approx(1.234)
    cfg.write_text('[transfer_engine]\ntimeout_msec = 5\n')
    with pytest.raises(mte.ConfigError, match="timeout_msec"):
        mte.TransferEngine(host="127.0.0.1", config=str(cfg))


def test_batch_in_same_process_and_status(engine_pair):
    a, b = engine_pair
    src = np.arange(65536, dtype=np.uint8)
    dst = np.zeros(65536, np.uint8)
    ra, rb = a.register(src), b.register(dst)
    batch = a.submit([mte.TransferRequest(mte.WRITE, ra.address, b.name, rb.address, 65536)])
    batch.wait(timeout=10)
    assert batch.done() and batch.status() == [mte.TransferStatus("completed", 65536)]
    assert (dst == src).all()
    seg = a.open_segment(b.name)
    assert a.open_segment(seg) is not None and seg.buffers[0].length == 65536


def test_forked_child_does_not_tear_down_the_parent(engine_pair):
    import os
    a, b = engine_pair
    src = np.arange(4096, dtype=np.uint8) % 251
    dst = np.zeros(4096, np.uint8)
    ra, rb = a.register(src), b.register(dst)
    pid = os.fork()
    if pid == 0:            # child: drop its copies and leave
        try:
            a.close()
            b.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    a.write(b.name, ra.address, rb.address, 4096)
    assert (dst == src).all()


def test_submit_errors_name_the_callers_index(engine_pair):
    a, b = engine_pair
    r = a.register(np.zeros(8192, np.uint8))
    rb = b.register(np.zeros(8192, np.uint8))
    junk = np.zeros(16, np.uint8)
    reqs = [mte.TransferRequest(mte.WRITE, r.address, b.name, rb.address, 16),
            mte.TransferRequest(mte.READ, r.address, b.name, rb.address, 16),
            mte.TransferRequest(mte.READ, junk.ctypes.data, b.name, rb.address, 16)]
    with pytest.raises(mte.AddressNotRegisteredError, match="request 2"):
        a.submit(reqs)
    reqs[2] = mte.TransferRequest(mte.READ, r.address, b.name, rb.address, 0)
    with pytest.raises(mte.InvalidArgumentError, match="request 2"):
        a.submit(reqs)


def test_register_many_is_all_or_nothing(engine_pair):
    a, b = engine_pair
    bufs = [np.zeros(4096, np.uint8) for _ in range(8)]
    regions = a.register_many(bufs)
    assert [r.address for r in regions] == [x.ctypes.data for x in bufs]
    assert len(b.open_segment(a.name, refresh=True).buffers) == 8
    more = [np.zeros(4096, np.uint8), bufs[3][100:200]]      # the second overlaps
    with pytest.raises(mte.AddressOverlappedError):
        a.register_many(more)
    assert len(a.regions) == 8                                # the first was rolled back

# SPDX-License-Identifier: Apache-2.0
"""Routing with the in-process fake transport (tests/fake_transport.py): selection by
priority and capability, fallback from one transport to the next, and failures, without
a data socket (issue 40, items 1 and 4)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import transports
from mooncake_te.core import Regions
from mooncake_te.routing import Transports

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_transport import fake_class  # noqa: E402

N = 1 << 16


@pytest.fixture
def offer():
    """offer(cls): engines created from now on (in this test) can run ``cls``."""
    names = []

    def add(cls):
        transports.register(cls.name, cls)
        names.append(cls.name)
        return cls
    yield add
    for n in names:
        transports.unregister(n)


@pytest.fixture
def engines():
    made = []

    def make(**kw):
        e = mte.TransferEngine(host="127.0.0.1", **kw)
        made.append(e)
        src = np.arange(N, dtype=np.uint64).view(np.uint8)[:N].copy()
        e._test_buf = src
        e._test_mr = e.register(src)
        return e
    yield make
    for e in made:
        e.close()


def _roundtrip(a, b) -> str:
    b._test_buf[:] = 0
    batch = a.submit([mte.TransferRequest(mte.Op.WRITE, a._test_mr.address, b.name,
                                          b._test_mr.address, 4096)])
    batch.wait()
    assert bytes(b._test_buf[:4096]) == bytes(a._test_buf[:4096])
    return batch.transport


def test_a_registered_transport_carries_data_before_tcp(offer, engines):
    offer(fake_class("fake"))
    a, b = engines(), engines()
    order = [t.name for t in a._tx.routing]
    assert order.index("fake") < order.index("tcp")    # priority 10: asked before TCP
    assert _roundtrip(a, b) == "fake"
    assert a._transports["fake"].calls["submit"] == 1
    a.write(b.name, a._test_mr.address + 8192, b._test_mr.address + 8192, 100)
    assert bytes(b._test_buf[8192:8292]) == bytes(a._test_buf[8192:8292])


def test_a_peer_without_the_transport_falls_back_to_tcp(offer, engines):
    offer(fake_class("fake"))
    a = engines()
    b = engines(protocol="tcp")          # runs TCP only: publishes no fake id
    assert "fake" not in b._transports
    assert _roundtrip(a, b) in ("tcp", "shm")     # TCP, or its same-host mode
    assert a._transports["fake"].calls["submit"] == 0


def test_the_next_transport_by_priority_takes_what_the_first_refuses(offer, engines):
    offer(fake_class("fake1", priority=10))
    offer(fake_class("fake2", priority=20))
    a, b = engines(), engines()
    order = [t.name for t in a._tx.routing]
    assert order.index("fake1") < order.index("fake2") < order.index("tcp")
    assert _roundtrip(a, b) == "fake1"
    a._transports["fake1"].refuse.add(b.name)
    a._sync_routes.clear()
    assert _roundtrip(a, b) == "fake2"
    a._transports["fake2"].refuse.add(b.name)
    assert _roundtrip(a, b) in ("tcp", "shm")     # TCP, or its same-host mode


def test_a_failed_request_reports_the_status_the_transport_gave(offer, engines):
    offer(fake_class("fake"))
    a, b = engines(), engines()
    a._transports["fake"].fail_with = -1008          # MTE_E_CLOSED
    with pytest.raises(mte.TransferError) as ei:
        a.write(b.name, a._test_mr.address, b._test_mr.address, 64)
    assert ei.value.status == -1008
    batch = a.submit([mte.TransferRequest(mte.Op.WRITE, a._test_mr.address, b.name,
                                          b._test_mr.address, 64)])
    with pytest.raises(mte.TransferError, match="closed"):
        batch.wait()
    b._transports["fake"].close()       # the peer's side is gone: the next transport
    a._transports["fake"].fail_with = 0
    assert _roundtrip(a, b) in ("tcp", "shm")


@pytest.mark.parametrize("counts", [True, False])
def test_the_sync_path_is_a_declared_capability_not_a_name(offer, engines, counts):
    # A transport whose transfer_sync counts in a metrics cell (sync_metrics) carries a
    # single request on the calling thread with metrics on; one that does not goes
    # through a batch. Before issue 40 the engine asked for the name "tcp" instead.
    offer(fake_class("fakesync", sync_metrics=counts))
    a, b = engines(), engines()
    t = a._transports["fakesync"]
    for _ in range(3):
        a.write(b.name, a._test_mr.address, b._test_mr.address, 512)
    assert t.calls["transfer_sync"] == (3 if counts else 0)
    assert t.calls["submit"] == (0 if counts else 3)
    rows = [r for r in a.metrics()["transfers"] if r["transport"] == "fakesync"]
    assert sum(r["requests"] for r in rows) == 3
    assert sum(r["bytes"] for r in rows) == 3 * 512


class _Book:
    """Registered memory as routing sees it: here every local address is GPU memory
    (this machine may have no GPU; RegionBook.on_gpu is tested on its own below)."""
    has_gpu = True

    @staticmethod
    def on_gpu(addresses):
        return True


def _desc(**extra):
    from mooncake_te.metadata import SegmentDescriptor
    return SegmentDescriptor(name="peer", protocol="auto", host="127.0.0.1", rpc_port=1,
                             instance_id="1", extra=extra)


def _started(*classes):
    known = {c.name: c for c in classes}
    tx = Transports(known, "auto")
    tx.start(tx.context(regions=Regions(), host="127.0.0.1", name="me", instance=1,
                        config={}, token=b"", devices=[], rpc=None, refresh_peer=None))
    return tx


def test_gpu_memory_goes_only_to_transports_that_declare_it():
    host_only = fake_class("hostonly", priority=10, notifications=True)
    gpu = fake_class("gpufake", priority=20, gpu_memory=True)
    tx = _started(host_only, gpu)
    try:
        me_h, me_g = tx.running["hostonly"], tx.running["gpufake"]
        desc = _desc(hostonly_id=me_h.id, gpufake_id=me_g.id)
        loc, rem = np.array([4096], np.uint64), np.array([8192], np.uint64)
        assert tx.pick(desc, 1, loc, rem)[1] == "hostonly"      # host memory: the first
        assert tx.cacheable(desc, me_h)
        tx.book = _Book()
        assert tx.pick(desc, 1, loc, rem)[1] == "gpufake"       # GPU memory: skipped
        assert not tx.cacheable(desc, me_g)                     # the answer depends on it
        with pytest.raises(mte.TransportUnavailableError,
                           match=r"GPU memory, which hostonly cannot move.*protocol='auto'"):
            tx.pick(_desc(hostonly_id=me_h.id), 1, loc, rem)
    finally:
        tx.close()


def test_every_built_in_transport_declares_whether_it_moves_gpu_memory():
    from mooncake_te.transports.tcp import TcpTransport
    assert TcpTransport.capabilities.gpu_memory       # staged (src/core/stage.h)
    for name, cls in transports.probe().items():
        if getattr(cls, "available", False):
            assert isinstance(cls.capabilities.gpu_memory, bool), name


def test_region_book_knows_which_addresses_are_gpu_memory():
    from mooncake_te.regions import RegionBook
    book = RegionBook()
    assert not book.has_gpu and not book.on_gpu(np.array([1, 2], np.uint64))
    book._gpu[0x10000] = 0x20000          # what add() records for a region on a GPU
    assert book.has_gpu
    assert book.on_gpu(0x10000) and book.on_gpu(np.array([5, 0x1ffff], np.uint64))
    assert not book.on_gpu(np.array([0x20000, 0xffff], np.uint64))


def test_register_refuses_a_class_that_is_not_a_transport():
    with pytest.raises(TypeError, match="Transport subclass"):
        transports.register("x", object)
    with pytest.raises(ValueError, match="tcp"):
        transports.register("tcp", fake_class("tcp2"))


def test_metrics_read_every_transport_through_its_counters(offer, engines):
    # Before issue 40, metrics looked transports up by the names "tcp" and "rdma".
    pytest.importorskip("prometheus_client")
    from mooncake_te.metrics import prometheus
    from metrics_names import samples, total
    offer(fake_class("fake"))
    a, b = engines(), engines()
    for _ in range(3):
        _roundtrip(a, b)
    m = a.metrics()
    tcp = a._transports["tcp"].counters()
    assert m["notifications"]["received"] == tcp["notifications_received"] + 3
    assert m["queue_depth"]["fake-peer"] == 1
    assert m["fake"] == {"memmove": {"copies": 3, "bytes": 3 * 4096}}
    got = samples(prometheus.exposition().decode())
    assert total(got, "mooncake_te_fake_copies_total", engine=a.name,
                 device="memmove") == 3
    assert total(got, "mooncake_te_fake_copied_bytes_total", engine=a.name) == 3 * 4096


def test_metrics_and_prepared_use_the_engine_through_its_internal_door():
    # No module of the package reaches into the engine's private fields any more.
    import ast
    pkg = Path(mte.__file__).parent
    for rel in ("metrics/engine.py", "metrics/prometheus.py", "prepared.py",
                "transports/cuda_ipc/host_dma.py"):
        tree = ast.parse((pkg / rel).read_text())
        bad = [f"{rel}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and n.attr.startswith("_")
               and not n.attr.startswith("__")
               and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]
        bad += [f"{rel}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(tree)
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr"
                and len(n.args) > 1 and isinstance(n.args[1], ast.Constant)
                and str(n.args[1].value).startswith("_")]
        assert not bad, bad


def test_a_transport_says_why_it_does_not_route():
    # The engine used to test protocol == "shm" itself; now TCP says it (no_route_reason).
    with mte.TransferEngine(host="127.0.0.1", protocol="shm") as a:
        far = _desc()
        far.tcp_data_port = 9                 # a TCP peer on another host (never dialed)
        with pytest.raises(mte.TransportUnavailableError,
                           match="protocol='shm' reaches peers on this host only; peer"):
            a.internal.pick(far, 1, np.array([0], np.uint64), np.array([0], np.uint64))

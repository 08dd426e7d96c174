# SPDX-License-Identifier: Apache-2.0
"""Metrics of a real engine after real transfers: eng.metrics() and a /metrics scrape
agree with what was moved, failures with what was injected (docs/observability.md)."""
from __future__ import annotations

import urllib.request

import time

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import errors as E
from metrics_names import documented, family, samples, total as _sum
from peers import PeerProcess

pytest.importorskip("prometheus_client")


def _scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return samples(r.read().decode())


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transfer(eng, peer, buf, region, sizes, op):
    """One batch of requests of ``sizes`` to ``peer``; returns bytes moved."""
    offs = np.cumsum([0] + sizes[:-1]).astype(np.uint64)
    eng.submit_arrays(op, peer.name, region.address + offs, peer.address + offs,
                      np.array(sizes, dtype=np.uint64)).wait()
    return sum(sizes)


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_scrape_counts_what_moved(protocol):
    port = _free_port()
    with PeerProcess(size=8 << 20) as peer, \
            mte.TransferEngine(host="127.0.0.1", protocol=protocol,
                               config=mte.Config.load(None, env={
                                   "MC_METRICS_PORT": str(port)})) as eng:
        buf = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
        region = eng.register(buf)
        sizes = [4096, 65536, 1 << 20, 3 << 20]             # one of them sliced
        wrote = _transfer(eng, peer, buf, region, sizes, mte.WRITE)
        wrote += _transfer(eng, peer, buf, region, [512] * 7, mte.WRITE)
        eng.write(peer.name, region.address, peer.address, 12345)   # the sync path
        wrote += 12345
        read = _transfer(eng, peer, buf, region, [1 << 20, 4096], mte.READ)
        eng.read(peer.name, region.address, peer.address, 777)
        read += 777

        # Injected failures: remote addresses outside every region the peer registered.
        bad = 0
        for _ in range(3):
            with pytest.raises(E.AddressNotRegisteredError):
                eng.write(peer.name, region.address, peer.address + (64 << 20), 4096)
            bad += 1
        b = eng.submit_arrays(mte.READ, peer.name,
                              np.array([region.address] * 2, dtype=np.uint64),
                              np.array([peer.address, peer.address + (64 << 20)],
                                       dtype=np.uint64), 4096)
        with pytest.raises(E.AddressNotRegisteredError):
            b.wait()
        read += 4096                                        # the good one of the two

        m = eng.metrics()
        route = "shm" if protocol == "shm" else "tcp"
        rows = {(t["peer"], t["transport"], t["op"]): t for t in m["transfers"]}
        w = rows[(peer.name, route, "write")]
        r = rows[(peer.name, route, "read")]
        assert w["bytes"] == wrote and r["bytes"] == read
        assert w["requests"] == len(sizes) + 7 + 1
        assert r["requests"] == 2 + 1 + 1
        assert w["failures"] == 3 and w["failures_by_status"] == {-3: 3}
        assert r["failures"] == 1 and r["failures_by_status"] == {-3: 1}
        assert w["request_latency"]["count"] == w["requests"] + w["failures"]
        assert w["request_latency"]["buckets"][-1][1] == w["request_latency"]["count"]
        assert w["batches"] == 2 + 1 + 3 and r["batches"] == 1 + 1 + 1
        assert m["registered_bytes"] == {region.location: buf.nbytes}
        assert m["enabled"] is True

        s = _scrape(f"http://127.0.0.1:{port}/metrics")
        lab = dict(engine=eng.name, peer=peer.name, transport=route)
        assert _sum(s, "mooncake_te_transfer_bytes_total", op="write", **lab) == wrote
        assert _sum(s, "mooncake_te_transfer_bytes_total", op="read", **lab) == read
        assert _sum(s, "mooncake_te_transfer_requests_total", op="write", **lab) == 12
        assert _sum(s, "mooncake_te_transfer_failures_total", status="-3", **lab) == 4
        assert _sum(s, "mooncake_te_transfer_request_duration_seconds_count",
                    engine=eng.name, transport=route) == 12 + 4 + 4
        assert _sum(s, "mooncake_te_transfer_request_duration_seconds_bucket",
                    engine=eng.name, transport=route, op="write", le="+Inf") == 15
        assert _sum(s, "mooncake_te_registered_bytes", engine=eng.name) == buf.nbytes
        assert not {family(n) for n, _ in s} - documented()
    # The listener went away with its only engine.
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_server_side_counters():
    """Connections peers hold to us, notifications received, auth refusals."""
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp", auth_token="s3cret") as a, \
            mte.TransferEngine(host="127.0.0.1", protocol="tcp", auth_token="s3cret") as b:
        from mooncake_te.metadata import framing
        from mooncake_te.metadata.p2p import split_host_port
        src = np.ones(1 << 16, np.uint8)
        ra = a.register(src)
        rb = b.register(np.zeros(1 << 16, np.uint8))
        a.write(b.name, ra.address, rb.address, 1 << 16)
        a.send_notification(b.name, b"hello")
        a.send_notification(b.name, b"again")
        host, port = split_host_port(b.name)
        with pytest.raises(E.AuthenticationError):       # a peer without the token
            framing.request(host, port, framing.METADATA, b"{}", 2.0)
        # The server counts the refusal on its connection thread, which may finish just
        # after the client saw the refusal: wait (bounded) for it.
        deadline = time.monotonic() + 5
        while b.metrics()["auth_failures"]["rpc"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        m = b.metrics()
        assert m["connections"]["accepted"] >= 1
        assert m["connections"]["open"] >= 1
        assert m["notifications"]["received"] == 2
        assert m["notifications"]["dropped"] == 0
        assert m["auth_failures"] == {"rpc": 1, "data": 0}
        assert [n.message for n in b.notifications()] == [b"hello", b"again"]


def test_metrics_off_counts_nothing():
    cfg = mte.Config.load(None, env={"MC_METRICS": "0"})
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp", config=cfg) as a, \
            mte.TransferEngine(host="127.0.0.1", protocol="tcp") as b:
        ra = a.register(np.ones(4096, np.uint8))
        rb = b.register(np.zeros(4096, np.uint8))
        a.write(b.name, ra.address, rb.address, 4096)
        a.submit_arrays(mte.WRITE, b.name, [ra.address], [rb.address], 4096).wait()
        m = a.metrics()
        assert m["enabled"] is False and m["transfers"] == []
        assert b.metrics()["connections"]["accepted"] >= 1    # server side still counts


def test_mixed_batch_counts_each_peer():
    """One batch over two peers: each (peer, op) cell gets its own requests."""
    with mte.TransferEngine(host="127.0.0.1", protocol="tcp") as a, \
            mte.TransferEngine(host="127.0.0.1", protocol="tcp") as b, \
            mte.TransferEngine(host="127.0.0.1", protocol="tcp") as c:
        ra = a.register(np.ones(1 << 20, np.uint8))
        rb = b.register(np.zeros(1 << 20, np.uint8))
        rc = c.register(np.zeros(1 << 20, np.uint8))
        reqs = [mte.TransferRequest(mte.WRITE, ra.address, b.name, rb.address, 1000),
                mte.TransferRequest(mte.WRITE, ra.address, c.name, rc.address, 2000),
                mte.TransferRequest(mte.READ, ra.address, b.name, rb.address, 3000),
                mte.TransferRequest(mte.WRITE, ra.address, b.name, rb.address, 4000)]
        a.submit(reqs).wait()
        rows = {(t["peer"], t["op"]): t for t in a.metrics()["transfers"]}
        assert rows[(b.name, "write")]["bytes"] == 5000
        assert rows[(b.name, "write")]["requests"] == 2
        assert rows[(c.name, "write")]["bytes"] == 2000
        assert rows[(b.name, "read")]["bytes"] == 3000
        assert sum(t["batches"] for t in rows.values()) == 1

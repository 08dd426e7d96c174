# SPDX-License-Identifier: Apache-2.0
"""The RDMA transport on real verbs devices (natively, or Soft-RoCE in the fabric lab):
rails, MTUs, NIC-side refusals, resources. The contract every transport keeps (random
READ/WRITE batches against a model, bounds, notifications) runs over RDMA in
tests/transports/test_contract.py.

Engine A runs in this process, engine B in another (tests/peers.py). The lab makes three
rxe devices on one bridge (``rdma(rxe=3)``): A uses rxe0 and/or rxe1, B rxe2, so taking
a veth down breaks exactly one of A's rails. Tests that change links or MTUs put them
back before they return.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import errors as E
from mooncake_te.config import Config
from peers import PeerProcess

pytestmark = pytest.mark.rdma(rxe=3)


def _lab():
    raw = os.environ.get("MOONCAKE_LAB_RXE")
    if not raw:
        pytest.skip("needs the fabric lab's rxe devices (MOONCAKE_LAB_RXE); these tests take "
                    "links down and change MTUs")
    devs = json.loads(raw)
    if len(devs) < 3:
        pytest.skip("needs three rxe devices (pytest.mark.rdma(rxe=3))")
    return devs


def _cfg(**te):
    c = Config.load()
    c.data["transfer_engine"].update(te)
    return c


def _counter(dev, name):
    base = f"/sys/class/infiniband/{dev}/ports/1"
    for sub in ("hw_counters", "counters"):
        try:
            with open(f"{base}/{sub}/{name}") as f:
                return int(f.read())
        except OSError:
            continue
    raise AssertionError(f"{dev} has no counter {name}")


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _set_link(netdev: str, up: bool) -> None:
    """`ip link set NETDEV up|down` without starting a process (SIOCGIFFLAGS /
    SIOCSIFFLAGS, linux/sockios.h): in the emulated guest spawning `ip` takes longer than
    a whole test batch."""
    import fcntl
    import socket
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sk:
        req = struct.pack("16sH14x", netdev.encode(), 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sk.fileno(), 0x8913, req))[1]
        flags = flags | 0x1 if up else flags & ~0x1                   # IFF_UP
        fcntl.ioctl(sk.fileno(), 0x8914, struct.pack("16sH14x", netdev.encode(), flags))


def _port_state(dev):
    with open(f"/sys/class/infiniband/{dev}/ports/1/state") as f:
        return f.read().strip()


def _wait_active(dev, timeout=20):
    deadline = time.monotonic() + timeout
    while "ACTIVE" not in _port_state(dev):
        if time.monotonic() > deadline:
            raise AssertionError(f"{dev} port did not come back ACTIVE: {_port_state(dev)}")
        time.sleep(0.05)


def _resources():
    """{device: {pd, cq, qp, mr, ctx}} from rdma(8) (the kernel's resource tracking)."""
    out = subprocess.run(["rdma", "resource", "show"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    res = {}
    for line in out.splitlines():
        m = re.match(r"\s*\d+:\s*(\S+):\s*(.*)", line)
        if m:
            kv = m.group(2).split()
            res[m.group(1)] = {kv[i]: int(kv[i + 1]) for i in range(0, len(kv) - 1, 2)}
    return res


def _sha(a):
    return hashlib.sha256(a).hexdigest()


@pytest.fixture
def lab():
    return _lab()


def _engine(devices, **te):
    return mte.TransferEngine(host="127.0.0.1", protocol="rdma", devices=devices,
                              config=_cfg(**te) if te else None)


# --------------------------------------------------------------------------- data


def test_striped_batch_uses_both_devices(lab):
    """With two NICs (rxe0, rxe1) a batch's slices go over both: each device's packet
    counter moves by a good share of the bytes, and the data arrives intact."""
    size = 8 << 20
    with PeerProcess(size, protocol="rdma", devices=["rxe2"]) as b, \
            _engine(["rxe0", "rxe1"]) as a:
        data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        ra = a.register(data)
        before = {d: _counter(d, "sent_pkts") for d in ("rxe0", "rxe1")}
        a.write(b.name, ra.address, b.address, size, timeout=60)
        after = {d: _counter(d, "sent_pkts") for d in ("rxe0", "rxe1")}
        assert b.call("sha", b.address, size) == _sha(data)
        stats = a._transports["rdma"].stats()
        sent = {d: after[d] - before[d] for d in after}
        mtu = a.descriptor().devices[0]["mtu"]
        # Each device carried at least a third of the packets the bytes need.
        need = size // mtu
        assert all(v >= need // 3 for v in sent.values()), (sent, stats)
        assert all(stats[d]["bytes"] >= size // 3 for d in ("rxe0", "rxe1")), stats
        assert [(r[0], r[1]) for r in a._transports["rdma"].peer_rails(b.name)] == \
            [("rxe0", "rxe2"), ("rxe1", "rxe2")]


def _link_down_during(a, b, ra, size, netdev, dev, timeout):
    """Start a WRITE of ``size`` bytes, take ``netdev`` down once it is under way;
    return (batch, seconds it took to finish or fail)."""
    batch = a.submit_arrays(mte.WRITE, b.name, np.arange(0, size, 1 << 20, dtype=np.uint64)
                            + ra.address, np.arange(0, size, 1 << 20, dtype=np.uint64)
                            + b.address, 1 << 20, timeout=timeout)
    t0 = time.monotonic()
    stats = a._transports["rdma"].stats
    while stats()[dev]["completions"] < 2 and not batch.done():
        time.sleep(0.001)
    early = batch.done()
    _set_link(netdev, False)
    try:
        assert not early, ("the batch finished before the link went down",
                                  {st.state for st in batch.status()}, stats()[dev],
                                  sorted(set(batch._status()[2].tolist())))
        batch._native.wait(batch._deadline_ns + 5_000_000_000)
        return batch, time.monotonic() - t0
    finally:
        _set_link(netdev, True)
        _wait_active(dev)


def test_rail_down_mid_batch_completes_over_the_other_rail(lab):
    """veth1 (rxe1's link) goes down while a striped batch is in flight: the slices that
    failed on rxe1 are retried on rxe0 and the whole batch completes, intact."""
    # Large enough that the batch is still in flight when `ip` (slow to start in an
    # emulated guest) has taken the link down.
    size = 64 << 20
    with PeerProcess(size, protocol="rdma", devices=["rxe2"]) as b, \
            _engine(["rxe0", "rxe1"], retry_count=4, rdma_rail_pause_s=1) as a:
        data = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
        ra = a.register(data)
        a.write(b.name, ra.address, b.address, 4096)          # connect first
        batch, took = _link_down_during(a, b, ra, size, "veth1", "rxe1", timeout=60)
        batch.raise_for_status()
        assert b.call("sha", b.address, size) == _sha(data)
        s = a._transports["rdma"].stats()
        assert s["rxe1"]["errors"] > 0 and s["rxe1"]["retries"] + s["rxe0"]["retries"] > 0, s
        # With the link back, the rail reconnects and carries traffic again.
        time.sleep(1.2)                                       # the rail's pause
        a.write(b.name, ra.address, b.address, size, timeout=60)
        assert b.call("sha", b.address, size) == _sha(data)


def test_rail_down_without_another_rail_fails_cleanly_within_the_deadline(lab):
    """Only rxe1, and its link goes down mid-batch: the batch fails with the first
    error's text (the NIC's retry counter), well before its deadline, nothing hangs."""
    # Not more than 16 MiB: on one Soft-RoCE rail in the emulated guest a QP sometimes
    # fails by itself ("local QP operation error") after 14-37 MB of back-to-back 64 KiB
    # WRITEs (cause not found), which would end the batch before the link goes down.
    size = 16 << 20
    with PeerProcess(size, protocol="rdma", devices=["rxe2"]) as b, \
            _engine(["rxe1"], retry_count=4) as a:
        ra = a.register(np.ones(size, np.uint8))
        a.write(b.name, ra.address, b.address, 4096)
        batch, took = _link_down_during(a, b, ra, size, "veth1", "rxe1", timeout=30)
        assert took < 30, took
        with pytest.raises(E.TransferError) as ei:
            batch.raise_for_status()
        # rxe reports the link going down as a port event (or a local QP operation
        # error); a hardware NIC as "transport retry counter exceeded".
        assert re.search(r"port of the local RDMA NIC went down|retry counter exceeded|"
                         r"local QP operation error", str(ei.value)), str(ei.value)
        states = {s.state for s in batch.status()}
        assert "failed" in states and "pending" not in states
        # The link is back: a later transfer reconnects and succeeds.
        a.write(b.name, ra.address, b.address, 1 << 20, timeout=30)


def test_mtu_mismatch_is_negotiated(lab):
    """rxe2's link gets a 9000-byte MTU (port MTU 4096) while rxe0 stays at 1500 (port
    MTU 1024). Packets of 4096 bytes would be dropped at rxe0's end of the bridge, so
    only the negotiated path MTU of 1024 moves data; READs (responses from rxe2) and
    WRITEs both arrive intact."""
    size = 2 << 20
    for nd in ("veth2", "vbr2"):
        _ip("link", "set", nd, "mtu", "9000")
    try:
        _wait_active("rxe2")
        with PeerProcess(size, protocol="rdma", devices=["rxe2"]) as b, _engine(["rxe0"]) as a:
            peer = a.open_segment(b.name).descriptor.devices
            assert peer[0]["mtu"] == 4096, peer
            assert a.descriptor().devices[0]["mtu"] == 1024
            theirs = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
            b.call("fill", b.address, theirs.tobytes())
            mine = np.zeros(size, np.uint8)
            r = a.register(mine)
            a.read(b.name, r.address, b.address, size, timeout=60)
            assert (mine == theirs).all()
            mine[:] = 7
            a.write(b.name, r.address, b.address, size, timeout=60)
            assert b.call("sha", b.address, size) == _sha(mine)
            assert a._transports["rdma"].peer_rails(b.name)[0][3] == 1024
    finally:
        for nd in ("veth2", "vbr2"):
            _ip("link", "set", nd, "mtu", "1500")
        _wait_active("rxe2")


def test_out_of_region_access_is_refused_by_the_nic(lab):
    """B unregisters a buffer A still has in its cached descriptor: A's software check
    passes, the NIC refuses the WRITE (remote access error), the error says so, B's
    memory is unchanged, and the next transfer reconnects the rail and works."""
    with PeerProcess(1 << 20, protocol="rdma", devices=["rxe2"]) as b, \
            _engine(["rxe0"]) as a:
        extra = b.call("alloc", 1 << 20, "rw")
        b.call("fill", extra, b"\x11" * (1 << 20))
        src = np.full(1 << 20, 0x5A, np.uint8)
        ra = a.register(src)
        a.write(b.name, ra.address, b.address, 4096)          # caches B's descriptor
        assert any(x.address == extra for x in a.open_segment(b.name).buffers)
        b.call("unregister", extra)
        before = b.call("sha", extra, 1 << 20)
        with pytest.raises(E.AddressNotRegisteredError, match="refused by the NIC"):
            a.write(b.name, ra.address, extra, 65536, timeout=20)
        assert b.call("sha", extra, 1 << 20) == before
        a.write(b.name, ra.address, b.address, 1 << 20, timeout=20)
        assert b.call("sha", b.address, 1 << 20) == _sha(src)


def test_many_engines_qps_and_mrs_leave_no_resources_behind(lab):
    """Engines opened, used and closed over and over (each with QPs on two rails, a CQ,
    PDs and MRs): the kernel's per-device counts of PDs, CQs, QPs and MRs return to
    where they started."""
    start = _resources()
    with PeerProcess(1 << 20, protocol="rdma", devices=["rxe2"]) as b:
        mid = _resources()
        for i in range(6):
            with _engine(["rxe0", "rxe1"], rdma_qps_per_endpoint=2) as a:
                bufs = [np.full(1 << 16, i, np.uint8) for _ in range(4)]
                regs = [a.register(x) for x in bufs]
                for r in regs:
                    a.write(b.name, r.address, b.address, 1 << 16)
                a.unregister(regs[0])
            assert _resources() == mid
    for _ in range(50):
        if _resources() == start:
            break
        time.sleep(0.1)
    assert _resources() == start


def test_auto_uses_rdma_between_rdma_peers_and_tcp_otherwise(lab):
    with PeerProcess(1 << 20, protocol="auto", devices=["rxe2"]) as b, \
            PeerProcess(1 << 20, protocol="tcp") as c, \
            mte.TransferEngine(host="127.0.0.1", devices=["rxe0"]) as a:
        assert a.protocol == "rdma"
        r = a.register(np.ones(1 << 20, np.uint8))
        bt = a.submit_arrays(mte.WRITE, b.name, [r.address], [b.address], 4096)
        bt.wait(30)
        assert bt.transport == "rdma"
        bt = a.submit_arrays(mte.WRITE, c.name, [r.address], [c.address], 4096)
        bt.wait(30)
        assert bt.transport in ("tcp", "shm")
        # protocol="rdma" never falls back: a TCP-only peer is an error.
        with _engine(["rxe0"]) as strict:
            r2 = strict.register(np.ones(4096, np.uint8))
            with pytest.raises(E.TransportUnavailableError, match="no transport"):
                strict.write(c.name, r2.address, c.address, 4096)


def test_unknown_device_name_lists_the_devices_that_exist(lab):
    with pytest.raises(E.DeviceNotFoundError) as ei:
        _engine(["mlx5_bond0"])
    msg = str(ei.value)
    assert "no RDMA device named 'mlx5_bond0'" in msg
    assert all(d["name"] in msg for d in lab), msg


def test_buffer_registered_after_first_contact_is_found(lab):
    """A's cached descriptor predates B's new buffer: A fetches B's descriptor again
    instead of refusing the address."""
    with PeerProcess(1 << 20, protocol="rdma", devices=["rxe2"]) as b, _engine(["rxe0"]) as a:
        r = a.register(np.full(1 << 16, 3, np.uint8))
        a.write(b.name, r.address, b.address, 4096)
        extra = b.call("alloc", 1 << 16, "rw")
        a.write(b.name, r.address, extra, 1 << 16)
        assert b.call("get", extra, 4) == b"\x03" * 4

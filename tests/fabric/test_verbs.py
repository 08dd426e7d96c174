# SPDX-License-Identifier: Apache-2.0
"""Our libibverbs bindings (mooncake_te/transports/rdma/_verbs.pyx) on real devices:
queue pairs connected by hand between rxe0 and rxe1, RDMA WRITE/READ, NIC-enforced
bounds, lifetime rules, and no resources left behind."""
from __future__ import annotations

import gc
import json
import os
import random
import re
import subprocess

import numpy as np
import pytest

pytestmark = pytest.mark.rdma

_verbs = pytest.importorskip("mooncake_te.transports.rdma._verbs",
                             reason="the RDMA extension is not built (libibverbs-dev)")

ACC = _verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_READ | _verbs.ACCESS_REMOTE_WRITE


def _devices():
    raw = os.environ.get("MOONCAKE_LAB_RXE")
    if raw:
        return json.loads(raw)
    names = _verbs.device_names()
    if len(names) < 2:
        pytest.skip("needs two verbs devices")
    return [{"name": n, "gid_index": None} for n in names[:2]]


def _gid(ctx, index):
    if index is None:
        from mooncake_te.topology.gids import select
        port = ctx.query_port(1)
        entries = [(i, *ctx.query_gid(1, i)[:2], True) for i in range(port["gid_tbl_len"])
                   if ctx.query_gid(1, i)]
        index = select(entries)[0]
    return index, ctx.query_gid(1, index)[0]


def _resources():
    out = subprocess.run(["rdma", "resource", "show"], capture_output=True, text=True,
                         timeout=30).stdout
    return {m.group(1): m.group(2) for m in re.finditer(r"\d+:\s*(\S+):\s*(.*)", out)}


class Side:
    def __init__(self, dev, size=1 << 20):
        self.ctx = _verbs.Context(dev["name"])
        self.gid_index, self.gid = _gid(self.ctx, dev.get("gid_index"))
        self.mtu = self.ctx.query_port(1)["active_mtu"]
        self.pd = _verbs.PD(self.ctx)
        self.cq = _verbs.CQ(self.ctx, 64)
        self.qp = _verbs.QP(self.pd, self.cq, 32)
        self.qp.init(1)
        self.buf = np.zeros(size, np.uint8)
        self.mr = _verbs.MR(self.pd, self.buf.ctypes.data, size, ACC)
        self.psn = random.getrandbits(24)


def _connect(a, b):
    mtu = min(a.mtu, b.mtu)
    a.qp.rtr(b.qp.qp_num, b.psn, mtu, b.gid, 0, a.gid_index)
    b.qp.rtr(a.qp.qp_num, a.psn, mtu, a.gid, 0, b.gid_index)
    a.qp.rts(a.psn)
    b.qp.rts(b.psn)


@pytest.fixture
def pair():
    devs = _devices()
    a, b = Side(devs[0]), Side(devs[1])
    _connect(a, b)
    yield a, b
    a.ctx.close()
    b.ctx.close()


def test_devices_ports_and_gids():
    names = _verbs.device_names()
    assert [d["name"] for d in _devices()][0] in names
    ctx = _verbs.Context(names[0])
    try:
        port = ctx.query_port(1)
        assert port["active"] and port["active_mtu"] in (256, 512, 1024, 2048, 4096)
        assert ctx.attr["max_qp"] > 0 and ctx.attr["max_cqe"] > 0
        entries = [g for g in (ctx.query_gid(1, i) for i in range(port["gid_tbl_len"])) if g]
        assert entries and all(len(g[0]) == 16 for g in entries)
    finally:
        ctx.close()
    with pytest.raises(OSError, match="no verbs device named"):
        _verbs.Context("mlx5_bond0")


def test_rdma_write_and_read_between_two_devices(pair):
    a, b = pair
    assert a.qp.state == "RTS" and b.qp.state == "RTS"
    a.buf[:] = np.random.default_rng(0).integers(0, 256, a.buf.size, dtype=np.uint8)
    a.qp.post_rdma(_verbs.WRITE, a.mr.address, 300_000, a.mr.lkey, b.mr.address + 5, b.mr.rkey,
                   wr_id=7)
    wc = a.cq.poll(4, timeout=30)
    assert wc and wc[0][:2] == (7, 0), wc
    assert (b.buf[5:300_005] == a.buf[:300_000]).all()
    b.buf[:4096] = 9
    a.qp.post_rdma(_verbs.READ, a.mr.address + 4096, 4096, a.mr.lkey, b.mr.address, b.mr.rkey,
                   wr_id=8)
    wc = a.cq.poll(4, timeout=30)
    assert wc and wc[0][:2] == (8, 0), wc
    assert (a.buf[4096:8192] == 9).all()


def test_access_outside_the_region_is_refused_by_the_nic(pair):
    a, b = pair
    before = b.buf.copy()
    a.qp.post_rdma(_verbs.WRITE, a.mr.address, 8192, a.mr.lkey,
                   b.mr.address + b.buf.size - 4096, b.mr.rkey, wr_id=1)
    wc = a.cq.poll(4, timeout=30)
    assert wc and wc[0][1] == 10, wc                      # IBV_WC_REM_ACCESS_ERR
    assert _verbs.wc_status_str(wc[0][1]) == "remote access error"
    assert (b.buf == before).all()
    assert a.qp.state == "ERR"


def test_parent_close_closes_children_and_close_is_idempotent():
    dev = _devices()[0]["name"]
    ctx = _verbs.Context(dev)
    pd = _verbs.PD(ctx)
    ch = _verbs.CompChannel(ctx)
    cq = _verbs.CQ(ctx, 16, ch)
    qp = _verbs.QP(pd, cq, 8)
    buf = bytearray(65536)
    addr = np.frombuffer(buf, np.uint8).ctypes.data
    mr = _verbs.MR(pd, addr, len(buf), ACC)
    assert mr.lkey and mr.rkey and qp.qp_num
    ctx.close()
    assert ctx.closed and pd.closed and mr.closed and qp.state == "closed"
    ctx.close()
    qp.close()
    mr.close()
    with pytest.raises(ValueError, match="closed"):
        _verbs.PD(ctx)


def test_children_keep_parents_alive():
    dev = _devices()[0]["name"]
    ctx = _verbs.Context(dev)
    pd = _verbs.PD(ctx)
    cq = _verbs.CQ(ctx, 16)
    del ctx
    gc.collect()
    qp = _verbs.QP(pd, cq, 8)                   # the context is still open underneath
    assert qp.qp_num and not pd.context.closed
    del qp, pd, cq
    gc.collect()                                # freed in __dealloc__, nothing raises


def test_many_qps_and_mrs_opened_and_closed_leave_nothing_behind():
    devs = _devices()
    start = _resources()
    buf = np.zeros(1 << 20, np.uint8)
    for _ in range(5):
        ctx = _verbs.Context(devs[0]["name"])
        pd = _verbs.PD(ctx)
        cq = _verbs.CQ(ctx, 256)
        qps = [_verbs.QP(pd, cq, 16) for _ in range(20)]
        mrs = [_verbs.MR(pd, buf.ctypes.data + i * 4096, 4096, ACC) for i in range(40)]
        assert len({q.qp_num for q in qps}) == 20 and len({m.rkey for m in mrs}) == 40
        for q in qps[:10]:
            q.close()
        ctx.close()                              # the rest go with their context
    gc.collect()
    assert _resources() == start

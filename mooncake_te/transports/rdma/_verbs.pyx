# SPDX-License-Identifier: Apache-2.0
# cython: language_level=3, boundscheck=False, wraparound=False
"""Our bindings over libibverbs, and the handle of the native data path (src/rdma).

Lifetime rules (the house style):

* a child keeps its parent alive (an MR holds its PD, a PD its Context, ...);
* closing a parent closes its children first, newest first (a Context closes its QPs,
  CQs, MRs, PDs and channels, and any data path polling its CQs);
* ``close()`` is idempotent; ``__dealloc__`` frees what is left and never raises;
* in a forked child nothing is freed (the verbs objects are the parent's).

Everything that can block or pin memory (registration, QP state changes, post and poll
loops) runs with the GIL released.
"""
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport errno, EIO, ENOSYS, ENODEV, ENOMEM
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset, memcpy
import os
import time
import weakref

import numpy as np

from mooncake_te.core._core cimport Regions, NativeBatch, Resource, check_errno
from mooncake_te.core.capi cimport mte_core_import
from mooncake_te.transports.rdma.libibverbs cimport *
from mooncake_te.transports.rdma.librdma cimport *

mte_core_import()

ACCESS_LOCAL_WRITE = IBV_ACCESS_LOCAL_WRITE
ACCESS_REMOTE_WRITE = IBV_ACCESS_REMOTE_WRITE
ACCESS_REMOTE_READ = IBV_ACCESS_REMOTE_READ
WRITE = MTE_OP_WRITE
READ = MTE_OP_READ
MAX_DEV = MTE_RDMA_MAX_DEV
MAX_QP = MTE_RDMA_MAX_QP
MAX_RAILS = MTE_RDMA_MAX_RAILS

_MTU_BYTES = {IBV_MTU_256: 256, IBV_MTU_512: 512, IBV_MTU_1024: 1024, IBV_MTU_2048: 2048,
              IBV_MTU_4096: 4096}
_MTU_ENUM = {v: k for k, v in _MTU_BYTES.items()}
_PORT_STATES = {IBV_PORT_NOP: "NOP", IBV_PORT_DOWN: "DOWN", IBV_PORT_INIT: "INIT",
                IBV_PORT_ARMED: "ARMED", IBV_PORT_ACTIVE: "ACTIVE",
                IBV_PORT_ACTIVE_DEFER: "ACTIVE_DEFER"}
_GID_TYPES = {IBV_GID_TYPE_IB: "IB", IBV_GID_TYPE_ROCE_V1: "RoCE v1",
              IBV_GID_TYPE_ROCE_V2: "RoCE v2"}


from mooncake_te.errors import InvalidArgumentError, VerbsError  # VerbsError: also an OSError


cdef _fail(str what, int err=0):
    e = err if err else errno
    if e == 0:
        e = EIO    # verbs returned NULL without setting errno
    check_errno(-e, what, VerbsError)


def wc_status_str(int status):
    """libibverbs' text for a work-completion status (``ibv_wc_status_str``)."""
    return ibv_wc_status_str(<ibv_wc_status>status).decode()


def mtu_bytes(int mtu_enum):
    return _MTU_BYTES.get(mtu_enum, 0)


def mtu_enum(int nbytes):
    """The ``ibv_mtu`` value for 256..4096 bytes (ValueError otherwise)."""
    if nbytes not in _MTU_ENUM:
        raise InvalidArgumentError(f"an RDMA path MTU is one of 256, 512, 1024, 2048, 4096; got {nbytes}")
    return _MTU_ENUM[nbytes]


def device_names():
    """Names of the verbs devices libibverbs sees (``ibv_get_device_list``)."""
    cdef int n = 0
    cdef ibv_device **lst = ibv_get_device_list(&n)
    if lst == NULL:
        e = errno
        if e == ENOSYS:   # no kernel support at all (no ib_uverbs)
            return []
        _fail("ibv_get_device_list", e)
    try:
        return [ibv_get_device_name(lst[i]).decode() for i in range(n)]
    finally:
        ibv_free_device_list(lst)


cdef class Context(Resource):
    """An open verbs device (``ibv_open_device``)."""

    def __init__(self, str name):
        cdef int n = 0, i
        cdef ibv_device **lst = ibv_get_device_list(&n)
        cdef ibv_device_attr a
        if lst == NULL:
            _fail("ibv_get_device_list")
        try:
            for i in range(n):
                if ibv_get_device_name(lst[i]).decode() == name:
                    self.ctx = ibv_open_device(lst[i])
                    if self.ctx == NULL:
                        _fail(f"ibv_open_device({name})")
                    self._opened()
                    break
            else:
                raise VerbsError(ENODEV, f"no verbs device named {name!r}")
        finally:
            ibv_free_device_list(lst)
        self.name = name
        if ibv_query_device(self.ctx, &a) != 0:
            _fail(f"ibv_query_device({name})")
        self.attr = {"fw_ver": a.fw_ver.decode(errors="replace"), "max_mr_size": a.max_mr_size,
                     "max_qp": a.max_qp, "max_qp_wr": a.max_qp_wr, "max_sge": a.max_sge,
                     "max_cq": a.max_cq, "max_cqe": a.max_cqe, "max_mr": a.max_mr,
                     "max_pd": a.max_pd, "max_qp_rd_atom": a.max_qp_rd_atom,
                     "max_qp_init_rd_atom": a.max_qp_init_rd_atom,
                     "phys_port_cnt": a.phys_port_cnt}

    cdef ibv_context *_get(self) except NULL:
        if self.ctx == NULL:
            self._raise_closed(f"context {self.name}")
        return self.ctx

    def query_port(self, int port=1):
        """State, MTUs, LID and link layer of a port (``ibv_query_port``)."""
        cdef ibv_port_attr a
        cdef ibv_context *c = self._get()
        memset(&a, 0, sizeof(a))
        if ibv_query_port(c, <uint8_t>port, &a) != 0:
            _fail(f"ibv_query_port({self.name}, {port})")
        return {"state": _PORT_STATES.get(a.state, str(a.state)), "active": a.state == IBV_PORT_ACTIVE,
                "max_mtu": _MTU_BYTES.get(a.max_mtu, 0), "active_mtu": _MTU_BYTES.get(a.active_mtu, 0),
                "lid": a.lid, "gid_tbl_len": a.gid_tbl_len,
                "link_layer": {IBV_LINK_LAYER_INFINIBAND: "InfiniBand",
                               IBV_LINK_LAYER_ETHERNET: "Ethernet"}.get(a.link_layer, "unspecified")}

    def query_gid(self, int port, int index):
        """(gid bytes, type str, netdev ifindex) of one GID table entry, or None if the
        entry is empty or unreadable."""
        cdef ibv_gid_entry e
        cdef ibv_context *c = self._get()
        memset(&e, 0, sizeof(e))
        if ibv_query_gid_ex(c, port, index, &e, 0) != 0:
            return None
        raw = bytes(e.gid.raw[:16])
        if raw == b"\0" * 16:
            return None
        return raw, _GID_TYPES.get(e.gid_type, str(e.gid_type)), e.ndev_ifindex

    cdef int _release(self, bint owner, bint finalizing) except -1:
        if self.ctx != NULL and owner:
            ibv_close_device(self.ctx)
        self.ctx = NULL
        return 0

    def __repr__(self):
        return f"<Context {self.name}{' closed' if self.ctx == NULL else ''}>"


cdef class PD(Resource):
    """A protection domain (``ibv_alloc_pd``)."""

    def __init__(self, Context context):
        cdef ibv_context *c = context._get()
        self.pd = ibv_alloc_pd(c)
        if self.pd == NULL:
            _fail(f"ibv_alloc_pd({context.name})")
        self._opened()
        self.context = context
        self.parent = context
        context._adopt(self)

    cdef ibv_pd *_get(self) except NULL:
        if self.pd == NULL:
            self._raise_closed("protection domain")
        return self.pd

    cdef int _release(self, bint owner, bint finalizing) except -1:
        if self.pd != NULL and owner:
            ibv_dealloc_pd(self.pd)
        self.pd = NULL
        return 0


cdef class MR(Resource):
    """A memory region: ``MR(pd, address, length, access)`` pins and registers host
    memory (or device memory under nvidia-peermem); :meth:`dmabuf` registers a dma-buf
    (GPU memory). The GIL is released while the kernel pins the pages."""

    def __init__(self, PD pd, uint64_t address, uint64_t length, int access, *, int dmabuf_fd=-1,
                 uint64_t dmabuf_offset=0):
        cdef ibv_pd *p = pd._get()
        cdef int e = 0
        if length == 0:
            raise InvalidArgumentError("cannot register 0 bytes")
        with nogil:
            if dmabuf_fd >= 0:
                self.mr = ibv_reg_dmabuf_mr(p, dmabuf_offset, length, address, dmabuf_fd, access)
            else:
                self.mr = ibv_reg_mr(p, <void *><uintptr_t>address, length, access)
            if self.mr == NULL:
                e = errno
        if self.mr == NULL:
            _fail(f"{'ibv_reg_dmabuf_mr' if dmabuf_fd >= 0 else 'ibv_reg_mr'}"
                  f"({pd.context.name}, {address:#x}, {length})", e)
        self._opened()
        self.pd = pd
        self.parent = pd
        self.address, self.length, self.access = address, length, access
        pd._adopt(self)

    @staticmethod
    def dmabuf(PD pd, int fd, uint64_t offset, uint64_t length, uint64_t iova, int access):
        """Register ``length`` bytes at ``offset`` of dma-buf ``fd``, addressed as ``iova``."""
        return MR(pd, iova, length, access, dmabuf_fd=fd, dmabuf_offset=offset)

    @property
    def lkey(self):
        return self.mr.lkey if self.mr != NULL else 0

    @property
    def rkey(self):
        return self.mr.rkey if self.mr != NULL else 0

    cdef int _release(self, bint owner, bint finalizing) except -1:
        cdef ibv_mr *m = self.mr
        self.mr = NULL
        if m != NULL and owner:
            with nogil:                      # unpinning many pages takes a while
                ibv_dereg_mr(m)
        return 0


cdef class CompChannel(Resource):
    """A completion channel (``ibv_create_comp_channel``): what a poller sleeps on."""

    def __init__(self, Context context):
        self.ch = ibv_create_comp_channel(context._get())
        if self.ch == NULL:
            _fail(f"ibv_create_comp_channel({context.name})")
        self._opened()
        self.context = context
        self.parent = context
        context._adopt(self)

    @property
    def fd(self):
        return self.ch.fd if self.ch != NULL else -1

    cdef int _release(self, bint owner, bint finalizing) except -1:
        if self.ch != NULL and owner:
            ibv_destroy_comp_channel(self.ch)
        self.ch = NULL
        return 0


cdef class CQ(Resource):
    """A completion queue (``ibv_create_cq``), optionally on a :class:`CompChannel`."""

    def __init__(self, Context context, int cqe=4096, CompChannel channel=None):
        cdef ibv_comp_channel *ch = NULL
        if channel is not None:
            ch = channel.ch
            if ch == NULL:
                channel._raise_closed("completion channel")
        cqe = min(cqe, context.attr["max_cqe"])
        self.cq = ibv_create_cq(context._get(), cqe, NULL, ch, 0)
        if self.cq == NULL:
            _fail(f"ibv_create_cq({context.name}, {cqe})")
        self._opened()
        self.cqe = self.cq.cqe
        self.context = context
        self.channel = channel
        self.parent = context
        context._adopt(self)
        if channel is not None:
            channel._adopt(self)

    cdef ibv_cq *_get(self) except NULL:
        if self.cq == NULL:
            self._raise_closed("completion queue")
        return self.cq

    def poll(self, int max_entries=16, double timeout=0.0):
        """Busy-poll up to ``timeout`` seconds (GIL released) for completions; returns a
        list of (wr_id, status, opcode, byte_len)."""
        cdef ibv_cq *cq = self._get()
        cdef ibv_wc *wc = <ibv_wc *>malloc(max_entries * sizeof(ibv_wc))
        cdef int n = 0, i
        cdef int64_t limit = <int64_t>(timeout * 1e9)
        cdef int64_t start = time.monotonic_ns()
        if wc == NULL:
            raise MemoryError()
        try:
            while True:
                with nogil:
                    n = ibv_poll_cq(cq, max_entries, wc)
                if n != 0 or time.monotonic_ns() - start >= limit:
                    break
                PyErr_CheckSignals()
            if n < 0:
                _fail("ibv_poll_cq")
            return [(wc[i].wr_id, <int>wc[i].status, <int>wc[i].opcode, wc[i].byte_len)
                    for i in range(n)]
        finally:
            free(wc)

    cdef int _release(self, bint owner, bint finalizing) except -1:
        if self.cq != NULL and owner:
            ibv_destroy_cq(self.cq)
        self.cq = NULL
        return 0


cdef class QP(Resource):
    """A reliable-connected queue pair. ``init`` -> ``rtr`` -> ``rts`` connects it to a
    remote QP (whose number, PSN, GID and LID came from the handshake)."""

    def __init__(self, PD pd, CQ cq, int max_send_wr=256, int max_sge=1, int max_rd_atomic=16):
        cdef ibv_qp_init_attr a
        memset(&a, 0, sizeof(a))
        a.send_cq = cq._get()
        a.recv_cq = a.send_cq
        a.qp_type = IBV_QPT_RC
        a.cap.max_send_wr = max_send_wr
        a.cap.max_recv_wr = 1
        a.cap.max_send_sge = max_sge
        a.cap.max_recv_sge = 1
        cdef ibv_pd *p = pd._get()
        with nogil:
            self.qp = ibv_create_qp(p, &a)
        if self.qp == NULL:
            _fail(f"ibv_create_qp({pd.context.name})")
        self._opened()
        self.max_send_wr = a.cap.max_send_wr
        self.pd = pd
        self.cq = cq
        self.parent = pd
        self.port = 1
        pd._adopt(self)
        cq._adopt(self)

    cdef ibv_qp *_get(self) except NULL:
        if self.qp == NULL:
            self._raise_closed("queue pair")
        return self.qp

    @property
    def qp_num(self):
        return self.qp.qp_num if self.qp != NULL else 0

    @property
    def state(self):
        cdef ibv_qp_attr a
        cdef ibv_qp_init_attr ia
        if self.qp == NULL:
            return "closed"
        if ibv_query_qp(self.qp, &a, IBV_QP_STATE, &ia) != 0:
            return "unknown"
        return {IBV_QPS_RESET: "RESET", IBV_QPS_INIT: "INIT", IBV_QPS_RTR: "RTR",
                IBV_QPS_RTS: "RTS", IBV_QPS_SQD: "SQD", IBV_QPS_SQE: "SQE",
                IBV_QPS_ERR: "ERR"}.get(a.qp_state, "unknown")

    cdef _modify(self, ibv_qp_attr *a, int mask, str what):
        cdef ibv_qp *q = self._get()
        cdef int rc
        with nogil:
            rc = ibv_modify_qp(q, a, mask)
        if rc != 0:
            _fail(f"modify QP {self.qp_num} to {what}", rc if rc > 0 else 0)

    def init(self, int port=1, int access=IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ
             | IBV_ACCESS_REMOTE_WRITE, int pkey_index=0):
        cdef ibv_qp_attr a
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_INIT
        a.pkey_index = pkey_index
        a.port_num = port
        a.qp_access_flags = access
        self.port = port
        self._modify(&a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
                     "INIT")

    def rtr(self, uint32_t dest_qp_num, uint32_t rq_psn, int mtu, bytes gid=None, int lid=0,
            int sgid_index=0, int max_dest_rd_atomic=16, int traffic_class=0, int sl=0):
        """To ready-to-receive: ``mtu`` in bytes (the negotiated path MTU)."""
        cdef ibv_qp_attr a
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_RTR
        cdef int m = mtu_enum(mtu)
        a.path_mtu = <ibv_mtu>m
        a.dest_qp_num = dest_qp_num
        a.rq_psn = rq_psn & 0xFFFFFF
        a.max_dest_rd_atomic = max_dest_rd_atomic
        a.min_rnr_timer = 12
        a.ah_attr.dlid = lid
        a.ah_attr.sl = sl
        a.ah_attr.port_num = self.port
        if gid is not None and gid != b"\0" * 16:
            if len(gid) != 16:
                raise InvalidArgumentError("a GID is 16 bytes")
            a.ah_attr.is_global = 1
            memcpy(a.ah_attr.grh.dgid.raw, <const char *>gid, 16)
            a.ah_attr.grh.sgid_index = sgid_index
            a.ah_attr.grh.hop_limit = 16
            a.ah_attr.grh.traffic_class = traffic_class
        self._modify(&a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN
                     | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, "RTR")

    def rts(self, uint32_t sq_psn, int timeout=14, int retry_cnt=7, int rnr_retry=7,
            int max_rd_atomic=16):
        cdef ibv_qp_attr a
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_RTS
        a.sq_psn = sq_psn & 0xFFFFFF
        a.timeout = timeout
        a.retry_cnt = retry_cnt
        a.rnr_retry = rnr_retry
        a.max_rd_atomic = max_rd_atomic
        self._modify(&a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT
                     | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC, "RTS")

    def to_error(self):
        """Move to ERR: everything posted completes, flushed."""
        cdef ibv_qp_attr a
        memset(&a, 0, sizeof(a))
        a.qp_state = IBV_QPS_ERR
        self._modify(&a, IBV_QP_STATE, "ERR")

    def post_rdma(self, int op, uint64_t local, uint32_t length, uint32_t lkey, uint64_t remote,
                  uint32_t rkey, uint64_t wr_id=0):
        """Post one signaled RDMA WRITE (op=WRITE) or READ (op=READ)."""
        cdef ibv_send_wr wr
        cdef ibv_send_wr *bad = NULL
        cdef ibv_sge sge
        cdef ibv_qp *q = self._get()
        cdef int rc
        memset(&wr, 0, sizeof(wr))
        sge.addr = local
        sge.length = length
        sge.lkey = lkey
        wr.wr_id = wr_id
        wr.sg_list = &sge
        wr.num_sge = 1
        wr.opcode = IBV_WR_RDMA_READ if op == MTE_OP_READ else IBV_WR_RDMA_WRITE
        wr.send_flags = IBV_SEND_SIGNALED
        wr.wr.rdma.remote_addr = remote
        wr.wr.rdma.rkey = rkey
        with nogil:
            rc = ibv_post_send(q, &wr, &bad)
        if rc != 0:
            _fail("ibv_post_send", rc)

    cdef int _release(self, bint owner, bint finalizing) except -1:
        cdef ibv_qp *q = self.qp
        self.qp = NULL
        if q != NULL and owner:
            with nogil:
                ibv_destroy_qp(q)
        return 0


# --------------------------------------------------------------------------- data path

cdef class DataPath(Resource):
    """The native data path of one engine (src/rdma/): a polling thread per
    device, the local key table and the peers. Adopted by every Context it polls, so
    closing a Context stops it first."""

    def __init__(self, Regions regions, uint64_t slice_size,
                 int retry_count, bint multi_nic=True, int pause_ms=30000, int spin_us=50):
        cdef mte_rdma_params_t prm
        cdef int err = 0
        prm.slice_size = slice_size
        prm.retry_count = retry_count
        prm.multi_nic = multi_nic
        prm.pause_ms = pause_ms
        prm.spin_us = spin_us
        self.r = mte_rdma_new(regions.t, &prm, &err)
        if self.r == NULL:
            check_errno(err if err < 0 else -ENOMEM, "cannot start the RDMA data path")
        self._opened()
        self.regions = regions
        self._keep = []
        self.ndev = 0

    cdef mte_rdma_t *_get(self) except NULL:
        if self.r == NULL:
            self._raise_closed("the RDMA data path")
        return self.r

    def add_device(self, int idx, CQ cq):
        """Poll ``cq`` (created on a CompChannel) as device ``idx``."""
        cdef int rc
        if cq.channel is None:
            raise InvalidArgumentError("the data path sleeps on a completion channel: create the CQ with one")
        rc = mte_rdma_add_device(self._get(), idx, cq.context.ctx, cq.cq, cq.channel.ch, cq.cqe)
        check_errno(rc, f"cannot add device {idx} to the data path")
        self._keep.append(cq)
        cq.context._adopt(self)
        cq._adopt(self)
        self.ndev = max(self.ndev, idx + 1)

    def start(self):
        rc = mte_rdma_start(self._get())
        check_errno(rc, "cannot start the RDMA polling threads")

    def add_mr(self, uint64_t address, uint64_t length, lkeys, uint64_t pref, uint64_t avail):
        cdef uint32_t keys[64]
        cdef int i, n = len(lkeys)
        if n > MTE_RDMA_MAX_DEV:
            raise InvalidArgumentError("too many devices")
        for i in range(n):
            keys[i] = lkeys[i]
        rc = mte_rdma_mr_add(self._get(), address, length, keys, n, pref, avail)
        check_errno(rc, "cannot add memory keys")

    def remove_mr(self, uint64_t address):
        if self.r != NULL:
            mte_rdma_mr_remove(self.r, address)

    def device_stats(self, int idx):
        """[slices posted, bytes posted, completions, errors, retries] of device ``idx``."""
        cdef uint64_t out[5]
        mte_rdma_dev_stats(self._get(), idx, out)
        return [out[0], out[1], out[2], out[3], out[4]]

    def port_down(self, int idx):
        return mte_rdma_dev_port_down(self._get(), idx) != 0

    def peer(self, int npdev):
        return Peer(self, npdev)

    def stop(self, int wait_ms=2000):
        if self.r != NULL and self._owner():
            with nogil:
                mte_rdma_stop(self.r, wait_ms)

    cdef int _release(self, bint owner, bint finalizing) except -1:
        # Children (the peers) are closed first by Resource.close.
        cdef mte_rdma_t *r = self.r
        cdef int wait_ms = 0 if finalizing else 2000
        self.r = NULL
        if r != NULL and owner:
            with nogil:
                mte_rdma_stop(r, wait_ms)
                mte_rdma_free(r)
        if not finalizing:
            self._keep = []
        return 0


cdef class Peer(Resource):
    """One remote engine in the data path: its buffers (rkeys) and rails."""

    def __init__(self, DataPath dp, int npdev):
        self.p = mte_rdma_peer_new(dp._get(), npdev)
        if self.p == NULL:
            raise InvalidArgumentError(f"cannot make a peer with {npdev} devices")
        self._opened()
        self.dp = dp
        self.parent = dp
        self.npdev = npdev
        self._qps = {}
        self._old = []
        dp._adopt(self)

    cdef mte_rdma_peer_t *_get(self) except NULL:
        if self.p == NULL:
            self._raise_closed("RDMA peer")
        return self.p

    def set_buffers(self, const uint64_t[::1] addrs, const uint64_t[::1] lens,
                    const uint8_t[::1] access, const uint32_t[::1] rkeys,
                    const uint64_t[::1] pref, const uint64_t[::1] avail):
        cdef size_t n = addrs.shape[0]
        cdef mte_rdma_peer_t *p = self._get()
        if <size_t>rkeys.shape[0] != n * <size_t>self.npdev:
            raise InvalidArgumentError("rkeys must hold npdev keys per buffer")
        if n == 0:
            rc = mte_rdma_peer_set_buffers(p, 0, NULL, NULL, NULL, NULL, NULL, NULL)
        else:
            rc = mte_rdma_peer_set_buffers(p, n, &addrs[0], &lens[0], &access[0], &rkeys[0],
                                           &pref[0], &avail[0])
        check_errno(rc, "cannot set the peer's buffers")

    def add_rail(self, int ldev, int pdev, list qps, int max_wr):
        cdef ibv_qp *arr[64]
        cdef int i, n = len(qps)
        cdef QP q
        if n == 0 or n > MTE_RDMA_MAX_QP:
            raise InvalidArgumentError(f"a rail has 1 to {MTE_RDMA_MAX_QP} queue pairs")
        for i in range(n):
            q = qps[i]
            arr[i] = q._get()
        rc = mte_rdma_peer_add_rail(self._get(), ldev, pdev, arr, n, max_wr)
        check_errno(rc, "cannot add a rail")
        self._qps[rc] = list(qps)
        return rc

    def reconnect_rail(self, int rail, list qps):
        cdef ibv_qp *arr[64]
        cdef int i, n = len(qps)
        cdef QP q
        if n == 0 or n > MTE_RDMA_MAX_QP:
            raise InvalidArgumentError(f"a rail has 1 to {MTE_RDMA_MAX_QP} queue pairs")
        for i in range(n):
            q = qps[i]
            arr[i] = q._get()
        rc = mte_rdma_rail_reconnect(self._get(), rail, arr, n)
        check_errno(rc, "cannot reconnect a rail")
        self._old += self._qps.get(rail, [])
        self._qps[rail] = list(qps)
        self.reap()

    def reap(self):
        """Destroy retired queue pairs whose posted work has all completed."""
        cdef QP q
        keep = []
        for q in self._old:
            if q.qp == NULL:
                continue
            if mte_rdma_qp_forget(self.p, q.qp) == 0:
                q.close()
            else:
                keep.append(q)
        self._old = keep
        return len(keep)

    def rails(self):
        """[(ldev, pdev, dead, paused_until_ns, first_err)] per rail."""
        cdef int state = 0, err = 0, ld = 0, pd = 0, i
        cdef int64_t paused = 0
        cdef mte_rdma_peer_t *p = self._get()
        out = []
        for i in range(mte_rdma_peer_nrails(p)):
            mte_rdma_rail_info(p, i, &state, &paused, &err, &ld, &pd)
            out.append((ld, pd, bool(state), paused, err))
        return out

    @property
    def outstanding(self):
        return mte_rdma_peer_outstanding(self.p) if self.p != NULL else 0

    def debug(self):
        """Per rail: (slices queued, [(work outstanding, dead: 0/1, 2 = retired)] per QP)."""
        cdef int q = 0, n, i, k
        cdef int outs[64]
        cdef int dead[64]
        cdef mte_rdma_peer_t *p = self._get()
        res = []
        for i in range(mte_rdma_peer_nrails(p)):
            n = mte_rdma_rail_debug(p, i, &q, outs, dead, 64)
            res.append((q, [(outs[k], dead[k]) for k in range(max(n, 0))]))
        return res

    def submit(self, NativeBatch batch, int op, const uint64_t[::1] local,
               const uint64_t[::1] remote, const uint64_t[::1] lens, uint32_t first):
        cdef uint32_t n = local.shape[0]
        cdef int stride = 1 if lens.shape[0] == n else 0
        cdef int rc = 0
        cdef mte_rdma_peer_t *p = self._get()
        if n == 0:
            return 0
        with nogil:
            rc = mte_rdma_submit(p, batch.b, op, &local[0], &remote[0], &lens[0],
                                 stride, first, n)
        return rc

    def shutdown(self):
        if self.p != NULL and self._owner():
            with nogil:
                mte_rdma_peer_shutdown(self.p)

    def close(self, int wait_ms=2000):
        """Wait up to ``wait_ms`` for posted work, free the peer, close its queue pairs."""
        self._wait_ms = wait_ms
        Resource.close(self)

    cdef int _release(self, bint owner, bint finalizing) except -1:
        cdef mte_rdma_peer_t *p = self.p
        cdef int wait_ms = 0 if finalizing else self._wait_ms
        cdef QP q
        self.p = NULL
        if p != NULL and owner:
            with nogil:
                mte_rdma_peer_free(p, wait_ms)
        if not finalizing:
            for qs in self._qps.values():
                for q in qs:
                    q.close()
            for q in self._old:
                q.close()
            self._qps = {}
            self._old = []
        return 0

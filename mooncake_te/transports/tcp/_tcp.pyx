# SPDX-License-Identifier: Apache-2.0
# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin one-to-one layer over src/tcp/ (tcp.h): the server and peers.

Everything that moves bytes or waits runs with the GIL released; the facade in
``mooncake_te.transports.tcp`` and ``mooncake_te.engine`` carries the domain words.
"""
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t, uintptr_t
import errno
import os
import numpy as np

cnp.import_array()

from mooncake_te.core._core cimport Regions, NativeBatch, PreparedTable, Resource, check_errno
cimport numpy as cnp
from mooncake_te.core.capi cimport mte_core_import
from mooncake_te.core.libcore cimport *
from mooncake_te.transports.tcp.libtcp cimport *

from mooncake_te.core._core import hmac_sha256, now_ns, OP_READ as READ, OP_WRITE as WRITE  # noqa: F401

from mooncake_te.errors import InvalidArgumentError

mte_core_import()


cdef class TcpServer(Resource):
    """Accepts data connections and applies peers' requests to registered memory."""
    cdef mte_tcp_t *t
    cdef readonly Regions regions
    cdef readonly int port
    cdef readonly str uds_name

    def __cinit__(self, Regions regions, str bind_host, int port, str name,
                  uint64_t instance, int stall_ms=30000, bytes token=b""):
        cdef int err = 0
        cdef bytes h = bind_host.encode(), n = name.encode()
        cdef const char *hp = h
        cdef const char *np_ = n
        cdef const char *tp = token
        cdef size_t tl = len(token)
        if tl > 256:
            raise InvalidArgumentError("auth token longer than 256 bytes")
        self.regions = regions
        with nogil:
            self.t = mte_tcp_new(regions.t, hp, port, np_, instance, stall_ms, tp, tl, &err)
        if self.t == NULL:
            check_errno(err if err < 0 else -errno.EIO,
                        f"cannot listen for TCP data connections on {bind_host}:{port}")
        self._opened()
        self.port = mte_tcp_port(self.t)
        self.uds_name = mte_tcp_uds_name(self.t).decode()

    cdef int _release(self, bint owner, bint finalizing) except -1:
        cdef mte_tcp_t *t = self.t
        self.t = NULL
        if t != NULL and owner:           # a forked child must not tear down our threads
            with nogil:
                mte_tcp_free(t)
        return 0

    @property
    def auth_failures(self):
        """Data connections refused because the peer could not prove the token."""
        return mte_tcp_auth_failures(self.t) if self.t != NULL else 0

    def counters(self):
        """(connections open, connections accepted, auth refusals, notifications received,
        notifications dropped, connections refused or closed by the limits)."""
        cdef uint64_t out[6]
        if self.t == NULL:
            return (0, 0, 0, 0, 0, 0)
        mte_tcp_counters(self.t, out)
        return (out[0], out[1], out[2], out[3], out[4], out[5])

    def set_limits(self, int max_connections, int max_per_peer, int auth_timeout_ms,
                   int idle_timeout_ms):
        """The data port's connection limits (src/tcp/tcp.h, mte_tcp_set_limits)."""
        if self.t != NULL:
            mte_tcp_set_limits(self.t, max_connections, max_per_peer, auth_timeout_ms,
                               idle_timeout_ms)

    def push_notification(self, str sender, bytes msg):
        """0, or a status code (MTE_E_NOTIFY_FULL: the queue is full, the message was
        not queued)."""
        if self.t == NULL:
            return 0
        return mte_tcp_push_notification(self.t, sender.encode(), <const char *>msg, len(msg))

    def wait_notifications(self, double timeout):
        """Wait up to ``timeout`` seconds (GIL released) until a notification is queued;
        True if one is (at once when one already was), False if none came or the server
        is closed."""
        cdef mte_tcp_t *t = self.t
        cdef int ms = <int>(min(max(timeout, 0.0), 86400.0) * 1000.0 + 0.5)
        cdef int any
        if t == NULL:
            return False
        mte_tcp_wait_enter(t)          # with the GIL held: close() cannot free t before
        with nogil:
            any = mte_tcp_wait_notifications(t, ms)
        return bool(any)

    def take_notifications(self):
        """Drained list of (sender, message bytes)."""
        cdef mte_notif_t *head
        cdef mte_notif_t *n
        out = []
        if self.t == NULL:
            return out
        head = mte_tcp_take_notifications(self.t)
        n = head
        while n != NULL:
            out.append((n.sender.decode(errors="replace"), n.msg[:n.len]))
            n = n.next
        mte_notif_free(head)
        return out


cdef class Peer(Resource):
    """Client side of one remote engine: lanes (connections), their workers, a queue."""
    cdef mte_peer_t *p
    cdef readonly TcpServer server
    cdef readonly str host
    cdef readonly int port
    cdef readonly int lanes
    cdef readonly str uds
    cdef public object key       # the facade's identity of the peer incarnation

    def __cinit__(self, TcpServer server, str host, int port, uint64_t expect_instance,
                  int lanes, uint64_t slice_size, str uds="", str expect_name=""):
        cdef int err = 0
        cdef bytes h = host.encode(), u = uds.encode(), en = expect_name.encode()
        self.server = server
        self.host, self.port, self.lanes, self.uds = host, port, lanes, uds
        if server.t == NULL:
            server._raise_closed("the TCP server")
        self.p = mte_peer_new(server.t, h, port, u, expect_instance, lanes, slice_size, &err)
        if self.p == NULL:
            raise MemoryError(f"cannot start lanes to {host}:{port} (error {err})")
        mte_peer_expect_name(self.p, en)        # identity in the handshake (#20 item 7)
        self._opened()

    @property
    def seen_instance(self):
        return mte_peer_seen_instance(self.p) if self.p != NULL else 0

    @property
    def cma(self):
        """True once a lane moves bytes by cross-memory attach (same host)."""
        return self.p != NULL and mte_peer_cma(self.p) != 0

    @property
    def restarted(self):
        return self.p != NULL and mte_peer_broken(self.p) != 0

    def queued(self):
        """Slices queued to this peer and not yet taken by a lane."""
        return mte_peer_queued(self.p) if self.p != NULL else 0

    def transfer_sync(self, int op, uint64_t local, uint64_t remote, uint64_t length,
                      int64_t deadline_ns, uintptr_t cell=0):
        """One request, carried on this thread when a lane is idle, waited for here.
        Returns 0 or the request's error code; the fast path of eng.write/eng.read."""
        cdef mte_batch_t *b
        cdef int rc = 0, done = 0
        cdef int64_t step
        cdef uint8_t state
        cdef uint64_t nbytes
        cdef int32_t err
        if self.p == NULL:
            self._raise_closed(f"the TCP peer {self.host}:{self.port}")
        b = mte_batch_new(1, deadline_ns)
        if b == NULL:
            raise MemoryError()
        if cell:
            mte_batch_tag(b, 0, 1, <uint64_t *>cell)
        try:
            with nogil:
                rc = mte_tcp_submit(self.p, b, op, &local, &remote, &length, 0, 0, 1, 1)
                mte_batch_seal(b)
            if rc != 0:
                return rc
            while True:
                step = mte_now_ns() + 100000000          # look at signals every 100 ms
                if deadline_ns < step:
                    step = deadline_ns
                with nogil:
                    done = mte_batch_wait(b, step)
                if done:
                    break
                PyErr_CheckSignals()
                if mte_now_ns() >= deadline_ns:
                    mte_batch_expire(b)
                    break
            mte_batch_status(b, &state, &nbytes, &err)
            if state == MTE_ST_COMPLETED:
                return 0
            return err if err != 0 else (MTE_E_TIMEOUT if state == MTE_ST_TIMEOUT
                                         else MTE_E_FAILED)
        finally:
            # Our reference; the in-flight one goes when the batch's slices finish (an
            # expired batch frees itself then).
            mte_batch_unref(b)

    def submit(self, NativeBatch batch, int op, const uint64_t[::1] local,
               const uint64_t[::1] remote, const uint64_t[::1] lens, uint32_t first,
               bint run_inline=False):
        """Queue requests [first, first+len(local)) of ``batch``; 0 or a status code."""
        cdef uint32_t n = local.shape[0]
        cdef int stride = 1 if lens.shape[0] == n else 0
        cdef int rc = 0
        if self.p == NULL:
            self._raise_closed(f"the TCP peer {self.host}:{self.port}")
        if n == 0:
            return 0
        batch._keep.append(self)
        with nogil:
            rc = mte_tcp_submit(self.p, batch.b, op, &local[0], &remote[0], &lens[0], stride,
                                first, n, run_inline)
        return rc

    def post_prepared(self, PreparedTable table, int op, cnp.ndarray lids, cnp.ndarray rids,
                      int64_t deadline_ns, uintptr_t cell=0, bytes notify=None):
        """A prepared post in one call (src/core/prep.h, mte_tcp_post_prepared): a new
        sealed NativeBatch of rows x len(lids) requests, queued. ``lids``/``rids``:
        C-contiguous 1-D int64 (TypeError otherwise: the caller converts). An id outside
        the table is an InvalidArgumentError and queues nothing. ``cell``: the metrics
        cell the requests count in (0: none). ``notify``: delivered to the peer once every
        request succeeded (at most 1 MiB; the caller checks)."""
        cdef const mte_prep_t *t = table.t
        cdef Py_ssize_t n = cnp.PyArray_DIM(lids, 0) if cnp.PyArray_NDIM(lids) == 1 else -1
        cdef int64_t bad
        cdef int rc
        cdef NativeBatch batch
        if (cnp.PyArray_TYPE(lids) != cnp.NPY_INT64 or cnp.PyArray_TYPE(rids) != cnp.NPY_INT64
                or n < 0 or cnp.PyArray_NDIM(rids) != 1
                or not cnp.PyArray_IS_C_CONTIGUOUS(lids)
                or not cnp.PyArray_IS_C_CONTIGUOUS(rids)):
            raise TypeError("post_prepared takes C-contiguous 1-D int64 ids")
        if cnp.PyArray_DIM(rids, 0) != n:
            raise InvalidArgumentError(f"{n} local_ids but {cnp.PyArray_DIM(rids, 0)} "
                                       f"remote_ids")
        if n * <Py_ssize_t>t.rows > 0xffffffff:
            raise InvalidArgumentError(f"{n} ids x {t.rows} regions: more than 2**32 - 1 "
                                       f"requests in one post")
        cdef const int64_t *lp = <const int64_t *>cnp.PyArray_DATA(lids)
        cdef const int64_t *rp = <const int64_t *>cnp.PyArray_DATA(rids)
        bad = mte_prep_bad_id(lp, <uint32_t>n, t.lcols)
        if bad >= 0:
            raise InvalidArgumentError(f"local_ids holds an index outside [0, {t.lcols}): "
                                       f"local_ids[{bad}] = {lp[bad]}")
        bad = mte_prep_bad_id(rp, <uint32_t>n, t.rcols)
        if bad >= 0:
            raise InvalidArgumentError(f"remote_ids holds an index outside [0, {t.rcols}): "
                                       f"remote_ids[{bad}] = {rp[bad]}")
        if self.p == NULL:
            self._raise_closed(f"the TCP peer {self.host}:{self.port}")
        batch = NativeBatch(<uint32_t>(n * t.rows), deadline_ns)
        batch._keep.append(self)
        if cell and n:
            mte_batch_tag(batch.b, 0, <uint32_t>(n * t.rows), <uint64_t *>cell)
        rc = 0
        if notify is not None:
            rc = mte_tcp_add_notify(self.p, batch.b, <const char *>notify, len(notify))
        if rc == 0:
            with nogil:
                rc = mte_tcp_post_prepared(self.p, batch.b, op, t, lp, rp, <uint32_t>n)
        if rc != 0:
            mte_batch_abandon(batch.b, 0, <uint32_t>(n * t.rows))
            mte_batch_seal(batch.b)
            return rc
        mte_batch_seal(batch.b)
        return batch

    def add_notify(self, NativeBatch batch, bytes msg):
        """Deliver ``msg`` once every request of ``batch`` succeeded; 0 or a status code."""
        if self.p == NULL:
            self._raise_closed(f"the TCP peer {self.host}:{self.port}")
        batch._keep.append(self)
        return mte_tcp_add_notify(self.p, batch.b, <const char *>msg, len(msg))

    def shutdown(self):
        """Stop the lanes and fail what is queued; the peer is freed by close() or, once
        no batch names it any more, by the garbage collector (no ResourceWarning then)."""
        if self.p != NULL and self._owner():
            with nogil:
                mte_peer_shutdown(self.p)
        self._detached()

    cdef int _release(self, bint owner, bint finalizing) except -1:
        cdef mte_peer_t *p = self.p
        self.p = NULL
        if p != NULL and owner:
            with nogil:
                mte_peer_free(p)
        return 0

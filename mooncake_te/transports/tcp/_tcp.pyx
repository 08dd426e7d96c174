# SPDX-License-Identifier: Apache-2.0
# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin one-to-one layer over src/tcp/tcp.c: the server, peers and native batches.

Everything that moves bytes or waits runs with the GIL released; the facade in
``mooncake_te.transports.tcp`` and ``mooncake_te.engine`` carries the domain words.
"""
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t, uintptr_t
import os
import numpy as np

from mooncake_te.core._regions cimport Regions
from mooncake_te.transports.tcp.libtcp cimport *

WRITE = MTE_OP_WRITE
READ = MTE_OP_READ


def now_ns():
    return mte_now_ns()


def hmac_sha256(bytes key, bytes data):
    """The data path's HMAC-SHA256 (src/core/hmac_sha256.c), exposed for tests."""
    cdef const void *parts[1]
    cdef size_t lens[1]
    cdef unsigned char out[32]
    parts[0] = <const char *>data
    lens[0] = len(data)
    mte_hmac_sha256(<const char *>key, len(key), parts, lens, 1, out)
    return bytes(out[:32])


cdef class TcpServer:
    """Accepts data connections and applies peers' requests to registered memory."""
    cdef mte_tcp_t *t
    cdef readonly Regions regions
    cdef readonly int port
    cdef readonly str uds_name
    cdef int pid

    def __cinit__(self, Regions regions, str bind_host, int port, str name,
                  uint64_t instance, int stall_ms=30000, bytes token=b""):
        cdef int err = 0
        cdef bytes h = bind_host.encode(), n = name.encode()
        cdef const char *hp = h
        cdef const char *np_ = n
        cdef const char *tp = token
        cdef size_t tl = len(token)
        if tl > 256:
            raise ValueError("auth token longer than 256 bytes")
        self.regions = regions
        with nogil:
            self.t = mte_tcp_new(regions.t, hp, port, np_, instance, stall_ms, tp, tl, &err)
        if self.t == NULL:
            raise OSError(-err, f"cannot listen for TCP data connections on {bind_host}:{port}: "
                                f"{os.strerror(-err)}")
        self.port = mte_tcp_port(self.t)
        self.uds_name = mte_tcp_uds_name(self.t).decode()
        self.pid = os.getpid()

    def close(self):
        if self.t != NULL:
            if self.pid == os.getpid():      # fork-safe: a child must not tear down our threads
                with nogil:
                    mte_tcp_free(self.t)
            self.t = NULL

    def __dealloc__(self):
        if self.t != NULL and self.pid == os.getpid():
            with nogil:
                mte_tcp_free(self.t)
            self.t = NULL

    @property
    def auth_failures(self):
        """Data connections refused because the peer could not prove the token."""
        return mte_tcp_auth_failures(self.t) if self.t != NULL else 0

    def counters(self):
        """(connections open, connections accepted, auth refusals, notifications received,
        notifications dropped)."""
        cdef uint64_t out[5]
        if self.t == NULL:
            return (0, 0, 0, 0, 0)
        mte_tcp_counters(self.t, out)
        return (out[0], out[1], out[2], out[3], out[4])

    def push_notification(self, str sender, bytes msg):
        if self.t != NULL:
            mte_tcp_push_notification(self.t, sender.encode(), <const char *>msg, len(msg))

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


cdef class Peer:
    """Client side of one remote engine: lanes (connections), their workers, a queue."""
    cdef mte_peer_t *p
    cdef readonly TcpServer server
    cdef readonly str host
    cdef readonly int port
    cdef readonly int lanes
    cdef readonly str uds
    cdef int pid
    cdef public object key       # the facade's identity of the peer incarnation

    def __cinit__(self, TcpServer server, str host, int port, uint64_t expect_instance,
                  int lanes, uint64_t slice_size, str uds=""):
        cdef int err = 0
        cdef bytes h = host.encode(), u = uds.encode()
        self.server = server
        self.host, self.port, self.lanes, self.uds = host, port, lanes, uds
        self.p = mte_peer_new(server.t, h, port, u, expect_instance, lanes, slice_size, &err)
        if self.p == NULL:
            raise MemoryError(f"cannot start lanes to {host}:{port} (error {err})")
        self.pid = os.getpid()

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
            raise RuntimeError("peer is closed")
        b = mte_batch_new(1, deadline_ns)
        if b == NULL:
            raise MemoryError()
        if cell:
            mte_batch_tag(b, 0, 1, <uint64_t *>cell)
        try:
            with nogil:
                rc = mte_batch_submit(b, self.p, op, &local, &remote, &length, 0, 0, 1, 1)
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
            if state == 1:
                return 0
            return err if err != 0 else (-801 if state == 3 else -800)
        finally:
            # Our reference; the in-flight one goes when the batch's slices finish (an
            # expired batch frees itself then).
            mte_batch_unref(b)

    def shutdown(self):
        if self.p != NULL and self.pid == os.getpid():
            with nogil:
                mte_peer_shutdown(self.p)

    def close(self):
        if self.p != NULL:
            if self.pid == os.getpid():
                with nogil:
                    mte_peer_free(self.p)
            self.p = NULL

    def __dealloc__(self):
        if self.p != NULL and self.pid == os.getpid():
            with nogil:
                mte_peer_free(self.p)
            self.p = NULL


cdef class NativeBatch:
    """A batch of requests in flight; per-request state lives in C."""
    cdef mte_batch_t *b
    cdef readonly uint32_t size
    cdef list _keep          # peers named by this batch stay alive while it lives

    def __cinit__(self, uint32_t n, int64_t deadline_ns):
        self.b = mte_batch_new(n, deadline_ns)
        if self.b == NULL:
            raise MemoryError(f"cannot allocate a batch of {n} requests")
        self.size = n
        self._keep = []

    def __dealloc__(self):
        if self.b != NULL:
            mte_batch_unref(self.b)
            self.b = NULL

    def submit(self, Peer peer, int op, const uint64_t[::1] local, const uint64_t[::1] remote,
               const uint64_t[::1] lens, uint32_t first, bint run_inline=False):
        cdef uint32_t n = local.shape[0]
        cdef int stride = 1 if lens.shape[0] == n else 0
        cdef int rc = 0
        if peer.p == NULL:
            raise RuntimeError("peer is closed")
        if n == 0:
            return 0
        self._keep.append(peer)
        with nogil:
            rc = mte_batch_submit(self.b, peer.p, op, &local[0], &remote[0], &lens[0], stride,
                                  first, n, run_inline)
        return rc

    def tag(self, uint32_t first, uint32_t n, uintptr_t cell):
        """Requests [first, first+n) count in the metrics cell at address ``cell``
        (src/core/metrics.h) when they finish; call before submitting them."""
        if n:
            return mte_batch_tag(self.b, first, n, <uint64_t *>cell)
        return 0

    def add_notify(self, Peer peer, bytes msg):
        self._keep.append(peer)
        return mte_batch_add_notify(self.b, peer.p, <const char *>msg, len(msg))

    def abandon(self, uint32_t first, uint32_t n):
        """Requests [first, first+n) will never be submitted: count them canceled."""
        with nogil:
            mte_batch_abandon(self.b, first, n)

    def seal(self):
        with nogil:
            mte_batch_seal(self.b)

    def wait(self, int64_t deadline_ns):
        """True when finished, False once ``deadline_ns`` (monotonic) passed; Ctrl-C works."""
        cdef int64_t step
        cdef int done = 0
        while True:
            step = mte_now_ns() + 100000000      # wake every 100 ms to look at signals
            if deadline_ns < step:
                step = deadline_ns
            with nogil:
                done = mte_batch_wait(self.b, step)
            if done:
                return True
            PyErr_CheckSignals()
            if mte_now_ns() >= deadline_ns:
                return False

    def done(self):
        return mte_batch_done(self.b) != 0

    def cancel(self):
        mte_batch_cancel(self.b)

    def expire(self):
        mte_batch_expire(self.b)

    def status(self):
        """(states uint8[n], transferred uint64[n], errors int32[n])."""
        states = np.empty(self.size, dtype=np.uint8)
        nbytes = np.empty(self.size, dtype=np.uint64)
        errs = np.empty(self.size, dtype=np.int32)
        cdef uint8_t[::1] s = states
        cdef uint64_t[::1] t = nbytes
        cdef int32_t[::1] e = errs
        if self.size:
            mte_batch_status(self.b, &s[0], &t[0], &e[0])
        return states, nbytes, errs

    @property
    def notify_error(self):
        return mte_batch_notify_error(self.b)

    @property
    def address(self):
        """The ``mte_batch_t *`` for other transports' C code (see tcp.h: completing
        requests from other transports); valid while this object lives."""
        return <uintptr_t>self.b

    def keep(self, obj):
        """Keep ``obj`` (a connection, a staging buffer) alive as long as the batch."""
        self._keep.append(obj)

    def begin(self, uint32_t idx, uint32_t slices):
        """Request ``idx`` will finish after ``slices`` calls of :meth:`finish`."""
        mte_batch_begin(self.b, idx, slices)

    def finish(self, uint32_t idx, uint64_t nbytes, int err=0):
        """One slice of request ``idx`` is done (``err`` 0 or a negative status code)."""
        with nogil:
            mte_batch_slice_done(self.b, idx, nbytes, err)

    @property
    def stopped(self):
        """True once the batch was canceled or its deadline passed."""
        return mte_batch_stopped(self.b) != 0


def batch_ops_address():
    """Address of the ``mte_batch_ops_t`` table (tcp.h) for other extension modules."""
    return <uintptr_t>mte_batch_ops()

# SPDX-License-Identifier: Apache-2.0
# cython: language_level=3, boundscheck=False, wraparound=False
"""The native core (src/core/), one-to-one: the region table, the engine-wide batch,
the clock, and the function table other extension modules use (src/core/api.h).

Transport modules cimport :class:`Regions` and :class:`NativeBatch` from here (typed,
through ``_core.pxd``) and reach the core's C functions through the capsule ``_C_API``.
"""
from cpython.exc cimport PyErr_CheckSignals
from cpython.pycapsule cimport PyCapsule_New
from libc.stdlib cimport malloc
from libc.string cimport memcpy
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t, uintptr_t
from libc.errno cimport EEXIST, ENOENT, EACCES, EINVAL
import os
import warnings
import weakref

import numpy as np
cimport numpy as cnp

cnp.import_array()

from mooncake_te.errors import ClosedError, NativeOSError, error_class

from mooncake_te.core.libcore cimport *

cdef extern from "core/api.h":
    ctypedef struct mte_core_api_t:
        pass
    const mte_core_api_t mte_core_table

# The table the transports' C code calls the core through (api.h).
_C_API = PyCapsule_New(<void *>&mte_core_table, "mooncake_te.core._core._C_API", NULL)

# Request directions (src/core/batch.h) and per-request states (src/core/status.h).
OP_WRITE = MTE_OP_WRITE
OP_READ = MTE_OP_READ
# Access rights a peer has on a region (src/core/regions.h); 0 is local only.
ACC_READ = MTE_ACC_REMOTE_READ
ACC_WRITE = MTE_ACC_REMOTE_WRITE
ST_PENDING, ST_COMPLETED, ST_FAILED, ST_TIMEOUT, ST_CANCELED = (
    MTE_ST_PENDING, MTE_ST_COMPLETED, MTE_ST_FAILED, MTE_ST_TIMEOUT, MTE_ST_CANCELED)


cdef int check_errno(long rc, str what, object cls=None) except -1:
    """The one checker for native calls that return 0 (or a count) or -errno: raises
    ``cls`` (default NativeOSError, a MooncakeError and an OSError) naming the call."""
    if rc >= 0:
        return 0
    raise (NativeOSError if cls is None else cls)(<int>-rc, f"{what}: {os.strerror(-rc)}")


cdef int check_status(long rc, str what) except -1:
    """The one checker for native calls that return 0 or a status code of
    src/core/status.h: raises the class that owns the code (errors.error_class)."""
    if rc == 0:
        return 0
    raise error_class(rc)(f"{what} (status {rc})", status=rc)


def now_ns():
    """CLOCK_MONOTONIC in ns: the clock of every deadline (src/core/clock.h)."""
    return mte_now_ns()


def gather_blocks(cnp.ndarray table, cnp.ndarray ids):
    """``table[:, ids]`` flattened row by row (a new uint64 array of rows x len(ids)):
    the block addresses of a prepared post (prepared.py), one C loop instead of numpy's
    checks, fancy indexing and copies. ``table``: C-contiguous 2-D uint64; ``ids``:
    C-contiguous 1-D int64. An int instead when an id is outside [0, columns): the
    position of the first such id."""
    if (cnp.PyArray_TYPE(table) != cnp.NPY_UINT64 or cnp.PyArray_NDIM(table) != 2
            or not cnp.PyArray_IS_C_CONTIGUOUS(table)
            or cnp.PyArray_TYPE(ids) != cnp.NPY_INT64 or cnp.PyArray_NDIM(ids) != 1
            or not cnp.PyArray_IS_C_CONTIGUOUS(ids)):
        raise TypeError("gather_blocks takes a C-contiguous 2-D uint64 table and "
                        "C-contiguous 1-D int64 ids")
    cdef Py_ssize_t rows = cnp.PyArray_DIM(table, 0), cols = cnp.PyArray_DIM(table, 1)
    cdef Py_ssize_t n = cnp.PyArray_DIM(ids, 0)
    cdef const uint64_t *t = <const uint64_t *>cnp.PyArray_DATA(table)
    cdef const int64_t *d = <const int64_t *>cnp.PyArray_DATA(ids)
    cdef Py_ssize_t r, k
    cdef int64_t v
    for k in range(n):
        v = d[k]
        if v < 0 or v >= cols:
            return k
    cdef cnp.npy_intp dim = rows * n
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_UINT64, 0)
    cdef uint64_t *o = <uint64_t *>cnp.PyArray_DATA(out)
    for r in range(rows):
        for k in range(n):
            o[r * n + k] = t[r * cols + d[k]]
    return out


cdef class PreparedTable:
    """A prepared post's block tables, copied into C once (src/core/prep.h): ``local``
    [rows, lcols] and ``remote`` [rows, rcols] block addresses (C-contiguous uint64),
    ``lens`` one block size or one per row. A transport's ``post_prepared`` reads them
    with no Python per block. ``regions``: the engine's region table, to note whether a
    local block is in device memory (such posts take the general path's slice sizes).
    ``merge``: uint8 per row, or None: 1 where the row's blocks are back to back on both
    sides inside one region and one peer buffer, so that consecutive ids may move as one
    request (src/core/prep.h; the caller checked it)."""

    def __cinit__(self, cnp.ndarray local, cnp.ndarray remote, cnp.ndarray lens,
                  Regions regions=None, cnp.ndarray merge=None):
        for arr in (local, remote, lens):
            if (cnp.PyArray_TYPE(arr) != cnp.NPY_UINT64
                    or not cnp.PyArray_IS_C_CONTIGUOUS(arr)):
                raise TypeError("PreparedTable takes C-contiguous uint64 arrays")
        if (cnp.PyArray_NDIM(local) != 2 or cnp.PyArray_NDIM(remote) != 2
                or cnp.PyArray_DIM(local, 0) != cnp.PyArray_DIM(remote, 0)
                or cnp.PyArray_NDIM(lens) != 1):
            raise ValueError("PreparedTable takes [rows, blocks] tables with the same rows "
                             "and 1-D lengths")
        cdef Py_ssize_t rows = cnp.PyArray_DIM(local, 0)
        cdef Py_ssize_t nlens = cnp.PyArray_DIM(lens, 0)
        if (rows < 1 or rows > 0xffffffff or cnp.PyArray_DIM(local, 1) > 0xffffffff
                or cnp.PyArray_DIM(remote, 1) > 0xffffffff or (nlens != 1 and nlens != rows)):
            raise ValueError(f"PreparedTable: {rows} rows and {nlens} lengths")
        self.t = mte_prep_new(<uint32_t>rows, <uint32_t>cnp.PyArray_DIM(local, 1),
                              <uint32_t>cnp.PyArray_DIM(remote, 1),
                              <const uint64_t *>cnp.PyArray_DATA(local),
                              <const uint64_t *>cnp.PyArray_DATA(remote),
                              <const uint64_t *>cnp.PyArray_DATA(lens), <uint32_t>nlens)
        if self.t == NULL:
            raise MemoryError("cannot copy the prepared tables")
        cdef const uint64_t *la = <const uint64_t *>cnp.PyArray_DATA(local)
        cdef Py_ssize_t i, size = cnp.PyArray_SIZE(local)
        if regions is not None:
            for i in range(size):
                if mte_regions_device_at(regions.t, la[i]) >= 0:
                    self.t.any_device = 1
                    break
        if merge is not None:
            if (cnp.PyArray_TYPE(merge) != cnp.NPY_UINT8 or cnp.PyArray_NDIM(merge) != 1
                    or cnp.PyArray_DIM(merge, 0) != rows
                    or not cnp.PyArray_IS_C_CONTIGUOUS(merge)):
                raise ValueError("PreparedTable: merge is one uint8 per row")
            self.t.merge = <uint8_t *>malloc(rows)
            if self.t.merge == NULL:
                raise MemoryError()
            memcpy(self.t.merge, cnp.PyArray_DATA(merge), rows)

    @property
    def any_device(self):
        return bool(self.t.any_device)

    @property
    def merged_rows(self):
        """Rows whose consecutive blocks may move as one request."""
        if self.t.merge == NULL:
            return 0
        return sum(self.t.merge[i] != 0 for i in range(self.t.rows))

    @property
    def evenly_spaced(self):
        """(local, remote): whether every row of that side is base + block * stride, kept
        as two numbers per row (src/core/prep.h)."""
        return (self.t.lbase != NULL, self.t.rbase != NULL)

    def __dealloc__(self):
        mte_prep_free(self.t)
        self.t = NULL

    @property
    def shape(self):
        """(rows, local blocks per row, remote blocks per row)."""
        return (self.t.rows, self.t.lcols, self.t.rcols)


def cuda_driver():
    """``(handle, name, None)``: the CUDA driver library as the core loaded and
    initialised it (src/core/gpu.c, the process's one loader; ``handle`` is its dlopen
    handle, for ``ctypes.CDLL(name, handle=handle)``), or ``(0, name, why)``."""
    cdef void *h
    with nogil:
        h = mte_gpu_library()
    name = MTE_CUDA_LIBRARY.decode()
    if h == NULL:
        return 0, name, mte_gpu_error().decode(errors="replace")
    return <uintptr_t>h, name, None


def hmac_sha256(bytes key, bytes data):
    """The data path's HMAC-SHA256 (src/core/hmac_sha256.c), exposed for tests."""
    cdef const void *parts[1]
    cdef size_t lens[1]
    cdef unsigned char out[32]
    parts[0] = <const char *>data
    lens[0] = len(data)
    mte_hmac_sha256(<const char *>key, len(key), parts, lens, 1, out)
    return bytes(out[:32])



cdef class Regions:
    """Sorted, non-overlapping registered regions with pin counts.

    ``add``/``remove`` return 0 or a negative errno; ``remove`` waits until no I/O pins
    the region (in-flight I/O is bounded by the transports' deadlines).
    """

    def __cinit__(self):
        self.t = mte_regions_new()
        if self.t == NULL:
            raise MemoryError()

    def __dealloc__(self):
        # Only C fields here; engines close transports before dropping the table.
        if self.t != NULL:
            mte_regions_free(self.t)
            self.t = NULL

    def add(self, uint64_t addr, uint64_t length, unsigned access, int device=-1):
        """``device``: the CUDA ordinal of GPU memory (the data paths stage its bytes
        through pinned host memory), -1 for host memory."""
        cdef int rc
        with nogil:
            rc = mte_regions_add_dev(self.t, addr, length, access, device)
        return rc

    def remove(self, uint64_t addr):
        cdef int rc
        with nogil:
            rc = mte_regions_remove(self.t, addr)
        return rc

    def check(self, uint64_t addr, uint64_t length, unsigned need=0):
        """0 when [addr, addr+length) is inside one region granting ``need``; else
        -ENOENT, -EACCES or -EINVAL (zero length)."""
        cdef int why = 0
        if length == 0:
            return -EINVAL
        with nogil:
            mte_regions_check_many(self.t, &addr, &length, 0, 1, need, &why)
        return why

    def check_many(self, const uint64_t[::1] addrs, const uint64_t[::1] lens, unsigned need=0):
        """Index of the first (addr, len) not inside a region granting ``need``, and why
        (-ENOENT, -EACCES, -EINVAL for a zero length); (-1, 0) when all are inside."""
        cdef int why = 0
        cdef int stride = 1 if lens.shape[0] == addrs.shape[0] else 0
        cdef int64_t bad
        if addrs.shape[0] == 0:
            return -1, 0
        if lens.shape[0] == 0:
            raise ValueError("lengths must not be empty")
        with nogil:
            bad = mte_regions_check_many(self.t, &addrs[0], &lens[0], stride,
                                         addrs.shape[0], need, &why)
        return bad, why

    def pin(self, uint64_t addr, uint64_t length, unsigned need=0):
        """Pin the region holding [addr, +length) for an I/O that finishes later (its
        ``remove`` then waits for :meth:`unpin`): a handle, or 0 when no region holds it.
        For transports whose copies complete asynchronously (CUDA IPC)."""
        cdef int why = 0
        cdef mte_region_t *r
        with nogil:
            r = mte_regions_pin(self.t, addr, length, need, &why)
        return <uintptr_t>r

    def unpin(self, uintptr_t handle):
        if handle:
            mte_region_unpin(<mte_region_t *>handle)


cdef class NativeBatch:
    """A batch of requests in flight on any transports; per-request state lives in C
    (src/core/batch.h). Transports queue requests with their own objects (a TCP peer, an
    RDMA peer, a storage device), which cimport this class and reach ``b``."""

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

    def submit(self, peer, *args):
        """Queue requests to ``peer`` (a transport's peer object): ``peer.submit(self,
        *args)``; kept so callers written against the batch keep working."""
        return peer.submit(self, *args)

    def add_notify(self, peer, bytes msg):
        """Deliver ``msg`` to ``peer`` once every request succeeded: ``peer.add_notify``."""
        return peer.add_notify(self, msg)

    def tag(self, uint32_t first, uint32_t n, uintptr_t cell):
        """Requests [first, first+n) count in the metrics cell at address ``cell``
        (src/core/metrics.h) when they finish; call before submitting them."""
        if n:
            return mte_batch_tag(self.b, first, n, <uint64_t *>cell)
        return 0

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
    def elapsed_ns(self):
        """ns from creation until the last request (and notification) finished; -1
        while any is pending."""
        return mte_batch_elapsed_ns(self.b)

    def keep(self, obj):
        """Keep ``obj`` (a peer, a connection, a staging buffer) alive as long as the batch."""
        self._keep.append(obj)

    def begin(self, uint32_t idx, uint32_t slices):
        """Request ``idx`` will finish after ``slices`` calls of :meth:`finish`."""
        mte_batch_begin(self.b, idx, slices)

    def finish(self, uint32_t idx, uint64_t nbytes, int err=0):
        """One slice of request ``idx`` is done (``err`` 0 or a negative status code)."""
        with nogil:
            mte_batch_slice_done(self.b, idx, nbytes, err)

    def begin_many(self, const uint32_t[::1] idx, uint32_t slices):
        """:meth:`begin` for every index of ``idx`` (a uint32 array): one call for a
        group of thousands of requests (a KV load of 32 KiB pieces)."""
        cdef Py_ssize_t j
        with nogil:
            for j in range(idx.shape[0]):
                mte_batch_begin(self.b, idx[j], slices)

    def finish_many(self, const uint32_t[::1] idx, const uint64_t[::1] nbytes, int err=0):
        """:meth:`finish` of one slice for every index of ``idx``, ``nbytes[j]`` bytes
        each (``err`` for all of them)."""
        cdef Py_ssize_t j
        if nbytes.shape[0] != idx.shape[0]:
            raise ValueError(f"{idx.shape[0]} requests but {nbytes.shape[0]} byte counts")
        with nogil:
            for j in range(idx.shape[0]):
                mte_batch_slice_done(self.b, idx[j], nbytes[j], err)

    @property
    def stopped(self):
        """True once the batch was canceled or its deadline passed."""
        return mte_batch_stopped(self.b) != 0


# Resource states.
cdef enum:
    _NEW = 0          # the native handle is not acquired (yet)
    _OPEN = 1
    _DETACHED = 2     # shut down, to be freed when the last user lets go (no warning)
    _CLOSED = 3


cdef class Resource:
    """Base of every native object of the compiled tier (verbs objects, the TCP server
    and peers, storage devices): one lifetime discipline.

    - ``close()`` is idempotent and closes the object's children (objects that
      :meth:`_adopt` registered, e.g. a protection domain's memory regions) first, newest
      first, then releases the native handle (``_release``, the subclass's only job).
    - ``with obj:`` closes it on exit.
    - An object still open when it is garbage-collected is released then, with a
      ResourceWarning (as Python's files do).
    - Fork-safe: only the process that created the object releases the native handle; a
      forked child just forgets it (the parent's threads and kernel objects are not the
      child's to tear down).
    - A closed object raises :class:`mooncake_te.errors.ClosedError` when used
      (``_raise_closed``).
    """

    def __cinit__(self, *args, **kwargs):
        self._children = []
        self._pid = os.getpid()
        self._state = _NEW

    cdef _opened(self):
        """The subclass acquired its native handle: from now on it must be released."""
        self._state = _OPEN

    cdef _detached(self):
        """Shut down on purpose, freed later by the garbage collector: no warning then."""
        if self._state == _OPEN:
            self._state = _DETACHED

    cdef _adopt(self, child):
        self._children = [r for r in self._children if r() is not None]
        self._children.append(weakref.ref(child))

    cdef _close_children(self):
        kids, self._children = self._children, []
        for r in reversed(kids):
            c = r()
            if c is not None:
                c.close()

    cdef bint _owner(self):
        return self._pid == os.getpid()

    cdef int _release(self, bint owner, bint finalizing) except -1:
        """Release the native handle (only when ``owner``) and forget it (always).
        ``finalizing``: called from the garbage collector, where Python attributes may
        already be cleared: touch C fields only, and do not wait."""
        return 0

    cdef int _raise_closed(self, str what) except -1:
        raise ClosedError(f"{what} is closed")

    @property
    def closed(self):
        return self._state != _OPEN and self._state != _DETACHED

    def close(self):
        """Close the children, then release the native handle; idempotent."""
        if self._state != _OPEN and self._state != _DETACHED:
            return
        self._state = _CLOSED
        self._close_children()
        self._release(self._owner(), False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        if self._state != _OPEN and self._state != _DETACHED:
            return
        owner = self._owner()
        if self._state == _OPEN and owner:
            try:
                warnings.warn(f"unclosed {type(self).__name__}: call close() or use `with`",
                              ResourceWarning, stacklevel=2)
            except Exception:
                pass          # interpreter shutting down
        self._state = _CLOSED
        try:
            self._release(owner, True)
        except Exception:
            pass

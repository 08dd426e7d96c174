# SPDX-License-Identifier: Apache-2.0
# cython: language_level=3
"""One-to-one over src/nvmeof/nvmeof.h: an opened storage device and its I/O workers."""
import os
import warnings

from libc.errno cimport EIO
from libc.stdint cimport uint32_t, uint64_t, int64_t
from mooncake_te.core._core cimport Regions, NativeBatch, Resource, check_errno
from mooncake_te.core.capi cimport mte_core_import
from mooncake_te.core.libcore cimport MTE_E_STORAGE_BASE, MTE_E_OUT_OF_RANGE, MTE_E_CLOSED
from mooncake_te.transports.nvmeof.libnvmeof cimport *

mte_core_import()

STORAGE_BASE = MTE_E_STORAGE_BASE   # an errno e from the device is STORAGE_BASE - e
OUT_OF_RANGE = MTE_E_OUT_OF_RANGE


cdef class Device(Resource):
    """A block device or file opened for the data path (O_DIRECT where the file system
    allows), with ``threads`` workers; ``size`` bytes are addressable."""
    cdef mte_nvf_t *f
    cdef readonly str path
    cdef readonly Regions regions
    cdef int _wait_ms
    cdef bint _stuck
    cdef public object ident          # (st_dev, st_ino, st_rdev) of the path when opened

    def __cinit__(self, str path, Regions regions, uint64_t size=0, int threads=16,
                  uint64_t slice_size=1 << 20):
        cdef int err = 0
        cdef bytes p = os.fsencode(path)
        cdef const char *cp = p
        with nogil:
            self.f = mte_nvf_open(cp, size, threads, slice_size, regions.t, &err)
        if self.f == NULL:
            check_errno(err if err < 0 else -EIO, f"cannot open {path} for storage I/O")
        self._opened()
        self.path = path
        self.regions = regions

    @property
    def size(self):
        return mte_nvf_size(self.f) if self.f else 0

    @property
    def block(self):
        return mte_nvf_block(self.f) if self.f else 0

    @property
    def memalign(self):
        """Memory alignment direct I/O needs (learned: a device answering EINVAL to
        less-aligned memory raises it to the block size); 1 when buffered."""
        return mte_nvf_memalign(self.f) if self.f else 0

    @property
    def direct(self):
        return bool(mte_nvf_direct(self.f)) if self.f else False

    def submit(self, NativeBatch batch, int op, const uint64_t[::1] local, const uint64_t[::1] offs,
               const uint64_t[::1] lens, uint32_t first):
        """Queue requests [first, first+len(local)) of ``batch`` (a NativeBatch); 0 or a
        status code (nothing queued)."""
        if self.f == NULL:
            return MTE_E_CLOSED
        cdef mte_batch_t *b = batch.b
        cdef uint32_t n = local.shape[0]
        cdef int stride = 1 if lens.shape[0] > 1 else 0
        cdef int rc
        if n == 0:
            return 0
        with nogil:
            rc = mte_nvf_submit(self.f, b, op, &local[0], &offs[0], &lens[0], stride, first, n)
        return rc

    def transfer(self, int op, uint64_t local, uint64_t off, uint64_t length,
                 int64_t deadline_ns):
        """One request on this thread (GIL released): 0 or a status code."""
        if self.f == NULL:
            return MTE_E_CLOSED
        cdef int rc
        with nogil:
            rc = mte_nvf_transfer(self.f, op, local, off, length, deadline_ns)
        return rc

    def close(self, int wait_ms=2000):
        """Stop the workers; True if one was stuck in the kernel and left behind."""
        self._wait_ms = wait_ms
        self._stuck = False
        Resource.close(self)
        return bool(self._stuck)

    cdef int _release(self, bint owner, bint finalizing) except -1:
        cdef mte_nvf_t *f = self.f
        cdef int wait_ms = 0 if finalizing else self._wait_ms
        cdef int stuck = 0
        self.f = NULL
        if f != NULL and owner:
            with nogil:
                stuck = mte_nvf_close(f, wait_ms)
        self._stuck = stuck != 0
        return 0

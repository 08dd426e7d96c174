# SPDX-License-Identifier: Apache-2.0
# cython: language_level=3
"""The engine's table of registered regions (src/core/regions.c), one-to-one."""
from libc.stdint cimport uint64_t, int64_t, uintptr_t
from libc.errno cimport EEXIST, ENOENT, EACCES, EINVAL
from mooncake_te.core.libregions cimport *

READ = MTE_ACC_REMOTE_READ
WRITE = MTE_ACC_REMOTE_WRITE


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

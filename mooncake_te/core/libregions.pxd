# SPDX-License-Identifier: Apache-2.0
# Declarations of src/core/regions.h, nothing else.
from libc.stdint cimport uint64_t, int64_t

cdef extern from "core/regions.h" nogil:
    unsigned MTE_ACC_REMOTE_READ
    unsigned MTE_ACC_REMOTE_WRITE
    ctypedef struct mte_regions_t:
        pass
    ctypedef struct mte_region_t:
        pass
    mte_regions_t *mte_regions_new()
    void mte_regions_free(mte_regions_t *t)
    int mte_regions_add(mte_regions_t *t, uint64_t addr, uint64_t len, unsigned access)
    int mte_regions_add_dev(mte_regions_t *t, uint64_t addr, uint64_t len, unsigned access,
                            int device)
    int mte_regions_remove(mte_regions_t *t, uint64_t addr)
    mte_region_t *mte_regions_pin(mte_regions_t *t, uint64_t addr, uint64_t len, unsigned need,
                                  int *why)
    void mte_region_unpin(mte_region_t *r)
    int mte_region_device(const mte_region_t *r)
    int64_t mte_regions_check_many(mte_regions_t *t, const uint64_t *addrs, const uint64_t *lens,
                                   int len_stride, uint64_t n, unsigned need, int *why)

# SPDX-License-Identifier: Apache-2.0
# Declarations of the native core's headers (src/core/), nothing else. Transport modules
# cimport these too: their calls go through the core's function table (src/core/api.h).
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t

cdef extern from "core/status.h" nogil:
    int MTE_ST_PENDING, MTE_ST_COMPLETED, MTE_ST_FAILED, MTE_ST_TIMEOUT, MTE_ST_CANCELED
    int MTE_E_FAILED, MTE_E_TIMEOUT, MTE_E_CANCELED, MTE_E_CLOSED, MTE_E_CUDA
    int MTE_E_OUT_OF_RANGE, MTE_E_STORAGE_BASE

cdef extern from "core/clock.h" nogil:
    int64_t mte_now_ns()

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
    int mte_regions_device_at(mte_regions_t *t, uint64_t addr)
    int64_t mte_regions_check_many(mte_regions_t *t, const uint64_t *addrs, const uint64_t *lens,
                                   int len_stride, uint64_t n, unsigned need, int *why)

cdef extern from "core/batch.h" nogil:
    int MTE_OP_WRITE, MTE_OP_READ
    ctypedef struct mte_batch_t:
        pass
    mte_batch_t *mte_batch_new(uint32_t n, int64_t deadline_ns)
    void mte_batch_unref(mte_batch_t *b)
    uint32_t mte_batch_size(const mte_batch_t *b)
    void mte_batch_abandon(mte_batch_t *b, uint32_t first, uint32_t n)
    void mte_batch_seal(mte_batch_t *b)
    int mte_batch_tag(mte_batch_t *b, uint32_t first, uint32_t n, uint64_t *cell)
    int mte_batch_wait(mte_batch_t *b, int64_t deadline_ns)
    int mte_batch_done(mte_batch_t *b)
    void mte_batch_cancel(mte_batch_t *b)
    void mte_batch_expire(mte_batch_t *b)
    void mte_batch_status(mte_batch_t *b, uint8_t *states, uint64_t *bytes, int32_t *errs)
    int32_t mte_batch_notify_error(const mte_batch_t *b)
    int64_t mte_batch_elapsed_ns(const mte_batch_t *b)
    void mte_batch_begin(mte_batch_t *b, uint32_t idx, uint32_t slices)
    void mte_batch_slice_done(mte_batch_t *b, uint32_t idx, uint64_t len, int err)
    int mte_batch_stopped(const mte_batch_t *b)

cdef extern from "core/prep.h" nogil:
    ctypedef struct mte_prep_t:
        uint32_t rows, lcols, rcols
        int any_device
        uint64_t *lbase
        uint64_t *rbase
        uint8_t *merge
    mte_prep_t *mte_prep_new(uint32_t rows, uint32_t lcols, uint32_t rcols,
                             const uint64_t *local, const uint64_t *remote,
                             const uint64_t *lens, uint32_t nlens)
    void mte_prep_free(mte_prep_t *t)
    int64_t mte_prep_bad_id(const int64_t *ids, uint32_t n, uint32_t cols)

cdef extern from "core/hmac_sha256.h" nogil:
    void mte_hmac_sha256(const void *key, size_t key_len, const void *const parts[],
                         const size_t lens[], int nparts, uint8_t *out)

cdef extern from "core/gpu.h" nogil:
    ctypedef struct mte_stage_t:
        pass
    int mte_gpu_init()
    const char *mte_gpu_error()
    void *mte_gpu_library()
    const char *MTE_CUDA_LIBRARY

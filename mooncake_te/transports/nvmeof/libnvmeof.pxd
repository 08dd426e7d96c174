# SPDX-License-Identifier: Apache-2.0
# Declarations of src/nvmeof/nvmeof.h, nothing else.
from libc.stdint cimport uint32_t, uint64_t, int64_t
from mooncake_te.core.libcore cimport mte_regions_t, mte_batch_t

cdef extern from "nvmeof/nvmeof.h" nogil:
    ctypedef struct mte_nvf_t:
        pass
    mte_nvf_t *mte_nvf_open(const char *path, uint64_t size, int threads, uint64_t slice,
                            mte_regions_t *regions, int *err)
    uint64_t mte_nvf_size(const mte_nvf_t *f)
    uint32_t mte_nvf_block(const mte_nvf_t *f)
    int mte_nvf_direct(const mte_nvf_t *f)
    uint32_t mte_nvf_memalign(mte_nvf_t *f)
    int mte_nvf_submit(mte_nvf_t *f, mte_batch_t *b, int op, const uint64_t *local,
                       const uint64_t *offs, const uint64_t *lens, int len_stride,
                       uint32_t first, uint32_t n)
    int mte_nvf_transfer(mte_nvf_t *f, int op, uint64_t local, uint64_t off, uint64_t len,
                         int64_t deadline_ns)
    int mte_nvf_close(mte_nvf_t *f, int wait_ms)

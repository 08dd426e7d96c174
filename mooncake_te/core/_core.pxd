# SPDX-License-Identifier: Apache-2.0
# The core's classes, for transport modules to cimport (typed, no integer addresses).
from libc.stdint cimport uint32_t
from mooncake_te.core.libcore cimport mte_regions_t, mte_batch_t

cdef class Regions:
    cdef mte_regions_t *t
    cdef object __weakref__

cdef class NativeBatch:
    cdef mte_batch_t *b
    cdef readonly uint32_t size
    cdef list _keep

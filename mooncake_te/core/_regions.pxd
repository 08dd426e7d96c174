# SPDX-License-Identifier: Apache-2.0
from mooncake_te.core.libregions cimport mte_regions_t

cdef class Regions:
    cdef mte_regions_t *t
    cdef object __weakref__

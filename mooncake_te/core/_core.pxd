# SPDX-License-Identifier: Apache-2.0
# The core's classes, for transport modules to cimport (typed, no integer addresses).
from libc.stdint cimport uint32_t
from mooncake_te.core.libcore cimport mte_regions_t, mte_batch_t, mte_prep_t

cdef class Regions:
    cdef mte_regions_t *t
    cdef object __weakref__

cdef class NativeBatch:
    cdef mte_batch_t *b
    cdef readonly uint32_t size
    cdef list _keep

cdef class PreparedTable:
    cdef mte_prep_t *t

cdef class Resource:
    cdef object __weakref__
    cdef list _children
    cdef int _pid
    cdef int _state
    cdef public object parent
    cdef _opened(self)
    cdef _detached(self)
    cdef _adopt(self, child)
    cdef _close_children(self)
    cdef bint _owner(self)
    cdef int _release(self, bint owner, bint finalizing) except -1
    cdef int _raise_closed(self, str what) except -1

# The compiled tier's status checkers (raise the right mooncake_te.errors class).
cdef int check_errno(long rc, str what, object cls=*) except -1
cdef int check_status(long rc, str what) except -1

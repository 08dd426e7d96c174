# SPDX-License-Identifier: Apache-2.0
# The verbs classes of _verbs.pyx, for other modules to cimport (typed: no addresses).
from libc.stdint cimport uint64_t
from mooncake_te.core._core cimport Regions, Resource
from mooncake_te.transports.rdma.libibverbs cimport *
from mooncake_te.transports.rdma.librdma cimport mte_rdma_t, mte_rdma_peer_t

cdef class Context(Resource):
    cdef ibv_context *ctx
    cdef readonly str name
    cdef readonly dict attr
    cdef ibv_context *_get(self) except NULL

cdef class PD(Resource):
    cdef ibv_pd *pd
    cdef readonly Context context
    cdef ibv_pd *_get(self) except NULL

cdef class MR(Resource):
    cdef ibv_mr *mr
    cdef readonly PD pd
    cdef readonly uint64_t address
    cdef readonly uint64_t length
    cdef readonly int access

cdef class CompChannel(Resource):
    cdef ibv_comp_channel *ch
    cdef readonly Context context

cdef class CQ(Resource):
    cdef ibv_cq *cq
    cdef readonly Context context
    cdef readonly CompChannel channel
    cdef readonly int cqe
    cdef ibv_cq *_get(self) except NULL

cdef class QP(Resource):
    cdef ibv_qp *qp
    cdef readonly PD pd
    cdef readonly CQ cq
    cdef readonly int max_send_wr
    cdef readonly int port
    cdef ibv_qp *_get(self) except NULL
    cdef _modify(self, ibv_qp_attr *a, int mask, str what)

cdef class DataPath(Resource):
    cdef mte_rdma_t *r
    cdef readonly Regions regions
    cdef list _keep
    cdef readonly int ndev
    cdef mte_rdma_t *_get(self) except NULL

cdef class Peer(Resource):
    cdef mte_rdma_peer_t *p
    cdef readonly DataPath dp
    cdef readonly int npdev
    cdef dict _qps          # rail index -> list of QP (current)
    cdef list _old          # retired QPs, freed once idle
    cdef int _wait_ms       # how long close() waits for posted work
    cdef public object key
    cdef mte_rdma_peer_t *_get(self) except NULL

# SPDX-License-Identifier: Apache-2.0
# Declarations of src/rdma/rdma.h (the native data path), nothing else.
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from mooncake_te.core.libcore cimport mte_regions_t, mte_batch_t
from mooncake_te.transports.rdma.libibverbs cimport ibv_context, ibv_cq, ibv_comp_channel, ibv_qp

cdef extern from "rdma/rdma.h" nogil:
    int MTE_OP_WRITE, MTE_OP_READ
    int MTE_RDMA_MAX_DEV, MTE_RDMA_MAX_QP, MTE_RDMA_MAX_RAILS
    ctypedef struct mte_rdma_t:
        pass
    ctypedef struct mte_rdma_peer_t:
        pass
    ctypedef struct mte_rdma_params_t:
        uint64_t slice_size
        int retry_count
        int multi_nic
        int pause_ms
        int spin_us

    mte_rdma_t *mte_rdma_new(mte_regions_t *regions, const mte_rdma_params_t *params, int *err)
    int mte_rdma_add_device(mte_rdma_t *r, int idx, ibv_context *ctx, ibv_cq *cq,
                            ibv_comp_channel *channel, int cqe)
    int mte_rdma_start(mte_rdma_t *r)
    void mte_rdma_stop(mte_rdma_t *r, int wait_ms)
    void mte_rdma_free(mte_rdma_t *r)
    int mte_rdma_mr_add(mte_rdma_t *r, uint64_t addr, uint64_t len, const uint32_t *lkeys,
                        int ndev, uint64_t pref, uint64_t avail)
    int mte_rdma_mr_remove(mte_rdma_t *r, uint64_t addr)
    void mte_rdma_dev_stats(mte_rdma_t *r, int idx, uint64_t *out)
    int mte_rdma_dev_port_down(mte_rdma_t *r, int idx)
    void mte_rdma_dev_set_port_down(mte_rdma_t *r, int idx, int down)

    mte_rdma_peer_t *mte_rdma_peer_new(mte_rdma_t *r, int npdev)
    int mte_rdma_peer_set_buffers(mte_rdma_peer_t *p, size_t n, const uint64_t *addrs,
                                  const uint64_t *lens, const uint8_t *access,
                                  const uint32_t *rkeys, const uint64_t *pref,
                                  const uint64_t *avail)
    int mte_rdma_peer_add_rail(mte_rdma_peer_t *p, int ldev, int pdev, ibv_qp **qps, int nqp,
                               int max_wr)
    int mte_rdma_rail_reconnect(mte_rdma_peer_t *p, int rail, ibv_qp **qps, int nqp)
    int mte_rdma_rail_info(mte_rdma_peer_t *p, int rail, int *state, int64_t *paused_until,
                           int *first_err, int *ldev, int *pdev)
    int mte_rdma_qp_outstanding(mte_rdma_peer_t *p, ibv_qp *qp)
    int mte_rdma_qp_forget(mte_rdma_peer_t *p, ibv_qp *qp)
    int mte_rdma_peer_nrails(mte_rdma_peer_t *p)
    int mte_rdma_rail_debug(mte_rdma_peer_t *p, int rail, int *queued, int *outstanding,
                            int *dead, int max)
    void mte_rdma_peer_shutdown(mte_rdma_peer_t *p)
    void mte_rdma_peer_free(mte_rdma_peer_t *p, int wait_ms)
    int mte_rdma_peer_outstanding(mte_rdma_peer_t *p)
    int mte_rdma_submit(mte_rdma_peer_t *p, mte_batch_t *b, int op, const uint64_t *local,
                        const uint64_t *remote, const uint64_t *lens, int len_stride,
                        uint32_t first, uint32_t n)

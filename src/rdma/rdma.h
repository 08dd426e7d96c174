/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA transport's native data path.
 *
 * Files: device.c (the engine, its NICs), keys.c (local lkeys, the peers' buffers and
 * rkeys), peer.c, rail.c (queue pairs between a local and a peer NIC), post.c (slicing,
 * rail choice, posting), poll.c (completion threads, retries); internal.h holds what
 * they share.
 *
 * One `mte_rdma_t` per engine holds the local NICs (each with its completion queue,
 * completion channel and one polling thread), the table of local memory keys (lkey per
 * NIC of every registered region) and the peers. A peer has the remote buffers it
 * published (address, length, access, rkey per peer NIC, preferred peer NICs) and its
 * rails: one rail per (local NIC, peer NIC) endpoint, each with several RC queue pairs
 * that Python created, connected and hands over (the verbs objects stay owned by the
 * Cython classes of mooncake_te/transports/rdma/_verbs.pyx).
 *
 * A request is cut into slices of `slice_size` bytes (a short tail is merged into the
 * slice before it); with multi-NIC on, its slices go round-robin over every rail that
 * both the local region's and the remote buffer's preferred NICs allow. A slice that
 * completes with a transport error (retry exceeded, flushed, ...) is posted again on
 * another rail, up to `retry_count` times; a rail whose queue pair failed is dead until
 * Python reconnects it, and one that keeps failing is paused for `pause_ms`. Requests
 * finish through the engine-wide batch of the core (src/core/batch.h). Nothing here
 * takes the GIL. */
#ifndef MTE_RDMA_H
#define MTE_RDMA_H

#include <stddef.h>
#include <stdint.h>

#include <infiniband/verbs.h>

#include "../core/api.h"

#define MTE_RDMA_MAX_DEV 32       /* local or peer NICs */
#define MTE_RDMA_MAX_QP 16        /* queue pairs per rail */
#define MTE_RDMA_MAX_RAILS 64

/* Error codes of the RDMA path: MTE_E_RDMA_* of src/core/status.h. A work-completion
 * error is reported as MTE_E_RDMA_WC_BASE - status (ibv_wc_status, 1..21): -1101 local
 * length error, ..., -1110 remote access error, -1112 transport retry counter exceeded,
 * -1105 flushed. */

typedef struct mte_rdma mte_rdma_t;
typedef struct mte_rdma_peer mte_rdma_peer_t;
typedef struct mte_rdma_rail mte_rdma_rail_t;

typedef struct mte_rdma_params {
    uint64_t slice_size;     /* bytes per slice (MC_SLICE_SIZE) */
    int retry_count;         /* re-posts of a failed slice on other rails */
    int multi_nic;           /* spread one request's slices over every preferred rail */
    int pause_ms;            /* how long a rail that failed twice in a row rests */
    int spin_us;             /* busy-poll this long before sleeping on the channel */
} mte_rdma_params_t;

mte_rdma_t *mte_rdma_new(mte_regions_t *regions, const mte_rdma_params_t *params, int *err);
/* Device `idx` (0..MAX_DEV-1): its context, CQ (created on `channel`) and CQ depth. */
int mte_rdma_add_device(mte_rdma_t *r, int idx, struct ibv_context *ctx, struct ibv_cq *cq,
                        struct ibv_comp_channel *channel, int cqe);
/* Starts one polling thread per device. */
int mte_rdma_start(mte_rdma_t *r);
/* Fails what is queued, flushes every queue pair (moves it to ERR), waits up to
 * wait_ms for posted work to complete, stops the threads. Idempotent. After this the
 * verbs objects may be destroyed. */
void mte_rdma_stop(mte_rdma_t *r, int wait_ms);
void mte_rdma_free(mte_rdma_t *r);

/* Local memory keys. lkeys[ndev] (0 where the region is not registered with a NIC);
 * pref/avail: bit masks of local NICs preferred / available for the region's location. */
int mte_rdma_mr_add(mte_rdma_t *r, uint64_t addr, uint64_t len, const uint32_t *lkeys,
                    int ndev, uint64_t pref, uint64_t avail);
int mte_rdma_mr_remove(mte_rdma_t *r, uint64_t addr);

/* Counters of device `idx`: [slices posted, bytes posted, completions, errors, retries]. */
void mte_rdma_dev_stats(mte_rdma_t *r, int idx, uint64_t out[5]);
int mte_rdma_dev_port_down(mte_rdma_t *r, int idx);
void mte_rdma_dev_set_port_down(mte_rdma_t *r, int idx, int down);

/* --- peers ------------------------------------------------------------------------- */
mte_rdma_peer_t *mte_rdma_peer_new(mte_rdma_t *r, int npdev);
/* Replaces the peer's buffer table: n buffers, rkeys[n * npdev] (row per buffer),
 * access bits (MTE_ACC_REMOTE_*), pref/avail peer-NIC masks per buffer. */
int mte_rdma_peer_set_buffers(mte_rdma_peer_t *p, size_t n, const uint64_t *addrs,
                              const uint64_t *lens, const uint8_t *access,
                              const uint32_t *rkeys, const uint64_t *pref,
                              const uint64_t *avail);
/* A rail from local NIC ldev to peer NIC pdev over nqp connected queue pairs; returns
 * its index (0..MAX_RAILS-1) or a negative errno. */
int mte_rdma_peer_add_rail(mte_rdma_peer_t *p, int ldev, int pdev, struct ibv_qp **qps,
                           int nqp, int max_wr);
/* Swaps in freshly connected queue pairs for a dead rail. The old ones stay known to
 * the data path until their posted work completed (mte_rdma_qp_outstanding). */
int mte_rdma_rail_reconnect(mte_rdma_peer_t *p, int rail, struct ibv_qp **qps, int nqp);
/* state: 0 alive, 1 dead (needs reconnecting); paused_until in CLOCK_MONOTONIC ns;
 * first_err: the first error code the rail saw since it was last connected. */
int mte_rdma_rail_info(mte_rdma_peer_t *p, int rail, int *state, int64_t *paused_until,
                       int *first_err, int *ldev, int *pdev);
/* Work posted on `qp` and not completed yet (-1: the data path does not know it). */
int mte_rdma_qp_outstanding(mte_rdma_peer_t *p, struct ibv_qp *qp);
/* Forget a queue pair that has no outstanding work (after reconnecting). 0 or -EBUSY. */
int mte_rdma_qp_forget(mte_rdma_peer_t *p, struct ibv_qp *qp);
int mte_rdma_peer_nrails(mte_rdma_peer_t *p);
/* Diagnostics: slices queued on the rail; outstanding work and dead flag (2: retired)
 * of each of its queue pairs, up to max; returns how many were written. */
int mte_rdma_rail_debug(mte_rdma_peer_t *p, int rail, int *queued, int *outstanding,
                        int *dead, int max);
/* Fails queued slices, flushes the peer's queue pairs; the peer stays valid (slices in
 * flight hold it) until mte_rdma_peer_free. */
void mte_rdma_peer_shutdown(mte_rdma_peer_t *p);
/* Waits up to wait_ms for posted work, then drops the owner's reference. */
void mte_rdma_peer_free(mte_rdma_peer_t *p, int wait_ms);
int mte_rdma_peer_outstanding(mte_rdma_peer_t *p);

/* Queues requests [first, first+n) of batch b (op MTE_OP_WRITE / MTE_OP_READ). Requests
 * that cannot start (unregistered memory, no rail) are finished with their error right
 * away; returns 0, or a status code of core/status.h when nothing was queued
 * (MTE_E_INVALID: bad op; MTE_E_CLOSED: shut down). len_stride 0: every
 * request has length lens[0]. */
int mte_rdma_submit(mte_rdma_peer_t *p, mte_batch_t *b, int op, const uint64_t *local,
                    const uint64_t *remote, const uint64_t *lens, int len_stride,
                    uint32_t first, uint32_t n);

#endif

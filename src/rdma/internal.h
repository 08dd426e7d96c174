/* SPDX-License-Identifier: Apache-2.0 */
/* What the RDMA data path's files share (rdma.h is the public side): the types of the
 * engine, NICs, key tables, peers, rails, requests and slices, and the functions one file
 * calls in another. Files: device.c, keys.c, peer.c, rail.c, post.c, poll.c. */
#ifndef MTE_RDMA_INTERNAL_H
#define MTE_RDMA_INTERNAL_H

#include "rdma.h"

#include <pthread.h>
#include <stdatomic.h>

#define MTE_RDMA_HIDDEN __attribute__((visibility("hidden")))

#define POLL_BATCH 32
#define POST_CHAIN 32

/* ------------------------------------------------------------------------------------ */
/* Types                                                                                  */

typedef struct lmr {               /* one local region's keys */
    uint64_t addr, len;
    uint64_t pref, avail;          /* local NIC masks */
    uint32_t lkey[MTE_RDMA_MAX_DEV];
} lmr_t;

typedef struct rbuf {              /* one buffer the peer published */
    uint64_t addr, len;
    uint64_t pref, avail;          /* peer NIC masks */
    uint8_t access;
    uint32_t *rkey;                /* npdev entries, inside the table's key block */
} rbuf_t;

typedef struct rtable {            /* the peer's buffers, replaced as a whole */
    size_t n;
    rbuf_t *bufs;                  /* sorted by addr */
    uint32_t *keys;
} rtable_t;

typedef struct req {
    mte_batch_t *b;
    uint32_t idx;
    atomic_uint left;              /* slices not finished */
    mte_region_t *pin;
    const lmr_t *lmr;
    uint64_t pref, avail;          /* rail masks */
    int op;
    uint32_t rkey[];               /* per peer NIC */
} req_t;

typedef struct cqp {               /* a queue pair as the data path sees it */
    struct cqp *next_old;
    struct ibv_qp *qp;
    mte_rdma_rail_t *rail;
    int outstanding;               /* under rail->mu */
    int dead;
} cqp_t;

typedef struct slice {
    struct slice *next;
    req_t *req;
    cqp_t *cqp;
    mte_rdma_rail_t *rail;
    uint64_t laddr, raddr;
    uint32_t len;
    int tries;
    int first_err;
} slice_t;

typedef struct dev {
    mte_rdma_t *r;
    int idx;
    struct ibv_context *ctx;
    struct ibv_cq *cq;
    struct ibv_comp_channel *ch;
    int cqe;
    atomic_int outstanding;        /* posted, not polled: never more than cqe */
    atomic_int port_down;
    pthread_t thread;
    int started;
    _Atomic uint64_t posted, bytes, completions, errors, retries;
} dev_t_;

struct mte_rdma_rail {
    mte_rdma_peer_t *peer;
    int index, ldev, pdev;
    int max_wr;
    pthread_mutex_t mu;
    cqp_t *qps[MTE_RDMA_MAX_QP];
    int nqp;
    cqp_t *old;                    /* retired queue pairs with work still posted */
    slice_t *qhead, *qtail;
    atomic_int dead;
    _Atomic int64_t paused_until;
    int fails_in_row;
    atomic_int first_err;
    unsigned next_qp;
};

struct mte_rdma_peer {
    mte_rdma_t *r;
    int npdev;
    pthread_rwlock_t lk;           /* bufs */
    rtable_t *table;
    pthread_mutex_t mu;            /* rails array */
    mte_rdma_rail_t *rails[MTE_RDMA_MAX_RAILS];
    atomic_int nrails;
    atomic_int refs;               /* owner + requests in flight */
    atomic_int outstanding;        /* slices not finished */
    atomic_int shutdown;
    atomic_uint rr;
    struct mte_rdma_peer *next;    /* in r->peers */
};

struct mte_rdma {
    mte_regions_t *regions;
    mte_rdma_params_t prm;
    dev_t_ devs[MTE_RDMA_MAX_DEV];
    int ndev;
    pthread_rwlock_t lk;           /* local key table */
    lmr_t **mrs;                   /* sorted by addr */
    size_t nmrs, capmrs;
    pthread_mutex_t peers_mu;
    mte_rdma_peer_t *peers;
    atomic_int stop;
    int wakefd;
    int stopped;
};

/* keys.c */
MTE_RDMA_HIDDEN const lmr_t *rdma_lmr_find(mte_rdma_t *r, uint64_t addr, uint64_t len);
MTE_RDMA_HIDDEN const rbuf_t *rdma_rbuf_find(const rtable_t *t, uint64_t addr, uint64_t len);
MTE_RDMA_HIDDEN void rdma_rtable_free(rtable_t *t);

/* peer.c (needs nothing from post.c: the files form no cycle) */
MTE_RDMA_HIDDEN void rdma_peer_unref(mte_rdma_peer_t *p);
MTE_RDMA_HIDDEN void rdma_finish_slice(mte_rdma_peer_t *p, slice_t *s, int err);

/* post.c */
MTE_RDMA_HIDDEN void rdma_dispatch(mte_rdma_peer_t *p, slice_t *s, mte_rdma_rail_t *exclude);
MTE_RDMA_HIDDEN void rdma_pump(mte_rdma_rail_t *rl);
MTE_RDMA_HIDDEN slice_t *rdma_qp_failed_locked(mte_rdma_rail_t *rl, cqp_t *c, int err);
MTE_RDMA_HIDDEN void rdma_redispatch_list(mte_rdma_peer_t *p, slice_t *s, mte_rdma_rail_t *from);

#endif

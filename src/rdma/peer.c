/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA data path: peers: creation, shutdown and the references slices in flight hold (rdma.h). */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

mte_rdma_peer_t *mte_rdma_peer_new(mte_rdma_t *r, int npdev)
{
    if (npdev <= 0 || npdev > MTE_RDMA_MAX_DEV)
        return NULL;
    mte_rdma_peer_t *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    p->r = r;
    p->npdev = npdev;
    pthread_rwlock_init(&p->lk, NULL);
    pthread_mutex_init(&p->mu, NULL);
    atomic_init(&p->refs, 1);
    pthread_mutex_lock(&r->peers_mu);
    p->next = r->peers;
    r->peers = p;
    pthread_mutex_unlock(&r->peers_mu);
    return p;
}


int mte_rdma_peer_nrails(mte_rdma_peer_t *p) { return atomic_load(&p->nrails); }

int mte_rdma_peer_outstanding(mte_rdma_peer_t *p) { return atomic_load(&p->outstanding); }

void mte_rdma_peer_shutdown(mte_rdma_peer_t *p)
{
    if (atomic_exchange(&p->shutdown, 1))
        return;
    int n = atomic_load(&p->nrails);
    for (int i = 0; i < n; i++) {
        mte_rdma_rail_t *rl = p->rails[i];
        pthread_mutex_lock(&rl->mu);
        slice_t *q = rl->qhead;
        rl->qhead = rl->qtail = NULL;
        for (int k = 0; k < rl->nqp; k++) {
            if (!rl->qps[k]->dead) {
                rl->qps[k]->dead = 1;
                struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
                ibv_modify_qp(rl->qps[k]->qp, &a, IBV_QP_STATE);
            }
        }
        atomic_store(&rl->dead, 1);
        pthread_mutex_unlock(&rl->mu);
        while (q) {
            slice_t *nx = q->next;
            rdma_finish_slice(p, q, MTE_E_CLOSED);
            q = nx;
        }
    }
}

static void peer_destroy(mte_rdma_peer_t *p)
{
    mte_rdma_t *r = p->r;
    pthread_mutex_lock(&r->peers_mu);
    for (mte_rdma_peer_t **pp = &r->peers; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    pthread_mutex_unlock(&r->peers_mu);
    int n = atomic_load(&p->nrails);
    for (int i = 0; i < n; i++) {
        mte_rdma_rail_t *rl = p->rails[i];
        for (int k = 0; k < rl->nqp; k++)
            free(rl->qps[k]);
        for (cqp_t *o = rl->old, *nx; o; o = nx) {
            nx = o->next_old;
            free(o);
        }
        pthread_mutex_destroy(&rl->mu);
        free(rl);
    }
    rdma_rtable_free(p->table);
    pthread_rwlock_destroy(&p->lk);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

/* One slice is over (done or failed): its request and batch learn it, and it gives back
 * its hold on the peer. Here, not in post.c, so that the peer's lifecycle (which
 * fails queued slices at shutdown) needs nothing from the posting code. */
void rdma_finish_slice(mte_rdma_peer_t *p, slice_t *s, int err)
{
    req_t *q = s->req;
    uint32_t len = s->len;
    free(s);
    int last = atomic_fetch_sub(&q->left, 1) == 1;
    if (last && q->pin) {
        mte_region_unpin(q->pin);       /* before the batch can finish */
        q->pin = NULL;
    }
    mte_batch_slice_done(q->b, q->idx, err ? 0 : len, err);
    if (last)
        free(q);
    atomic_fetch_sub(&p->outstanding, 1);
    rdma_peer_unref(p);
}

void rdma_peer_unref(mte_rdma_peer_t *p)
{
    if (atomic_fetch_sub(&p->refs, 1) == 1)
        peer_destroy(p);
}

void mte_rdma_peer_free(mte_rdma_peer_t *p, int wait_ms)
{
    if (!p)
        return;
    mte_rdma_peer_shutdown(p);
    int64_t until = mte_now_ns() + (int64_t)wait_ms * 1000000LL;
    while (atomic_load(&p->outstanding) > 0 && mte_now_ns() < until)
        usleep(1000);
    rdma_peer_unref(p);
}


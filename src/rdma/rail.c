/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA data path: rails: the queue pairs between one local and one peer NIC, reconnection, diagnostics (rdma.h). */
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

static cqp_t **make_cqps(mte_rdma_rail_t *rl, struct ibv_qp **qps, int nqp)
{
    cqp_t **out = calloc((size_t)nqp, sizeof(*out));
    if (!out)
        return NULL;
    for (int i = 0; i < nqp; i++) {
        out[i] = calloc(1, sizeof(cqp_t));
        if (!out[i]) {
            for (int j = 0; j < i; j++)
                free(out[j]);
            free(out);
            return NULL;
        }
        out[i]->qp = qps[i];
        out[i]->rail = rl;
    }
    return out;
}

int mte_rdma_peer_add_rail(mte_rdma_peer_t *p, int ldev, int pdev, struct ibv_qp **qps,
                           int nqp, int max_wr)
{
    if (nqp <= 0 || nqp > MTE_RDMA_MAX_QP || ldev < 0 || ldev >= p->r->ndev ||
        !p->r->devs[ldev].ctx || pdev < 0 || pdev >= p->npdev || max_wr <= 0)
        return -EINVAL;
    mte_rdma_rail_t *rl = calloc(1, sizeof(*rl));
    if (!rl)
        return -ENOMEM;
    rl->peer = p;
    rl->ldev = ldev;
    rl->pdev = pdev;
    rl->max_wr = max_wr;
    pthread_mutex_init(&rl->mu, NULL);
    cqp_t **c = make_cqps(rl, qps, nqp);
    if (!c) {
        free(rl);
        return -ENOMEM;
    }
    memcpy(rl->qps, c, (size_t)nqp * sizeof(*c));
    free(c);
    rl->nqp = nqp;
    pthread_mutex_lock(&p->mu);
    int n = atomic_load(&p->nrails);
    if (n >= MTE_RDMA_MAX_RAILS) {
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < nqp; i++)
            free(rl->qps[i]);
        free(rl);
        return -ENOSPC;
    }
    rl->index = n;
    p->rails[n] = rl;
    atomic_store(&p->nrails, n + 1);
    pthread_mutex_unlock(&p->mu);
    return n;
}

int mte_rdma_rail_reconnect(mte_rdma_peer_t *p, int rail, struct ibv_qp **qps, int nqp)
{
    if (rail < 0 || rail >= atomic_load(&p->nrails) || nqp <= 0 || nqp > MTE_RDMA_MAX_QP)
        return -EINVAL;
    mte_rdma_rail_t *rl = p->rails[rail];
    cqp_t **c = make_cqps(rl, qps, nqp);
    if (!c)
        return -ENOMEM;
    pthread_mutex_lock(&rl->mu);
    for (int i = 0; i < rl->nqp; i++) {
        cqp_t *o = rl->qps[i];
        if (!o->dead) {
            o->dead = 1;
            struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
            ibv_modify_qp(o->qp, &a, IBV_QP_STATE);
        }
        o->next_old = rl->old;
        rl->old = o;
    }
    memcpy(rl->qps, c, (size_t)nqp * sizeof(*c));
    rl->nqp = nqp;
    atomic_store(&rl->first_err, 0);
    atomic_store(&rl->paused_until, 0);
    atomic_store(&rl->dead, 0);
    pthread_mutex_unlock(&rl->mu);
    free(c);
    return 0;
}

int mte_rdma_rail_info(mte_rdma_peer_t *p, int rail, int *state, int64_t *paused_until,
                       int *first_err, int *ldev, int *pdev)
{
    if (rail < 0 || rail >= atomic_load(&p->nrails))
        return -EINVAL;
    mte_rdma_rail_t *rl = p->rails[rail];
    *state = atomic_load(&rl->dead);
    *paused_until = atomic_load(&rl->paused_until);
    *first_err = atomic_load(&rl->first_err);
    *ldev = rl->ldev;
    *pdev = rl->pdev;
    return 0;
}

int mte_rdma_qp_outstanding(mte_rdma_peer_t *p, struct ibv_qp *qp)
{
    int n = atomic_load(&p->nrails), out = -1;
    for (int i = 0; i < n && out < 0; i++) {
        mte_rdma_rail_t *rl = p->rails[i];
        pthread_mutex_lock(&rl->mu);
        for (int k = 0; k < rl->nqp; k++)
            if (rl->qps[k]->qp == qp)
                out = rl->qps[k]->outstanding;
        for (cqp_t *o = rl->old; o && out < 0; o = o->next_old)
            if (o->qp == qp)
                out = o->outstanding;
        pthread_mutex_unlock(&rl->mu);
    }
    return out;
}

int mte_rdma_qp_forget(mte_rdma_peer_t *p, struct ibv_qp *qp)
{
    int n = atomic_load(&p->nrails);
    for (int i = 0; i < n; i++) {
        mte_rdma_rail_t *rl = p->rails[i];
        pthread_mutex_lock(&rl->mu);
        for (cqp_t **pp = &rl->old; *pp; pp = &(*pp)->next_old) {
            if ((*pp)->qp == qp) {
                cqp_t *o = *pp;
                if (o->outstanding) {
                    pthread_mutex_unlock(&rl->mu);
                    return -EBUSY;
                }
                *pp = o->next_old;
                pthread_mutex_unlock(&rl->mu);
                free(o);
                return 0;
            }
        }
        pthread_mutex_unlock(&rl->mu);
    }
    return -ENOENT;
}



int mte_rdma_rail_debug(mte_rdma_peer_t *p, int rail, int *queued, int *outstanding,
                        int *dead, int max)
{
    if (rail < 0 || rail >= atomic_load(&p->nrails))
        return -EINVAL;
    mte_rdma_rail_t *rl = p->rails[rail];
    pthread_mutex_lock(&rl->mu);
    int q = 0;
    for (slice_t *s = rl->qhead; s; s = s->next)
        q++;
    *queued = q;
    int n = 0;
    for (int i = 0; i < rl->nqp && n < max; i++, n++) {
        outstanding[n] = rl->qps[i]->outstanding;
        dead[n] = rl->qps[i]->dead;
    }
    for (cqp_t *o = rl->old; o && n < max; o = o->next_old, n++) {
        outstanding[n] = o->outstanding;
        dead[n] = 2;
    }
    pthread_mutex_unlock(&rl->mu);
    return n;
}

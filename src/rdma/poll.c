/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA data path: completion polling: one thread per NIC reading its completion queue and async events, retries of failed slices (rdma.h). */
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

static int retriable(int status)
{
    switch (status) {
    case IBV_WC_WR_FLUSH_ERR:
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_GENERAL_ERR:
    case IBV_WC_BAD_RESP_ERR:
    case IBV_WC_LOC_QP_OP_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
    case IBV_WC_FATAL_ERR:
        return 1;
    default:           /* access, protection, length errors: the request itself is wrong */
        return 0;
    }
}

static void on_completion(dev_t_ *d, const struct ibv_wc *wc)
{
    slice_t *s = (slice_t *)(uintptr_t)wc->wr_id;
    cqp_t *c = s->cqp;
    mte_rdma_rail_t *rl = c->rail;
    mte_rdma_peer_t *p = rl->peer;
    mte_rdma_t *r = p->r;
    atomic_fetch_add(&p->refs, 1);       /* the rail stays valid until we are done */
    atomic_fetch_sub(&d->outstanding, 1);
    atomic_fetch_add(&d->completions, 1);
    if (wc->status == IBV_WC_SUCCESS) {
        pthread_mutex_lock(&rl->mu);
        c->outstanding--;
        if (!c->dead)
            rl->fails_in_row = 0;
        pthread_mutex_unlock(&rl->mu);
        rdma_finish_slice(p, s, 0);
        rdma_pump(rl);
        rdma_peer_unref(p);
        return;
    }
    int err = MTE_E_RDMA_WC_BASE - (int)wc->status;
    atomic_fetch_add(&d->errors, 1);
    pthread_mutex_lock(&rl->mu);
    c->outstanding--;
    slice_t *orphans = rdma_qp_failed_locked(rl, c, err);
    pthread_mutex_unlock(&rl->mu);
    if (wc->status == IBV_WC_WR_FLUSH_ERR) {
        /* Collateral of another failure on this queue pair: report that one. */
        int first = atomic_load(&rl->first_err);
        if (!s->first_err && first)
            s->first_err = first;
    } else {
        s->tries++;
        if (!s->first_err)
            s->first_err = err;
    }
    if (!s->first_err)
        s->first_err = err;
    if (retriable((int)wc->status) && s->tries <= r->prm.retry_count &&
        !atomic_load(&p->shutdown)) {
        atomic_fetch_add(&d->retries, 1);
        rdma_dispatch(p, s, rl);
    } else {
        rdma_finish_slice(p, s, s->first_err);
    }
    if (orphans)
        rdma_redispatch_list(p, orphans, rl);
    rdma_pump(rl);
    rdma_peer_unref(p);
}

/* The port of device d went down: every rail leaving from it is dead (its queue
 * pairs flushed, its queued slices sent elsewhere). */
static void port_down(dev_t_ *d)
{
    mte_rdma_t *r = d->r;
    mte_rdma_peer_t *list[256];
    int np = 0;
    pthread_mutex_lock(&r->peers_mu);
    for (mte_rdma_peer_t *p = r->peers; p && np < 256; p = p->next) {
        atomic_fetch_add(&p->refs, 1);
        list[np++] = p;
    }
    pthread_mutex_unlock(&r->peers_mu);
    for (int i = 0; i < np; i++) {
        mte_rdma_peer_t *p = list[i];
        int n = atomic_load(&p->nrails);
        for (int k = 0; k < n; k++) {
            mte_rdma_rail_t *rl = p->rails[k];
            if (rl->ldev != d->idx)
                continue;
            pthread_mutex_lock(&rl->mu);
            slice_t *orphans = rdma_qp_failed_locked(rl, NULL, MTE_E_RDMA_PORT_DOWN);
            pthread_mutex_unlock(&rl->mu);
            if (orphans)
                rdma_redispatch_list(p, orphans, rl);
        }
        rdma_peer_unref(p);
    }
}

static void on_async(dev_t_ *d)
{
    struct ibv_async_event ev;
    while (ibv_get_async_event(d->ctx, &ev) == 0) {
        enum ibv_event_type t = ev.event_type;
        ibv_ack_async_event(&ev);
        if (t == IBV_EVENT_PORT_ERR || t == IBV_EVENT_DEVICE_FATAL) {
            atomic_store(&d->port_down, 1);
            port_down(d);
        } else if (t == IBV_EVENT_PORT_ACTIVE) {
            atomic_store(&d->port_down, 0);
        }
    }
}

static void *poller(void *arg)
{
    dev_t_ *d = arg;
    mte_rdma_t *r = d->r;
    struct ibv_wc wc[POLL_BATCH];
    int64_t idle_since = 0;
    int armed = 0;
    while (1) {
        int n = ibv_poll_cq(d->cq, POLL_BATCH, wc);
        if (n > 0) {
            /* Completions of one poll share one clock read in the metrics (metrics.h). */
            mte_metrics_group(1);
            for (int i = 0; i < n; i++)
                on_completion(d, &wc[i]);
            mte_metrics_group(0);
            idle_since = 0;
            continue;
        }
        if (atomic_load(&r->stop) && atomic_load(&d->outstanding) <= 0)
            break;
        int64_t now = mte_now_ns();
        if (!idle_since)
            idle_since = now;
        if (now - idle_since < (int64_t)r->prm.spin_us * 1000) {
            sched_yield();
            continue;
        }
        if (!armed) {
            ibv_req_notify_cq(d->cq, 0);
            armed = 1;
            continue;                   /* poll once more: a completion may have raced */
        }
        struct pollfd pf[3] = {{.fd = d->ch->fd, .events = POLLIN},
                               {.fd = d->ctx->async_fd, .events = POLLIN},
                               {.fd = r->wakefd, .events = POLLIN}};
        int rc = poll(pf, 3, 100);
        if (rc > 0 && (pf[0].revents & POLLIN)) {
            struct ibv_cq *cq;
            void *ctx;
            if (ibv_get_cq_event(d->ch, &cq, &ctx) == 0) {
                ibv_ack_cq_events(cq, 1);
                armed = 0;
            }
        }
        if (rc > 0 && (pf[1].revents & POLLIN))
            on_async(d);
        idle_since = 0;
        if (rc == 0)
            idle_since = mte_now_ns() - (int64_t)r->prm.spin_us * 1000;   /* stay asleep */
    }
    return NULL;
}

int mte_rdma_start(mte_rdma_t *r)
{
    for (int i = 0; i < r->ndev; i++) {
        dev_t_ *d = &r->devs[i];
        if (!d->ctx || d->started)
            continue;
        int rc = pthread_create(&d->thread, NULL, poller, d);
        if (rc)
            return -rc;
        d->started = 1;
    }
    return 0;
}


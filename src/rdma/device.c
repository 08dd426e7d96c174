/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA data path: the engine and its local NICs: creation, devices, counters, stop and free (rdma.h). */
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

mte_rdma_t *mte_rdma_new(mte_regions_t *regions, const mte_rdma_params_t *params, int *err)
{
    if (!params || params->slice_size == 0) {
        if (err) *err = -EINVAL;
        return NULL;
    }
    mte_rdma_t *r = calloc(1, sizeof(*r));
    if (!r) {
        if (err) *err = -ENOMEM;
        return NULL;
    }
    r->regions = regions;
    r->prm = *params;
    pthread_rwlock_init(&r->lk, NULL);
    pthread_mutex_init(&r->peers_mu, NULL);
    r->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->wakefd < 0) {
        if (err) *err = -errno;
        free(r);
        return NULL;
    }
    return r;
}

int mte_rdma_add_device(mte_rdma_t *r, int idx, struct ibv_context *ctx, struct ibv_cq *cq,
                        struct ibv_comp_channel *channel, int cqe)
{
    if (idx < 0 || idx >= MTE_RDMA_MAX_DEV || !ctx || !cq || !channel || r->devs[idx].ctx)
        return -EINVAL;
    dev_t_ *d = &r->devs[idx];
    d->r = r;
    d->idx = idx;
    d->ctx = ctx;
    d->cq = cq;
    d->ch = channel;
    d->cqe = cqe > 0 ? cqe : 1;
    int fl = fcntl(channel->fd, F_GETFL);
    fcntl(channel->fd, F_SETFL, fl | O_NONBLOCK);
    fl = fcntl(ctx->async_fd, F_GETFL);
    fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
    if (idx >= r->ndev)
        r->ndev = idx + 1;
    return 0;
}

void mte_rdma_dev_stats(mte_rdma_t *r, int idx, uint64_t out[5])
{
    memset(out, 0, 5 * sizeof(uint64_t));
    if (idx < 0 || idx >= MTE_RDMA_MAX_DEV)
        return;
    dev_t_ *d = &r->devs[idx];
    out[0] = atomic_load(&d->posted);
    out[1] = atomic_load(&d->bytes);
    out[2] = atomic_load(&d->completions);
    out[3] = atomic_load(&d->errors);
    out[4] = atomic_load(&d->retries);
}

int mte_rdma_dev_port_down(mte_rdma_t *r, int idx)
{
    return idx >= 0 && idx < MTE_RDMA_MAX_DEV && atomic_load(&r->devs[idx].port_down);
}

void mte_rdma_dev_set_port_down(mte_rdma_t *r, int idx, int down)
{
    if (idx >= 0 && idx < MTE_RDMA_MAX_DEV)
        atomic_store(&r->devs[idx].port_down, down);
}



void mte_rdma_stop(mte_rdma_t *r, int wait_ms)
{
    if (!r || r->stopped)
        return;
    r->stopped = 1;
    pthread_mutex_lock(&r->peers_mu);
    mte_rdma_peer_t *list[1024];
    int np = 0;
    for (mte_rdma_peer_t *p = r->peers; p && np < 1024; p = p->next) {
        atomic_fetch_add(&p->refs, 1);
        list[np++] = p;
    }
    pthread_mutex_unlock(&r->peers_mu);
    for (int i = 0; i < np; i++)
        mte_rdma_peer_shutdown(list[i]);
    int64_t until = mte_now_ns() + (int64_t)wait_ms * 1000000LL;
    for (int i = 0; i < np; i++) {
        while (atomic_load(&list[i]->outstanding) > 0 && mte_now_ns() < until)
            usleep(1000);
    }
    atomic_store(&r->stop, 1);
    uint64_t one = 1;
    if (write(r->wakefd, &one, sizeof(one)) < 0) {
        /* nothing to do: the pollers wake every 100 ms anyway */
    }
    for (int i = 0; i < r->ndev; i++) {
        dev_t_ *d = &r->devs[i];
        if (d->started) {
            /* Completions that never came (a device gone) must not hold us forever. */
            atomic_store(&d->outstanding, 0);
            pthread_join(d->thread, NULL);
            d->started = 0;
        }
    }
    for (int i = 0; i < np; i++)
        rdma_peer_unref(list[i]);
}

void mte_rdma_free(mte_rdma_t *r)
{
    if (!r)
        return;
    mte_rdma_stop(r, 0);
    for (size_t i = 0; i < r->nmrs; i++)
        free(r->mrs[i]);
    free(r->mrs);
    close(r->wakefd);
    pthread_rwlock_destroy(&r->lk);
    pthread_mutex_destroy(&r->peers_mu);
    free(r);
}


/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA data path: submission and posting: requests cut into slices, rails chosen, work requests posted, slices finished or re-dispatched (rdma.h). */
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

static int stop_code(mte_batch_t *b)
{
    /* Canceled or expired: report which, as the batch would. */
    int e = mte_batch_stop_code(b, mte_now_ns());
    return e ? e : MTE_E_CANCELED;
}

static int rail_usable(mte_rdma_rail_t *rl, int64_t now)
{
    mte_rdma_t *r = rl->peer->r;
    return !atomic_load(&rl->dead) && atomic_load(&rl->paused_until) <= now &&
           !atomic_load(&r->devs[rl->ldev].port_down);
}

/* A rail for slice s: among its request's preferred rails first, then the available
 * ones; round-robin; not `exclude` unless it is the only one. NULL: none usable. */
static mte_rdma_rail_t *choose(mte_rdma_peer_t *p, const req_t *q, mte_rdma_rail_t *exclude,
                               unsigned start)
{
    int64_t now = mte_now_ns();
    int n = atomic_load(&p->nrails);
    mte_rdma_rail_t *fallback = NULL;
    for (int pass = 0; pass < 2; pass++) {
        uint64_t mask = pass == 0 ? q->pref : q->avail;
        for (int k = 0; k < n; k++) {
            int i = (int)((start + (unsigned)k) % (unsigned)n);
            if (!(mask >> i & 1))
                continue;
            mte_rdma_rail_t *rl = p->rails[i];
            if (!rl || !rail_usable(rl, now))
                continue;
            if (rl == exclude) {
                fallback = rl;
                continue;
            }
            return rl;
        }
    }
    return fallback;
}

static void enqueue(mte_rdma_rail_t *rl, slice_t *s)
{
    s->next = NULL;
    s->rail = rl;
    pthread_mutex_lock(&rl->mu);
    if (rl->qtail)
        rl->qtail->next = s;
    else
        rl->qhead = s;
    rl->qtail = s;
    pthread_mutex_unlock(&rl->mu);
}

/* The rail's queue pair `c` failed (NULL: the rail's port went down): the whole rail
 * is dead. Its queue pairs share one path, and one that has not failed yet may hold work
 * that will never complete (rxe stops a queue pair's requester when its netdev goes down),
 * so every one goes to ERR, which flushes what it holds. Returns the slices still queued
 * on the rail, for redispatch. Under rl->mu. */
slice_t *rdma_qp_failed_locked(mte_rdma_rail_t *rl, cqp_t *c, int err)
{
    (void)c;
    int zero = 0;
    if (err && err != MTE_E_RDMA_WC_BASE - IBV_WC_WR_FLUSH_ERR)
        atomic_compare_exchange_strong(&rl->first_err, &zero, err);
    for (int i = 0; i < rl->nqp; i++) {
        cqp_t *x = rl->qps[i];
        if (!x->dead) {
            x->dead = 1;
            struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
            ibv_modify_qp(x->qp, &a, IBV_QP_STATE);     /* flush what is still posted */
        }
    }
    if (atomic_load(&rl->dead))
        return NULL;
    atomic_store(&rl->dead, 1);
    rl->fails_in_row++;
    int pause = rl->fails_in_row >= 2 ? rl->peer->r->prm.pause_ms : 0;
    atomic_store(&rl->paused_until, mte_now_ns() + (int64_t)pause * 1000000LL);
    slice_t *q = rl->qhead;
    rl->qhead = rl->qtail = NULL;
    return q;
}

void rdma_redispatch_list(mte_rdma_peer_t *p, slice_t *s, mte_rdma_rail_t *from)
{
    while (s) {
        slice_t *nx = s->next;
        rdma_dispatch(p, s, from);
        s = nx;
    }
}

/* Posts queued slices while the rail's queue pairs and the device's CQ have room. */
void rdma_pump(mte_rdma_rail_t *rl)
{
    mte_rdma_peer_t *p = rl->peer;
    mte_rdma_t *r = p->r;
    dev_t_ *d = &r->devs[rl->ldev];
    slice_t *stopped = NULL, *orphans = NULL;
    pthread_mutex_lock(&rl->mu);
    while (rl->qhead && !atomic_load(&rl->dead)) {
        cqp_t *c = NULL;
        int room = 0;
        for (int k = 0; k < rl->nqp; k++) {
            cqp_t *x = rl->qps[(rl->next_qp + (unsigned)k) % (unsigned)rl->nqp];
            if (!x->dead && rl->max_wr - x->outstanding > room) {
                c = x;
                room = rl->max_wr - x->outstanding;
            }
        }
        int cq_room = d->cqe - atomic_load(&d->outstanding);
        if (room > cq_room)
            room = cq_room;
        if (!c || room <= 0)
            break;
        rl->next_qp++;
        if (room > POST_CHAIN)
            room = POST_CHAIN;
        struct ibv_send_wr wrs[POST_CHAIN];
        struct ibv_sge sges[POST_CHAIN];
        slice_t *taken[POST_CHAIN];
        int n = 0;
        while (n < room && rl->qhead) {
            slice_t *s = rl->qhead;
            rl->qhead = s->next;
            if (!rl->qhead)
                rl->qtail = NULL;
            req_t *q = s->req;
            if (mte_batch_stopped(q->b) || atomic_load(&p->shutdown)) {
                s->next = stopped;
                stopped = s;
                continue;
            }
            s->cqp = c;
            sges[n] = (struct ibv_sge){.addr = s->laddr, .length = s->len,
                                       .lkey = q->lmr->lkey[rl->ldev]};
            wrs[n] = (struct ibv_send_wr){
                .wr_id = (uintptr_t)s, .sg_list = &sges[n], .num_sge = 1,
                .opcode = q->op == MTE_OP_READ ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE,
                .send_flags = IBV_SEND_SIGNALED};
            wrs[n].wr.rdma.remote_addr = s->raddr;
            wrs[n].wr.rdma.rkey = q->rkey[rl->pdev];
            if (n > 0)
                wrs[n - 1].next = &wrs[n];
            taken[n++] = s;
        }
        if (n == 0)
            continue;
        struct ibv_send_wr *bad = NULL;
        int rc = ibv_post_send(c->qp, wrs, &bad);
        int posted = n;
        if (rc) {
            posted = (int)(bad - wrs);
            if (posted < 0 || posted > n)
                posted = 0;
        }
        c->outstanding += posted;
        atomic_fetch_add(&d->outstanding, posted);
        atomic_fetch_add(&d->posted, (uint64_t)posted);
        for (int i = 0; i < posted; i++)
            atomic_fetch_add(&d->bytes, taken[i]->len);
        if (rc) {
            /* The queue pair refused work (it is in the error state): it is dead; the
             * slices it did not take go elsewhere. */
            for (int i = n - 1; i >= posted; i--) {
                taken[i]->next = orphans;
                if (!taken[i]->first_err)
                    taken[i]->first_err = MTE_E_RDMA_POST;
                orphans = taken[i];
            }
            slice_t *rest = rdma_qp_failed_locked(rl, c, MTE_E_RDMA_POST);
            while (rest) {
                slice_t *nx = rest->next;
                rest->next = orphans;
                orphans = rest;
                rest = nx;
            }
        }
    }
    pthread_mutex_unlock(&rl->mu);
    while (stopped) {
        slice_t *nx = stopped->next;
        int code = atomic_load(&p->shutdown) ? MTE_E_CLOSED
                                             : stop_code(stopped->req->b);
        rdma_finish_slice(p, stopped, code);
        stopped = nx;
    }
    if (orphans)
        rdma_redispatch_list(p, orphans, rl);
}

/* Put slice s on a rail (not `exclude` if another will do) and post it, or finish it
 * with its first error when no rail can take it. */
void rdma_dispatch(mte_rdma_peer_t *p, slice_t *s, mte_rdma_rail_t *exclude)
{
    if (atomic_load(&p->shutdown)) {
        rdma_finish_slice(p, s, MTE_E_CLOSED);
        return;
    }
    if (mte_batch_stopped(s->req->b)) {
        rdma_finish_slice(p, s, stop_code(s->req->b));
        return;
    }
    mte_rdma_rail_t *rl = choose(p, s->req, exclude, atomic_fetch_add(&p->rr, 1));
    if (!rl) {
        int err = s->first_err;
        if (!err && exclude)
            err = atomic_load(&exclude->first_err);
        rdma_finish_slice(p, s, err ? err : MTE_E_RDMA_NO_RAIL);
        return;
    }
    enqueue(rl, s);
    rdma_pump(rl);
}



static void fail_request(mte_batch_t *b, uint32_t idx, int err)
{
    mte_batch_begin(b, idx, 1);
    mte_batch_slice_done(b, idx, 0, err);
}

/* One request's checks and keys: pins its local region, finds the local and remote keys
 * and the rails that may carry it. NULL with *err when it cannot start. Called with
 * p->lk read-held (the peer's buffer table). */
static req_t *request_new(mte_rdma_peer_t *p, mte_batch_t *b, int op, uint32_t idx,
                          uint64_t laddr, uint64_t raddr, uint64_t len, int nrails, int *err)
{
    mte_rdma_t *r = p->r;
    int why = 0;
    mte_region_t *pin = mte_regions_pin(r->regions, laddr, len, 0, &why);
    if (!pin) {
        *err = MTE_E_LOCAL_NOT_REG;
        return NULL;
    }
    pthread_rwlock_rdlock(&r->lk);
    const lmr_t *m = rdma_lmr_find(r, laddr, len);
    pthread_rwlock_unlock(&r->lk);
    const rbuf_t *rb = rdma_rbuf_find(p->table, raddr, len);
    *err = 0;
    if (!m)
        *err = MTE_E_RDMA_LOCAL_KEY;
    else if (!rb)
        *err = MTE_E_REMOTE_NOT_REG;
    else if (!(rb->access & (op == MTE_OP_WRITE ? MTE_ACC_REMOTE_WRITE : MTE_ACC_REMOTE_READ)))
        *err = MTE_E_REMOTE_ACCESS;
    req_t *q = NULL;
    if (!*err) {
        q = calloc(1, sizeof(*q) + (size_t)p->npdev * sizeof(uint32_t));
        if (!q)
            *err = MTE_E_NOMEM;
    }
    if (*err) {
        mte_region_unpin(pin);
        return NULL;
    }
    q->b = b;
    q->idx = idx;
    q->pin = pin;
    q->lmr = m;
    q->op = op;
    memcpy(q->rkey, rb->rkey, (size_t)p->npdev * sizeof(uint32_t));
    for (int k = 0; k < nrails; k++) {
        mte_rdma_rail_t *rl = p->rails[k];
        uint64_t lb = 1ull << rl->ldev, pb = 1ull << rl->pdev;
        if (!m->lkey[rl->ldev] || !rb->rkey[rl->pdev])
            continue;
        if ((m->pref & lb) && (rb->pref & pb))
            q->pref |= 1ull << k;
        if (((m->pref | m->avail) & lb) && ((rb->pref | rb->avail) & pb))
            q->avail |= 1ull << k;
    }
    return q;
}

/* A slice could not even be allocated: finish its share of the request anyway. */
static void slice_lost(mte_rdma_peer_t *p, req_t *q, uint64_t len)
{
    slice_t *t = malloc(sizeof(*t));
    if (t) {
        *t = (slice_t){.req = q, .len = (uint32_t)len};
        rdma_finish_slice(p, t, MTE_E_NOMEM);
        return;
    }
    /* Cannot even allocate the failure: account for it by hand. */
    mte_batch_t *b = q->b;
    uint32_t idx = q->idx;
    int last = atomic_fetch_sub(&q->left, 1) == 1;
    if (last && q->pin) {
        mte_region_unpin(q->pin);
        q->pin = NULL;
    }
    mte_batch_slice_done(b, idx, 0, MTE_E_NOMEM);
    if (last)
        free(q);
    atomic_fetch_sub(&p->outstanding, 1);
    atomic_fetch_sub(&p->refs, 1);
}

/* Per-rail lists of slices, handed over to each rail once per submission, so a big
 * batch takes each rail's lock once rather than once per slice. */
typedef struct {
    slice_t *head[MTE_RDMA_MAX_RAILS], *tail[MTE_RDMA_MAX_RAILS];
} gather_t;

/* Cuts request q into slices (a short tail merges into the slice before it) and gathers
 * them per rail; slices no rail can take finish with the rails' first error. */
static void request_slice(mte_rdma_peer_t *p, req_t *q, uint64_t laddr, uint64_t raddr,
                          uint64_t len, unsigned rr, int nrails, gather_t *g)
{
    mte_rdma_t *r = p->r;
    const uint64_t ssz = r->prm.slice_size;
    const uint64_t tail_merge = ssz / 4;          /* MC_FRAGMENT_RATIO 4 */
    uint32_t nsl = (uint32_t)((len + ssz - 1) / ssz);
    if (nsl > 1 && len - (uint64_t)(nsl - 1) * ssz <= tail_merge)
        nsl--;
    atomic_init(&q->left, nsl);
    mte_batch_begin(q->b, q->idx, nsl);
    mte_rdma_rail_t *one = r->prm.multi_nic ? NULL : choose(p, q, NULL, rr);
    uint64_t off = 0;
    for (uint32_t k = 0; k < nsl; k++) {
        uint64_t sl = k + 1 == nsl ? len - off : ssz;
        slice_t *s = calloc(1, sizeof(*s));
        mte_rdma_rail_t *rl = s ? (one ? one : choose(p, q, NULL, rr + k)) : NULL;
        atomic_fetch_add(&p->refs, 1);
        atomic_fetch_add(&p->outstanding, 1);
        if (!s) {
            slice_lost(p, q, sl);
            off += sl;
            continue;
        }
        s->req = q;
        s->laddr = laddr + off;
        s->raddr = raddr + off;
        s->len = (uint32_t)sl;
        off += sl;
        if (!rl) {
            int e = MTE_E_RDMA_NO_RAIL;
            for (int j = 0; j < nrails; j++)
                if ((q->avail >> j & 1) && atomic_load(&p->rails[j]->first_err)) {
                    e = atomic_load(&p->rails[j]->first_err);
                    break;
                }
            rdma_finish_slice(p, s, e);
            continue;
        }
        s->rail = rl;
        int ri = rl->index;
        if (g->tail[ri])
            g->tail[ri]->next = s;
        else
            g->head[ri] = s;
        g->tail[ri] = s;
    }
}

/* Appends each rail's gathered slices to its queue and posts what fits. */
static void hand_over(mte_rdma_peer_t *p, gather_t *g, int nrails)
{
    for (int k = 0; k < nrails; k++) {
        if (!g->head[k])
            continue;
        mte_rdma_rail_t *rl = p->rails[k];
        pthread_mutex_lock(&rl->mu);
        if (rl->qtail)
            rl->qtail->next = g->head[k];
        else
            rl->qhead = g->head[k];
        rl->qtail = g->tail[k];
        int dead = atomic_load(&rl->dead);
        slice_t *orphans = NULL;
        if (dead) {           /* died while we were slicing: take them back */
            orphans = rl->qhead;
            rl->qhead = rl->qtail = NULL;
        }
        pthread_mutex_unlock(&rl->mu);
        if (orphans)
            rdma_redispatch_list(p, orphans, rl);
        else
            rdma_pump(rl);
    }
}

int mte_rdma_submit(mte_rdma_peer_t *p, mte_batch_t *b, int op, const uint64_t *local,
                    const uint64_t *remote, const uint64_t *lens, int len_stride,
                    uint32_t first, uint32_t n)
{
    mte_rdma_t *r = p->r;
    if (op != MTE_OP_WRITE && op != MTE_OP_READ)
        return MTE_E_INVALID;
    if (atomic_load(&p->shutdown) || atomic_load(&r->stop))
        return MTE_E_CLOSED;
    int nrails = atomic_load(&p->nrails);
    gather_t g = {{0}};
    unsigned rr = atomic_fetch_add(&p->rr, n);
    pthread_rwlock_rdlock(&p->lk);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t idx = first + i;
        uint64_t len = lens[len_stride ? i : 0];
        if (mte_batch_stopped(b)) {
            fail_request(b, idx, stop_code(b));
            continue;
        }
        int err = 0;
        req_t *q = request_new(p, b, op, idx, local[i], remote[i], len, nrails, &err);
        if (!q) {
            fail_request(b, idx, err);
            continue;
        }
        request_slice(p, q, local[i], remote[i], len, rr + i, nrails, &g);
    }
    pthread_rwlock_unlock(&p->lk);
    hand_over(p, &g, nrails);
    return 0;
}

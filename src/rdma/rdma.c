/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA data path: slicing, rails, posting, completion polling, retries (rdma.h). */
#define _GNU_SOURCE
#include "rdma.h"

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

static void peer_unref(mte_rdma_peer_t *p);
static void pump(mte_rdma_rail_t *rl);
static void dispatch(mte_rdma_peer_t *p, slice_t *s, mte_rdma_rail_t *exclude);

/* ------------------------------------------------------------------------------------ */
/* Engine, devices                                                                        */

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

/* ------------------------------------------------------------------------------------ */
/* Local keys                                                                             */

static const lmr_t *lmr_find(mte_rdma_t *r, uint64_t addr, uint64_t len)
{
    /* caller holds r->lk */
    size_t lo = 0, hi = r->nmrs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (r->mrs[mid]->addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return NULL;
    const lmr_t *m = r->mrs[lo - 1];
    if (addr + len < addr || addr + len > m->addr + m->len)
        return NULL;
    return m;
}

int mte_rdma_mr_add(mte_rdma_t *r, uint64_t addr, uint64_t len, const uint32_t *lkeys,
                    int ndev, uint64_t pref, uint64_t avail)
{
    if (ndev < 0 || ndev > MTE_RDMA_MAX_DEV || len == 0)
        return -EINVAL;
    lmr_t *m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    m->addr = addr;
    m->len = len;
    m->pref = pref;
    m->avail = avail;
    memcpy(m->lkey, lkeys, (size_t)ndev * sizeof(uint32_t));
    pthread_rwlock_wrlock(&r->lk);
    if (r->nmrs == r->capmrs) {
        size_t cap = r->capmrs ? r->capmrs * 2 : 16;
        lmr_t **nm = realloc(r->mrs, cap * sizeof(*nm));
        if (!nm) {
            pthread_rwlock_unlock(&r->lk);
            free(m);
            return -ENOMEM;
        }
        r->mrs = nm;
        r->capmrs = cap;
    }
    size_t i = r->nmrs;
    while (i > 0 && r->mrs[i - 1]->addr > addr) {
        r->mrs[i] = r->mrs[i - 1];
        i--;
    }
    r->mrs[i] = m;
    r->nmrs++;
    pthread_rwlock_unlock(&r->lk);
    return 0;
}

int mte_rdma_mr_remove(mte_rdma_t *r, uint64_t addr)
{
    lmr_t *gone = NULL;
    pthread_rwlock_wrlock(&r->lk);
    for (size_t i = 0; i < r->nmrs; i++) {
        if (r->mrs[i]->addr == addr) {
            gone = r->mrs[i];
            memmove(&r->mrs[i], &r->mrs[i + 1], (r->nmrs - i - 1) * sizeof(*r->mrs));
            r->nmrs--;
            break;
        }
    }
    pthread_rwlock_unlock(&r->lk);
    /* The engine removed the region from its table first, which waited for every
     * request pinning it: no slice refers to these keys any more. */
    free(gone);
    return gone ? 0 : -ENOENT;
}

/* ------------------------------------------------------------------------------------ */
/* Finishing slices                                                                       */

static int stop_code(mte_batch_t *b)
{
    /* Canceled or expired: report which, as the batch would. */
    int e = mte_batch_stop_code(b, mte_now_ns());
    return e ? e : MTE_E_CANCELED;
}

static void finish_slice(mte_rdma_peer_t *p, slice_t *s, int err)
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
    peer_unref(p);
}

/* ------------------------------------------------------------------------------------ */
/* Rails                                                                                  */

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
static slice_t *qp_failed_locked(mte_rdma_rail_t *rl, cqp_t *c, int err)
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

static void redispatch_list(mte_rdma_peer_t *p, slice_t *s, mte_rdma_rail_t *from)
{
    while (s) {
        slice_t *nx = s->next;
        dispatch(p, s, from);
        s = nx;
    }
}

/* Posts queued slices while the rail's queue pairs and the device's CQ have room. */
static void pump(mte_rdma_rail_t *rl)
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
            slice_t *rest = qp_failed_locked(rl, c, MTE_E_RDMA_POST);
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
        finish_slice(p, stopped, code);
        stopped = nx;
    }
    if (orphans)
        redispatch_list(p, orphans, rl);
}

/* Put slice s on a rail (not `exclude` if another will do) and post it, or finish it
 * with its first error when no rail can take it. */
static void dispatch(mte_rdma_peer_t *p, slice_t *s, mte_rdma_rail_t *exclude)
{
    if (atomic_load(&p->shutdown)) {
        finish_slice(p, s, MTE_E_CLOSED);
        return;
    }
    if (mte_batch_stopped(s->req->b)) {
        finish_slice(p, s, stop_code(s->req->b));
        return;
    }
    mte_rdma_rail_t *rl = choose(p, s->req, exclude, atomic_fetch_add(&p->rr, 1));
    if (!rl) {
        int err = s->first_err;
        if (!err && exclude)
            err = atomic_load(&exclude->first_err);
        finish_slice(p, s, err ? err : MTE_E_RDMA_NO_RAIL);
        return;
    }
    enqueue(rl, s);
    pump(rl);
}

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
        finish_slice(p, s, 0);
        pump(rl);
        peer_unref(p);
        return;
    }
    int err = MTE_E_RDMA_WC_BASE - (int)wc->status;
    atomic_fetch_add(&d->errors, 1);
    pthread_mutex_lock(&rl->mu);
    c->outstanding--;
    slice_t *orphans = qp_failed_locked(rl, c, err);
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
        dispatch(p, s, rl);
    } else {
        finish_slice(p, s, s->first_err);
    }
    if (orphans)
        redispatch_list(p, orphans, rl);
    pump(rl);
    peer_unref(p);
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
            slice_t *orphans = qp_failed_locked(rl, NULL, MTE_E_RDMA_PORT_DOWN);
            pthread_mutex_unlock(&rl->mu);
            if (orphans)
                redispatch_list(p, orphans, rl);
        }
        peer_unref(p);
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
            for (int i = 0; i < n; i++)
                on_completion(d, &wc[i]);
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

/* ------------------------------------------------------------------------------------ */
/* Peers                                                                                  */

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

static void rtable_free(rtable_t *t)
{
    if (t) {
        free(t->bufs);
        free(t->keys);
        free(t);
    }
}

static int cmp_rbuf(const void *a, const void *b)
{
    uint64_t x = ((const rbuf_t *)a)->addr, y = ((const rbuf_t *)b)->addr;
    return x < y ? -1 : x > y;
}

int mte_rdma_peer_set_buffers(mte_rdma_peer_t *p, size_t n, const uint64_t *addrs,
                              const uint64_t *lens, const uint8_t *access,
                              const uint32_t *rkeys, const uint64_t *pref,
                              const uint64_t *avail)
{
    rtable_t *t = calloc(1, sizeof(*t));
    if (!t)
        return -ENOMEM;
    t->n = n;
    t->bufs = calloc(n ? n : 1, sizeof(rbuf_t));
    t->keys = calloc((n ? n : 1) * (size_t)p->npdev, sizeof(uint32_t));
    if (!t->bufs || !t->keys) {
        rtable_free(t);
        return -ENOMEM;
    }
    memcpy(t->keys, rkeys, n * (size_t)p->npdev * sizeof(uint32_t));
    for (size_t i = 0; i < n; i++)
        t->bufs[i] = (rbuf_t){.addr = addrs[i], .len = lens[i], .access = access[i],
                              .pref = pref[i], .avail = avail[i],
                              .rkey = t->keys + i * (size_t)p->npdev};
    qsort(t->bufs, n, sizeof(rbuf_t), cmp_rbuf);
    pthread_rwlock_wrlock(&p->lk);
    rtable_t *old = p->table;
    p->table = t;
    pthread_rwlock_unlock(&p->lk);
    rtable_free(old);        /* requests copied what they needed */
    return 0;
}

static const rbuf_t *rbuf_find(const rtable_t *t, uint64_t addr, uint64_t len)
{
    if (!t)
        return NULL;
    size_t lo = 0, hi = t->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (t->bufs[mid].addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return NULL;
    const rbuf_t *b = &t->bufs[lo - 1];
    if (addr + len < addr || addr + len > b->addr + b->len)
        return NULL;
    return b;
}

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

int mte_rdma_peer_nrails(mte_rdma_peer_t *p) { return atomic_load(&p->nrails); }

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
            finish_slice(p, q, MTE_E_CLOSED);
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
    rtable_free(p->table);
    pthread_rwlock_destroy(&p->lk);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static void peer_unref(mte_rdma_peer_t *p)
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
    peer_unref(p);
}

/* ------------------------------------------------------------------------------------ */
/* Submission                                                                             */

static void fail_request(mte_rdma_t *r, mte_batch_t *b, uint32_t idx, int err)
{
    mte_batch_begin(b, idx, 1);
    mte_batch_slice_done(b, idx, 0, err);
}

int mte_rdma_submit(mte_rdma_peer_t *p, mte_batch_t *b, int op, const uint64_t *local,
                    const uint64_t *remote, const uint64_t *lens, int len_stride,
                    uint32_t first, uint32_t n)
{
    mte_rdma_t *r = p->r;
    if (op != MTE_OP_WRITE && op != MTE_OP_READ)
        return -EINVAL;
    if (atomic_load(&p->shutdown) || atomic_load(&r->stop))
        return -ESHUTDOWN;
    const uint64_t ssz = r->prm.slice_size;
    const uint64_t tail_merge = ssz / 4;          /* MC_FRAGMENT_RATIO 4 */
    int nrails = atomic_load(&p->nrails);
    /* Slices are gathered per rail and handed over once, so a big batch takes each
     * rail's lock once rather than once per slice. */
    slice_t *heads[MTE_RDMA_MAX_RAILS] = {0}, *tails[MTE_RDMA_MAX_RAILS] = {0};
    unsigned rr = atomic_fetch_add(&p->rr, n);
    pthread_rwlock_rdlock(&p->lk);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t idx = first + i;
        uint64_t laddr = local[i], raddr = remote[i];
        uint64_t len = lens[len_stride ? i : 0];
        if (mte_batch_stopped(b)) {
            fail_request(r, b, idx, stop_code(b));
            continue;
        }
        int why = 0;
        mte_region_t *pin = mte_regions_pin(r->regions, laddr, len, 0, &why);
        if (!pin) {
            fail_request(r, b, idx, MTE_E_LOCAL_NOT_REG);
            continue;
        }
        pthread_rwlock_rdlock(&r->lk);
        const lmr_t *m = lmr_find(r, laddr, len);
        pthread_rwlock_unlock(&r->lk);
        const rbuf_t *rb = rbuf_find(p->table, raddr, len);
        int err = 0;
        if (!m)
            err = MTE_E_RDMA_LOCAL_KEY;
        else if (!rb)
            err = MTE_E_REMOTE_NOT_REG;
        else if (!(rb->access & (op == MTE_OP_WRITE ? MTE_ACC_REMOTE_WRITE
                                                    : MTE_ACC_REMOTE_READ)))
            err = MTE_E_REMOTE_ACCESS;
        req_t *q = NULL;
        if (!err) {
            q = calloc(1, sizeof(*q) + (size_t)p->npdev * sizeof(uint32_t));
            if (!q)
                err = MTE_E_NOMEM;
        }
        if (err) {
            mte_region_unpin(pin);
            fail_request(r, b, idx, err);
            continue;
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
        uint32_t nsl = (uint32_t)((len + ssz - 1) / ssz);
        if (nsl > 1 && len - (uint64_t)(nsl - 1) * ssz <= tail_merge)
            nsl--;                                   /* merge a short tail */
        atomic_init(&q->left, nsl);
        mte_batch_begin(b, idx, nsl);
        mte_rdma_rail_t *one = NULL;
        if (!r->prm.multi_nic)
            one = choose(p, q, NULL, rr + i);
        uint64_t off = 0;
        for (uint32_t k = 0; k < nsl; k++) {
            uint64_t sl = k + 1 == nsl ? len - off : ssz;
            slice_t *s = calloc(1, sizeof(*s));
            mte_rdma_rail_t *rl = s ? (one ? one : choose(p, q, NULL, rr + i + k)) : NULL;
            atomic_fetch_add(&p->refs, 1);
            atomic_fetch_add(&p->outstanding, 1);
            if (!s) {
                slice_t tmp = {.req = q, .len = (uint32_t)sl};
                slice_t *t = malloc(sizeof(*t));
                if (t) {
                    *t = tmp;
                    finish_slice(p, t, MTE_E_NOMEM);
                } else {        /* cannot even allocate the failure: account for it */
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
                finish_slice(p, s, e);
                continue;
            }
            s->rail = rl;
            int ri = rl->index;
            if (tails[ri])
                tails[ri]->next = s;
            else
                heads[ri] = s;
            tails[ri] = s;
        }
    }
    pthread_rwlock_unlock(&p->lk);
    for (int k = 0; k < nrails; k++) {
        if (!heads[k])
            continue;
        mte_rdma_rail_t *rl = p->rails[k];
        pthread_mutex_lock(&rl->mu);
        if (rl->qtail)
            rl->qtail->next = heads[k];
        else
            rl->qhead = heads[k];
        rl->qtail = tails[k];
        int dead = atomic_load(&rl->dead);
        slice_t *orphans = NULL;
        if (dead) {           /* died while we were slicing: take them back */
            orphans = rl->qhead;
            rl->qhead = rl->qtail = NULL;
        }
        pthread_mutex_unlock(&rl->mu);
        if (orphans)
            redispatch_list(p, orphans, rl);
        else
            pump(rl);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Stop                                                                                   */

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
        peer_unref(list[i]);
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

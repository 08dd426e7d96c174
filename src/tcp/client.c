/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport's client side: peers, their lanes (one connection and worker thread
 * each), the queue of slices, and submission (tcp.h). The wire format is wire.h's. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define GROUP_MAX 256                 /* requests pipelined per writev on a lane */
#define GROUP_BYTES (2u << 20)        /* ...or this many payload bytes */
#define TICK_MS 200                   /* socket timeout tick: deadlines are checked per tick */
#define NOTIFY_IDX UINT32_MAX
#define REQ_SIZE MTE_WIRE_REQ_SIZE
#define RESP_SIZE MTE_WIRE_RESP_SIZE
#define CMA_EXTRA MTE_WIRE_CMA_EXTRA
#define RBUF_SIZE MTE_TCP_RBUF_SIZE
#define SMALL_READ MTE_TCP_SMALL_READ

/* One slice on a peer's queue (idx NOTIFY_IDX: the batch's notification). nreq > 1: the
 * slice is requests [idx, idx + nreq) whole, of len / nreq bytes each, back to back on
 * both sides (a prepared post's merged blocks, prep.h); 0 or 1: one slice of request idx. */
typedef struct {
    mte_batch_t *b;
    uint32_t idx;
    uint16_t op;
    uint16_t nreq;
    uint64_t laddr, raddr, len;
} item_t;

static int ring_reserve(mte_peer_t *p, size_t more);

static void item_done(const item_t *it, int err)
{
    if (it->idx == NOTIFY_IDX) {
        mte_batch_notify_done(it->b, err);
    } else if (it->nreq > 1) {
        /* The last call may finish (and free) the batch: nothing touches it after. */
        uint64_t each = it->len / it->nreq;
        mte_batch_t *b = it->b;
        uint32_t idx = it->idx, m = it->nreq;
        for (uint32_t j = 0; j < m; j++)
            mte_batch_slice_done(b, idx + j, each, err);
    } else {
        mte_batch_slice_done(it->b, it->idx, it->len, err);
    }
}

static int sink_sock(void *ctx, const uint8_t *p, size_t n) { return mte_sock_send_all(ctx, p, n); }
static int source_sock(void *ctx, uint8_t *p, size_t n) { return mte_sock_recv_into(ctx, p, n); }

typedef struct lane {
    mte_peer_t *peer;
    int index;
    pthread_t thread;
    pthread_mutex_t busy;       /* held while a group is on this lane */
    mte_sockio_t io;
    uint64_t seq;
    int64_t group_deadline;     /* earliest deadline among the group on the wire */
    uint8_t *hdrs;              /* GROUP_MAX request headers */
    struct iovec *iov;
    int cma;                    /* this connection's server copies with process_vm_* */
    uint64_t probe;             /* a value the server reads from us to prove it can */
    mte_stage_t *stage;         /* pinned staging for device memory, made on first use */
} lane_t;

struct mte_peer {
    mte_tcp_t *tcp;
    char host[256];
    int port;
    uint64_t expect_instance;
    char expect_name[MTE_WIRE_NAME_MAX + 1];   /* the segment we asked for ("": unchecked) */
    char uds[108];              /* same-host peer: its abstract unix socket name */
    atomic_int cma_seen;
    atomic_ullong seen_instance;
    atomic_int restarted;
    int nlanes;
    uint64_t slice;
    lane_t *lanes;
    atomic_int refs;            /* the owner's, plus one per batch that will notify it */
    pthread_mutex_t mu;         /* guards the queue */
    pthread_cond_t cv;
    item_t *q;
    size_t qhead, qlen, qcap;
    atomic_int closing;
};


static int lane_stop(void *ctx)
{
    lane_t *L = ctx;
    if (atomic_load(&L->peer->closing))
        return MTE_E_CLOSED;
    /* On a cross-memory-attach lane the server copies into and out of our memory itself:
     * giving up here would unpin memory that requests already in the server's buffer
     * may still touch. Such a lane waits for the answers (or the server's death) and
     * keeps the pins; the caller's Batch.wait still returns at the deadline. */
    if (L->cma)
        return 0;
    if (L->group_deadline && mte_now_ns() > L->group_deadline)
        return MTE_E_TIMEOUT;
    return 0;
}

static void lane_disconnect(lane_t *L)
{
    if (L->io.fd >= 0) {
        close(L->io.fd);
        L->io.fd = -1;
    }
    L->io.pos = L->io.end = 0;
}

/* Connects and says hello (wire.h). 0 or an error code. */
static int lane_connect(lane_t *L)
{
    mte_peer_t *p = L->peer;
    mte_tcp_t *t = p->tcp;
    int timeout_ms = 5000;                                  /* Mooncake: 5 s */
    if (L->group_deadline) {
        int64_t left = (L->group_deadline - mte_now_ns()) / 1000000;
        if (left < timeout_ms)
            timeout_ms = left > 1 ? (int)left : 1;
    }
    int fd = p->uds[0] ? mte_sock_connect_unix(p->uds)
                       : mte_sock_connect_tcp(p->host, p->port, timeout_ms);
    if (fd < 0)
        return MTE_E_SOCKET;
    mte_sock_set_tick(fd, TICK_MS);
    L->io.fd = fd;
    L->io.pos = L->io.end = 0;
    const char *name = t->name;
    size_t nl = strlen(name);
    mte_hello_t h = {.version = MTE_WIRE_VERSION, .instance = t->instance,
                     .name_len = (uint32_t)nl,
                     .flags = !t->token_len ? 0 : MTE_WIRE_HELLO_AUTH |
                              (p->expect_name[0] ? MTE_WIRE_HELLO_AUTH_NAMED : 0)};
    mte_wire_nonce(h.nonce);
    /* Same host: offer a value in our memory for the server to read with
     * process_vm_readv(2); if it can, it moves our bytes itself (one copy, no socket). */
    if (getrandom(&L->probe, sizeof(L->probe), 0) != sizeof(L->probe))
        L->probe = (uint64_t)mte_now_ns() ^ 0x9e3779b97f4a7c15ull;
    h.probe_addr = p->uds[0] ? (uint64_t)(uintptr_t)&L->probe : 0;
    memcpy(h.probe_value, &L->probe, 8);
    uint8_t hello[MTE_WIRE_HELLO_SIZE];
    mte_wire_hello_encode(hello, &h);
    struct iovec iov[2] = {{hello, MTE_WIRE_HELLO_SIZE}, {(void *)name, nl}};
    int e = mte_sock_send_iov(&L->io, iov, 2);
    if (!e)
        e = mte_sock_fill(&L->io, MTE_WIRE_REPLY_SIZE);
    if (e)
        goto fail;
    mte_hello_reply_t r;
    e = mte_wire_reply_decode(L->io.buf + L->io.pos, &r);
    L->io.pos += MTE_WIRE_REPLY_SIZE;
    if (e)
        goto fail;
    if (r.status != 0) {
        e = r.status == MTE_E_AUTH ? MTE_E_AUTH : MTE_E_PROTOCOL;
        goto fail;
    }
    L->cma = (r.flags & MTE_WIRE_REPLY_CMA) != 0;
    if (L->cma)
        atomic_store(&p->cma_seen, 1);
    if (t->token_len) {
        uint8_t expect[MTE_SHA256_LEN], mine[MTE_SHA256_LEN], who[8 + MTE_WIRE_NAME_MAX];
        /* A server that bound its name (reply flag) must prove the name we asked for; an
         * older one proves its instance id, which is checked against the descriptor's
         * below. */
        int named = p->expect_name[0] && (r.flags & MTE_WIRE_REPLY_NAMED);
        size_t wl = mte_wire_server_identity(who, r.instance, named ? p->expect_name : NULL);
        mte_wire_proof(t->token, t->token_len, MTE_WIRE_SERVER_LABEL, h.nonce, r.nonce,
                       who, wl, expect);
        if (mte_ct_compare(expect, r.proof, MTE_SHA256_LEN)) {
            /* The server does not know the token, or it is not the segment we asked for
             * (a stale or forged descriptor): no request goes out. */
            e = named ? MTE_E_WRONG_PEER : MTE_E_AUTH;
            goto fail;
        }
        mte_wire_proof(t->token, t->token_len, MTE_WIRE_CLIENT_LABEL, r.nonce, h.nonce,
                       name, nl, mine);
        e = mte_sock_send_all(&L->io, mine, MTE_SHA256_LEN);
        if (!e)
            e = mte_sock_fill(&L->io, MTE_WIRE_FIN_SIZE);
        if (e)
            goto fail;
        int32_t fin = mte_wire_fin_decode(L->io.buf + L->io.pos);
        L->io.pos += MTE_WIRE_FIN_SIZE;
        if (fin != 0) {
            e = MTE_E_AUTH;
            goto fail;
        }
    }
    atomic_store(&p->seen_instance, r.instance);
    if (p->expect_instance && r.instance != p->expect_instance) {
        atomic_store(&p->restarted, 1);
        e = MTE_E_PEER_RESTARTED;
        goto fail;
    }
    return 0;
fail:
    lane_disconnect(L);
    return e;
}

/* Carries up to GROUP_MAX same-op items on lane L; completes every one of them. */
static void lane_run_group(lane_t *L, item_t *it, int k)
{
    mte_region_t *pins[GROUP_MAX];
    int dev[GROUP_MAX];         /* CUDA ordinal of each item's local memory, -1: host */
    int live[GROUP_MAX];
    int nlive = 0;
    int64_t now = mte_now_ns();
    L->group_deadline = 0;
    mte_regions_t *regions = L->peer->tcp->regions;

    for (int i = 0; i < k; i++) {
        mte_batch_t *b = it[i].b;
        int err = mte_batch_stop_code(b, now);
        if (!err && atomic_load(&L->peer->restarted))
            err = MTE_E_PEER_RESTARTED;
        pins[i] = NULL;
        dev[i] = -1;
        if (!err && it[i].idx != NOTIFY_IDX) {
            int why = 0;
            pins[i] = mte_regions_pin(regions, it[i].laddr, it[i].len, 0, &why);
            if (!pins[i])
                err = MTE_E_LOCAL_NOT_REG;
            else if ((dev[i] = mte_region_device(pins[i])) >= 0 && !mte_stage_get(&L->stage))
                err = MTE_E_NOMEM;
        }
        if (err) {
            item_done(&it[i], err);
            continue;
        }
        int64_t dl = mte_batch_deadline(b);
        if (dl && (!L->group_deadline || dl < L->group_deadline))
            L->group_deadline = dl;
        live[nlive++] = i;
    }
    if (nlive == 0)
        return;

    int err = 0;
    if (L->io.fd >= 0) {
        /* Between groups nothing is owed to us, so a readable socket means the peer
         * closed it (died or restarted): reconnect now, and the hello tells a restart
         * apart, rather than failing this group on a stale connection. */
        struct pollfd pfd = {.fd = L->io.fd, .events = POLLIN | POLLRDHUP};
        if (poll(&pfd, 1, 0) > 0)
            lane_disconnect(L);
    }
    if (L->io.fd < 0)
        err = lane_connect(L);

    /* Send every request of the group in one writev. */
    int niov = 0;
    uint64_t first_seq = L->seq;
    if (!err) {
        for (int j = 0; !err && j < nlive; j++) {
            item_t *x = &it[live[j]];
            int d = dev[live[j]];
            uint8_t *h = L->hdrs + (size_t)j * (REQ_SIZE + CMA_EXTRA);
            /* The server cannot reach our GPU memory with process_vm_*: device memory
             * goes over the socket, staged. */
            int cma = L->cma && x->op != MTE_OP_NOTIFY && d < 0;
            mte_wire_req_t q = {.op = cma ? (x->op == MTE_OP_WRITE ? MTE_OP_WRITE_CMA
                                                                   : MTE_OP_READ_CMA) : x->op,
                                .seq = L->seq++, .addr = x->raddr, .len = x->len};
            mte_wire_req_encode(h, &q);
            if (cma) {
                /* The server copies between its region and [laddr, +len) of ours. */
                mte_wire_put64(h + REQ_SIZE, x->laddr);
                L->iov[niov++] = (struct iovec){h, REQ_SIZE + CMA_EXTRA};
            } else {
                L->iov[niov++] = (struct iovec){h, REQ_SIZE};
                if (x->op != MTE_OP_READ && d < 0) {
                    L->iov[niov++] = (struct iovec){(void *)(uintptr_t)x->laddr, x->len};
                } else if (x->op != MTE_OP_READ) {
                    /* What is gathered so far goes first, then this payload, staged. */
                    err = mte_sock_send_iov(&L->io, L->iov, niov);
                    niov = 0;
                    if (!err)
                        err = mte_stage_out(L->stage, d, (const uint8_t *)(uintptr_t)x->laddr,
                                         x->len, sink_sock, &L->io);
                }
            }
        }
        if (!err)
            err = mte_sock_send_iov(&L->io, L->iov, niov);
    }
    /* Then collect the responses, in order. Requests answered by one recv share one
     * clock read in their metrics (src/core/metrics.h). */
    mte_metrics_group(1);
    int j = 0;
    for (; !err && j < nlive; j++) {
        item_t *x = &it[live[j]];
        /* READ bytes follow the reply unless the server copied them itself (same host,
         * host memory: see the send loop). */
        int inband = x->op == MTE_OP_READ && !(L->cma && dev[live[j]] < 0);
        /* A big READ reply: read just its header, then its bytes straight into place. */
        L->io.readahead = (inband && x->len >= MTE_DIRECT_RECV) ? 0 : RBUF_SIZE;
        err = mte_sock_fill(&L->io, RESP_SIZE);
        if (err)
            break;
        mte_wire_resp_t resp;
        int bad = mte_wire_resp_decode(L->io.buf + L->io.pos, &resp);
        L->io.pos += RESP_SIZE;
        int32_t st = resp.status;
        uint64_t len = resp.len;
        if (bad || resp.seq != first_seq + (uint64_t)j ||
            (st == 0 && inband && len != x->len) || ((st != 0 || !inband) && len != 0)) {
            err = MTE_E_PROTOCOL;
            break;
        }
        if (st == 0 && inband) {
            int d = dev[live[j]], cuda_err = 0;
            if (d < 0)
                err = mte_sock_recv_into(&L->io, (uint8_t *)(uintptr_t)x->laddr, len);
            else
                err = mte_stage_in(L->stage, d, (uint8_t *)(uintptr_t)x->laddr, len, source_sock,
                                &L->io, 1, &cuda_err);
            if (err)
                break;
            if (cuda_err)
                st = cuda_err;
        }
        if (pins[live[j]])
            mte_region_unpin(pins[live[j]]);
        pins[live[j]] = NULL;
        item_done(x, st);
    }
    if (err) {
        /* The stream is in an unknown state: drop the connection, fail the rest. */
        lane_disconnect(L);
        for (; j < nlive; j++) {
            if (pins[live[j]])
                mte_region_unpin(pins[live[j]]);
            item_done(&it[live[j]], err);
        }
    }
    mte_metrics_group(0);
    L->group_deadline = 0;
}

/* Pops a group of same-op items for one lane; caller holds p->mu. */
static int pop_group(mte_peer_t *p, item_t *out)
{
    /* Share the queue among the lanes so a burst spreads over connections. */
    size_t share = (p->qlen + (size_t)p->nlanes - 1) / (size_t)p->nlanes;
    if (share > GROUP_MAX)
        share = GROUP_MAX;
    if (share == 0)
        share = 1;
    int k = 0;
    uint64_t bytes = 0;
    uint32_t op = p->q[p->qhead].op;
    while (p->qlen > 0 && (size_t)k < share) {
        item_t *x = &p->q[p->qhead];
        if (x->op != op || (k > 0 && bytes + x->len > GROUP_BYTES))
            break;
        bytes += x->len;
        out[k++] = *x;
        p->qhead = (p->qhead + 1) % p->qcap;
        p->qlen--;
    }
    return k;
}

static void *lane_main(void *arg)
{
    lane_t *L = arg;
    mte_peer_t *p = L->peer;
    item_t group[GROUP_MAX];
    for (;;) {
        /* Poll the queue briefly before sleeping: the next request of a ping-pong user
         * usually arrives within microseconds (clock.h). */
        int64_t until = mte_now_ns() + mte_spin_ns();
        while (__atomic_load_n(&p->qlen, __ATOMIC_RELAXED) == 0 &&
               !atomic_load(&p->closing) && mte_now_ns() < until)
            sched_yield();
        pthread_mutex_lock(&p->mu);
        while (p->qlen == 0 && !atomic_load(&p->closing))
            pthread_cond_wait(&p->cv, &p->mu);
        if (p->qlen == 0) {
            pthread_mutex_unlock(&p->mu);
            break;
        }
        int k = pop_group(p, group);
        int more = p->qlen > 0;
        pthread_mutex_unlock(&p->mu);
        if (more)
            pthread_cond_signal(&p->cv);     /* the next lane takes the next share */
        pthread_mutex_lock(&L->busy);
        L->io.spin = k == 1 && group[0].len <= SMALL_READ;    /* a lone small request */
        lane_run_group(L, group, k);
        L->io.spin = 0;
        pthread_mutex_unlock(&L->busy);
    }
    return NULL;
}

static void peer_enqueue(mte_peer_t *p, const item_t *items, size_t n)
{
    pthread_mutex_lock(&p->mu);
    if (atomic_load(&p->closing)) {
        pthread_mutex_unlock(&p->mu);
        for (size_t i = 0; i < n; i++)
            item_done(&items[i], MTE_E_CLOSED);
        return;
    }
    if (ring_reserve(p, n)) {
        pthread_mutex_unlock(&p->mu);
        for (size_t i = 0; i < n; i++)
            item_done(&items[i], MTE_E_NOMEM);
        return;
    }
    /* At most two runs, up to the end of the ring then from its start: no division
     * per item (a prepared post queues 1,024 slices at once). */
    if (n) {
        size_t tail = (p->qhead + p->qlen) % p->qcap;
        size_t run = n < p->qcap - tail ? n : p->qcap - tail;
        memcpy(p->q + tail, items, run * sizeof(*items));
        if (n > run)
            memcpy(p->q, items + run, (n - run) * sizeof(*items));
    }
    p->qlen += n;
    if (n == 1)
        pthread_cond_signal(&p->cv);
    else
        pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

mte_peer_t *mte_peer_new(mte_tcp_t *t, const char *host, int port, const char *uds,
                         uint64_t expect_instance, int lanes, uint64_t slice_size, int *err)
{
    *err = 0;
    if (lanes < 1)
        lanes = 1;
    if (lanes > 64)
        lanes = 64;
    mte_peer_t *p = calloc(1, sizeof(*p));
    if (!p) {
        *err = MTE_E_NOMEM;
        return NULL;
    }
    p->tcp = t;
    atomic_init(&p->refs, 1);
    snprintf(p->host, sizeof(p->host), "%s", host);
    snprintf(p->uds, sizeof(p->uds), "%s", uds ? uds : "");
    p->port = port;
    p->expect_instance = expect_instance;
    p->nlanes = lanes;
    p->slice = slice_size ? slice_size : (256u << 10);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->lanes = calloc((size_t)lanes, sizeof(lane_t));
    if (!p->lanes) {
        free(p);
        *err = MTE_E_NOMEM;
        return NULL;
    }
    for (int i = 0; i < lanes; i++) {
        lane_t *L = &p->lanes[i];
        L->peer = p;
        L->index = i;
        pthread_mutex_init(&L->busy, NULL);
        L->io = (mte_sockio_t){.fd = -1, .buf = malloc(RBUF_SIZE), .cap = RBUF_SIZE,
                           .readahead = RBUF_SIZE, .stop = lane_stop, .ctx = L};
        L->hdrs = malloc((size_t)GROUP_MAX * (REQ_SIZE + CMA_EXTRA));
        L->iov = malloc(sizeof(struct iovec) * 2 * GROUP_MAX);
        if (!L->io.buf || !L->hdrs || !L->iov || pthread_create(&L->thread, NULL, lane_main, L)) {
            /* Unwind the lanes started so far. */
            atomic_store(&p->closing, 1);
            pthread_cond_broadcast(&p->cv);
            for (int j = 0; j < i; j++)
                pthread_join(p->lanes[j].thread, NULL);
            for (int j = 0; j <= i; j++) {
                free(p->lanes[j].io.buf);
                free(p->lanes[j].hdrs);
                free(p->lanes[j].iov);
            }
            free(p->lanes);
            free(p);
            *err = MTE_E_NOMEM;
            return NULL;
        }
    }
    return p;
}

uint64_t mte_peer_seen_instance(const mte_peer_t *p) { return atomic_load(&p->seen_instance); }

void mte_peer_expect_name(mte_peer_t *p, const char *name)
{
    snprintf(p->expect_name, sizeof(p->expect_name), "%s", name ? name : "");
}

int mte_peer_broken(const mte_peer_t *p) { return atomic_load(&p->restarted); }
size_t mte_peer_queued(mte_peer_t *p)
{
    pthread_mutex_lock(&p->mu);
    size_t n = p->qlen;
    pthread_mutex_unlock(&p->mu);
    return n;
}

int mte_peer_cma(const mte_peer_t *p) { return atomic_load(&p->cma_seen); }

void mte_peer_shutdown(mte_peer_t *p)
{
    if (!p || atomic_load(&p->closing) == 2)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->closing, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nlanes; i++) {
        lane_t *L = &p->lanes[i];
        if (L->io.fd >= 0)
            shutdown(L->io.fd, SHUT_RDWR);     /* unblocks a lane stuck in I/O */
    }
    for (int i = 0; i < p->nlanes; i++)
        pthread_join(p->lanes[i].thread, NULL);
    /* Whatever is still queued fails as closed. */
    pthread_mutex_lock(&p->mu);
    while (p->qlen > 0) {
        item_t x = p->q[p->qhead];
        p->qhead = (p->qhead + 1) % p->qcap;
        p->qlen--;
        pthread_mutex_unlock(&p->mu);
        item_done(&x, MTE_E_CLOSED);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nlanes; i++) {
        lane_t *L = &p->lanes[i];
        pthread_mutex_lock(&L->busy);          /* wait out an inline caller */
        lane_disconnect(L);
        pthread_mutex_unlock(&L->busy);
    }
    atomic_store(&p->closing, 2);
}

static void peer_unref(mte_peer_t *p);

void mte_peer_free(mte_peer_t *p)
{
    if (!p)
        return;
    mte_peer_shutdown(p);
    peer_unref(p);           /* batches that will notify it keep the memory alive */
}

static void peer_unref(mte_peer_t *p)
{
    if (atomic_fetch_sub(&p->refs, 1) != 1)
        return;
    for (int i = 0; i < p->nlanes; i++) {
        lane_t *L = &p->lanes[i];
        pthread_mutex_destroy(&L->busy);
        free(L->io.buf);
        free(L->hdrs);
        free(L->iov);
        mte_stage_free(L->stage);
    }
    free(p->lanes);
    free(p->q);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

int mte_tcp_submit(mte_peer_t *p, mte_batch_t *b, int op, const uint64_t *local,
                   const uint64_t *remote, const uint64_t *lens, int len_stride,
                   uint32_t first, uint32_t n, int run_inline)
{
    if (op != MTE_OP_WRITE && op != MTE_OP_READ)
        return MTE_E_INVALID;
    if ((uint64_t)first + n > mte_batch_size(b))
        return MTE_E_INVALID;
    uint64_t slice = p->slice;
    /* Single-slice request on an idle lane: carry it on this thread (no hand-off). */
    if (run_inline && n == 1 && lens[0] <= slice) {
        for (int i = 0; i < p->nlanes; i++) {
            lane_t *L = &p->lanes[i];
            if (pthread_mutex_trylock(&L->busy) == 0) {
                mte_batch_begin(b, first, 1);
                if (atomic_load(&p->closing)) {         /* shut down: carry nothing */
                    pthread_mutex_unlock(&L->busy);
                    item_t it = {.b = b, .idx = first, .op = (uint16_t)op, .len = lens[0]};
                    item_done(&it, MTE_E_CLOSED);
                    return 0;
                }
                item_t it = {.b = b, .idx = first, .op = (uint16_t)op, .laddr = local[0],
                             .raddr = remote[0], .len = lens[0]};
                L->io.spin = 1;             /* the caller waits for this one answer */
                lane_run_group(L, &it, 1);
                L->io.spin = 0;
                pthread_mutex_unlock(&L->busy);
                return 0;
            }
        }
    }
    /* GPU memory on our side: bigger slices (mte_gpu_slice). */
    uint64_t gpu_slice = slice < mte_gpu_slice() ? mte_gpu_slice() : slice;
    int any_gpu = 0;
    for (uint32_t k = 0; k < n && !any_gpu; k++)
        any_gpu = mte_regions_device_at(p->tcp->regions, local[k]) >= 0;
    size_t nitems = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t len = lens[len_stride ? k : 0];
        uint64_t sl = any_gpu && mte_regions_device_at(p->tcp->regions, local[k]) >= 0
                      ? gpu_slice : slice;
        nitems += len ? (size_t)((len + sl - 1) / sl) : 1;
    }
    item_t *items = malloc(nitems * sizeof(*items));
    if (!items)
        return MTE_E_NOMEM;
    size_t m = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t len = lens[len_stride ? k : 0];
        uint32_t idx = first + k;
        uint64_t off = 0;
        uint64_t sl = any_gpu && mte_regions_device_at(p->tcp->regions, local[k]) >= 0
                      ? gpu_slice : slice;
        uint32_t count = len ? (uint32_t)((len + sl - 1) / sl) : 1;
        mte_batch_begin(b, idx, count);
        do {
            uint64_t l = len - off < sl ? len - off : sl;
            items[m++] = (item_t){.b = b, .idx = idx, .op = (uint16_t)op,
                                  .laddr = local[k] + off, .raddr = remote[k] + off, .len = l};
            off += l;
        } while (off < len);
    }
    peer_enqueue(p, items, m);
    free(items);
    return 0;
}

/* Room for `more` items in p's ring; caller holds p->mu. 0 or MTE_E_NOMEM. */
static int ring_reserve(mte_peer_t *p, size_t more)
{
    if (p->qlen + more <= p->qcap)
        return 0;
    size_t cap = p->qcap ? p->qcap : 1024;
    while (cap < p->qlen + more)
        cap *= 2;
    item_t *q = malloc(cap * sizeof(*q));
    if (!q)
        return MTE_E_NOMEM;
    /* The ring in order: [qhead, qcap) then [0, rest). */
    size_t first = p->qlen < p->qcap - p->qhead ? p->qlen : p->qcap - p->qhead;
    if (first)
        memcpy(q, p->q + p->qhead, first * sizeof(*q));
    if (p->qlen > first)
        memcpy(q + first, p->q, (p->qlen - first) * sizeof(*q));
    free(p->q);
    p->q = q;
    p->qcap = cap;
    p->qhead = 0;
    return 0;
}

int mte_tcp_post_prepared(mte_peer_t *p, mte_batch_t *b, int op, const mte_prep_t *t,
                          const int64_t *lids, const int64_t *rids, uint32_t n)
{
    if (op != MTE_OP_WRITE && op != MTE_OP_READ)
        return -1;
    if ((uint64_t)t->rows * n != mte_batch_size(b))
        return -1;
    if (n == 0)
        return 0;
    if (t->any_device) {
        /* Device memory takes bigger slices, chosen per block: the general path. */
        size_t m = (size_t)t->rows * n;
        uint64_t *buf = malloc(3 * m * sizeof(uint64_t));
        if (!buf)
            return MTE_E_NOMEM;
        uint64_t *loc = buf, *rem = buf + m, *lens = buf + 2 * m;
        for (uint32_t r = 0; r < t->rows; r++)
            for (uint32_t k = 0; k < n; k++) {
                loc[(size_t)r * n + k] = mte_prep_local(t, r, lids[k]);
                rem[(size_t)r * n + k] = mte_prep_remote(t, r, rids[k]);
                lens[(size_t)r * n + k] = t->lens[r];
            }
        int rc = mte_tcp_submit(p, b, op, loc, rem, lens, 1, 0, (uint32_t)m, 0);
        free(buf);
        return rc;
    }
    uint64_t sl = p->slice;
    size_t nitems = 0;
    for (uint32_t r = 0; r < t->rows; r++) {
        uint64_t len = t->lens[r];
        uint32_t count = len ? (uint32_t)((len + sl - 1) / sl) : 1;
        mte_batch_begin_range(b, r * n, n, count);
        nitems += (size_t)count * n;
    }
    pthread_mutex_lock(&p->mu);
    int err = atomic_load(&p->closing) ? MTE_E_CLOSED : ring_reserve(p, nitems);
    if (err) {
        pthread_mutex_unlock(&p->mu);
        /* Nothing queued: every slice of every request finishes with err. */
        for (uint32_t r = 0; r < t->rows; r++) {
            uint64_t len = t->lens[r];
            uint32_t count = len ? (uint32_t)((len + sl - 1) / sl) : 1;
            for (uint32_t k = 0; k < n; k++)
                for (uint32_t c = 0; c < count; c++)
                    mte_batch_slice_done(b, r * n + k, 0, err);
        }
        return 0;
    }
    size_t tail = (p->qhead + p->qlen) % p->qcap;
    item_t *q = p->q;
    size_t cap = p->qcap, put = 0;
    for (uint32_t r = 0; r < t->rows; r++) {
        uint64_t len = t->lens[r];
        uint32_t idx = r * n;
        /* A row whose blocks are back to back (prep.h, merge): blocks whose ids follow
         * each other on both sides go as one item, up to a slice. */
        uint64_t most = t->merge && t->merge[r] && len && len <= sl ? sl / len : 1;
        if (most > UINT16_MAX)
            most = UINT16_MAX;
        for (uint32_t k = 0; k < n;) {
            uint64_t la = mte_prep_local(t, r, lids[k]), ra = mte_prep_remote(t, r, rids[k]);
            uint32_t m = 1;
            while (m < most && k + m < n && lids[k + m] == lids[k] + m &&
                   rids[k + m] == rids[k] + m)
                m++;
            if (m > 1) {
                q[tail] = (item_t){.b = b, .idx = idx, .op = (uint16_t)op,
                                   .nreq = (uint16_t)m, .laddr = la, .raddr = ra,
                                   .len = len * m};
                if (++tail == cap)
                    tail = 0;
                put++;
                k += m;
                idx += m;
                continue;
            }
            uint64_t off = 0;
            do {
                uint64_t l = len - off < sl ? len - off : sl;
                q[tail] = (item_t){.b = b, .idx = idx, .op = (uint16_t)op,
                                   .laddr = la + off, .raddr = ra + off, .len = l};
                if (++tail == cap)
                    tail = 0;
                put++;
                off += l;
            } while (off < len);
            k++;
            idx++;
        }
    }
    p->qlen += put;
    pthread_mutex_unlock(&p->mu);
    /* One lane, after the unlock (it does not wake into a held mutex); it wakes the next
     * when it leaves work behind (lane_main). Waking is the costliest step of a post. */
    pthread_cond_signal(&p->cv);
    return 0;
}

/* The batch's notification to one peer: a NOTIFY item on its queue (batch.h). */
static void notify_send(void *peer, mte_batch_t *b, const void *msg, size_t len)
{
    item_t it = {.b = b, .idx = NOTIFY_IDX, .op = MTE_OP_NOTIFY,
                 .laddr = (uint64_t)(uintptr_t)msg, .raddr = 0, .len = len};
    peer_enqueue(peer, &it, 1);
}

static void notify_release(void *peer) { peer_unref(peer); }

static const mte_notifier_t notifier = {.send = notify_send, .release = notify_release};

int mte_tcp_add_notify(mte_peer_t *p, mte_batch_t *b, const void *msg, size_t len)
{
    atomic_fetch_add(&p->refs, 1);        /* the batch's, if it takes it */
    int rc = mte_batch_add_notify(b, p, &notifier, msg, len);
    if (rc != 0)
        peer_unref(p);
    return rc < 0 ? rc : 0;
}

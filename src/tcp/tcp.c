/* SPDX-License-Identifier: Apache-2.0 */
/* TCP transport data path; see tcp.h for the design and the wire format. */
#define _GNU_SOURCE
#include "tcp.h"
#include "../core/gpu.h"
#include "../core/hmac_sha256.h"

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAGIC_REQ   0x3245544du   /* "MTE2" */
#define MAGIC_RESP  0x5245544du   /* "MTER" */
#define MAGIC_HELLO 0x4845544du   /* "MTEH" */
#define PROTO_VERSION 2u
#define NONCE_LEN 16
#define HELLO_SIZE 56     /* magic, version, instance, name len, flags, nonce, probe addr+value */
#define REPLY_SIZE 72     /* magic, status, instance, nonce, proof, flags, pad */
#define HELLO_AUTH 1u
#define REPLY_CMA 1u      /* the server can copy to and from our memory (same host) */
#define CMA_EXTRA 8       /* CMA requests carry the initiator's address after the header */
#define REQ_SIZE 32
#define RESP_SIZE 24
#define GROUP_MAX 256                 /* requests pipelined per writev on a lane */
#define GROUP_BYTES (2u << 20)        /* ...or this many payload bytes */
#define RBUF_SIZE (256u << 10)
#define OBUF_SIZE (256u << 10)
#define SMALL_READ (16u << 10)        /* READ replies up to this size are coalesced */
#define DIRECT_RECV (16u << 10)       /* payloads at least this big skip the buffer */
#define TICK_MS 200                   /* socket timeout tick: deadlines are checked per tick */
#define NOTIFY_MAX (1u << 20)
#define NOTIFY_IDX UINT32_MAX

int64_t mte_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void put32(uint8_t *p, uint32_t v) { v = htole32(v); memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { v = htole64(v); memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }

static void set_tick(int fd, int ms)
{
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* ------------------------------------------------------------------------------------ */
/* Buffered socket I/O with a stop predicate checked at every timeout tick.            */

typedef int (*stop_fn)(void *ctx);   /* returns 0 to go on, or an error code to give up */

typedef struct {
    int fd;
    uint8_t *buf;
    size_t pos, end, cap;
    /* How far a refill may read past what is needed. After a big payload the next one
     * is likely big too: then only its header is read into the buffer and the payload
     * goes straight to its destination, instead of being copied out of the buffer. */
    size_t readahead;
    int spin;                   /* poll briefly before blocking (latency mode, see spin_ns) */
    stop_fn stop;
    void *ctx;
} sockio_t;

static int io_err(void) { return MTE_E_SOCKET; }

/* Sends all of iov[0..n) (modifies iov). 0 or an error code. */
static int send_iov(sockio_t *s, struct iovec *iov, int n)
{
    while (n > 0) {
        ssize_t k = writev(s->fd, iov, n > 1024 ? 1024 : n);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int e = s->stop ? s->stop(s->ctx) : 0;
                if (e)
                    return e;
                continue;
            }
            return io_err();
        }
        while (n > 0 && (size_t)k >= iov->iov_len) {
            k -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + k;
            iov->iov_len -= (size_t)k;
        }
    }
    return 0;
}

static int send_all(sockio_t *s, const void *p, size_t n)
{
    struct iovec iov = {.iov_base = (void *)p, .iov_len = n};
    return send_iov(s, &iov, 1);
}

/* One recv into dst (at most n); >0 bytes, or an error code. */
/* How long a receiver polls before it blocks. On virtual machines a thread that blocks
 * lets its vCPU halt, and waking it again costs tens of microseconds (measured here:
 * a 4 KiB round trip took 16 us with both ends on one vCPU and 70-100 us across two),
 * more than the round trip itself. Polling briefly keeps the vCPU running through the
 * gap between a request and its answer; sched_yield keeps it polite when other threads
 * have work. Only ping-pong traffic polls (a synchronous request on the caller's thread,
 * and a server connection that just answered one small request): streams of requests
 * keep both sides busy anyway, and polling there takes CPU from the copies on small
 * machines. MC_TCP_SPIN_US overrides the time (0 turns polling off). */
static int64_t spin_ns(void)
{
    static int64_t cached = -1;
    if (cached < 0) {
        const char *v = getenv("MC_TCP_SPIN_US");
        cached = (v && *v ? atoll(v) : 50) * 1000;
    }
    return cached;
}

static ssize_t recv_some(sockio_t *s, void *dst, size_t n)
{
    int64_t spin = s->spin ? spin_ns() : 0;
    if (spin > 0) {
        int64_t until = mte_now_ns() + spin;
        do {
            ssize_t k = recv(s->fd, dst, n, MSG_DONTWAIT);
            if (k > 0)
                return k;
            if (k == 0)
                return MTE_E_SOCKET;
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                return io_err();
            sched_yield();
        } while (mte_now_ns() < until);
    }
    for (;;) {
        ssize_t k = recv(s->fd, dst, n, 0);
        if (k > 0) {
            /* Progress alone must not hide a deadline: a peer can trickle bytes. */
            int e = s->stop && (size_t)k < n ? s->stop(s->ctx) : 0;
            return e ? e : k;
        }
        if (k == 0)
            return MTE_E_SOCKET;     /* the peer closed the connection */
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int e = s->stop ? s->stop(s->ctx) : 0;
            if (e)
                return e;
            continue;
        }
        return io_err();
    }
}

/* Ensures at least n bytes are buffered. 0 or error. */
static int fill(sockio_t *s, size_t n)
{
    if (s->end - s->pos >= n)
        return 0;
    if (s->pos > 0) {
        memmove(s->buf, s->buf + s->pos, s->end - s->pos);
        s->end -= s->pos;
        s->pos = 0;
    }
    while (s->end < n) {
        size_t want = s->cap - s->end;
        if (n - s->end + s->readahead < want)
            want = n - s->end + s->readahead;
        ssize_t k = recv_some(s, s->buf + s->end, want);
        if (k < 0)
            return (int)k;
        s->end += (size_t)k;
    }
    return 0;
}

/* Receives exactly n bytes into dst (NULL: discard), buffered part first, then straight
 * from the socket for big payloads so they never pass through a bounce buffer. */
static int recv_into(sockio_t *s, uint8_t *dst, uint64_t n)
{
    size_t have = s->end - s->pos;
    size_t take = have < n ? have : (size_t)n;
    if (take) {
        if (dst)
            memcpy(dst, s->buf + s->pos, take);
        s->pos += take;
        n -= take;
        if (dst)
            dst += take;
    }
    while (n > 0) {
        if (dst && n >= DIRECT_RECV) {
            ssize_t k = recv_some(s, dst, (size_t)n);
            if (k < 0)
                return (int)k;
            dst += k;
            n -= (uint64_t)k;
        } else {
            s->pos = s->end = 0;
            ssize_t k = recv_some(s, s->buf, s->cap);
            if (k < 0)
                return (int)k;
            s->end = (size_t)k;
            size_t t = (size_t)k < n ? (size_t)k : (size_t)n;
            if (dst) {
                memcpy(dst, s->buf, t);
                dst += t;
            }
            s->pos = t;
            n -= t;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Device memory: recv(2), writev(2) and process_vm_*(2) cannot touch GPU memory, so its */
/* bytes pass through a ring of pinned slots (src/core/gpu.h), in chunks: the PCIe copy */
/* of one chunk runs on the GPU's copy engine while the previous chunk is on the wire.  */

typedef int (*sink_fn)(void *ctx, const uint8_t *p, size_t n);
typedef int (*source_fn)(void *ctx, uint8_t *p, size_t n);

static int sink_sock(void *ctx, const uint8_t *p, size_t n) { return send_all(ctx, p, n); }
static int source_sock(void *ctx, uint8_t *p, size_t n) { return recv_into(ctx, p, n); }

static mte_stage_t *stage_get(mte_stage_t **sp)
{
    if (!*sp)
        *sp = mte_stage_new();
    return *sp;
}

/* Sends n bytes of device `dev` memory at src through `sink`. Any error leaves the
 * stream short of bytes: the caller must drop the connection. */
static int device_out(mte_stage_t *s, int dev, const uint8_t *src, uint64_t n, sink_fn sink,
                      void *ctx)
{
    const uint64_t C = mte_stage_chunk(), chunks = (n + C - 1) / C;
    uint64_t issued = 0, sent = 0;
    int err = 0;
    while (!err && sent < chunks) {
        /* Keep every slot busy copying ahead of what the socket takes. */
        while (!err && issued < chunks && issued - sent < MTE_STAGE_SLOTS) {
            uint64_t off = issued * C;
            err = mte_stage_d2h(s, (int)(issued % MTE_STAGE_SLOTS), dev, src + off,
                                (size_t)(n - off < C ? n - off : C));
            issued++;
        }
        if (err)
            break;
        int k = (int)(sent % MTE_STAGE_SLOTS);
        uint64_t off = sent * C;
        err = mte_stage_wait(s, k);
        if (!err)
            err = sink(ctx, mte_stage_slot(s, k, dev), (size_t)(n - off < C ? n - off : C));
        sent++;
    }
    int e = mte_stage_drain(s);
    return err ? err : e;
}

/* Takes n bytes from `source` into device `dev` memory at dst; returns once they are in
 * device memory. The return value is the source's error; a CUDA error goes to *cuda_err,
 * and then, with `drain`, the rest of the bytes are still taken (and dropped) so a
 * socket stays in step. */
static int device_in(mte_stage_t *s, int dev, uint8_t *dst, uint64_t n, source_fn source,
                     void *ctx, int drain, int *cuda_err)
{
    uint64_t off = 0;
    int k = 0, err = 0;
    *cuda_err = 0;
    while (off < n) {
        size_t C = mte_stage_chunk(), len = n - off < C ? (size_t)(n - off) : C;
        uint8_t *slot = NULL;
        if (!*cuda_err) {
            slot = mte_stage_slot(s, k, dev);
            *cuda_err = !slot ? MTE_E_CUDA : mte_stage_wait(s, k);
            if (*cuda_err)
                slot = NULL;
        }
        if (!slot && !drain)
            break;
        err = source(ctx, slot, len);
        if (err)
            break;
        if (slot)
            *cuda_err = mte_stage_h2d(s, k, dev, dst + off, len);
        off += len;
        k = (k + 1) % MTE_STAGE_SLOTS;
    }
    int e = mte_stage_drain(s);
    if (!*cuda_err)
        *cuda_err = e;
    return err;
}

/* ------------------------------------------------------------------------------------ */
/* Batches                                                                              */

typedef struct notify_ref {
    struct notify_ref *next;
    mte_peer_t *peer;
} notify_ref_t;

struct mte_batch {
    uint32_t n;
    int64_t deadline;
    atomic_int refs;
    atomic_uint pending;        /* unfinished requests + 1 until sealed */
    atomic_uint notify_left;
    atomic_int any_failed;
    atomic_int canceled;
    atomic_int expired;
    atomic_int notify_err;
    notify_ref_t *notify_peers;
    char *notify_msg;
    size_t notify_len;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int finished;
    _Atomic uint8_t *state;
    _Atomic uint64_t *bytes;
    atomic_uint *slices_left;
    atomic_int *err;
};

typedef struct {
    mte_batch_t *b;
    uint32_t idx;
    uint32_t op;
    uint64_t laddr, raddr, len;
} item_t;

mte_batch_t *mte_batch_new(uint32_t n, int64_t deadline_ns)
{
    mte_batch_t *b = calloc(1, sizeof(*b));
    if (!b)
        return NULL;
    size_t m = n ? n : 1;
    b->state = calloc(m, sizeof(*b->state));
    b->bytes = calloc(m, sizeof(*b->bytes));
    b->slices_left = calloc(m, sizeof(*b->slices_left));
    b->err = calloc(m, sizeof(*b->err));
    if (!b->state || !b->bytes || !b->slices_left || !b->err) {
        free(b->state); free(b->bytes); free(b->slices_left); free(b->err); free(b);
        return NULL;
    }
    b->n = n;
    b->deadline = deadline_ns;
    atomic_init(&b->refs, 2);            /* the caller's, and the in-flight one */
    atomic_init(&b->pending, n + 1);     /* +1 = not sealed yet */
    pthread_mutex_init(&b->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&b->cv, &ca);
    pthread_condattr_destroy(&ca);
    return b;
}

static void peer_unref(mte_peer_t *p);

void mte_batch_unref(mte_batch_t *b)
{
    if (!b || atomic_fetch_sub(&b->refs, 1) != 1)
        return;
    for (notify_ref_t *r = b->notify_peers, *nx; r; r = nx) {
        nx = r->next;
        peer_unref(r->peer);
        free(r);
    }
    free(b->notify_msg);
    free(b->state); free(b->bytes); free(b->slices_left); free(b->err);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
}

uint32_t mte_batch_size(const mte_batch_t *b) { return b->n; }
int32_t mte_batch_notify_error(const mte_batch_t *b) { return atomic_load(&b->notify_err); }

static void batch_finish(mte_batch_t *b)
{
    pthread_mutex_lock(&b->mu);
    b->finished = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    mte_batch_unref(b);                  /* the in-flight reference */
}

static void peer_enqueue(mte_peer_t *p, const item_t *items, size_t n);

/* Every request is accounted for: send notifications, or finish. */
static void batch_requests_done(mte_batch_t *b)
{
    unsigned count = 0;
    for (notify_ref_t *r = b->notify_peers; r; r = r->next)
        count++;
    if (count == 0 || atomic_load(&b->any_failed) || atomic_load(&b->canceled)) {
        batch_finish(b);
        return;
    }
    atomic_store(&b->notify_left, count);
    /* The last notify may finish and free b while we loop: hold it until done. */
    atomic_fetch_add(&b->refs, 1);
    for (notify_ref_t *r = b->notify_peers; r; r = r->next) {
        item_t it = {.b = b, .idx = NOTIFY_IDX, .op = MTE_OP_NOTIFY,
                     .laddr = (uint64_t)(uintptr_t)b->notify_msg, .raddr = 0,
                     .len = b->notify_len};
        peer_enqueue(r->peer, &it, 1);
    }
    mte_batch_unref(b);
}

static uint8_t state_for(int err)
{
    return err == MTE_E_TIMEOUT ? MTE_ST_TIMEOUT
         : err == MTE_E_CANCELED ? MTE_ST_CANCELED : MTE_ST_FAILED;
}

/* One slice finished. The caller must not touch it->b afterwards. */
static void item_done(const item_t *it, int err)
{
    mte_batch_t *b = it->b;
    if (it->idx == NOTIFY_IDX) {
        if (err) {
            int zero = 0;
            atomic_compare_exchange_strong(&b->notify_err, &zero, err);
        }
        if (atomic_fetch_sub(&b->notify_left, 1) == 1)
            batch_finish(b);
        return;
    }
    uint32_t i = it->idx;
    if (err) {
        int zero = 0;
        atomic_compare_exchange_strong(&b->err[i], &zero, err);
        uint8_t pending = MTE_ST_PENDING;
        atomic_compare_exchange_strong(&b->state[i], &pending, state_for(err));
        atomic_store(&b->any_failed, 1);
    } else {
        atomic_fetch_add(&b->bytes[i], it->len);
    }
    if (atomic_fetch_sub(&b->slices_left[i], 1) == 1) {
        uint8_t pending = MTE_ST_PENDING;
        atomic_compare_exchange_strong(&b->state[i], &pending, MTE_ST_COMPLETED);
        if (atomic_fetch_sub(&b->pending, 1) == 1)
            batch_requests_done(b);
    }
}

void mte_batch_begin(mte_batch_t *b, uint32_t idx, uint32_t slices)
{
    if (idx < b->n)
        atomic_store(&b->slices_left[idx], slices ? slices : 1);
}

void mte_batch_slice_done(mte_batch_t *b, uint32_t idx, uint64_t len, int err)
{
    if (idx >= b->n)
        return;
    item_t it = {.b = b, .idx = idx, .len = len};
    item_done(&it, err);
}

int64_t mte_batch_deadline(const mte_batch_t *b) { return b->deadline; }

int mte_batch_stopped(const mte_batch_t *b)
{
    return atomic_load(&b->canceled) || atomic_load(&b->expired);
}

static const mte_batch_ops_t batch_ops = {
    .version = 1, .begin = mte_batch_begin, .slice_done = mte_batch_slice_done,
    .deadline = mte_batch_deadline, .stopped = mte_batch_stopped, .now_ns = mte_now_ns,
};

const mte_batch_ops_t *mte_batch_ops(void) { return &batch_ops; }

void mte_batch_abandon(mte_batch_t *b, uint32_t first, uint32_t n)
{
    if (n == 0 || (uint64_t)first + n > b->n)
        return;
    for (uint32_t i = first; i < first + n; i++) {
        uint8_t pending = MTE_ST_PENDING;
        if (atomic_compare_exchange_strong(&b->state[i], &pending, MTE_ST_CANCELED))
            atomic_store(&b->err[i], MTE_E_CANCELED);
    }
    atomic_store(&b->any_failed, 1);
    if (atomic_fetch_sub(&b->pending, n) == n)
        batch_requests_done(b);
}

void mte_batch_seal(mte_batch_t *b)
{
    if (atomic_fetch_sub(&b->pending, 1) == 1)
        batch_requests_done(b);
}

int mte_batch_wait(mte_batch_t *b, int64_t deadline_ns)
{
    struct timespec ts = {.tv_sec = deadline_ns / 1000000000LL,
                          .tv_nsec = deadline_ns % 1000000000LL};
    /* A small batch often finishes within microseconds: poll first (see spin_ns). */
    int64_t until = mte_now_ns() + spin_ns();
    if (until > deadline_ns)
        until = deadline_ns;
    while (mte_now_ns() < until) {
        pthread_mutex_lock(&b->mu);
        int done = b->finished;
        pthread_mutex_unlock(&b->mu);
        if (done)
            return 1;
        sched_yield();
    }
    pthread_mutex_lock(&b->mu);
    while (!b->finished) {
        if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT)
            break;
    }
    int done = b->finished;
    pthread_mutex_unlock(&b->mu);
    return done;
}

int mte_batch_done(mte_batch_t *b)
{
    if (atomic_load(&b->expired))
        return 1;
    pthread_mutex_lock(&b->mu);
    int done = b->finished;
    pthread_mutex_unlock(&b->mu);
    return done;
}

/* Marks every still-pending request with `st`; in-flight slices then finish unseen. */
static void mark_pending(mte_batch_t *b, uint8_t st, int err)
{
    for (uint32_t i = 0; i < b->n; i++) {
        uint8_t pending = MTE_ST_PENDING;
        if (atomic_compare_exchange_strong(&b->state[i], &pending, st)) {
            int zero = 0;
            atomic_compare_exchange_strong(&b->err[i], &zero, err);
        }
    }
}

void mte_batch_cancel(mte_batch_t *b)
{
    atomic_store(&b->canceled, 1);
    mark_pending(b, MTE_ST_CANCELED, MTE_E_CANCELED);
}

void mte_batch_expire(mte_batch_t *b)
{
    atomic_store(&b->expired, 1);
    mark_pending(b, MTE_ST_TIMEOUT, MTE_E_TIMEOUT);
}

void mte_batch_status(mte_batch_t *b, uint8_t *states, uint64_t *bytes, int32_t *errs)
{
    for (uint32_t i = 0; i < b->n; i++) {
        if (states)
            states[i] = atomic_load(&b->state[i]);
        if (bytes)
            bytes[i] = atomic_load(&b->bytes[i]);
        if (errs)
            errs[i] = atomic_load(&b->err[i]);
    }
}

/* ------------------------------------------------------------------------------------ */
/* Client side: peers and lanes                                                          */

typedef struct lane {
    mte_peer_t *peer;
    int index;
    pthread_t thread;
    pthread_mutex_t busy;       /* held while a group is on this lane */
    sockio_t io;
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

struct mte_tcp {
    mte_regions_t *regions;
    int listen_fd;
    int uds_fd;                  /* same-host listener (abstract unix socket), or -1 */
    char uds_name[108];
    pthread_t uds_thread;
    int port;
    char name[256];
    uint64_t instance;
    int stall_ms;
    uint8_t token[256];          /* shared secret; token_len 0 = no authentication */
    size_t token_len;
    atomic_ullong auth_failures;
    pthread_t accept_thread;
    atomic_int closing;
    pthread_mutex_t mu;          /* guards conns, nconns, notifs */
    pthread_cond_t cv;
    struct conn *conns;
    int nconns;
    mte_notif_t *notif_head, *notif_tail;
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

/* Abstract-namespace unix socket (unix(7)): no file to clean up, scoped to the network
 * namespace, and the kernel tells the server who we are (SO_PEERCRED). */
static socklen_t unix_addr(struct sockaddr_un *a, const char *name)
{
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    size_t n = strnlen(name, sizeof(a->sun_path) - 2);
    memcpy(a->sun_path + 1, name, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static int connect_unix(const char *name)
{
    struct sockaddr_un a;
    socklen_t len = unix_addr(&a, name);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&a, len) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int connect_timeout(const char *host, int port, int timeout_ms)
{
    char portstr[16];
    snprintf(portstr, sizeof(portstr), "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(host, portstr, &hints, &res) != 0)
        return -1;
    int fd = -1;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
            continue;
        int rc = connect(fd, a->ai_addr, a->ai_addrlen);
        if (rc < 0 && errno == EINPROGRESS) {
            struct pollfd pfd = {.fd = fd, .events = POLLOUT};
            rc = poll(&pfd, 1, timeout_ms) == 1 ? 0 : -1;
            if (rc == 0) {
                int soerr = 0;
                socklen_t sl = sizeof(soerr);
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
                rc = soerr ? -1 : 0;
            }
        }
        if (rc == 0)
            break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd >= 0) {
        int fl = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    }
    return fd;
}

/* The hello (both directions) and, when a token is set, a mutual HMAC challenge-response
 * with fresh nonces on each connection (tcp.h). Proofs bind both nonces, a direction
 * label and the identity sent, so a recorded exchange cannot be replayed. */
static void proof(const mte_tcp_t *t, const char *label, const uint8_t *n1, const uint8_t *n2,
                  const void *extra, size_t extra_len, uint8_t out[MTE_SHA256_LEN])
{
    const void *parts[4] = {label, n1, n2, extra};
    const size_t lens[4] = {strlen(label), NONCE_LEN, NONCE_LEN, extra_len};
    mte_hmac_sha256(t->token, t->token_len, parts, lens, 4, out);
}

static void fresh_nonce(uint8_t n[NONCE_LEN])
{
    if (getrandom(n, NONCE_LEN, 0) != NONCE_LEN) {
        /* getrandom(2) cannot fail for 16 bytes once the pool is ready; be safe anyway. */
        int64_t t = mte_now_ns();
        for (int i = 0; i < NONCE_LEN; i++)
            n[i] ^= (uint8_t)(t >> (i % 8 * 8)) ^ (uint8_t)rand();
    }
}

/* Connects and says hello. 0 or an error code. */
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
    int fd = p->uds[0] ? connect_unix(p->uds) : connect_timeout(p->host, p->port, timeout_ms);
    if (fd < 0)
        return MTE_E_SOCKET;
    set_tick(fd, TICK_MS);
    L->io.fd = fd;
    L->io.pos = L->io.end = 0;
    const char *name = t->name;
    size_t nl = strlen(name);
    uint8_t hello[HELLO_SIZE], cnonce[NONCE_LEN];
    fresh_nonce(cnonce);
    put32(hello, MAGIC_HELLO);
    put32(hello + 4, PROTO_VERSION);
    put64(hello + 8, t->instance);
    put32(hello + 16, (uint32_t)nl);
    put32(hello + 20, t->token_len ? HELLO_AUTH : 0);
    memcpy(hello + 24, cnonce, NONCE_LEN);
    /* Same host: offer a value in our memory for the server to read with
     * process_vm_readv(2); if it can, it moves our bytes itself (one copy, no socket). */
    if (getrandom(&L->probe, sizeof(L->probe), 0) != sizeof(L->probe))
        L->probe = (uint64_t)mte_now_ns() ^ 0x9e3779b97f4a7c15ull;
    put64(hello + 40, p->uds[0] ? (uint64_t)(uintptr_t)&L->probe : 0);
    memcpy(hello + 48, &L->probe, 8);
    struct iovec iov[2] = {{hello, HELLO_SIZE}, {(void *)name, nl}};
    int e = send_iov(&L->io, iov, 2);
    if (!e)
        e = fill(&L->io, REPLY_SIZE);
    if (e)
        goto fail;
    const uint8_t *r = L->io.buf + L->io.pos;
    L->io.pos += REPLY_SIZE;
    int32_t st = (int32_t)get32(r + 4);
    if (get32(r) != MAGIC_HELLO) {
        e = MTE_E_PROTOCOL;
        goto fail;
    }
    if (st != 0) {
        e = st == MTE_E_AUTH ? MTE_E_AUTH : MTE_E_PROTOCOL;
        goto fail;
    }
    uint64_t inst = get64(r + 8);
    L->cma = (get32(r + 64) & REPLY_CMA) != 0;
    if (L->cma)
        atomic_store(&p->cma_seen, 1);
    if (t->token_len) {
        uint8_t expect[MTE_SHA256_LEN], mine[MTE_SHA256_LEN], inst_le[8];
        const uint8_t *snonce = r + 16;
        put64(inst_le, inst);
        proof(t, "mte-data-server", cnonce, snonce, inst_le, 8, expect);
        if (mte_ct_compare(expect, r + 16 + NONCE_LEN, MTE_SHA256_LEN)) {
            e = MTE_E_AUTH;            /* the server does not know the token */
            goto fail;
        }
        proof(t, "mte-data-client", snonce, cnonce, name, nl, mine);
        e = send_all(&L->io, mine, MTE_SHA256_LEN);
        if (!e)
            e = fill(&L->io, 8);
        if (e)
            goto fail;
        r = L->io.buf + L->io.pos;
        L->io.pos += 8;
        if (get32(r) != MAGIC_HELLO || (int32_t)get32(r + 4) != 0) {
            e = MTE_E_AUTH;
            goto fail;
        }
    }
    atomic_store(&p->seen_instance, inst);
    if (p->expect_instance && inst != p->expect_instance) {
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
        int err = 0;
        if (atomic_load(&b->canceled))
            err = MTE_E_CANCELED;
        else if ((b->deadline && now > b->deadline) || atomic_load(&b->expired))
            err = MTE_E_TIMEOUT;
        else if (atomic_load(&L->peer->restarted))
            err = MTE_E_PEER_RESTARTED;
        pins[i] = NULL;
        dev[i] = -1;
        if (!err && it[i].idx != NOTIFY_IDX) {
            int why = 0;
            pins[i] = mte_regions_pin(regions, it[i].laddr, it[i].len, 0, &why);
            if (!pins[i])
                err = MTE_E_LOCAL_NOT_REG;
            else if ((dev[i] = mte_region_device(pins[i])) >= 0 && !stage_get(&L->stage))
                err = MTE_E_NOMEM;
        }
        if (err) {
            item_done(&it[i], err);
            continue;
        }
        if (b->deadline && (!L->group_deadline || b->deadline < L->group_deadline))
            L->group_deadline = b->deadline;
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
            put32(h, MAGIC_REQ);
            put32(h + 4, cma ? (x->op == MTE_OP_WRITE ? MTE_OP_WRITE_CMA : MTE_OP_READ_CMA)
                             : x->op);
            put64(h + 8, L->seq++);
            put64(h + 16, x->raddr);
            put64(h + 24, x->len);
            if (cma) {
                /* The server copies between its region and [laddr, +len) of ours. */
                put64(h + REQ_SIZE, x->laddr);
                L->iov[niov++] = (struct iovec){h, REQ_SIZE + CMA_EXTRA};
            } else {
                L->iov[niov++] = (struct iovec){h, REQ_SIZE};
                if (x->op != MTE_OP_READ && d < 0) {
                    L->iov[niov++] = (struct iovec){(void *)(uintptr_t)x->laddr, x->len};
                } else if (x->op != MTE_OP_READ) {
                    /* What is gathered so far goes first, then this payload, staged. */
                    err = send_iov(&L->io, L->iov, niov);
                    niov = 0;
                    if (!err)
                        err = device_out(L->stage, d, (const uint8_t *)(uintptr_t)x->laddr,
                                         x->len, sink_sock, &L->io);
                }
            }
        }
        if (!err)
            err = send_iov(&L->io, L->iov, niov);
    }
    /* Then collect the responses, in order. */
    int j = 0;
    for (; !err && j < nlive; j++) {
        item_t *x = &it[live[j]];
        /* READ bytes follow the reply unless the server copied them itself (same host,
         * host memory: see the send loop). */
        int inband = x->op == MTE_OP_READ && !(L->cma && dev[live[j]] < 0);
        /* A big READ reply: read just its header, then its bytes straight into place. */
        L->io.readahead = (inband && x->len >= DIRECT_RECV) ? 0 : RBUF_SIZE;
        err = fill(&L->io, RESP_SIZE);
        if (err)
            break;
        const uint8_t *r = L->io.buf + L->io.pos;
        L->io.pos += RESP_SIZE;
        int32_t st = (int32_t)get32(r + 4);
        uint64_t len = get64(r + 16);
        if (get32(r) != MAGIC_RESP || get64(r + 8) != first_seq + (uint64_t)j ||
            (st == 0 && inband && len != x->len) || ((st != 0 || !inband) && len != 0)) {
            err = MTE_E_PROTOCOL;
            break;
        }
        if (st == 0 && inband) {
            int d = dev[live[j]], cuda_err = 0;
            if (d < 0)
                err = recv_into(&L->io, (uint8_t *)(uintptr_t)x->laddr, len);
            else
                err = device_in(L->stage, d, (uint8_t *)(uintptr_t)x->laddr, len, source_sock,
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
         * usually arrives within microseconds (see spin_ns). */
        int64_t until = mte_now_ns() + spin_ns();
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
        pthread_mutex_unlock(&p->mu);
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
    if (p->qlen + n > p->qcap) {
        size_t cap = p->qcap ? p->qcap : 1024;
        while (cap < p->qlen + n)
            cap *= 2;
        item_t *q = malloc(cap * sizeof(*q));
        if (!q) {
            pthread_mutex_unlock(&p->mu);
            for (size_t i = 0; i < n; i++)
                item_done(&items[i], MTE_E_NOMEM);
            return;
        }
        for (size_t i = 0; i < p->qlen; i++)
            q[i] = p->q[(p->qhead + i) % p->qcap];
        free(p->q);
        p->q = q;
        p->qcap = cap;
        p->qhead = 0;
    }
    for (size_t i = 0; i < n; i++)
        p->q[(p->qhead + p->qlen + i) % p->qcap] = items[i];
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
        L->io = (sockio_t){.fd = -1, .buf = malloc(RBUF_SIZE), .cap = RBUF_SIZE,
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
int mte_peer_broken(const mte_peer_t *p) { return atomic_load(&p->restarted); }
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

int mte_batch_submit(mte_batch_t *b, mte_peer_t *p, int op, const uint64_t *local,
                     const uint64_t *remote, const uint64_t *lens, int len_stride,
                     uint32_t first, uint32_t n, int run_inline)
{
    if (op != MTE_OP_WRITE && op != MTE_OP_READ)
        return -1;
    if ((uint64_t)first + n > b->n)
        return -1;
    uint64_t slice = p->slice;
    /* Single-slice request on an idle lane: carry it on this thread (no hand-off). */
    if (run_inline && n == 1 && lens[0] <= slice) {
        for (int i = 0; i < p->nlanes; i++) {
            lane_t *L = &p->lanes[i];
            if (pthread_mutex_trylock(&L->busy) == 0) {
                atomic_store(&b->slices_left[first], 1);
                if (atomic_load(&p->closing)) {         /* shut down: carry nothing */
                    pthread_mutex_unlock(&L->busy);
                    item_t it = {.b = b, .idx = first, .op = (uint32_t)op, .len = lens[0]};
                    item_done(&it, MTE_E_CLOSED);
                    return 0;
                }
                item_t it = {.b = b, .idx = first, .op = (uint32_t)op, .laddr = local[0],
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
        atomic_store(&b->slices_left[idx], count);
        do {
            uint64_t l = len - off < sl ? len - off : sl;
            items[m++] = (item_t){.b = b, .idx = idx, .op = (uint32_t)op,
                                  .laddr = local[k] + off, .raddr = remote[k] + off, .len = l};
            off += l;
        } while (off < len);
    }
    peer_enqueue(p, items, m);
    free(items);
    return 0;
}

int mte_batch_add_notify(mte_batch_t *b, mte_peer_t *p, const void *msg, size_t len)
{
    if (len > NOTIFY_MAX)
        return -1;
    if (!b->notify_msg) {
        b->notify_msg = malloc(len ? len : 1);
        if (!b->notify_msg)
            return MTE_E_NOMEM;
        memcpy(b->notify_msg, msg, len);
        b->notify_len = len;
    }
    for (notify_ref_t *r = b->notify_peers; r; r = r->next)
        if (r->peer == p)
            return 0;
    notify_ref_t *r = malloc(sizeof(*r));
    if (!r)
        return MTE_E_NOMEM;
    atomic_fetch_add(&p->refs, 1);
    r->peer = p;
    r->next = b->notify_peers;
    b->notify_peers = r;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Server side                                                                          */

typedef struct conn {
    struct conn *next;
    mte_tcp_t *tcp;
    int fd;
    int64_t stall_since;        /* when the current message started waiting on the wire */
    int mid_message;
    pid_t peer_pid;             /* unix connections: the client's pid, from SO_PEERCRED */
    int cma;                    /* we can copy to and from the client's memory */
    char peer_name[256];
} conn_t;

static int conn_stop(void *ctx)
{
    conn_t *c = ctx;
    if (atomic_load(&c->tcp->closing))
        return MTE_E_CLOSED;
    /* A peer that stops sending mid-message, or trickles it, must not pin our regions
     * for ever: a message gets stall_ms from its start (checked after every recv). */
    if (c->mid_message && c->stall_since &&
        mte_now_ns() - c->stall_since > (int64_t)c->tcp->stall_ms * 1000000LL)
        return MTE_E_TIMEOUT;
    return 0;
}

typedef struct {
    sockio_t *io;
    uint8_t *buf;
    size_t len;
} obuf_t;

static int oflush(obuf_t *o)
{
    if (!o->len)
        return 0;
    int e = send_all(o->io, o->buf, o->len);
    o->len = 0;
    return e;
}

static void oresp(obuf_t *o, int32_t st, uint64_t seq, uint64_t len)
{
    uint8_t *r = o->buf + o->len;
    put32(r, MAGIC_RESP);
    put32(r + 4, (uint32_t)st);
    put64(r + 8, seq);
    put64(r + 16, len);
    o->len += RESP_SIZE;
}

static int32_t reject_code(int why)
{
    return why == -EACCES ? MTE_E_REMOTE_ACCESS : MTE_E_REMOTE_NOT_REG;
}

/* Moves len bytes between our region at `ours` and the client's memory at `theirs`
 * with process_vm_readv/writev(2): one copy, no socket. pull: client -> us (a WRITE). */
static int32_t cma_copy(pid_t pid, uint64_t ours, uint64_t theirs, uint64_t len, int pull)
{
    uint64_t done = 0;
    while (done < len) {
        struct iovec l = {(void *)(uintptr_t)(ours + done), (size_t)(len - done)};
        struct iovec r = {(void *)(uintptr_t)(theirs + done), (size_t)(len - done)};
        ssize_t k = pull ? process_vm_readv(pid, &l, 1, &r, 1, 0)
                         : process_vm_writev(pid, &l, 1, &r, 1, 0);
        if (k <= 0) {
            if (k < 0 && errno == EINTR)
                continue;
            return MTE_E_CMA;        /* the client's address is not mapped (or it is gone) */
        }
        done += (uint64_t)k;
    }
    return 0;
}

typedef struct {
    pid_t pid;
    uint64_t addr;              /* the client's memory, advanced chunk by chunk */
} cma_ctx_t;

static int cma_source(void *ctx, uint8_t *p, size_t n)
{
    cma_ctx_t *x = ctx;
    int32_t e = cma_copy(x->pid, (uint64_t)(uintptr_t)p, x->addr, n, 1);
    x->addr += n;
    return e;
}

static int cma_sink(void *ctx, const uint8_t *p, size_t n)
{
    cma_ctx_t *x = ctx;
    int32_t e = cma_copy(x->pid, (uint64_t)(uintptr_t)p, x->addr, n, 0);
    x->addr += n;
    return e;
}

static void conn_serve(conn_t *c)
{
    mte_tcp_t *t = c->tcp;
    mte_stage_t *stage = NULL;       /* pinned staging for our GPU regions, on first use */
    sockio_t io = {.fd = c->fd, .buf = malloc(RBUF_SIZE), .cap = RBUF_SIZE,
                   .readahead = RBUF_SIZE, .stop = conn_stop, .ctx = c};
    obuf_t o = {.io = &io, .buf = malloc(OBUF_SIZE), .len = 0};
    if (!io.buf || !o.buf)
        goto out;
    /* Hello: magic, version, the peer's instance, its name, flags, its nonce. */
    c->mid_message = 1;
    c->stall_since = mte_now_ns();
    if (fill(&io, HELLO_SIZE))
        goto out;
    uint8_t hello[HELLO_SIZE];
    memcpy(hello, io.buf + io.pos, HELLO_SIZE);
    io.pos += HELLO_SIZE;
    uint32_t nl = get32(hello + 16), flags = get32(hello + 20);
    const uint8_t *cnonce = hello + 24;
    uint64_t probe_addr = get64(hello + 40);
    int32_t status = 0;
    if (get32(hello) != MAGIC_HELLO || get32(hello + 4) != PROTO_VERSION || nl > 255)
        status = MTE_E_PROTOCOL;
    else if (!!(flags & HELLO_AUTH) != !!t->token_len)
        status = MTE_E_AUTH;           /* one side has a token, the other has none */
    if (status != MTE_E_PROTOCOL) {
        if (fill(&io, nl))
            goto out;
        memcpy(c->peer_name, io.buf + io.pos, nl);
        c->peer_name[nl] = 0;
        io.pos += nl;
    }
    uint8_t reply[REPLY_SIZE] = {0}, snonce[NONCE_LEN];
    put32(reply, MAGIC_HELLO);
    put32(reply + 4, (uint32_t)status);
    put64(reply + 8, t->instance);
    if (status == 0 && c->peer_pid > 0 && probe_addr) {
        /* Can we reach the client's memory? Read the value it offered and compare. */
        uint64_t got = 0;
        struct iovec l = {&got, 8}, r = {(void *)(uintptr_t)probe_addr, 8};
        c->cma = process_vm_readv(c->peer_pid, &l, 1, &r, 1, 0) == 8 &&
                 memcmp(&got, hello + 48, 8) == 0;
        put32(reply + 64, c->cma ? REPLY_CMA : 0);
    }
    if (status == 0 && t->token_len) {
        fresh_nonce(snonce);
        memcpy(reply + 16, snonce, NONCE_LEN);
        proof(t, "mte-data-server", cnonce, snonce, reply + 8, 8, reply + 16 + NONCE_LEN);
    }
    if (send_all(&io, reply, REPLY_SIZE) || status != 0) {
        if (status == MTE_E_AUTH)
            atomic_fetch_add(&t->auth_failures, 1);
        goto out;
    }
    if (t->token_len) {
        uint8_t expect[MTE_SHA256_LEN], fin[8];
        if (fill(&io, MTE_SHA256_LEN))
            goto out;
        proof(t, "mte-data-client", snonce, cnonce, c->peer_name, nl, expect);
        int bad = mte_ct_compare(expect, io.buf + io.pos, MTE_SHA256_LEN) != 0;
        io.pos += MTE_SHA256_LEN;
        put32(fin, MAGIC_HELLO);
        put32(fin + 4, bad ? (uint32_t)MTE_E_AUTH : 0);
        send_all(&io, fin, 8);
        if (bad) {
            /* Nothing this peer sent is applied: the connection ends here. */
            atomic_fetch_add(&t->auth_failures, 1);
            goto out;
        }
    }

    int served = 0;              /* requests since we last waited for the wire */
    uint64_t last_len = 0;
    for (;;) {
        if (io.end - io.pos < REQ_SIZE) {
            /* About to wait for the wire: push out the coalesced responses first. */
            if (oflush(&o))
                break;
            c->mid_message = 0;
            /* One small request answered: likely ping-pong, so poll for the next. */
            io.spin = served == 1 && last_len <= SMALL_READ;
            served = 0;
            if (fill(&io, REQ_SIZE))
                break;
            io.spin = 0;
        }
        c->mid_message = 1;
        c->stall_since = mte_now_ns();
        const uint8_t *q = io.buf + io.pos;
        uint32_t op = get32(q + 4);
        uint64_t seq = get64(q + 8), addr = get64(q + 16), len = get64(q + 24);
        if (get32(q) != MAGIC_REQ)
            break;
        io.pos += REQ_SIZE;
        served++;
        last_len = len;
        if (o.len + RESP_SIZE > OBUF_SIZE && oflush(&o))
            break;
        int why = 0;
        if (op == MTE_OP_WRITE) {
            mte_region_t *r = len ? mte_regions_pin(t->regions, addr, len,
                                                    MTE_ACC_REMOTE_WRITE, &why) : NULL;
            int32_t st = r ? 0 : reject_code(why ? why : -ENOENT);
            int d = r ? mte_region_device(r) : -1, e;
            if (d >= 0 && stage_get(&stage)) {
                /* Acknowledged below only once the bytes are in device memory. */
                int cuda_err = 0;
                e = device_in(stage, d, (uint8_t *)(uintptr_t)addr, len, source_sock, &io, 1,
                              &cuda_err);
                st = cuda_err;
            } else {
                if (d >= 0)
                    st = MTE_E_NOMEM;
                e = recv_into(&io, r && d < 0 ? (uint8_t *)(uintptr_t)addr : NULL, len);
            }
            if (r)
                mte_region_unpin(r);
            if (e)
                break;
            io.readahead = len >= DIRECT_RECV ? 0 : RBUF_SIZE;
            oresp(&o, st, seq, 0);
        } else if (op == MTE_OP_READ) {
            mte_region_t *r = len ? mte_regions_pin(t->regions, addr, len,
                                                    MTE_ACC_REMOTE_READ, &why) : NULL;
            if (!r) {
                oresp(&o, reject_code(why ? why : -ENOENT), seq, 0);
                continue;
            }
            int e = 0, d = mte_region_device(r);
            if (d >= 0) {
                if (!stage_get(&stage)) {
                    mte_region_unpin(r);
                    oresp(&o, MTE_E_NOMEM, seq, 0);
                    continue;
                }
                oresp(&o, 0, seq, len);
                e = oflush(&o);
                if (!e)
                    e = device_out(stage, d, (const uint8_t *)(uintptr_t)addr, len, sink_sock,
                                   &io);
            } else if (len <= SMALL_READ) {
                if (o.len + RESP_SIZE + len > OBUF_SIZE)
                    e = oflush(&o);
                if (!e) {
                    oresp(&o, 0, seq, len);
                    memcpy(o.buf + o.len, (void *)(uintptr_t)addr, len);
                    o.len += len;
                }
            } else {
                oresp(&o, 0, seq, len);
                struct iovec iov[2] = {{o.buf, o.len}, {(void *)(uintptr_t)addr, len}};
                e = send_iov(&io, iov, 2);
                o.len = 0;
            }
            mte_region_unpin(r);
            if (e)
                break;
        } else if ((op == MTE_OP_WRITE_CMA || op == MTE_OP_READ_CMA) && c->cma) {
            if (fill(&io, CMA_EXTRA))
                break;
            uint64_t peer_addr = get64(io.buf + io.pos);
            io.pos += CMA_EXTRA;
            int pull = op == MTE_OP_WRITE_CMA;
            mte_region_t *r = len ? mte_regions_pin(t->regions, addr, len, pull ?
                                                    MTE_ACC_REMOTE_WRITE : MTE_ACC_REMOTE_READ,
                                                    &why) : NULL;
            /* A client that hung up has released its memory: touch nothing of it. */
            struct pollfd hup = {.fd = c->fd, .events = POLLRDHUP};
            int gone = poll(&hup, 1, 0) > 0 && (hup.revents & (POLLRDHUP | POLLHUP | POLLERR));
            int d = r ? mte_region_device(r) : -1;
            int32_t st = gone ? MTE_E_CLOSED : !r ? reject_code(why ? why : -ENOENT) : 0;
            if (!st && d < 0) {
                st = cma_copy(c->peer_pid, addr, peer_addr, len, pull);
            } else if (!st && !stage_get(&stage)) {
                st = MTE_E_NOMEM;
            } else if (!st) {
                /* Our region is GPU memory: the client's bytes pass through staging. */
                cma_ctx_t x = {c->peer_pid, peer_addr};
                int cuda_err = 0;
                st = pull ? device_in(stage, d, (uint8_t *)(uintptr_t)addr, len, cma_source, &x,
                                      0, &cuda_err)
                          : device_out(stage, d, (const uint8_t *)(uintptr_t)addr, len,
                                       cma_sink, &x);
                if (!st)
                    st = cuda_err;
            }
            if (r)
                mte_region_unpin(r);
            oresp(&o, st, seq, 0);
        } else if (op == MTE_OP_NOTIFY && len <= NOTIFY_MAX) {
            char *msg = malloc(len ? len : 1);
            if (!msg || recv_into(&io, (uint8_t *)msg, len)) {
                free(msg);
                break;
            }
            mte_tcp_push_notification(t, c->peer_name, msg, len);
            free(msg);
            oresp(&o, 0, seq, 0);
        } else {
            break;    /* protocol violation: drop the connection */
        }
    }
out:
    mte_stage_free(stage);
    free(io.buf);
    free(o.buf);
}

static void *conn_main(void *arg)
{
    conn_t *c = arg;
    mte_tcp_t *t = c->tcp;
    conn_serve(c);
    pthread_mutex_lock(&t->mu);
    for (conn_t **pp = &t->conns; *pp; pp = &(*pp)->next) {
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    }
    close(c->fd);
    free(c);
    t->nconns--;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

static void *accept_loop(mte_tcp_t *t, int lfd, int is_unix)
{
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (atomic_load(&t->closing))
                break;
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
                if (errno == EMFILE || errno == ENFILE)
                    usleep(10000);
                continue;
            }
            break;
        }
        set_tick(fd, 500);
        conn_t *c = calloc(1, sizeof(*c));
        if (!c) {
            close(fd);
            continue;
        }
        c->tcp = t;
        c->fd = fd;
        if (is_unix) {
            struct ucred cred;
            socklen_t cl = sizeof(cred);
            /* Kernel-verified: the client cannot lie. Only a client of our own uid may have
             * us copy into its memory (a privileged server must not become a way into
             * other users' processes). */
            if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0 &&
                cred.uid == geteuid())
                c->peer_pid = cred.pid;
        }
        pthread_mutex_lock(&t->mu);
        if (atomic_load(&t->closing)) {
            pthread_mutex_unlock(&t->mu);
            close(fd);
            free(c);
            break;
        }
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &attr, conn_main, c) != 0) {
            pthread_mutex_unlock(&t->mu);
            pthread_attr_destroy(&attr);
            close(fd);
            free(c);
            continue;
        }
        pthread_attr_destroy(&attr);
        c->next = t->conns;
        t->conns = c;
        t->nconns++;
        pthread_mutex_unlock(&t->mu);
    }
    return NULL;
}

static void *accept_main(void *arg)
{
    mte_tcp_t *t = arg;
    return accept_loop(t, t->listen_fd, 0);
}

static void *accept_unix_main(void *arg)
{
    mte_tcp_t *t = arg;
    return accept_loop(t, t->uds_fd, 1);
}

/* The same-host listener: an abstract unix socket named after our instance id. */
static int listen_unix(mte_tcp_t *t)
{
    snprintf(t->uds_name, sizeof(t->uds_name), "mooncake_te.%d.%016llx", (int)getpid(),
             (unsigned long long)t->instance);
    struct sockaddr_un a;
    socklen_t len = unix_addr(&a, t->uds_name);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (bind(fd, (struct sockaddr *)&a, len) < 0 || listen(fd, 128) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

mte_tcp_t *mte_tcp_new(mte_regions_t *regions, const char *bind_host, int port,
                       const char *name, uint64_t instance, int stall_ms,
                       const void *token, size_t token_len, int *err)
{
    *err = 0;
    if (token_len > 256) {
        *err = -EINVAL;
        return NULL;
    }
    char portstr[16];
    snprintf(portstr, sizeof(portstr), "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE}, *res = NULL;
    int gai = getaddrinfo(bind_host && *bind_host ? bind_host : NULL, portstr, &hints, &res);
    if (gai != 0) {
        *err = -EADDRNOTAVAIL;
        return NULL;
    }
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        *err = -errno;
        freeaddrinfo(res);
        return NULL;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, res->ai_addr, res->ai_addrlen) < 0 || listen(fd, 128) < 0) {
        *err = -errno;
        close(fd);
        freeaddrinfo(res);
        return NULL;
    }
    freeaddrinfo(res);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    mte_tcp_t *t = calloc(1, sizeof(*t));
    if (!t) {
        close(fd);
        *err = -ENOMEM;
        return NULL;
    }
    t->regions = regions;
    t->listen_fd = fd;
    t->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    snprintf(t->name, sizeof(t->name), "%s", name ? name : "");
    t->instance = instance;
    t->stall_ms = stall_ms > 0 ? stall_ms : 30000;
    if (token_len)
        memcpy(t->token, token, token_len);
    t->token_len = token_len;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    if (pthread_create(&t->accept_thread, NULL, accept_main, t) != 0) {
        close(fd);
        free(t);
        *err = -EAGAIN;
        return NULL;
    }
    /* Same-host peers are optional: without the listener they simply use TCP. */
    t->uds_fd = listen_unix(t);
    if (t->uds_fd >= 0 && pthread_create(&t->uds_thread, NULL, accept_unix_main, t) != 0) {
        close(t->uds_fd);
        t->uds_fd = -1;
    }
    if (t->uds_fd < 0)
        t->uds_name[0] = 0;
    return t;
}

int mte_tcp_port(const mte_tcp_t *t) { return t->port; }
const char *mte_tcp_uds_name(const mte_tcp_t *t) { return t->uds_name; }
uint64_t mte_tcp_auth_failures(const mte_tcp_t *t) { return atomic_load(&t->auth_failures); }

void mte_tcp_free(mte_tcp_t *t)
{
    if (!t)
        return;
    atomic_store(&t->closing, 1);
    shutdown(t->listen_fd, SHUT_RDWR);
    pthread_join(t->accept_thread, NULL);
    close(t->listen_fd);
    if (t->uds_fd >= 0) {
        shutdown(t->uds_fd, SHUT_RDWR);
        pthread_join(t->uds_thread, NULL);
        close(t->uds_fd);
    }
    pthread_mutex_lock(&t->mu);
    for (conn_t *c = t->conns; c; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    while (t->nconns > 0)
        pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
    mte_notif_free(t->notif_head);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t);
}

int mte_tcp_push_notification(mte_tcp_t *t, const char *sender, const void *msg, size_t len)
{
    mte_notif_t *n = malloc(sizeof(*n) + len + 1);
    if (!n)
        return MTE_E_NOMEM;
    n->next = NULL;
    n->sender = strdup(sender ? sender : "");
    n->len = len;
    memcpy(n->msg, msg, len);
    n->msg[len] = 0;
    pthread_mutex_lock(&t->mu);
    if (t->notif_tail)
        t->notif_tail->next = n;
    else
        t->notif_head = n;
    t->notif_tail = n;
    pthread_mutex_unlock(&t->mu);
    return 0;
}

mte_notif_t *mte_tcp_take_notifications(mte_tcp_t *t)
{
    pthread_mutex_lock(&t->mu);
    mte_notif_t *n = t->notif_head;
    t->notif_head = t->notif_tail = NULL;
    pthread_mutex_unlock(&t->mu);
    return n;
}

void mte_notif_free(mte_notif_t *n)
{
    while (n) {
        mte_notif_t *nx = n->next;
        free(n->sender);
        free(n);
        n = nx;
    }
}

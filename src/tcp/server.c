/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport's server side: the listeners (TCP and the same-host unix socket),
 * one thread per connection, the connection's handshake (conn_handshake) and the
 * handlers of the five request ops, and received notifications (tcp.h, wire.h). */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define OBUF_SIZE (256u << 10)
#define REQ_SIZE MTE_WIRE_REQ_SIZE
#define RESP_SIZE MTE_WIRE_RESP_SIZE
#define CMA_EXTRA MTE_WIRE_CMA_EXTRA
#define RBUF_SIZE MTE_TCP_RBUF_SIZE
#define SMALL_READ MTE_TCP_SMALL_READ

static int sink_sock(void *ctx, const uint8_t *p, size_t n) { return mte_sock_send_all(ctx, p, n); }
static int source_sock(void *ctx, uint8_t *p, size_t n) { return mte_sock_recv_into(ctx, p, n); }

typedef struct conn {
    struct conn *next;
    mte_tcp_t *tcp;
    int fd;
    int64_t stall_since;        /* when the current message started waiting on the wire */
    int mid_message;
    int ready;                  /* the hello (and authentication) is done */
    int evicted;                /* shut down by preauth_admit (under mu) */
    int64_t accepted_ns;        /* the hello must be done by accepted_ns + auth_ms */
    int64_t idle_since;         /* between requests: when the last one was answered */
    int64_t partial_since;      /* between requests: when a header began to arrive */
    mte_sockio_t *io;           /* the connection's buffered reader (bytes waiting) */
    uint8_t peer_key[16];       /* the peer's address (TCP) or pid (unix), for max_per_peer */
    pid_t peer_pid;             /* unix connections: the client's pid, from SO_PEERCRED */
    int pidfd;                  /* ...and a pidfd on that very process, or -1 */
    int cma;                    /* we can copy to and from the client's memory */
    char peer_name[256];
} conn_t;

static int conn_stop(void *ctx)
{
    conn_t *c = ctx;
    mte_tcp_t *t = c->tcp;
    if (atomic_load(&t->closing))
        return MTE_E_CLOSED;
    int64_t now = mte_now_ns();
    if (!c->ready) {
        /* The hello and its proof within auth_ms of the accept: a peer that connects and
         * says nothing (or cannot authenticate) does not keep a thread and an fd. */
        if (now - c->accepted_ns > (int64_t)atomic_load(&t->auth_ms) * 1000000LL) {
            atomic_fetch_add(&t->conns_refused, 1);
            return MTE_E_TIMEOUT;
        }
        return 0;
    }
    /* A peer that stops sending mid-message, or trickles it, must not pin our regions
     * for ever: a message gets stall_ms from its start (checked after every recv). */
    if (c->mid_message)
        return c->stall_since && now - c->stall_since > (int64_t)t->stall_ms * 1000000LL
               ? MTE_E_TIMEOUT : 0;
    if (c->io && c->io->end > c->io->pos) {
        /* Part of a request header arrived: the rest gets stall_ms too. */
        if (!c->partial_since)
            c->partial_since = now;
        return now - c->partial_since > (int64_t)t->stall_ms * 1000000LL ? MTE_E_TIMEOUT : 0;
    }
    int idle_ms = atomic_load(&t->idle_ms);
    if (idle_ms > 0 && now - c->idle_since > (int64_t)idle_ms * 1000000LL) {
        atomic_fetch_add(&t->conns_refused, 1);
        return MTE_E_CLOSED;          /* idle: the client's lane reconnects when needed */
    }
    return 0;
}

typedef struct {
    mte_sockio_t *io;
    uint8_t *buf;
    size_t len;
} obuf_t;

static int oflush(obuf_t *o)
{
    if (!o->len)
        return 0;
    int e = mte_sock_send_all(o->io, o->buf, o->len);
    o->len = 0;
    return e;
}

static void oresp(obuf_t *o, int32_t st, uint64_t seq, uint64_t len)
{
    mte_wire_resp_t r = {.status = st, .seq = seq, .len = len};
    mte_wire_resp_encode(o->buf + o->len, &r);
    o->len += RESP_SIZE;
}

static int32_t reject_code(int why)
{
    return why == -EACCES ? MTE_E_REMOTE_ACCESS : MTE_E_REMOTE_NOT_REG;
}

/* Issue #20 item 10: a pid names a process only while that process lives. A client that
 * hands its socket to another process and exits leaves us a pid the kernel may give to an
 * unrelated process. So a pidfd is taken at accept (SO_PEERPIDFD, Linux 6.5, names the
 * very process that connected; else pidfd_open(2) on the SO_PEERCRED pid, Linux 5.3) and
 * process_vm_* is used only while it says that process is alive: a pid cannot be reused
 * before its process has exited and been reaped. Without a pidfd, no CMA (socket path). */
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

static int peer_pidfd(int fd, pid_t pid)
{
    int pidfd = -1;
    socklen_t l = sizeof(pidfd);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &l) == 0 && pidfd >= 0)
        return pidfd;
    return (int)syscall(SYS_pidfd_open, pid, 0);
}

/* 1 while the process behind pidfd runs (a pidfd polls readable once it has exited). */
static int pidfd_alive(int pidfd)
{
    struct pollfd p = {.fd = pidfd, .events = POLLIN};
    return pidfd >= 0 && poll(&p, 1, 0) == 0;
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


/* A connection's state while it serves requests. */
typedef struct {
    conn_t *c;
    mte_tcp_t *t;
    mte_sockio_t io;
    obuf_t o;
    mte_stage_t *stage;         /* pinned staging for our GPU regions, made on first use */
} serve_t;

/* The hello (wire.h) and, with a token, the mutual proof. 0 when requests may follow. */
static int conn_handshake(serve_t *s)
{
    conn_t *c = s->c;
    mte_tcp_t *t = s->t;
    mte_sockio_t *io = &s->io;
    c->mid_message = 1;
    c->stall_since = mte_now_ns();
    if (mte_sock_fill(io, MTE_WIRE_HELLO_SIZE))
        return -1;
    mte_hello_t h;
    int32_t status = mte_wire_hello_decode(io->buf + io->pos, &h);
    io->pos += MTE_WIRE_HELLO_SIZE;
    uint32_t nl = h.name_len;
    if (status || h.version != MTE_WIRE_VERSION || nl > MTE_WIRE_NAME_MAX)
        status = MTE_E_PROTOCOL;
    else if (!!(h.flags & MTE_WIRE_HELLO_AUTH) != !!t->token_len)
        status = MTE_E_AUTH;           /* one side has a token, the other has none */
    if (status != MTE_E_PROTOCOL) {
        if (mte_sock_fill(io, nl))
            return -1;
        memcpy(c->peer_name, io->buf + io->pos, nl);
        c->peer_name[nl] = 0;
        io->pos += nl;
    }
    mte_hello_reply_t r = {.status = status, .instance = t->instance};
    if (status == 0 && c->peer_pid > 0 && h.probe_addr && pidfd_alive(c->pidfd)) {
        /* Can we reach the client's memory? Read the value it offered and compare. */
        uint64_t got = 0;
        struct iovec l = {&got, 8}, rv = {(void *)(uintptr_t)h.probe_addr, 8};
        c->cma = process_vm_readv(c->peer_pid, &l, 1, &rv, 1, 0) == 8 &&
                 memcmp(&got, h.probe_value, 8) == 0;
        r.flags = c->cma ? MTE_WIRE_REPLY_CMA : 0;
    }
    if (status == 0 && t->token_len) {
        /* Bind our segment name too when the client asks (issue #20 item 7). */
        uint8_t who[8 + MTE_WIRE_NAME_MAX];
        int named = (h.flags & MTE_WIRE_HELLO_AUTH_NAMED) != 0;
        size_t wl = mte_wire_server_identity(who, t->instance, named ? t->name : NULL);
        if (named)
            r.flags |= MTE_WIRE_REPLY_NAMED;
        mte_wire_nonce(r.nonce);
        mte_wire_proof(t->token, t->token_len, MTE_WIRE_SERVER_LABEL, h.nonce, r.nonce,
                       who, wl, r.proof);
    }
    uint8_t reply[MTE_WIRE_REPLY_SIZE];
    mte_wire_reply_encode(reply, &r);
    if (mte_sock_send_all(io, reply, MTE_WIRE_REPLY_SIZE) || status != 0) {
        if (status == MTE_E_AUTH)
            atomic_fetch_add(&t->auth_failures, 1);
        return -1;
    }
    if (t->token_len) {
        uint8_t expect[MTE_SHA256_LEN], fin[MTE_WIRE_FIN_SIZE];
        if (mte_sock_fill(io, MTE_SHA256_LEN))
            return -1;
        mte_wire_proof(t->token, t->token_len, MTE_WIRE_CLIENT_LABEL, r.nonce, h.nonce,
                       c->peer_name, nl, expect);
        int bad = mte_ct_compare(expect, io->buf + io->pos, MTE_SHA256_LEN) != 0;
        io->pos += MTE_SHA256_LEN;
        mte_wire_fin_encode(fin, bad ? MTE_E_AUTH : 0);
        mte_sock_send_all(io, fin, MTE_WIRE_FIN_SIZE);
        if (bad) {
            /* Nothing this peer sent is applied: the connection ends here. */
            atomic_fetch_add(&t->auth_failures, 1);
            return -1;
        }
    }
    return 0;
}

/* The op handlers: each answers its request (coalesced in s->o) and returns 0, or
 * nonzero when the stream is out of step and the connection must be dropped. */

static int serve_write(serve_t *s, const mte_wire_req_t *q)
{
    int why = 0;
    mte_region_t *r = q->len ? mte_regions_pin(s->t->regions, q->addr, q->len,
                                               MTE_ACC_REMOTE_WRITE, &why) : NULL;
    int32_t st = r ? 0 : reject_code(why ? why : -ENOENT);
    int d = r ? mte_region_device(r) : -1, e;
    if (d >= 0 && mte_stage_get(&s->stage)) {
        /* Acknowledged below only once the bytes are in device memory. */
        int cuda_err = 0;
        e = mte_stage_in(s->stage, d, (uint8_t *)(uintptr_t)q->addr, q->len, source_sock, &s->io,
                         1, &cuda_err);
        st = cuda_err;
    } else {
        if (d >= 0)
            st = MTE_E_NOMEM;
        e = mte_sock_recv_into(&s->io, r && d < 0 ? (uint8_t *)(uintptr_t)q->addr : NULL,
                               q->len);
    }
    if (r)
        mte_region_unpin(r);
    if (e)
        return e;
    s->io.readahead = q->len >= MTE_DIRECT_RECV ? 0 : RBUF_SIZE;
    oresp(&s->o, st, q->seq, 0);
    return 0;
}

static int serve_read(serve_t *s, const mte_wire_req_t *q)
{
    int why = 0;
    obuf_t *o = &s->o;
    uint64_t addr = q->addr, len = q->len;
    mte_region_t *r = len ? mte_regions_pin(s->t->regions, addr, len, MTE_ACC_REMOTE_READ,
                                            &why) : NULL;
    if (!r) {
        oresp(o, reject_code(why ? why : -ENOENT), q->seq, 0);
        return 0;
    }
    int e = 0, d = mte_region_device(r);
    if (d >= 0) {
        if (!mte_stage_get(&s->stage)) {
            mte_region_unpin(r);
            oresp(o, MTE_E_NOMEM, q->seq, 0);
            return 0;
        }
        oresp(o, 0, q->seq, len);
        e = oflush(o);
        if (!e)
            e = mte_stage_out(s->stage, d, (const uint8_t *)(uintptr_t)addr, len, sink_sock,
                              &s->io);
    } else if (len <= SMALL_READ) {
        if (o->len + RESP_SIZE + len > OBUF_SIZE)
            e = oflush(o);
        if (!e) {
            oresp(o, 0, q->seq, len);
            memcpy(o->buf + o->len, (void *)(uintptr_t)addr, len);
            o->len += len;
        }
    } else {
        oresp(o, 0, q->seq, len);
        struct iovec iov[2] = {{o->buf, o->len}, {(void *)(uintptr_t)addr, len}};
        e = mte_sock_send_iov(&s->io, iov, 2);
        o->len = 0;
    }
    mte_region_unpin(r);
    return e;
}

/* Same host: we copy between our region and the client's memory ourselves. */
static int serve_cma(serve_t *s, const mte_wire_req_t *q)
{
    conn_t *c = s->c;
    mte_sockio_t *io = &s->io;
    int why = 0;
    if (mte_sock_fill(io, CMA_EXTRA))
        return -1;
    uint64_t peer_addr = mte_wire_get64(io->buf + io->pos);
    io->pos += CMA_EXTRA;
    uint64_t addr = q->addr, len = q->len;
    int pull = q->op == MTE_OP_WRITE_CMA;
    mte_region_t *r = len ? mte_regions_pin(s->t->regions, addr, len, pull ?
                                            MTE_ACC_REMOTE_WRITE : MTE_ACC_REMOTE_READ,
                                            &why) : NULL;
    /* A client that hung up has released its memory: touch nothing of it. And the
     * process that connected must still live, or its pid may now name another process
     * (issue #20 item 10; its pidfd polls readable once it exited). One poll(2) asks
     * both, once per request. */
    struct pollfd pf[2] = {{.fd = c->fd, .events = POLLRDHUP}, {.fd = c->pidfd, .events = POLLIN}};
    int gone = 0, exited = c->pidfd < 0;
    if (poll(pf, 2, 0) > 0) {
        gone = (pf[0].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
        exited = exited || pf[1].revents != 0;
    }
    int d = r ? mte_region_device(r) : -1;
    int32_t st = gone ? MTE_E_CLOSED : !r ? reject_code(why ? why : -ENOENT) : 0;
    if (!st && exited)
        st = MTE_E_CMA;
    if (!st && d < 0) {
        st = cma_copy(c->peer_pid, addr, peer_addr, len, pull);
    } else if (!st && !mte_stage_get(&s->stage)) {
        st = MTE_E_NOMEM;
    } else if (!st) {
        /* Our region is GPU memory: the client's bytes pass through staging. */
        cma_ctx_t x = {c->peer_pid, peer_addr};
        int cuda_err = 0;
        st = pull ? mte_stage_in(s->stage, d, (uint8_t *)(uintptr_t)addr, len, cma_source, &x,
                                 0, &cuda_err)
                  : mte_stage_out(s->stage, d, (const uint8_t *)(uintptr_t)addr, len,
                                  cma_sink, &x);
        if (!st)
            st = cuda_err;
    }
    if (r)
        mte_region_unpin(r);
    oresp(&s->o, st, q->seq, 0);
    return 0;
}

static int serve_notify(serve_t *s, const mte_wire_req_t *q)
{
    char *msg = malloc(q->len ? q->len : 1);
    if (!msg || mte_sock_recv_into(&s->io, (uint8_t *)msg, q->len)) {
        free(msg);
        return -1;
    }
    /* The sender learns when the queue was full (MTE_E_NOTIFY_FULL): nothing is dropped
     * silently. */
    int32_t st = mte_tcp_push_notification(s->t, s->c->peer_name, msg, q->len);
    if (st == 0)
        atomic_fetch_add(&s->t->notifs_received, 1);
    else
        atomic_fetch_add(&s->t->notifs_dropped, 1);
    free(msg);
    oresp(&s->o, st, q->seq, 0);
    return 0;
}

static void conn_serve(conn_t *c)
{
    serve_t s = {.c = c, .t = c->tcp,
                 .io = {.fd = c->fd, .buf = malloc(RBUF_SIZE), .cap = RBUF_SIZE,
                        .readahead = RBUF_SIZE, .stop = conn_stop, .ctx = c}};
    s.o = (obuf_t){.io = &s.io, .buf = malloc(OBUF_SIZE), .len = 0};
    mte_sockio_t *io = &s.io;
    c->io = io;
    if (!io->buf || !s.o.buf || conn_handshake(&s))
        goto out;
    /* Under mu: the accept loop counts the connections not yet ready (preauth_admit). */
    pthread_mutex_lock(&c->tcp->mu);
    c->ready = 1;
    pthread_mutex_unlock(&c->tcp->mu);
    c->idle_since = mte_now_ns();
    int served = 0;              /* requests since we last waited for the wire */
    uint64_t last_len = 0;
    for (;;) {
        if (io->end - io->pos < REQ_SIZE) {
            /* About to wait for the wire: push out the coalesced responses first. */
            if (oflush(&s.o))
                break;
            c->mid_message = 0;
            c->idle_since = mte_now_ns();
            c->partial_since = 0;
            /* One small request answered: likely ping-pong, so poll for the next. */
            io->spin = served == 1 && last_len <= SMALL_READ;
            served = 0;
            if (mte_sock_fill(io, REQ_SIZE))
                break;
            io->spin = 0;
        }
        c->mid_message = 1;
        c->stall_since = mte_now_ns();
        mte_wire_req_t q;
        if (mte_wire_req_decode(io->buf + io->pos, &q))
            break;
        io->pos += REQ_SIZE;
        served++;
        last_len = q.len;
        if (s.o.len + RESP_SIZE > OBUF_SIZE && oflush(&s.o))
            break;
        int e;
        if (q.op == MTE_OP_WRITE)
            e = serve_write(&s, &q);
        else if (q.op == MTE_OP_READ)
            e = serve_read(&s, &q);
        else if ((q.op == MTE_OP_WRITE_CMA || q.op == MTE_OP_READ_CMA) && c->cma)
            e = serve_cma(&s, &q);
        else if (q.op == MTE_OP_NOTIFY && q.len <= MTE_NOTIFY_MAX)
            e = serve_notify(&s, &q);
        else {
            if (q.op == MTE_OP_NOTIFY)
                atomic_fetch_add(&s.t->notifs_dropped, 1);     /* over MTE_NOTIFY_MAX */
            e = -1;    /* protocol violation: drop the connection */
        }
        if (e)
            break;
    }
out:
    mte_stage_free(s.stage);
    free(io->buf);
    free(s.o.buf);
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
    if (c->pidfd >= 0)
        close(c->pidfd);
    free(c);
    t->nconns--;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Connections from the peer with this key (under t->mu). */
static int conns_from(mte_tcp_t *t, const uint8_t key[16])
{
    int n = 0;
    for (conn_t *c = t->conns; c; c = c->next)
        n += memcmp(c->peer_key, key, 16) == 0;
    return n;
}

/* Issue #35: connections that have not finished their hello (and authentication) may
 * hold at most a quarter of max_conns, and at most MTE_TCP_PREAUTH_PER_PEER from one
 * peer address; before, six addresses that never authenticated filled the whole cap
 * (max_per_peer each) and no peer with the token could connect until auth_ms passed.
 * When that quarter is full, a newcomer from an address with fewer connections
 * waiting than another address has takes the place of the oldest waiting connection of
 * the address with the most (that one is shut down): a flood from a few addresses cannot
 * keep out a peer that connects now and then. Under mu; 0: admit, -1: refuse. */
#define MTE_TCP_PREAUTH_PER_PEER 64

static int preauth_from(mte_tcp_t *t, const uint8_t key[16])
{
    int n = 0;
    for (conn_t *c = t->conns; c; c = c->next)
        n += !c->ready && !c->evicted && memcmp(c->peer_key, key, 16) == 0;
    return n;
}

static int preauth_admit(mte_tcp_t *t, const uint8_t key[16])
{
    int cap = atomic_load(&t->max_conns) / 4;
    if (cap < 1)
        cap = 1;
    int total = 0;
    for (conn_t *c = t->conns; c; c = c->next)
        total += !c->ready && !c->evicted;
    int mine = preauth_from(t, key);
    if (mine >= MTE_TCP_PREAUTH_PER_PEER)
        return -1;
    if (total < cap)
        return 0;
    conn_t *victim = NULL;
    int most = mine;
    /* The list is newest first: ">=" keeps the oldest of the address with the most. */
    for (conn_t *c = t->conns; c; c = c->next) {
        if (c->ready || c->evicted)
            continue;
        int n = preauth_from(t, c->peer_key);
        if (n > mine && n >= most) {
            most = n;
            victim = c;
        }
    }
    if (!victim)
        return -1;
    /* Its thread sees the end of the stream and closes it (the fd is closed under mu,
     * so it is still ours to shut down here). */
    shutdown(victim->fd, SHUT_RDWR);
    victim->evicted = 1;           /* not counted again while its thread winds down */
    atomic_fetch_add(&t->conns_refused, 1);
    return 0;
}

static void *accept_loop(mte_tcp_t *t, int lfd, int is_unix)
{
    for (;;) {
        struct sockaddr_storage sa;
        socklen_t sal = sizeof(sa);
        int fd = accept4(lfd, (struct sockaddr *)&sa, &sal, SOCK_CLOEXEC);
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
        mte_sock_set_tick(fd, 500);
        conn_t *c = calloc(1, sizeof(*c));
        if (!c) {
            close(fd);
            continue;
        }
        c->tcp = t;
        c->fd = fd;
        c->pidfd = -1;
        c->accepted_ns = mte_now_ns();
        if (!is_unix && sa.ss_family == AF_INET)
            memcpy(c->peer_key, &((struct sockaddr_in *)&sa)->sin_addr, 4);
        else if (!is_unix && sa.ss_family == AF_INET6)
            memcpy(c->peer_key, &((struct sockaddr_in6 *)&sa)->sin6_addr, 16);
        if (is_unix) {
            struct ucred cred;
            socklen_t cl = sizeof(cred);
            /* Kernel-verified: the client cannot lie. Only a client of our own uid may have
             * us copy into its memory (a privileged server must not become a way into
             * other users' processes). */
            int have = getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0;
            if (have && cred.uid == geteuid()) {
                c->pidfd = peer_pidfd(fd, cred.pid);
                if (c->pidfd >= 0)
                    c->peer_pid = cred.pid;      /* else no CMA: the socket path is safe */
            }
            /* Same host: a peer is a process (the key's first byte marks it a pid). */
            int32_t who = have ? (int32_t)cred.pid : -1;
            c->peer_key[0] = 0xff;
            memcpy(c->peer_key + 12, &who, 4);
        }
        pthread_mutex_lock(&t->mu);
        if (atomic_load(&t->closing)) {
            pthread_mutex_unlock(&t->mu);
            close(fd);
            if (c->pidfd >= 0)
                close(c->pidfd);
            free(c);
            break;
        }
        if (t->nconns >= atomic_load(&t->max_conns) ||
            conns_from(t, c->peer_key) >= atomic_load(&t->max_per_peer) ||
            preauth_admit(t, c->peer_key)) {
            /* Over the limits: closed at once (the peer sees the connection end), so one
             * peer cannot take the descriptors and threads that others need. */
            pthread_mutex_unlock(&t->mu);
            atomic_fetch_add(&t->conns_refused, 1);
            close(fd);
            if (c->pidfd >= 0)
                close(c->pidfd);
            free(c);
            continue;
        }
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &attr, conn_main, c) != 0) {
            pthread_mutex_unlock(&t->mu);
            pthread_attr_destroy(&attr);
            close(fd);
            if (c->pidfd >= 0)
                close(c->pidfd);
            free(c);
            continue;
        }
        pthread_attr_destroy(&attr);
        c->next = t->conns;
        t->conns = c;
        t->nconns++;
        atomic_fetch_add(&t->conns_accepted, 1);
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
    return mte_sock_listen_unix(t->uds_name);
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
    atomic_init(&t->max_conns, 1024);
    atomic_init(&t->max_per_peer, 128);
    atomic_init(&t->auth_ms, 10000);
    atomic_init(&t->idle_ms, 600000);
    if (token_len)
        memcpy(t->token, token, token_len);
    t->token_len = token_len;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->notif_cv, &ca);
    pthread_condattr_destroy(&ca);
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

void mte_tcp_set_limits(mte_tcp_t *t, int max_conns, int max_per_peer, int auth_ms,
                        int idle_ms)
{
    if (max_conns > 0)
        atomic_store(&t->max_conns, max_conns);
    if (max_per_peer > 0)
        atomic_store(&t->max_per_peer, max_per_peer);
    if (auth_ms > 0)
        atomic_store(&t->auth_ms, auth_ms);
    if (idle_ms >= 0)
        atomic_store(&t->idle_ms, idle_ms);
}
const char *mte_tcp_uds_name(const mte_tcp_t *t) { return t->uds_name; }
uint64_t mte_tcp_auth_failures(const mte_tcp_t *t) { return atomic_load(&t->auth_failures); }

void mte_tcp_counters(mte_tcp_t *t, uint64_t out[MTE_TCP_COUNTERS])
{
    pthread_mutex_lock(&t->mu);
    out[0] = (uint64_t)t->nconns;
    pthread_mutex_unlock(&t->mu);
    out[1] = atomic_load(&t->conns_accepted);
    out[2] = atomic_load(&t->auth_failures);
    out[3] = atomic_load(&t->notifs_received);
    out[4] = atomic_load(&t->notifs_dropped);
    out[5] = atomic_load(&t->conns_refused);
}

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
    pthread_cond_broadcast(&t->notif_cv);   /* closing is set: waiters leave */
    while (t->notif_waiters > 0)
        pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
    mte_notif_free(t->notif_head);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    pthread_cond_destroy(&t->notif_cv);
    free(t);
}

int mte_tcp_push_notification(mte_tcp_t *t, const char *sender, const void *msg, size_t len)
{
    pthread_mutex_lock(&t->mu);
    int full = t->notif_count >= MTE_TCP_NOTIFY_QUEUE_COUNT ||
               t->notif_bytes + len > MTE_TCP_NOTIFY_QUEUE_BYTES;
    if (!full) {                 /* reserve the room before allocating */
        t->notif_count++;
        t->notif_bytes += len;
    }
    pthread_mutex_unlock(&t->mu);
    if (full)
        return MTE_E_NOTIFY_FULL;
    mte_notif_t *n = malloc(sizeof(*n) + len + 1);
    if (!n) {
        pthread_mutex_lock(&t->mu);
        t->notif_count--;
        t->notif_bytes -= len;
        pthread_mutex_unlock(&t->mu);
        return MTE_E_NOMEM;
    }
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
    pthread_cond_broadcast(&t->notif_cv);
    pthread_mutex_unlock(&t->mu);
    return 0;
}

void mte_tcp_wait_enter(mte_tcp_t *t)
{
    pthread_mutex_lock(&t->mu);
    t->notif_waiters++;
    pthread_mutex_unlock(&t->mu);
}

int mte_tcp_wait_notifications(mte_tcp_t *t, int timeout_ms)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    if (timeout_ms < 0)
        timeout_ms = 0;
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&t->mu);
    int rc = 0;
    while (!t->notif_head && !atomic_load(&t->closing) && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&t->notif_cv, &t->mu, &until);
    int any = t->notif_head != NULL;
    if (--t->notif_waiters == 0 && atomic_load(&t->closing))
        pthread_cond_broadcast(&t->cv);      /* mte_tcp_free waits for the last waiter */
    pthread_mutex_unlock(&t->mu);
    return any;
}

mte_notif_t *mte_tcp_take_notifications(mte_tcp_t *t)
{
    pthread_mutex_lock(&t->mu);
    mte_notif_t *n = t->notif_head;
    t->notif_head = t->notif_tail = NULL;
    t->notif_count = t->notif_bytes = 0;
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

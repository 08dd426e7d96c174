/* SPDX-License-Identifier: Apache-2.0 */
/* See sockio.h. */
#define _GNU_SOURCE
#include "sockio.h"
#include "metrics.h"
#include "clock.h"
#include "status.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

static int io_err(void) { return MTE_E_SOCKET; }

int mte_sock_send_iov(mte_sockio_t *s, struct iovec *iov, int n)
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

int mte_sock_send_all(mte_sockio_t *s, const void *p, size_t n)
{
    struct iovec iov = {.iov_base = (void *)p, .iov_len = n};
    return mte_sock_send_iov(s, &iov, 1);
}

/* One recv into dst (at most n); >0 bytes, or a status code. In latency mode (spin) it
 * polls for mte_spin_ns() before blocking (clock.h says why). */
static ssize_t recv_some(mte_sockio_t *s, void *dst, size_t n)
{
    mte_metrics_input();        /* what arrives now finishes at a new time (metrics.h) */
    int64_t spin = s->spin ? mte_spin_ns() : 0;
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

int mte_sock_fill(mte_sockio_t *s, size_t n)
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

int mte_sock_recv_into(mte_sockio_t *s, uint8_t *dst, uint64_t n)
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
        if (dst && n >= MTE_DIRECT_RECV) {
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

void mte_sock_set_tick(int fd, int ms)
{
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

socklen_t mte_sock_unix_addr(struct sockaddr_un *a, const char *name)
{
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    size_t n = strnlen(name, sizeof(a->sun_path) - 2);
    memcpy(a->sun_path + 1, name, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

int mte_sock_connect_unix(const char *name)
{
    struct sockaddr_un a;
    socklen_t len = mte_sock_unix_addr(&a, name);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&a, len) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int mte_sock_listen_unix(const char *name)
{
    struct sockaddr_un a;
    socklen_t len = mte_sock_unix_addr(&a, name);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (bind(fd, (struct sockaddr *)&a, len) < 0 || listen(fd, 128) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int mte_sock_connect_tcp(const char *host, int port, int timeout_ms)
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

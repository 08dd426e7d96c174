/* SPDX-License-Identifier: Apache-2.0 */
/* Buffered, blocking socket I/O with a stop predicate checked at every timeout tick.
 *
 * Sockets get a short SO_RCVTIMEO/SO_SNDTIMEO (the tick): a blocked call wakes up every
 * tick and asks `stop` whether to give up (deadline passed, transport closing), so no
 * data path thread waits on a dead peer for ever. Big payloads bypass the buffer and
 * land straight in their destination. */
#ifndef MTE_SOCKIO_H
#define MTE_SOCKIO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>

#define MTE_DIRECT_RECV (16u << 10)   /* payloads at least this big skip the buffer */

typedef int (*mte_stop_fn)(void *ctx);   /* 0 to go on, or a status code to give up */

typedef struct mte_sockio {
    int fd;
    uint8_t *buf;
    size_t pos, end, cap;
    /* How far a refill may read past what is needed. After a big payload the next one
     * is likely big too: then only its header is read into the buffer and the payload
     * goes straight to its destination, instead of being copied out of the buffer. */
    size_t readahead;
    int spin;                   /* poll briefly before blocking (latency mode, clock.h) */
    mte_stop_fn stop;
    void *ctx;
} mte_sockio_t;

/* Sends all of iov[0..n) (modifies iov). 0 or a status code (MTE_E_SOCKET, or stop's). */
int mte_sock_send_iov(mte_sockio_t *s, struct iovec *iov, int n);
int mte_sock_send_all(mte_sockio_t *s, const void *p, size_t n);
/* Ensures at least n bytes are buffered at buf + pos. 0 or a status code. */
int mte_sock_fill(mte_sockio_t *s, size_t n);
/* Receives exactly n bytes into dst (NULL: discard), buffered part first. */
int mte_sock_recv_into(mte_sockio_t *s, uint8_t *dst, uint64_t n);

/* Timeout tick (ms) for both directions, and TCP_NODELAY. */
void mte_sock_set_tick(int fd, int ms);
/* Connects to host:port within timeout_ms; a blocking fd, or -1. */
int mte_sock_connect_tcp(const char *host, int port, int timeout_ms);
/* Abstract-namespace unix socket (unix(7)): no file to clean up, scoped to the network
 * namespace, and the kernel tells the server who the client is (SO_PEERCRED). */
socklen_t mte_sock_unix_addr(struct sockaddr_un *a, const char *name);
int mte_sock_connect_unix(const char *name);
int mte_sock_listen_unix(const char *name);

#endif

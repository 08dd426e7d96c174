/* SPDX-License-Identifier: Apache-2.0 */
/* What the TCP transport's client (client.c) and server (server.c) share: the engine's
 * endpoint, with its identity, token and region table. */
#ifndef MTE_TCP_INTERNAL_H
#define MTE_TCP_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "tcp.h"
#include "wire.h"

#define MTE_TCP_RBUF_SIZE (256u << 10)
#define MTE_TCP_SMALL_READ (16u << 10)   /* READ replies up to this size are coalesced */
/* Notifications received and not yet taken (issue #20 item 6): past either bound the
 * sender's notify fails with MTE_E_NOTIFY_FULL and the drop is counted, instead of one
 * peer growing our memory without end (1 MiB messages: +600 MiB in a second). */
#define MTE_TCP_NOTIFY_QUEUE_BYTES (64u << 20)
#define MTE_TCP_NOTIFY_QUEUE_COUNT 65536u

struct conn;

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
    atomic_int max_conns, max_per_peer, auth_ms, idle_ms;   /* mte_tcp_set_limits */
    uint8_t token[256];          /* shared secret; token_len 0 = no authentication */
    size_t token_len;
    atomic_ullong auth_failures;
    atomic_ullong conns_accepted, notifs_received, notifs_dropped;   /* mte_tcp_counters */
    atomic_ullong conns_refused;    /* closed by the limits: at accept, auth or idle */
    pthread_t accept_thread;
    atomic_int closing;
    pthread_mutex_t mu;          /* guards conns, nconns, notifs */
    pthread_cond_t cv;
    struct conn *conns;
    int nconns;
    mte_notif_t *notif_head, *notif_tail;
    size_t notif_bytes, notif_count;       /* queued and not yet taken, under mu */
    pthread_cond_t notif_cv;     /* CLOCK_MONOTONIC; signalled on push and at close */
    int notif_waiters;           /* threads in mte_tcp_wait_notifications, under mu */
};

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport's native data path.
 *
 * One `mte_tcp_t` per engine: a server that applies peers' READ/WRITE requests to
 * registered memory (server.c), and client-side peers, each with several lanes
 * (connections), a worker thread per lane and a queue of slices (client.c). Bytes go from
 * registered memory to the socket and back with writev/recv straight into registered
 * memory; Python only submits descriptors and waits, with the GIL released. The wire
 * format is in wire.h. A WRITE is acknowledged only after the bytes are in the target's
 * memory, so a completed WRITE means applied, and a rejected one (address outside every
 * region) is drained and answered with a status instead of tearing the connection down.
 *
 * Same-host peers connect over an abstract unix socket instead; the server learns the
 * client's pid from SO_PEERCRED (kernel-verified, so a client cannot point the server at
 * another process) and, if process_vm_readv of the probe returns the probe value, serves
 * WRITE_CMA/READ_CMA requests (header + u64 client address, no payload) by copying
 * directly between its region and the client's memory.
 *
 * Requests belong to the engine-wide batch of the core (src/core/batch.h); GPU memory
 * moves through the core's staging (src/core/stage.h). */
#ifndef MTE_TCP_H
#define MTE_TCP_H

#include <stddef.h>
#include <stdint.h>

#include "../core/api.h"

typedef struct mte_tcp mte_tcp_t;
typedef struct mte_peer mte_peer_t;

typedef struct mte_notif {
    struct mte_notif *next;
    char *sender;
    size_t len;
    char msg[];
} mte_notif_t;

/* --- server (server.c) ------------------------------------------------------------- */
/* token: shared secret (token_len 0: none, at most 256 bytes). */
mte_tcp_t *mte_tcp_new(mte_regions_t *regions, const char *bind_host, int port,
                       const char *name, uint64_t instance, int stall_ms,
                       const void *token, size_t token_len, int *err);
int mte_tcp_port(const mte_tcp_t *t);
/* What one peer can make the data port hold (issue #20 item 6; docs/security.md). A
 * connection over max_conns in total, or over max_per_peer from one peer address (TCP:
 * its IP; same host: its pid), is closed at accept; connections that have not finished
 * their hello hold at most max_conns / 4 (64 from one peer; a newcomer from a quieter
 * peer replaces the oldest of the busiest, issue #35). The hello and its authentication must
 * finish within auth_ms of the accept; a request header that started arriving must be
 * whole within the server's stall_ms; a connection with no request for idle_ms is closed
 * (0: never; the client's lanes reconnect by themselves). Defaults: 1024, 128, 10 s,
 * 600 s. Values <= 0 keep the current one, except idle_ms 0 (never). */
void mte_tcp_set_limits(mte_tcp_t *t, int max_conns, int max_per_peer, int auth_ms,
                        int idle_ms);
/* Name of the same-host listener (abstract unix socket), "" if there is none. */
const char *mte_tcp_uds_name(const mte_tcp_t *t);
uint64_t mte_tcp_auth_failures(const mte_tcp_t *t);
/* [connections open, connections accepted, auth refusals, notifications received,
 *  notifications dropped (over 1 MiB, queue full or out of memory), connections refused
 *  or closed by the limits below]: server counters for metrics. */
#define MTE_TCP_COUNTERS 6
void mte_tcp_counters(mte_tcp_t *t, uint64_t out[MTE_TCP_COUNTERS]);
void mte_tcp_free(mte_tcp_t *t);
int mte_tcp_push_notification(mte_tcp_t *t, const char *sender, const void *msg, size_t len);
mte_notif_t *mte_tcp_take_notifications(mte_tcp_t *t);
/* Waits up to timeout_ms for a notification to be queued (returns at once if one is):
 * 1 if one is queued, 0 if none came or the server is being freed. mte_tcp_free waits for
 * every waiter to leave, so a caller registers first with mte_tcp_wait_enter, while
 * whatever keeps t from being freed (the Python binding: the GIL) is still held, and
 * mte_tcp_wait_notifications then waits and leaves. */
void mte_tcp_wait_enter(mte_tcp_t *t);
int mte_tcp_wait_notifications(mte_tcp_t *t, int timeout_ms);
void mte_notif_free(mte_notif_t *n);

/* --- peers (client.c) -------------------------------------------------------------- */
/* uds: the peer's same-host listener name (then lanes are unix connections and, when the
 * peer can reach our memory, bytes move by process_vm_readv/writev), or NULL/"" for TCP. */
mte_peer_t *mte_peer_new(mte_tcp_t *t, const char *host, int port, const char *uds,
                         uint64_t expect_instance, int lanes, uint64_t slice_size, int *err);
/* Stops the lanes and fails what is queued; the peer stays valid (batches may still name
 * it for notifications) until mte_peer_free. Shut every peer down before freeing any. */
void mte_peer_shutdown(mte_peer_t *p);
void mte_peer_free(mte_peer_t *p);
uint64_t mte_peer_seen_instance(const mte_peer_t *p);
int mte_peer_broken(const mte_peer_t *p);     /* the peer reported a new instance id */
/* With a token: connect only to the engine that proves it is segment `name` (its proof in
 * the hello covers its name); another one fails the lane with MTE_E_WRONG_PEER. Call
 * before the first batch. */
void mte_peer_expect_name(mte_peer_t *p, const char *name);
int mte_peer_cma(const mte_peer_t *p);        /* some lane moves bytes by process_vm_* */
size_t mte_peer_queued(mte_peer_t *p);       /* slices queued, not yet on a lane */

/* Queues a prepared post (src/core/prep.h) as requests [0, t->rows * n) of batch b, whose
 * size must be that: for every row, blocks lids[k] -> rids[k]. The items are written
 * straight into the peer's queue, under its lock, with no intermediate arrays. The ids
 * must have been checked (mte_prep_bad_id); tables whose local memory is on a device
 * go through mte_tcp_submit (its slice sizes). 0, or a negative code when nothing was
 * queued. */
int mte_tcp_post_prepared(mte_peer_t *p, mte_batch_t *b, int op, const mte_prep_t *t,
                          const int64_t *lids, const int64_t *rids, uint32_t n);

/* Queues requests [first, first+n) of batch b to peer p (op MTE_OP_WRITE/READ). len_stride
 * 0: all lens[0]. run_inline: a single-slice request may be carried by the calling
 * thread. 0, or a status code of core/status.h when nothing was queued (MTE_E_INVALID:
 * bad op or range; MTE_E_NOMEM). */
int mte_tcp_submit(mte_peer_t *p, mte_batch_t *b, int op, const uint64_t *local,
                   const uint64_t *remote, const uint64_t *lens, int len_stride,
                   uint32_t first, uint32_t n, int run_inline);
/* Adds a notification to deliver to p once every request of b completed successfully. */
int mte_tcp_add_notify(mte_peer_t *p, mte_batch_t *b, const void *msg, size_t len);

#endif

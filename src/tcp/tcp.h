/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport's native data path.
 *
 * One `mte_tcp_t` per engine: a server that applies peers' READ/WRITE requests to
 * registered memory, and client-side peers, each with several lanes (connections), a
 * worker thread per lane and a queue of slices. Bytes go from registered memory to the
 * socket and back with writev/recv straight into registered memory; Python only
 * submits descriptors and waits, with the GIL released.
 *
 * Wire format (little-endian), after a hello exchange on each connection:
 *   request  32 B: u32 magic 'MTE2' | u16 op | u16 flags | u64 seq | u64 addr | u64 len
 *                  [+ len bytes of payload for WRITE and NOTIFY]
 *   response 24 B: u32 magic 'MTER' | i32 status | u64 seq | u64 len [+ len bytes for READ]
 * A WRITE is acknowledged only after the bytes are in the target's memory, so a
 * completed WRITE means applied, and a rejected one (address outside every region)
 * is drained and answered with a status instead of tearing the connection down.
 *
 * Hello: client -> 56 B: u32 'MTEH' | u32 version | u64 instance | u32 name_len |
 *                        u32 flags (1 = authenticates) | 16 B nonce Nc |
 *                        u64 probe address | u64 probe value  [+ name]
 *        server -> 72 B: u32 'MTEH' | i32 status | u64 instance | 16 B nonce Ns |
 *                        32 B HMAC(token, "mte-data-server" Nc Ns instance) |
 *                        u32 flags (1 = cross-memory attach) | u32 0
 * Same-host peers connect over an abstract unix socket instead; the server learns the
 * client's pid from SO_PEERCRED (kernel-verified, so a client cannot point the server at
 * another process) and, if process_vm_readv of the probe returns the probe value, serves
 * WRITE_CMA/READ_CMA requests (header + u64 client address, no payload) by copying
 * directly between its region and the client's memory.
 * With a token (both sides must have one, else status -803), the client checks the
 * server's proof, then sends HMAC(token, "mte-data-client" Ns Nc name), and the server
 * answers u32 'MTEH' | i32 status before any request is read. */
#ifndef MTE_TCP_H
#define MTE_TCP_H

#include <stddef.h>
#include <stdint.h>

#include "../core/regions.h"

enum { MTE_OP_WRITE = 1, MTE_OP_READ = 2, MTE_OP_NOTIFY = 3,
       /* same host: the server copies with process_vm_readv/writev, no payload */
       MTE_OP_WRITE_CMA = 4, MTE_OP_READ_CMA = 5 };
enum { MTE_ST_PENDING = 0, MTE_ST_COMPLETED = 1, MTE_ST_FAILED = 2, MTE_ST_TIMEOUT = 3,
       MTE_ST_CANCELED = 4 };

/* Status codes; the small ones are Mooncake's (include/error.h). */
#define MTE_E_REMOTE_NOT_REG   (-3)
#define MTE_E_SOCKET           (-102)
#define MTE_E_TIMEOUT          (-801)
#define MTE_E_AUTH             (-803)
#define MTE_E_CANCELED         (-805)
#define MTE_E_LOCAL_NOT_REG    (-1003)
#define MTE_E_REMOTE_ACCESS    (-1004)
#define MTE_E_PEER_RESTARTED   (-1006)
#define MTE_E_PROTOCOL         (-1007)
#define MTE_E_CLOSED           (-1008)
#define MTE_E_CMA              (-1009)
#define MTE_E_NOMEM            (-302)

typedef struct mte_tcp mte_tcp_t;
typedef struct mte_peer mte_peer_t;
typedef struct mte_batch mte_batch_t;

typedef struct mte_notif {
    struct mte_notif *next;
    char *sender;
    size_t len;
    char msg[];
} mte_notif_t;

/* --- server ------------------------------------------------------------------------ */
/* token: shared secret (token_len 0: none, at most 256 bytes). */
mte_tcp_t *mte_tcp_new(mte_regions_t *regions, const char *bind_host, int port,
                       const char *name, uint64_t instance, int stall_ms,
                       const void *token, size_t token_len, int *err);
int mte_tcp_port(const mte_tcp_t *t);
/* Name of the same-host listener (abstract unix socket), "" if there is none. */
const char *mte_tcp_uds_name(const mte_tcp_t *t);
uint64_t mte_tcp_auth_failures(const mte_tcp_t *t);
/* [connections open, connections accepted, auth refusals, notifications received,
 *  notifications dropped (over 1 MiB or out of memory)]: server counters for metrics. */
#define MTE_TCP_COUNTERS 5
void mte_tcp_counters(mte_tcp_t *t, uint64_t out[MTE_TCP_COUNTERS]);
void mte_tcp_free(mte_tcp_t *t);
int mte_tcp_push_notification(mte_tcp_t *t, const char *sender, const void *msg, size_t len);
mte_notif_t *mte_tcp_take_notifications(mte_tcp_t *t);
void mte_notif_free(mte_notif_t *n);

/* --- peers (client side) ----------------------------------------------------------- */
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
int mte_peer_cma(const mte_peer_t *p);        /* some lane moves bytes by process_vm_* */
size_t mte_peer_queued(mte_peer_t *p);       /* slices queued, not yet on a lane */

/* --- batches ----------------------------------------------------------------------- */
mte_batch_t *mte_batch_new(uint32_t n, int64_t deadline_ns);   /* CLOCK_MONOTONIC ns, 0=none */
void mte_batch_unref(mte_batch_t *b);
/* Queues requests [first, first+n) of the batch to peer p. len_stride 0: all lens[0].
 * run_inline: a single-slice request may be carried by the calling thread. */
int mte_batch_submit(mte_batch_t *b, mte_peer_t *p, int op, const uint64_t *local,
                     const uint64_t *remote, const uint64_t *lens, int len_stride,
                     uint32_t first, uint32_t n, int run_inline);
/* Adds a notification to deliver to p once every request completed successfully. */
int mte_batch_add_notify(mte_batch_t *b, mte_peer_t *p, const void *msg, size_t len);
/* Requests [first, first+n) will never be submitted (submission failed part-way):
 * count them as canceled so the batch can finish. */
void mte_batch_abandon(mte_batch_t *b, uint32_t first, uint32_t n);
/* Called after the last submit/add_notify: from now on the batch may finish. */
void mte_batch_seal(mte_batch_t *b);
/* Requests [first, first+n) count in metrics cell `cell` (src/core/metrics.h) when they
 * finish; call before queuing them. The first tag also stamps the batch's submit time. */
int mte_batch_tag(mte_batch_t *b, uint32_t first, uint32_t n, uint64_t *cell);
/* 1 when finished, 0 when deadline_ns (monotonic) passed first. */
int mte_batch_wait(mte_batch_t *b, int64_t deadline_ns);
int mte_batch_done(mte_batch_t *b);
void mte_batch_cancel(mte_batch_t *b);
void mte_batch_expire(mte_batch_t *b);
uint32_t mte_batch_size(const mte_batch_t *b);
void mte_batch_status(mte_batch_t *b, uint8_t *states, uint64_t *bytes, int32_t *errs);
int32_t mte_batch_notify_error(const mte_batch_t *b);
int64_t mte_now_ns(void);

/* --- completing requests from other transports ------------------------------------- */
/* Every transport (RDMA, GPU staging, CUDA IPC, NVMe-oF) finishes requests of the same
 * batch object, so one Batch can span transports and notifications still go out after
 * the last byte. Per request: call begin(idx, slices) once before any of its slices can
 * finish, then slice_done once per slice (err 0, or a negative MTE_E_* code). A request
 * counts as finished when its last slice is done; the batch is finished when every
 * request is (and it was sealed). Safe from any thread; never blocks. stopped() is 1
 * once the batch was canceled or expired (skip slices not yet started: report them with
 * MTE_E_CANCELED / MTE_E_TIMEOUT). Other extension modules reach these through the
 * table from mte_batch_ops() (exported by the _tcp module as a capsule-free integer
 * address: mooncake_te.transports.tcp._tcp.batch_ops_address()), because Python loads
 * extension modules with RTLD_LOCAL and they cannot link to each other's symbols. */
void mte_batch_begin(mte_batch_t *b, uint32_t idx, uint32_t slices);
void mte_batch_slice_done(mte_batch_t *b, uint32_t idx, uint64_t len, int err);
int64_t mte_batch_deadline(const mte_batch_t *b);
int mte_batch_stopped(const mte_batch_t *b);

typedef struct mte_batch_ops {
    uint32_t version;                  /* 1 */
    void (*begin)(mte_batch_t *b, uint32_t idx, uint32_t slices);
    void (*slice_done)(mte_batch_t *b, uint32_t idx, uint64_t len, int err);
    int64_t (*deadline)(const mte_batch_t *b);
    int (*stopped)(const mte_batch_t *b);
    int64_t (*now_ns)(void);
} mte_batch_ops_t;
const mte_batch_ops_t *mte_batch_ops(void);

#endif

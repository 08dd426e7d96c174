/* SPDX-License-Identifier: Apache-2.0 */
/* The engine-wide batch: requests in flight on any transport, and their completion.
 *
 * One batch object can span transports (TCP, same host, RDMA, NVMe-oF, CUDA IPC): each
 * transport finishes the requests it carries through the same functions, so the batch
 * knows when the last byte landed, and only then sends its notifications.
 *
 * Per request: call mte_batch_begin(idx, slices) once before any of its slices can
 * finish, then mte_batch_slice_done once per slice (err 0, or a negative MTE_E_* code of
 * status.h). A request counts as finished when its last slice is done; the batch is
 * finished when every request is, and it was sealed (no more submissions). Safe from
 * any thread; never blocks. mte_batch_stop_code() is nonzero once the batch was canceled
 * or its deadline passed: transports skip slices not yet started with that code.
 *
 * Notifications: a transport that can deliver a message to a peer registers it with
 * mte_batch_add_notify (its own send/release functions); when every request completed
 * successfully the batch calls send() for each such peer, and each send must end in
 * exactly one mte_batch_notify_done. */
#ifndef MTE_BATCH_H
#define MTE_BATCH_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* Engine-wide request directions (Python: mooncake_te.batch.Op). */
enum { MTE_OP_WRITE = 1, MTE_OP_READ = 2 };

#define MTE_NOTIFY_MAX (1u << 20)     /* bytes of one notification message */

typedef struct mte_batch mte_batch_t;

/* How a transport delivers a batch's notification to one of its peers. */
typedef struct mte_notifier {
    /* Queue msg[0..len) to `peer`; call mte_batch_notify_done(b, err) once it is
     * delivered or failed. The batch stays alive until then. */
    void (*send)(void *peer, mte_batch_t *b, const void *msg, size_t len);
    /* The batch is gone: drop the reference add_notify's caller took on `peer`. */
    void (*release)(void *peer);
} mte_notifier_t;

mte_batch_t *mte_batch_new(uint32_t n, int64_t deadline_ns);   /* CLOCK_MONOTONIC ns, 0=none */
void mte_batch_unref(mte_batch_t *b);
uint32_t mte_batch_size(const mte_batch_t *b);

/* Registers `peer` to be notified with msg (the first message given is the batch's).
 * 0 when added (the batch now owns one reference on peer, dropped by release), 1 when
 * the peer was already registered (the caller keeps its reference), or a negative code. */
int mte_batch_add_notify(mte_batch_t *b, void *peer, const mte_notifier_t *how,
                         const void *msg, size_t len);
void mte_batch_notify_done(mte_batch_t *b, int err);

/* Requests [first, first+n) will never be submitted (submission failed part-way):
 * count them as canceled so the batch can finish. */
void mte_batch_abandon(mte_batch_t *b, uint32_t first, uint32_t n);
/* Requests [first, first+n) count in metrics cell `cell` (metrics.h) when they finish;
 * call before queuing them. The first tag also stamps the batch's submit time. */
int mte_batch_tag(mte_batch_t *b, uint32_t first, uint32_t n, uint64_t *cell);
/* Called after the last submit/add_notify: from now on the batch may finish. */
void mte_batch_seal(mte_batch_t *b);
/* 1 when finished, 0 when deadline_ns (monotonic) passed first. Polls for
 * mte_spin_ns() first: a small batch often finishes within microseconds. */
int mte_batch_wait(mte_batch_t *b, int64_t deadline_ns);
int mte_batch_done(mte_batch_t *b);
void mte_batch_cancel(mte_batch_t *b);
void mte_batch_expire(mte_batch_t *b);
void mte_batch_status(mte_batch_t *b, uint8_t *states, uint64_t *bytes, int32_t *errs);
int32_t mte_batch_notify_error(const mte_batch_t *b);
/* ns from creation until the last request and notification finished; -1 until then. */
int64_t mte_batch_elapsed_ns(const mte_batch_t *b);

/* Completing requests (any transport, any thread). */
void mte_batch_begin(mte_batch_t *b, uint32_t idx, uint32_t slices);
/* mte_batch_begin for requests [first, first+n), each of `slices` slices. */
void mte_batch_begin_range(mte_batch_t *b, uint32_t first, uint32_t n, uint32_t slices);
void mte_batch_slice_done(mte_batch_t *b, uint32_t idx, uint64_t len, int err);
int64_t mte_batch_deadline(const mte_batch_t *b);
int mte_batch_stopped(const mte_batch_t *b);
/* 0 while the batch goes on; MTE_E_CANCELED once canceled; MTE_E_TIMEOUT once expired
 * or past its deadline at `now_ns`. */
int mte_batch_stop_code(const mte_batch_t *b, int64_t now_ns);

#endif

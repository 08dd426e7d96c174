/* SPDX-License-Identifier: Apache-2.0 */
/* The engine-wide batch and its completion; see batch.h. */
#include "batch.h"
#include "clock.h"
#include "metrics.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct notify_ref {
    struct notify_ref *next;
    void *peer;
    const mte_notifier_t *how;
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
    /* Metrics (metrics.h): the cell of each request, set by mte_batch_tag before the
     * request is queued; NULL cells (metrics off) cost one load per request. */
    int64_t t0;                 /* first tag: submit time */
    /* Monotonic ns at creation and when the last request (and notification) finished:
     * how long the transfer took, whenever its owner looks (mte_batch_elapsed_ns). */
    int64_t created_ns;
    _Atomic int64_t finished_ns;
    uint64_t *cell0;            /* the cell of every request while `cells` is NULL */
    uint64_t **cells;           /* per request, once requests name different cells */
};

mte_batch_t *mte_batch_new(uint32_t n, int64_t deadline_ns)
{
    /* One allocation: the batch, then its per-request arrays, widest first (a prepared
     * post makes a batch of 1,024 requests per call, one allocation instead of five). */
    size_t m = n ? n : 1;
    size_t head = (sizeof(struct mte_batch) + 7) & ~(size_t)7;
    mte_batch_t *b = calloc(1, head + m * (sizeof(*b->bytes) + sizeof(*b->slices_left) +
                                           sizeof(*b->err) + sizeof(*b->state)));
    if (!b)
        return NULL;
    char *p = (char *)b + head;
    b->bytes = (void *)p;
    p += m * sizeof(*b->bytes);
    b->slices_left = (void *)p;
    p += m * sizeof(*b->slices_left);
    b->err = (void *)p;
    p += m * sizeof(*b->err);
    b->state = (void *)p;
    b->n = n;
    b->deadline = deadline_ns;
    b->created_ns = mte_now_ns();
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

void mte_batch_unref(mte_batch_t *b)
{
    if (!b || atomic_fetch_sub(&b->refs, 1) != 1)
        return;
    for (notify_ref_t *r = b->notify_peers, *nx; r; r = nx) {
        nx = r->next;
        r->how->release(r->peer);
        free(r);
    }
    free(b->notify_msg);
    free(b->cells);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
}

uint32_t mte_batch_size(const mte_batch_t *b) { return b->n; }
int32_t mte_batch_notify_error(const mte_batch_t *b) { return atomic_load(&b->notify_err); }

static void batch_finish(mte_batch_t *b)
{
    if (b->cell0)
        mte_metrics_batch(b->cell0, mte_metrics_clock() - b->t0);
    atomic_store(&b->finished_ns, mte_now_ns());
    pthread_mutex_lock(&b->mu);
    b->finished = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    mte_batch_unref(b);                  /* the in-flight reference */
}

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
    for (notify_ref_t *r = b->notify_peers; r; r = r->next)
        r->how->send(r->peer, b, b->notify_msg, b->notify_len);
    mte_batch_unref(b);
}

int mte_batch_add_notify(mte_batch_t *b, void *peer, const mte_notifier_t *how,
                         const void *msg, size_t len)
{
    if (len > MTE_NOTIFY_MAX)
        return -EMSGSIZE;
    if (!b->notify_msg) {
        b->notify_msg = malloc(len ? len : 1);
        if (!b->notify_msg)
            return MTE_E_NOMEM;
        memcpy(b->notify_msg, msg, len);
        b->notify_len = len;
    }
    for (notify_ref_t *r = b->notify_peers; r; r = r->next)
        if (r->peer == peer)
            return 1;
    notify_ref_t *r = malloc(sizeof(*r));
    if (!r)
        return MTE_E_NOMEM;
    r->peer = peer;
    r->how = how;
    r->next = b->notify_peers;
    b->notify_peers = r;
    return 0;
}

void mte_batch_notify_done(mte_batch_t *b, int err)
{
    if (err) {
        int zero = 0;
        atomic_compare_exchange_strong(&b->notify_err, &zero, err);
    }
    if (atomic_fetch_sub(&b->notify_left, 1) == 1)
        batch_finish(b);
}

static uint8_t state_for(int err)
{
    return err == MTE_E_TIMEOUT ? MTE_ST_TIMEOUT
         : err == MTE_E_CANCELED ? MTE_ST_CANCELED : MTE_ST_FAILED;
}

/* Request i finished (its last slice): count it in its metrics cell, if it has one. */
static void batch_count_request(mte_batch_t *b, uint32_t i)
{
    uint64_t **cells = __atomic_load_n(&b->cells, __ATOMIC_ACQUIRE);
    uint64_t *cell = cells ? cells[i] : b->cell0;
    if (!cell)
        return;
    int err = 0;
    if (atomic_load(&b->state[i]) != MTE_ST_COMPLETED)
        err = atomic_load(&b->err[i]) ? atomic_load(&b->err[i]) : MTE_E_TIMEOUT;
    mte_metrics_request(cell, atomic_load(&b->bytes[i]), err, mte_metrics_clock() - b->t0);
}

int mte_batch_tag(mte_batch_t *b, uint32_t first, uint32_t n, uint64_t *cell)
{
    if ((uint64_t)first + n > b->n || !cell)
        return -EINVAL;
    if (!b->t0)
        b->t0 = mte_now_ns();
    if (!b->cell0) {
        b->cell0 = cell;
        return 0;
    }
    uint64_t **cells = b->cells;
    if (!cells) {
        if (cell == b->cell0)
            return 0;
        /* Requests already queued keep cell0; publish the array only once it says so. */
        cells = malloc(sizeof(*cells) * (b->n ? b->n : 1));
        if (!cells)
            return MTE_E_NOMEM;
        for (uint32_t i = 0; i < b->n; i++)
            cells[i] = b->cell0;
        for (uint32_t i = first; i < first + n; i++)
            cells[i] = cell;
        __atomic_store_n(&b->cells, cells, __ATOMIC_RELEASE);
        return 0;
    }
    for (uint32_t i = first; i < first + n; i++)
        cells[i] = cell;          /* not queued yet: nobody reads these entries */
    return 0;
}

void mte_batch_begin(mte_batch_t *b, uint32_t idx, uint32_t slices)
{
    if (idx < b->n)
        atomic_store(&b->slices_left[idx], slices ? slices : 1);
}

void mte_batch_begin_range(mte_batch_t *b, uint32_t first, uint32_t n, uint32_t slices)
{
    if ((uint64_t)first + n > b->n)
        return;
    for (uint32_t i = first; i < first + n; i++)
        atomic_store_explicit(&b->slices_left[i], slices ? slices : 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);   /* before the requests are queued */
}

/* One slice finished. The caller must not touch b afterwards (unless it holds a
 * reference of its own). */
void mte_batch_slice_done(mte_batch_t *b, uint32_t i, uint64_t len, int err)
{
    if (i >= b->n)
        return;
    if (err) {
        int zero = 0;
        atomic_compare_exchange_strong(&b->err[i], &zero, err);
        uint8_t pending = MTE_ST_PENDING;
        atomic_compare_exchange_strong(&b->state[i], &pending, state_for(err));
        atomic_store(&b->any_failed, 1);
    } else {
        atomic_fetch_add(&b->bytes[i], len);
    }
    if (atomic_fetch_sub(&b->slices_left[i], 1) == 1) {
        uint8_t pending = MTE_ST_PENDING;
        atomic_compare_exchange_strong(&b->state[i], &pending, MTE_ST_COMPLETED);
        batch_count_request(b, i);
        if (atomic_fetch_sub(&b->pending, 1) == 1)
            batch_requests_done(b);
    }
}

int64_t mte_batch_deadline(const mte_batch_t *b) { return b->deadline; }

int mte_batch_stopped(const mte_batch_t *b)
{
    return atomic_load(&b->canceled) || atomic_load(&b->expired);
}

int mte_batch_stop_code(const mte_batch_t *b, int64_t now_ns)
{
    if (atomic_load(&b->canceled))
        return MTE_E_CANCELED;
    if ((b->deadline && now_ns > b->deadline) || atomic_load(&b->expired))
        return MTE_E_TIMEOUT;
    return 0;
}

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
    /* A small batch often finishes within microseconds: poll first (clock.h). */
    int64_t until = mte_now_ns() + mte_spin_ns();
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

int64_t mte_batch_elapsed_ns(const mte_batch_t *b)
{
    int64_t f = atomic_load(&b->finished_ns);
    return f ? f - b->created_ns : -1;
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

/* SPDX-License-Identifier: Apache-2.0 */
/* Stress of the engine-wide batch (src/core/batch.c), for the sanitizer builds.
 *
 * What the transports do to one batch at once: several finisher threads complete the
 * slices of its requests (as TCP lanes, RDMA pollers and storage workers do), a
 * notifier delivers the batch's notification from yet another thread, the submitter
 * waits for it and reads its status, and, in every third round, a canceller cancels it
 * mid-flight. Under -fsanitize=thread any unsynchronised access is a report; under
 * -fsanitize=address a use after free of the batch or its notification (the last
 * reference dropped while a finisher still touches it) is one. Each round also checks the
 * bookkeeping: every request ends completed or canceled, and a completed batch sent its
 * notification exactly once. A clean run prints "ok" and exits 0.
 *
 * Usage: batch_stress [seconds] [finishers] */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/batch.h"
#include "core/clock.h"

#define N 256
#define SLICES 4

typedef struct {
    mte_batch_t *b;
    int first, step;
} part_t;

static atomic_int sent, released;
static pthread_t notify_thread;
static atomic_int notify_started;

static void *deliver(void *arg)
{
    mte_batch_notify_done(arg, 0);
    return NULL;
}

/* The notifier: deliver from another thread, as a TCP lane does. */
static void notify_send(void *peer, mte_batch_t *b, const void *msg, size_t len)
{
    (void)peer;
    if (len != 5 || memcmp(msg, "hello", 5) != 0)
        abort();
    atomic_fetch_add(&sent, 1);
    atomic_store(&notify_started, 1);
    if (pthread_create(&notify_thread, NULL, deliver, b) != 0)
        abort();
}

static void notify_release(void *peer)
{
    (void)peer;
    atomic_fetch_add(&released, 1);
}

static const mte_notifier_t notifier = {.send = notify_send, .release = notify_release};

static void *finisher(void *arg)
{
    part_t *p = arg;
    for (int s = 0; s < SLICES; s++)
        for (int i = p->first; i < N; i += p->step) {
            int err = mte_batch_stop_code(p->b, mte_now_ns());
            mte_batch_slice_done(p->b, (uint32_t)i, err ? 0 : 4096, err);
        }
    return NULL;
}

static void *canceller(void *arg)
{
    mte_batch_cancel(arg);
    return NULL;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    int nf = argc > 2 ? atoi(argv[2]) : 3;
    if (nf < 1 || nf > 16)
        nf = 3;
    int64_t end = mte_now_ns() + (int64_t)(seconds * 1e9);
    long rounds = 0, canceled_rounds = 0;
    static int dummy_peer;
    while (mte_now_ns() < end) {
        mte_batch_t *b = mte_batch_new(N, mte_now_ns() + 10000000000LL);
        if (!b)
            return 2;
        for (int i = 0; i < N; i++)
            mte_batch_begin(b, (uint32_t)i, SLICES);
        int before = atomic_load(&sent);
        atomic_store(&notify_started, 0);
        if (mte_batch_add_notify(b, &dummy_peer, &notifier, "hello", 5) != 0)
            return 3;
        pthread_t th[16], ct;
        part_t parts[16];
        for (int t = 0; t < nf; t++) {
            parts[t] = (part_t){b, t, nf};
            pthread_create(&th[t], NULL, finisher, &parts[t]);
        }
        int cancel = rounds % 3 == 2;
        if (cancel)
            pthread_create(&ct, NULL, canceller, b);
        mte_batch_seal(b);
        if (!mte_batch_wait(b, mte_now_ns() + 10000000000LL)) {
            fprintf(stderr, "round %ld: the batch did not finish\n", rounds);
            return 4;
        }
        for (int t = 0; t < nf; t++)
            pthread_join(th[t], NULL);
        if (cancel)
            pthread_join(ct, NULL);
        uint8_t st[N];
        uint64_t bytes[N];
        int32_t errs[N];
        mte_batch_status(b, st, bytes, errs);
        int completed = 0;
        for (int i = 0; i < N; i++) {
            if (st[i] == MTE_ST_COMPLETED) {
                completed++;
                if (bytes[i] != SLICES * 4096u) {
                    fprintf(stderr, "round %ld: request %d completed with %llu bytes\n",
                            rounds, i, (unsigned long long)bytes[i]);
                    return 5;
                }
            } else if (st[i] != MTE_ST_CANCELED) {
                fprintf(stderr, "round %ld: request %d in state %d\n", rounds, i, st[i]);
                return 6;
            }
        }
        int notified = atomic_load(&sent) - before;
        /* A cancel that lands after the last request completed may still withhold the
         * notification (the batch is canceled); without a cancel it must go, once. */
        if (completed == N && (cancel ? notified > 1 : notified != 1)) {
            fprintf(stderr, "round %ld: all completed but %d notifications\n", rounds,
                    notified);
            return 7;
        }
        if (completed < N && notified != 0) {
            fprintf(stderr, "round %ld: a failed batch sent its notification\n", rounds);
            return 8;
        }
        if (atomic_load(&notify_started))
            pthread_join(notify_thread, NULL);
        canceled_rounds += completed < N;
        mte_batch_unref(b);
        rounds++;
    }
    if (atomic_load(&released) != rounds) {
        fprintf(stderr, "%d releases for %ld batches\n", atomic_load(&released), rounds);
        return 9;
    }
    printf("ok: %ld rounds (%ld with requests canceled), %d notifications\n", rounds,
           canceled_rounds, atomic_load(&sent));
    return 0;
}

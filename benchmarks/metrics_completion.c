/* SPDX-License-Identifier: Apache-2.0 */
/* What counting costs where requests finish: the native batch's completion path
 * (mte_batch_begin + mte_batch_slice_done, as every transport calls it) for a batch of
 * N requests, untagged (metrics off) and tagged with a metrics cell (on), on one thread
 * and on T threads finishing requests of one batch at once (as TCP lanes do).
 * Built and run by benchmarks/metrics_overhead.py --micro; prints JSON. The optional
 * argument is the number of repetitions (default REPS; --smoke runs 1). */
#include "core/batch.h"
#include "core/clock.h"
#include "core/metrics.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 1 << 20, REPS = 7 };
static uint64_t cell[MTE_M_CELL_WORDS] __attribute__((aligned(64)));

typedef struct { mte_batch_t *b; uint32_t lo, hi; int group; } part_t;

/* group 0: every request reads the clock (RDMA, NVMe-oF, CUDA paths); group g: as a TCP
 * lane does, requests are answered g per received buffer and share one clock read. */
static void *finish(void *arg)
{
    part_t *p = arg;
    if (p->group)
        mte_metrics_group(1);
    for (uint32_t i = p->lo; i < p->hi; i++) {
        if (p->group && (i - p->lo) % p->group == 0)
            mte_metrics_input();
        mte_batch_slice_done(p->b, i, 4096, 0);
    }
    mte_metrics_group(0);
    return NULL;
}

static double run(int tagged, int threads, int group)
{
    mte_batch_t *b = mte_batch_new(N, 0);
    if (tagged)
        mte_batch_tag(b, 0, N, cell);
    for (uint32_t i = 0; i < N; i++)
        mte_batch_begin(b, i, 1);
    pthread_t th[16];
    part_t parts[16];
    /* CPU time, not wall time: on a shared machine preemption would swamp the ns. */
    struct timespec c0, c1;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    for (int t = 0; t < threads; t++) {
        parts[t] = (part_t){b, (uint32_t)((uint64_t)N * t / threads),
                            (uint32_t)((uint64_t)N * (t + 1) / threads), group};
        pthread_create(&th[t], NULL, finish, &parts[t]);
    }
    for (int t = 0; t < threads; t++)
        pthread_join(th[t], NULL);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    int64_t dt = (c1.tv_sec - c0.tv_sec) * 1000000000LL + (c1.tv_nsec - c0.tv_nsec);
    mte_batch_seal(b);
    mte_batch_wait(b, mte_now_ns() + 1000000000LL);
    mte_batch_unref(b);
    return (double)dt / N;
}

int main(int argc, char **argv)
{
    int reps = argc > 1 ? atoi(argv[1]) : REPS;
    if (reps < 1)
        reps = 1;
    printf("{");
    int tcount[] = {1, 4, 1, 4}, groups[] = {0, 0, 16, 16};
    for (int k = 0; k < 4; k++) {
        int t = tcount[k], g = groups[k];
        double best_off = 1e9, best_on = 1e9;
        for (int r = 0; r < reps; r++) {        /* interleaved; best of reps each */
            double off = run(0, t, g), on = run(1, t, g);
            if (off < best_off) best_off = off;
            if (on < best_on) best_on = on;
        }
        printf("%s\"threads_%d_per_recv_%d\": {\"ns_per_request_off\": %.2f, "
               "\"ns_per_request_on\": %.2f}", k ? ", " : "", t, g, best_off, best_on);
    }
    uint64_t s = 0;
    for (int i = 0; i < MTE_M_SHARDS; i++)
        s += cell[i * MTE_M_SHARD_WORDS + MTE_M_REQ_OK];
    printf(", \"counted\": %llu}\n", (unsigned long long)s);
    return 0;
}

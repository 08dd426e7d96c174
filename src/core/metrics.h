/* SPDX-License-Identifier: Apache-2.0 */
/* Transfer metrics: lock-free counters updated where requests and batches finish.
 *
 * A *cell* counts the traffic of one (peer, route, op) of one engine. The engine (Python,
 * mooncake_te/metrics/cells.py) owns the cells (plain uint64 arrays it never frees, so a
 * batch still finishing after its engine closed writes to live memory) and tags each
 * request of a batch with its cell before the request is queued (mte_batch_tag). The
 * batch's completion path then calls mte_metrics_request / mte_metrics_batch: relaxed
 * atomic adds into a per-thread shard of the cell (the lanes and polling threads that
 * finish requests do not share cache lines), a clock read per request, and nothing else.
 * Readers (eng.metrics(), a Prometheus scrape) sum the shards on demand; a read that races
 * with an update sees it or not, never a torn value (aligned 64-bit loads).
 *
 * Layout of a cell, in uint64 words:
 *   MTE_M_SHARDS shards of MTE_M_SHARD_WORDS, each:
 *     [0] requests completed  [1] bytes of completed requests  [2] requests failed
 *     [3] request latency sum (ns, submit to complete)  [4 .. 4+NB) request latency buckets
 *     [4+NB] batches finished  [5+NB] batch latency sum (ns)  [6+NB .. 6+2NB) batch buckets
 *   then MTE_M_CODES (status code, count) pairs shared by all threads (failures are rare):
 *   a slot is claimed by compare-and-swap of its code from 0; the last slot counts codes
 *   that found no free slot (its code word is 1).
 * Histogram buckets are powers of two of nanoseconds: bucket 0 holds latencies below
 * 2^10 ns (1.02 us), bucket k holds [2^(k+9), 2^(k+10)) ns, the last one everything above
 * (about 68.7 s and up). */
#ifndef MTE_METRICS_H
#define MTE_METRICS_H

#include <stdint.h>

#define MTE_M_BUCKETS     28
#define MTE_M_MIN_LOG2    10
#define MTE_M_SHARDS      8
#define MTE_M_SHARD_WORDS 64            /* 6 + 2*28 = 62, padded to 512 bytes */
#define MTE_M_CODES       16
#define MTE_M_CELL_WORDS  (MTE_M_SHARDS * MTE_M_SHARD_WORDS + 2 * MTE_M_CODES)

enum { MTE_M_REQ_OK = 0, MTE_M_BYTES = 1, MTE_M_REQ_FAILED = 2, MTE_M_REQ_LAT_SUM = 3,
       MTE_M_REQ_BUCKET0 = 4, MTE_M_BATCHES = 4 + MTE_M_BUCKETS,
       MTE_M_BATCH_LAT_SUM = 5 + MTE_M_BUCKETS, MTE_M_BATCH_BUCKET0 = 6 + MTE_M_BUCKETS };

/* The clock. Reading it costs 20-80 ns (more in VMs): more than the counting. A thread
 * that finishes many requests from one input (a TCP lane parsing a buffer of responses,
 * an RDMA poller handling one ibv_poll_cq) brackets that work with mte_metrics_group(1)
 * ... (0), and the core's socket I/O calls mte_metrics_input() whenever it receives:
 * requests finished from the same input then share one clock read, taken lazily at the
 * first of them. Elsewhere every request reads it. Per thread (metrics.c, in the core;
 * transports reach these through the core's table, api.h). */
void mte_metrics_group(int on);
void mte_metrics_input(void);
int64_t mte_metrics_clock(void);

/* Each thread that finishes requests takes a shard once, round robin. */
static inline uint64_t *mte_metrics_shard(uint64_t *cell)
{
    static uint32_t next_shard;
    static __thread int shard = -1;
    if (shard < 0)
        shard = (int)(__atomic_fetch_add(&next_shard, 1, __ATOMIC_RELAXED) % MTE_M_SHARDS);
    return cell + shard * MTE_M_SHARD_WORDS;
}

static inline int mte_metrics_bucket(int64_t ns)
{
    if (ns < (1 << MTE_M_MIN_LOG2))
        return 0;
    int k = 64 - __builtin_clzll((uint64_t)ns) - MTE_M_MIN_LOG2;
    return k < MTE_M_BUCKETS ? k : MTE_M_BUCKETS - 1;
}

static inline void mte_metrics_add(uint64_t *w, uint64_t v)
{
    __atomic_fetch_add(w, v, __ATOMIC_RELAXED);
}

static inline void mte_metrics_code(uint64_t *cell, int code)
{
    uint64_t *codes = cell + MTE_M_SHARDS * MTE_M_SHARD_WORDS;
    uint64_t want = (uint64_t)(int64_t)code;
    for (int i = 0; i < MTE_M_CODES - 1; i++) {
        uint64_t have = __atomic_load_n(&codes[2 * i], __ATOMIC_RELAXED);
        if (have == 0) {
            uint64_t zero = 0;
            if (__atomic_compare_exchange_n(&codes[2 * i], &zero, want, 0, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED))
                have = want;
            else
                have = zero;          /* someone else claimed it: with which code? */
        }
        if (have == want) {
            mte_metrics_add(&codes[2 * i + 1], 1);
            return;
        }
    }
    __atomic_store_n(&codes[2 * (MTE_M_CODES - 1)], 1, __ATOMIC_RELAXED);
    mte_metrics_add(&codes[2 * (MTE_M_CODES - 1) + 1], 1);
}

/* One request finished: ok with `bytes`, or failed with status `code` (< 0). */
static inline void mte_metrics_request(uint64_t *cell, uint64_t bytes, int code,
                                       int64_t latency_ns)
{
    uint64_t *s = mte_metrics_shard(cell);
    if (code == 0) {
        mte_metrics_add(&s[MTE_M_REQ_OK], 1);
        mte_metrics_add(&s[MTE_M_BYTES], bytes);
    } else {
        mte_metrics_add(&s[MTE_M_REQ_FAILED], 1);
        mte_metrics_code(cell, code);
    }
    if (latency_ns < 0)
        latency_ns = 0;
    mte_metrics_add(&s[MTE_M_REQ_LAT_SUM], (uint64_t)latency_ns);
    mte_metrics_add(&s[MTE_M_REQ_BUCKET0 + mte_metrics_bucket(latency_ns)], 1);
}

/* One batch finished (every request, and its notifications). */
static inline void mte_metrics_batch(uint64_t *cell, int64_t latency_ns)
{
    uint64_t *s = mte_metrics_shard(cell);
    if (latency_ns < 0)
        latency_ns = 0;
    mte_metrics_add(&s[MTE_M_BATCHES], 1);
    mte_metrics_add(&s[MTE_M_BATCH_LAT_SUM], (uint64_t)latency_ns);
    mte_metrics_add(&s[MTE_M_BATCH_BUCKET0 + mte_metrics_bucket(latency_ns)], 1);
}

#endif

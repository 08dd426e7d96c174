/* SPDX-License-Identifier: Apache-2.0 */
/* The per-thread clock cache of the metrics (metrics.h says why). */
#include "metrics.h"

#include <time.h>

static __thread int64_t now_cached;      /* 0: read the clock at the next use */
static __thread int grouped;

void mte_metrics_group(int on)
{
    grouped = on;
    now_cached = 0;
}

void mte_metrics_input(void)
{
    now_cached = 0;
}

int64_t mte_metrics_clock(void)
{
    if (grouped && now_cached)
        return now_cached;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    if (grouped)
        now_cached = now;
    return now;
}

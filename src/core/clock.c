/* SPDX-License-Identifier: Apache-2.0 */
/* See clock.h. */
#include "clock.h"

#include <stdlib.h>
#include <time.h>

int64_t mte_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t mte_spin_ns(void)
{
    static int64_t cached = -1;
    if (cached < 0) {
        const char *v = getenv("MC_TCP_SPIN_US");
        cached = (v && *v ? atoll(v) : 50) * 1000;
    }
    return cached;
}

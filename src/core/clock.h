/* SPDX-License-Identifier: Apache-2.0 */
/* Time for every data path: one monotonic clock, and how long a waiter polls. */
#ifndef MTE_CLOCK_H
#define MTE_CLOCK_H

#include <stdint.h>

/* CLOCK_MONOTONIC in nanoseconds: deadlines everywhere are in this clock. */
int64_t mte_now_ns(void);

/* How long a waiter polls before it blocks, in ns. On virtual machines a thread that
 * blocks lets its vCPU halt, and waking it again costs tens of microseconds (measured
 * here: a 4 KiB round trip took 16 us with both ends on one vCPU and 70-100 us across
 * two), more than the round trip itself. Polling briefly keeps the vCPU running through
 * the gap between a request and its answer; sched_yield keeps it polite when other
 * threads have work. Only ping-pong traffic polls (a synchronous request on the caller's
 * thread, a server connection that just answered one small request, a small batch's
 * wait): streams of requests keep both sides busy anyway, and polling there takes CPU
 * from the copies on small machines. MC_TCP_SPIN_US overrides the time (0: off). */
int64_t mte_spin_ns(void);

#endif

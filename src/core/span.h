/* SPDX-License-Identifier: Apache-2.0 */
/* Which of a sorted table's [addr, addr + len) entries holds an address: the one lookup
 * of the native tree (issue 40). The core's region table (regions.c) and the RDMA
 * transport's local keys and peers' buffers (src/rdma/keys.c) are tables of this shape:
 * entries sorted by start and not overlapping, each with `uint64_t addr, len`, kept as an
 * array of structs or of pointers to them. Header-only (static inline): the lookups sit
 * on every slice's path, and with the offsets known at the call site the compiler makes
 * each one the loop it was.
 *
 * MTE_SPAN_LAST_LE(v, n, direct|indirect, type, a)   last index whose start <= a, or -1
 * MTE_SPAN_FIND(v, n, direct|indirect, type, a, l)   index of the entry holding all of
 *                                                    [a, a + l), or -1 */
#ifndef MTE_CORE_SPAN_H
#define MTE_CORE_SPAN_H

#include <stddef.h>
#include <stdint.h>

static inline const void *mte_span_entry(const void *base, size_t i, size_t stride,
                                         int indirect)
{
    const char *e = (const char *)base + i * stride;
    return indirect ? *(const void *const *)e : (const void *)e;
}

static inline uint64_t mte_span_u64(const void *entry, size_t off)
{
    return *(const uint64_t *)((const char *)entry + off);
}

/* The index of the last of `n` entries whose start is <= `a`, or -1. */
static inline ptrdiff_t mte_span_last_le(const void *base, size_t n, size_t stride,
                                         int indirect, size_t addr_off, uint64_t a)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (mte_span_u64(mte_span_entry(base, mid, stride, indirect), addr_off) <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (ptrdiff_t)lo - 1;
}

/* The index of the entry whose [addr, addr + len) holds all of [a, a + l), or -1 (also
 * when a + l wraps around). */
static inline ptrdiff_t mte_span_find(const void *base, size_t n, size_t stride,
                                      int indirect, size_t addr_off, size_t len_off,
                                      uint64_t a, uint64_t l)
{
    ptrdiff_t i = mte_span_last_le(base, n, stride, indirect, addr_off, a);
    if (i < 0 || a + l < a)
        return -1;
    const void *e = mte_span_entry(base, (size_t)i, stride, indirect);
    return a + l > mte_span_u64(e, addr_off) + mte_span_u64(e, len_off) ? -1 : i;
}

#define MTE_SPAN_direct(type) sizeof(type), 0
#define MTE_SPAN_indirect(type) sizeof(type *), 1
#define MTE_SPAN_LAST_LE(v, n, how, type, a)                                              \
    mte_span_last_le((v), (n), MTE_SPAN_##how(type), offsetof(type, addr), (a))
#define MTE_SPAN_FIND(v, n, how, type, a, l)                                              \
    mte_span_find((v), (n), MTE_SPAN_##how(type), offsetof(type, addr),                   \
                  offsetof(type, len), (a), (l))

#endif

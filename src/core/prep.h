/* SPDX-License-Identifier: Apache-2.0 */
/* Prepared block tables (mooncake_te.prepared): what TransferEngine.prepare checked
 * once, kept in C so that a post is one native call (a transport's post_prepared) that
 * turns two arrays of block indices into queued requests, with no per-block Python and
 * no gathered address arrays.
 *
 * Layout: `rows` regions (1 for a 1-D table), each with `lcols` local and `rcols` remote
 * block addresses; a post of ids l[0..n), r[0..n) moves, for every row, block l[k] of
 * the local table and block r[k] of the remote one, lens[row] bytes: request
 * row * n + k (region-major, as core.gather_blocks lays addresses out).
 *
 * The tables are immutable once made; several threads may post from one at a time.
 * Nothing here re-checks addresses: prepare() checked them, the data path pins every
 * local region while its bytes move, and the peer checks every remote address. */
#ifndef MTE_PREP_H
#define MTE_PREP_H

#include <stddef.h>
#include <stdint.h>

typedef struct mte_prep {
    uint32_t rows, lcols, rcols;
    int any_device;             /* a local block was in device memory at prepare time */
    uint64_t *local;            /* rows x lcols */
    uint64_t *remote;           /* rows x rcols */
    uint64_t *lens;             /* rows */
    /* Every row of a side evenly spaced (a paged KV cache: block b of a plane is at
     * base + b * stride): its addresses are computed from base and stride per row, so a
     * post reads two numbers per row instead of one cache line per block. NULL when a
     * row of that side is not evenly spaced. */
    uint64_t *lbase, *lstride;  /* rows each, or NULL */
    uint64_t *rbase, *rstride;
    /* Per row, or NULL: 1 when the row's blocks are back to back on both sides (stride =
     * length) and the whole row lies in one registered region here and in one buffer of
     * the peer, so that blocks with consecutive ids on both sides may move as one request
     * (the coalescing vLLM's connector did in Python). Set by the owner (malloc'd). */
    uint8_t *merge;
} mte_prep_t;

/* Copies the tables; lens holds one value (every row) or `rows`. NULL when out of
 * memory. */
mte_prep_t *mte_prep_new(uint32_t rows, uint32_t lcols, uint32_t rcols, const uint64_t *local,
                         const uint64_t *remote, const uint64_t *lens, uint32_t nlens);
void mte_prep_free(mte_prep_t *t);

/* Address of block `col` of row `row` on one side. */
static inline uint64_t mte_prep_local(const mte_prep_t *t, uint32_t row, int64_t col)
{
    return t->lbase ? t->lbase[row] + (uint64_t)col * t->lstride[row]
                    : t->local[(size_t)row * t->lcols + col];
}

static inline uint64_t mte_prep_remote(const mte_prep_t *t, uint32_t row, int64_t col)
{
    return t->rbase ? t->rbase[row] + (uint64_t)col * t->rstride[row]
                    : t->remote[(size_t)row * t->rcols + col];
}

/* The position of the first id outside [0, cols), or -1 when every one is inside. */
static inline int64_t mte_prep_bad_id(const int64_t *ids, uint32_t n, uint32_t cols)
{
    for (uint32_t k = 0; k < n; k++)
        if ((uint64_t)ids[k] >= cols)       /* a negative id too */
            return k;
    return -1;
}

#endif

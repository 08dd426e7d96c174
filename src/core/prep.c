/* SPDX-License-Identifier: Apache-2.0 */
/* Prepared block tables; see prep.h. */
#include "prep.h"

#include <stdlib.h>
#include <string.h>

/* base[r], stride[r] of every row of a rows x cols table when each row is evenly spaced
 * (0 on success), or -1 (the caller keeps the full table). */
static int affine(const uint64_t *a, uint32_t rows, uint32_t cols, uint64_t **base,
                  uint64_t **stride)
{
    for (uint32_t r = 0; r < rows; r++) {
        const uint64_t *row = a + (size_t)r * cols;
        uint64_t s = cols > 1 ? row[1] - row[0] : 0;
        for (uint32_t c = 2; c < cols; c++)
            if (row[c] - row[c - 1] != s)
                return -1;
    }
    *base = malloc(rows * sizeof(uint64_t));
    *stride = malloc(rows * sizeof(uint64_t));
    if (!*base || !*stride) {
        free(*base);
        free(*stride);
        *base = *stride = NULL;
        return -1;
    }
    for (uint32_t r = 0; r < rows; r++) {
        const uint64_t *row = a + (size_t)r * cols;
        (*base)[r] = row[0];
        (*stride)[r] = cols > 1 ? row[1] - row[0] : 0;
    }
    return 0;
}

mte_prep_t *mte_prep_new(uint32_t rows, uint32_t lcols, uint32_t rcols, const uint64_t *local,
                         const uint64_t *remote, const uint64_t *lens, uint32_t nlens)
{
    if (!rows || !lcols || !rcols || (nlens != 1 && nlens != rows))
        return NULL;
    size_t nl = (size_t)rows * lcols, nr = (size_t)rows * rcols;
    mte_prep_t *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->local = malloc(nl * sizeof(uint64_t));
    t->remote = malloc(nr * sizeof(uint64_t));
    t->lens = malloc(rows * sizeof(uint64_t));
    if (!t->local || !t->remote || !t->lens) {
        mte_prep_free(t);
        return NULL;
    }
    memcpy(t->local, local, nl * sizeof(uint64_t));
    memcpy(t->remote, remote, nr * sizeof(uint64_t));
    for (uint32_t r = 0; r < rows; r++)
        t->lens[r] = lens[nlens == 1 ? 0 : r];
    t->rows = rows;
    t->lcols = lcols;
    t->rcols = rcols;
    affine(t->local, rows, lcols, &t->lbase, &t->lstride);
    affine(t->remote, rows, rcols, &t->rbase, &t->rstride);
    return t;
}

void mte_prep_free(mte_prep_t *t)
{
    if (!t)
        return;
    free(t->local);
    free(t->remote);
    free(t->lens);
    free(t->lbase);
    free(t->lstride);
    free(t->rbase);
    free(t->rstride);
    free(t->merge);
    free(t);
}

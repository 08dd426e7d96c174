/* SPDX-License-Identifier: Apache-2.0 */
/* Prepared block tables; see prep.h. */
#include "prep.h"

#include <stdlib.h>
#include <string.h>

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
    return t;
}

void mte_prep_free(mte_prep_t *t)
{
    if (!t)
        return;
    free(t->local);
    free(t->remote);
    free(t->lens);
    free(t);
}

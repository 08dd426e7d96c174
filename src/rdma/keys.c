/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA data path: memory keys: the local regions' lkeys per NIC, and the peers' published buffers with their rkeys (rdma.h). */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

const lmr_t *rdma_lmr_find(mte_rdma_t *r, uint64_t addr, uint64_t len)
{
    /* caller holds r->lk */
    ptrdiff_t i = MTE_SPAN_FIND(r->mrs, r->nmrs, indirect, lmr_t, addr, len);
    return i < 0 ? NULL : r->mrs[i];
}

int mte_rdma_mr_add(mte_rdma_t *r, uint64_t addr, uint64_t len, const uint32_t *lkeys,
                    int ndev, uint64_t pref, uint64_t avail)
{
    if (ndev < 0 || ndev > MTE_RDMA_MAX_DEV || len == 0)
        return -EINVAL;
    lmr_t *m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    m->addr = addr;
    m->len = len;
    m->pref = pref;
    m->avail = avail;
    memcpy(m->lkey, lkeys, (size_t)ndev * sizeof(uint32_t));
    pthread_rwlock_wrlock(&r->lk);
    if (r->nmrs == r->capmrs) {
        size_t cap = r->capmrs ? r->capmrs * 2 : 16;
        lmr_t **nm = realloc(r->mrs, cap * sizeof(*nm));
        if (!nm) {
            pthread_rwlock_unlock(&r->lk);
            free(m);
            return -ENOMEM;
        }
        r->mrs = nm;
        r->capmrs = cap;
    }
    size_t i = r->nmrs;
    while (i > 0 && r->mrs[i - 1]->addr > addr) {
        r->mrs[i] = r->mrs[i - 1];
        i--;
    }
    r->mrs[i] = m;
    r->nmrs++;
    pthread_rwlock_unlock(&r->lk);
    return 0;
}

int mte_rdma_mr_remove(mte_rdma_t *r, uint64_t addr)
{
    lmr_t *gone = NULL;
    pthread_rwlock_wrlock(&r->lk);
    for (size_t i = 0; i < r->nmrs; i++) {
        if (r->mrs[i]->addr == addr) {
            gone = r->mrs[i];
            memmove(&r->mrs[i], &r->mrs[i + 1], (r->nmrs - i - 1) * sizeof(*r->mrs));
            r->nmrs--;
            break;
        }
    }
    pthread_rwlock_unlock(&r->lk);
    /* The engine removed the region from its table first, which waited for every
     * request pinning it: no slice refers to these keys any more. */
    free(gone);
    return gone ? 0 : -ENOENT;
}


void rdma_rtable_free(rtable_t *t)
{
    if (t) {
        free(t->bufs);
        free(t->keys);
        free(t);
    }
}

static int cmp_rbuf(const void *a, const void *b)
{
    uint64_t x = ((const rbuf_t *)a)->addr, y = ((const rbuf_t *)b)->addr;
    return x < y ? -1 : x > y;
}

int mte_rdma_peer_set_buffers(mte_rdma_peer_t *p, size_t n, const uint64_t *addrs,
                              const uint64_t *lens, const uint8_t *access,
                              const uint32_t *rkeys, const uint64_t *pref,
                              const uint64_t *avail)
{
    rtable_t *t = calloc(1, sizeof(*t));
    if (!t)
        return -ENOMEM;
    t->n = n;
    t->bufs = calloc(n ? n : 1, sizeof(rbuf_t));
    t->keys = calloc((n ? n : 1) * (size_t)p->npdev, sizeof(uint32_t));
    if (!t->bufs || !t->keys) {
        rdma_rtable_free(t);
        return -ENOMEM;
    }
    memcpy(t->keys, rkeys, n * (size_t)p->npdev * sizeof(uint32_t));
    for (size_t i = 0; i < n; i++)
        t->bufs[i] = (rbuf_t){.addr = addrs[i], .len = lens[i], .access = access[i],
                              .pref = pref[i], .avail = avail[i],
                              .rkey = t->keys + i * (size_t)p->npdev};
    qsort(t->bufs, n, sizeof(rbuf_t), cmp_rbuf);
    pthread_rwlock_wrlock(&p->lk);
    rtable_t *old = p->table;
    p->table = t;
    pthread_rwlock_unlock(&p->lk);
    rdma_rtable_free(old);        /* requests copied what they needed */
    return 0;
}

const rbuf_t *rdma_rbuf_find(const rtable_t *t, uint64_t addr, uint64_t len)
{
    if (!t)
        return NULL;
    ptrdiff_t i = MTE_SPAN_FIND(t->bufs, t->n, direct, rbuf_t, addr, len);
    return i < 0 ? NULL : &t->bufs[i];
}


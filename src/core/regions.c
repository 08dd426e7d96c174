/* SPDX-License-Identifier: Apache-2.0 */
#include "regions.h"
#include "span.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define PIN_REMOVED 0x80000000u
#define PIN_COUNT   0x7fffffffu

struct mte_region {
    uint64_t addr, len;
    unsigned access;
    int device;                /* CUDA ordinal, -1: host memory */
    /* Pin count, with PIN_REMOVED set once the region left the table. One word, so
     * that an unpinner learns "last pin of a removed region" from its own atomic
     * operation and never reads the region after letting go of it (issue #20 item 1:
     * reading a separate `removed` flag after the decrement raced with free()). */
    atomic_uint pins;
    mte_regions_t *table;
};

struct mte_regions {
    pthread_rwlock_t lock;     /* guards the sorted array */
    mte_region_t **v;          /* sorted by addr, non-overlapping */
    size_t n, cap;
    pthread_mutex_t wait_mu;   /* remove() waits here for pins to drain */
    pthread_cond_t wait_cv;
    atomic_int device_regions;     /* GPU regions ever added (never decreases) */
};

mte_regions_t *mte_regions_new(void)
{
    mte_regions_t *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    pthread_rwlock_init(&t->lock, NULL);
    pthread_mutex_init(&t->wait_mu, NULL);
    pthread_cond_init(&t->wait_cv, NULL);
    return t;
}

void mte_regions_free(mte_regions_t *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->n; i++)
        free(t->v[i]);
    free(t->v);
    pthread_rwlock_destroy(&t->lock);
    pthread_mutex_destroy(&t->wait_mu);
    pthread_cond_destroy(&t->wait_cv);
    free(t);
}

/* Index of the last region with addr <= a, or -1. Caller holds the lock. */
static ptrdiff_t find_le(const mte_regions_t *t, uint64_t a)
{
    return MTE_SPAN_LAST_LE(t->v, t->n, indirect, mte_region_t, a);
}

int mte_regions_add(mte_regions_t *t, uint64_t addr, uint64_t len, unsigned access)
{
    return mte_regions_add_dev(t, addr, len, access, -1);
}

int mte_region_device(const mte_region_t *r) { return r->device; }

int mte_regions_add_dev(mte_regions_t *t, uint64_t addr, uint64_t len, unsigned access,
                        int device)
{
    if (len == 0 || addr + len < addr)
        return -EINVAL;
    mte_region_t *r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->addr = addr;
    r->len = len;
    r->access = access;
    r->device = device < 0 ? -1 : device;
    if (device >= 0)
        atomic_fetch_add(&t->device_regions, 1);
    r->table = t;
    pthread_rwlock_wrlock(&t->lock);
    ptrdiff_t i = find_le(t, addr);
    if ((i >= 0 && t->v[i]->addr + t->v[i]->len > addr) ||
        ((size_t)(i + 1) < t->n && t->v[i + 1]->addr < addr + len)) {
        pthread_rwlock_unlock(&t->lock);
        free(r);
        return -EEXIST;
    }
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        mte_region_t **v = realloc(t->v, cap * sizeof(*v));
        if (!v) {
            pthread_rwlock_unlock(&t->lock);
            free(r);
            return -ENOMEM;
        }
        t->v = v;
        t->cap = cap;
    }
    memmove(&t->v[i + 2], &t->v[i + 1], (t->n - (size_t)(i + 1)) * sizeof(*t->v));
    t->v[i + 1] = r;
    t->n++;
    pthread_rwlock_unlock(&t->lock);
    return 0;
}

int mte_regions_remove(mte_regions_t *t, uint64_t addr)
{
    pthread_rwlock_wrlock(&t->lock);
    ptrdiff_t i = find_le(t, addr);
    if (i < 0 || t->v[i]->addr != addr) {
        pthread_rwlock_unlock(&t->lock);
        return -ENOENT;
    }
    mte_region_t *r = t->v[i];
    memmove(&t->v[i], &t->v[i + 1], (t->n - (size_t)i - 1) * sizeof(*t->v));
    t->n--;
    /* Under the write lock: no pin can be taken any more (pins need the read lock and
     * the region is no longer in the array), so the count can only go down now. */
    atomic_fetch_or(&r->pins, PIN_REMOVED);
    pthread_rwlock_unlock(&t->lock);
    /* In-flight I/O is bounded by the transports' deadlines, so this wait ends. An
     * unpinner that sees PIN_REMOVED decrements under wait_mu, so once we hold wait_mu
     * and read a count of 0, nobody touches r again and it can be freed. */
    pthread_mutex_lock(&t->wait_mu);
    while (atomic_load(&r->pins) & PIN_COUNT)
        pthread_cond_wait(&t->wait_cv, &t->wait_mu);
    pthread_mutex_unlock(&t->wait_mu);
    free(r);
    return 0;
}

static mte_region_t *lookup(mte_regions_t *t, uint64_t addr, uint64_t len, unsigned need, int *why)
{
    ptrdiff_t i = MTE_SPAN_FIND(t->v, t->n, indirect, mte_region_t, addr, len);
    if (i < 0) {
        *why = -ENOENT;
        return NULL;
    }
    if ((t->v[i]->access & need) != need) {
        *why = -EACCES;
        return NULL;
    }
    return t->v[i];
}

mte_region_t *mte_regions_pin(mte_regions_t *t, uint64_t addr, uint64_t len, unsigned need, int *why)
{
    pthread_rwlock_rdlock(&t->lock);
    mte_region_t *r = lookup(t, addr, len, need, why);
    if (r)
        atomic_fetch_add(&r->pins, 1);
    pthread_rwlock_unlock(&t->lock);
    return r;
}

void mte_region_unpin(mte_region_t *r)
{
    /* Fast path: the region is live, drop the pin with one CAS and never look back. */
    unsigned v = atomic_load(&r->pins);
    while (!(v & PIN_REMOVED))
        if (atomic_compare_exchange_weak(&r->pins, &v, v - 1))
            return;
    /* Removal pending: the remover frees r only after it read a count of 0 under
     * wait_mu, so decrement and wake it while holding wait_mu. r and its table are
     * alive until we unlock; we touch neither afterwards. */
    mte_regions_t *t = r->table;
    pthread_mutex_lock(&t->wait_mu);
    if ((atomic_fetch_sub(&r->pins, 1) & PIN_COUNT) == 1)
        pthread_cond_broadcast(&t->wait_cv);
    pthread_mutex_unlock(&t->wait_mu);
}

int64_t mte_regions_check_many(mte_regions_t *t, const uint64_t *addrs, const uint64_t *lens,
                               int len_stride, uint64_t n, unsigned need, int *why)
{
    int64_t bad = -1;
    pthread_rwlock_rdlock(&t->lock);
    for (uint64_t k = 0; k < n; k++) {
        uint64_t len = lens[len_stride ? k : 0];
        if (len == 0 || !lookup(t, addrs[k], len, need, why)) {
            if (len == 0)
                *why = -EINVAL;
            bad = (int64_t)k;
            break;
        }
    }
    pthread_rwlock_unlock(&t->lock);
    return bad;
}

int mte_regions_device_at(mte_regions_t *t, uint64_t addr)
{
    if (atomic_load(&t->device_regions) == 0)
        return -1;
    pthread_rwlock_rdlock(&t->lock);
    ptrdiff_t i = find_le(t, addr);
    int dev = i >= 0 && addr < t->v[i]->addr + t->v[i]->len ? t->v[i]->device : -1;
    pthread_rwlock_unlock(&t->lock);
    return dev;
}

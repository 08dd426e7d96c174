/* SPDX-License-Identifier: Apache-2.0 */
/* NVMe-oF data path: see nvmeof.h. */
#define _GNU_SOURCE
#include "nvmeof.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define STRIPES 64

typedef struct {
    mte_batch_t *b;
    uint32_t idx;
    int op;
    uint64_t laddr, off, len;
} slice_t;

struct mte_nvf {
    int fd;
    int direct;
    uint32_t block;             /* O_DIRECT alignment of offsets and lengths */
    atomic_ulong memmask;       /* ... and of memory addresses (mask), learned: see io_slice */
    uint64_t size;
    uint64_t slice;
    mte_regions_t *regions;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    slice_t *q;                 /* ring buffer */
    size_t qcap, qhead, qlen;
    int stop;

    int nthreads;
    pthread_t *threads;
    atomic_int refs;            /* the owner's + one per running worker */
    char *_Atomic spare;        /* a bounce buffer kept for mte_nvf_transfer */
    pthread_mutex_t stripe[STRIPES];   /* edge blocks of unaligned writes */
};

static void nvf_unref(mte_nvf_t *f)
{
    if (atomic_fetch_sub(&f->refs, 1) != 1)
        return;
    close(f->fd);
    free(atomic_load(&f->spare));
    free(f->q);
    free(f->threads);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    for (int i = 0; i < STRIPES; i++)
        pthread_mutex_destroy(&f->stripe[i]);
    free(f);
}

/* --- raw I/O ----------------------------------------------------------------------- */

static int io_full(int fd, int op, char *buf, uint64_t len, uint64_t off)
{
    while (len) {
        ssize_t r = op == MTE_OP_READ ? pread(fd, buf, len, (off_t)off)
                                      : pwrite(fd, buf, len, (off_t)off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return MTE_E_STORAGE_BASE - errno;
        }
        if (r == 0)
            return MTE_E_STORAGE_BASE - EIO;       /* past the end of the device */
        buf += r;
        off += (uint64_t)r;
        len -= (uint64_t)r;
    }
    return 0;
}

static int aligned(mte_nvf_t *f, uint64_t laddr, uint64_t off, uint64_t len)
{
    return !((off | len) & (f->block - 1)) && !(laddr & atomic_load(&f->memmask));
}

/* One slice: straight between memory and the device when aligned, else through
 * `bounce` (at least slice + 2 blocks, block-aligned). */
static int io_slice(mte_nvf_t *f, int op, uint64_t laddr, uint64_t off, uint64_t len,
                    char *bounce)
{
    char *mem = (char *)(uintptr_t)laddr;
    if (!f->direct)
        return io_full(f->fd, op, mem, len, off);
    if (aligned(f, laddr, off, len)) {
        int rc = io_full(f->fd, op, mem, len, off);
        if (rc != MTE_E_STORAGE_BASE - EINVAL || !(laddr & (f->block - 1)))
            return rc;
        /* Offset and length were whole blocks, so the device wants memory aligned more
         * strictly than we assumed (block/fops.c checks the queue's dma_alignment):
         * from now on such memory goes through the bounce buffer. */
        atomic_store(&f->memmask, f->block - 1);
    }
    uint64_t bs = f->block;
    uint64_t a0 = off & ~(bs - 1);
    uint64_t a1 = (off + len + bs - 1) & ~(bs - 1);
    uint64_t span = a1 - a0;
    if (op == MTE_OP_READ) {
        int rc = io_full(f->fd, op, bounce, span, a0);
        if (rc == 0)
            memcpy(mem, bounce + (off - a0), len);
        return rc;
    }
    /* Read-modify-write of the partial edge blocks, under their stripe locks (taken
     * in index order, so two writers never wait on each other crosswise). */
    int edges = off != a0 || off + len != a1;      /* only memory unaligned: no merge */
    unsigned s0 = (unsigned)((a0 / bs) % STRIPES), s1 = (unsigned)(((a1 - bs) / bs) % STRIPES);
    if (s0 > s1) { unsigned t = s0; s0 = s1; s1 = t; }
    if (edges) {
        pthread_mutex_lock(&f->stripe[s0]);
        if (s1 != s0)
            pthread_mutex_lock(&f->stripe[s1]);
    }
    int rc = 0;
    if (off != a0)
        rc = io_full(f->fd, MTE_OP_READ, bounce, bs, a0);
    if (rc == 0 && off + len != a1 && (span > bs || off == a0))
        rc = io_full(f->fd, MTE_OP_READ, bounce + span - bs, bs, a1 - bs);
    if (rc == 0) {
        memcpy(bounce + (off - a0), mem, len);
        rc = io_full(f->fd, MTE_OP_WRITE, bounce, span, a0);
    }
    if (edges) {
        if (s1 != s0)
            pthread_mutex_unlock(&f->stripe[s1]);
        pthread_mutex_unlock(&f->stripe[s0]);
    }
    return rc;
}

/* GPU memory: pread/pwrite cannot touch it, so its bytes pass through the core's
 * pinned staging ring (src/core/stage.h), chunk by chunk: the device's copy of one chunk
 * overlaps the storage I/O of the previous one. Chunks are at most a slice long, so the
 * bounce buffer covers the unaligned ones. */
typedef struct {
    mte_nvf_t *f;
    uint64_t off;               /* device offset of the next chunk */
    char *bounce;
} staged_io_t;

static int staged_to_disk(void *ctx, const uint8_t *p, size_t n)
{
    staged_io_t *x = ctx;
    int rc = io_slice(x->f, MTE_OP_WRITE, (uint64_t)(uintptr_t)p, x->off, n, x->bounce);
    x->off += n;
    return rc;
}

static int disk_to_staged(void *ctx, uint8_t *p, size_t n)
{
    staged_io_t *x = ctx;
    int rc = io_slice(x->f, MTE_OP_READ, (uint64_t)(uintptr_t)p, x->off, n, x->bounce);
    x->off += n;
    return rc;
}

static int run_staged(mte_nvf_t *f, const slice_t *s, int dev, char *bounce,
                      mte_stage_t **stage)
{
    if (!mte_stage_get(stage))
        return MTE_E_NOMEM;
    staged_io_t x = {.f = f, .off = s->off, .bounce = bounce};
    if (s->op == MTE_OP_WRITE)
        return mte_stage_out(*stage, dev, (const uint8_t *)(uintptr_t)s->laddr, s->len,
                             staged_to_disk, &x);
    int cuda_err = 0;
    int rc = mte_stage_in(*stage, dev, (uint8_t *)(uintptr_t)s->laddr, s->len, disk_to_staged,
                          &x, 0, &cuda_err);
    return rc ? rc : cuda_err;
}

static int run_slice(mte_nvf_t *f, const slice_t *s, char *bounce, mte_stage_t **stage)
{
    int why = 0;
    mte_region_t *r = mte_regions_pin(f->regions, s->laddr, s->len, 0, &why);
    if (!r)
        return MTE_E_LOCAL_NOT_REG;
    int dev = mte_region_device(r);
    int rc = dev >= 0 ? run_staged(f, s, dev, bounce, stage)
                      : io_slice(f, s->op, s->laddr, s->off, s->len, bounce);
    mte_region_unpin(r);
    return rc;
}

/* --- workers ----------------------------------------------------------------------- */

static char *bounce_new(const mte_nvf_t *f)
{
    void *p = NULL;
    if (posix_memalign(&p, f->block < 4096 ? 4096 : f->block, f->slice + 2 * (size_t)f->block))
        return NULL;
    return p;
}

static int stopped_code(const mte_nvf_t *f, mte_batch_t *b)
{
    (void)f;
    int64_t dl = mte_batch_deadline(b);
    if (dl && mte_now_ns() > dl)
        return MTE_E_TIMEOUT;
    if (mte_batch_stopped(b))
        return MTE_E_CANCELED;
    return 0;
}

static void *worker(void *arg)
{
    mte_nvf_t *f = arg;
    char *bounce = bounce_new(f);
    mte_stage_t *stage = NULL;          /* pinned staging for GPU memory, on first use */
    pthread_mutex_lock(&f->mu);
    for (;;) {
        while (!f->qlen && !f->stop)
            pthread_cond_wait(&f->cv, &f->mu);
        if (!f->qlen)
            break;                      /* stopping, nothing left */
        slice_t s = f->q[f->qhead];
        f->qhead = (f->qhead + 1) % f->qcap;
        f->qlen--;
        int stop = f->stop;
        pthread_mutex_unlock(&f->mu);
        int rc = stop ? MTE_E_CLOSED : stopped_code(f, s.b);
        if (rc == 0)
            rc = bounce ? run_slice(f, &s, bounce, &stage) : MTE_E_NOMEM;
        mte_batch_slice_done(s.b, s.idx, rc ? 0 : s.len, rc);   /* s.b may be gone after */
        pthread_mutex_lock(&f->mu);
    }
    pthread_mutex_unlock(&f->mu);
    mte_stage_free(stage);
    free(bounce);
    nvf_unref(f);
    return NULL;
}

/* --- public ------------------------------------------------------------------------ */

mte_nvf_t *mte_nvf_open(const char *path, uint64_t size, int threads, uint64_t slice,
                        mte_regions_t *regions, int *err)
{
    *err = 0;
    if (threads < 1 || threads > 1024 || slice < 4096 ||
        slice % 4096) {
        *err = -EINVAL;
        return NULL;
    }
    int direct = 1;
    int fd = open(path, O_RDWR | O_DIRECT | O_CLOEXEC);
    if (fd < 0 && errno == EINVAL) {          /* tmpfs and friends: no O_DIRECT */
        direct = 0;
        fd = open(path, O_RDWR | O_CLOEXEC);
    }
    if (fd < 0) {
        *err = -errno;
        return NULL;
    }
    struct stat st;
    uint64_t devsize = 0;
    uint32_t block = 4096;
    if (fstat(fd, &st) == 0 && S_ISBLK(st.st_mode)) {
        int lbs = 0;
        if (ioctl(fd, BLKGETSIZE64, &devsize) != 0 || ioctl(fd, BLKSSZGET, &lbs) != 0) {
            *err = -errno;
            close(fd);
            return NULL;
        }
        block = lbs > 0 ? (uint32_t)lbs : 512;
    } else {
        devsize = (uint64_t)st.st_size;
        if (direct && devsize % block) {
            /* The tail of the file is not a whole block: direct I/O could not reach it. */
            close(fd);
            fd = open(path, O_RDWR | O_CLOEXEC);
            if (fd < 0) {
                *err = -errno;
                return NULL;
            }
            direct = 0;
        }
    }
    if (size == 0 || size > devsize)
        size = size ? size : devsize;
    if (size > devsize) {
        *err = -ERANGE;
        close(fd);
        return NULL;
    }
    mte_nvf_t *f = calloc(1, sizeof(*f));
    if (!f) {
        close(fd);
        *err = -ENOMEM;
        return NULL;
    }
    f->fd = fd;
    f->direct = direct;
    f->block = direct ? block : 1;
    /* Memory alignment: block devices are first tried at 4 bytes (NVMe asks only dword
     * alignment of user buffers, drivers/nvme/host/core.c; a stricter device answers
     * EINVAL and we learn), files at the block size (file systems differ). */
    atomic_init(&f->memmask, !direct ? 0 : S_ISBLK(st.st_mode) ? 3 : block - 1);
    f->size = size;
    f->slice = slice;
    f->regions = regions;
    f->qcap = 256;
    f->q = malloc(f->qcap * sizeof(*f->q));
    f->threads = calloc((size_t)threads, sizeof(pthread_t));
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    for (int i = 0; i < STRIPES; i++)
        pthread_mutex_init(&f->stripe[i], NULL);
    atomic_init(&f->refs, 1);
    if (!f->q || !f->threads) {
        nvf_unref(f);
        *err = -ENOMEM;
        return NULL;
    }
    for (int i = 0; i < threads; i++) {
        atomic_fetch_add(&f->refs, 1);
        if (pthread_create(&f->threads[i], NULL, worker, f) != 0) {
            atomic_fetch_sub(&f->refs, 1);
            break;
        }
        f->nthreads++;
    }
    if (f->nthreads == 0) {
        nvf_unref(f);
        *err = -EAGAIN;
        return NULL;
    }
    return f;
}

uint64_t mte_nvf_size(const mte_nvf_t *f) { return f->size; }
uint32_t mte_nvf_block(const mte_nvf_t *f) { return f->block; }
int mte_nvf_direct(const mte_nvf_t *f) { return f->direct; }
uint32_t mte_nvf_memalign(mte_nvf_t *f) { return (uint32_t)atomic_load(&f->memmask) + 1; }

static int push(mte_nvf_t *f, const slice_t *s)
{
    if (f->qlen == f->qcap) {
        size_t cap = f->qcap * 2;
        slice_t *q = malloc(cap * sizeof(*q));
        if (!q)
            return -ENOMEM;
        for (size_t i = 0; i < f->qlen; i++)
            q[i] = f->q[(f->qhead + i) % f->qcap];
        free(f->q);
        f->q = q;
        f->qcap = cap;
        f->qhead = 0;
    }
    f->q[(f->qhead + f->qlen) % f->qcap] = *s;
    f->qlen++;
    return 0;
}

int mte_nvf_submit(mte_nvf_t *f, mte_batch_t *b, int op, const uint64_t *local,
                   const uint64_t *offs, const uint64_t *lens, int len_stride,
                   uint32_t first, uint32_t n)
{
    if (op != MTE_OP_READ && op != MTE_OP_WRITE)
        return MTE_E_INVALID;
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t len = lens[len_stride ? i : 0];
        if (len == 0 || offs[i] > f->size || len > f->size - offs[i])
            return MTE_E_OUT_OF_RANGE;
        total += (len + f->slice - 1) / f->slice + 1;
    }
    /* Room for every slice first, so the batch is queued whole or not at all. */
    pthread_mutex_lock(&f->mu);
    if (f->stop) {
        pthread_mutex_unlock(&f->mu);
        return MTE_E_CLOSED;
    }
    while (f->qcap - f->qlen < total) {
        size_t cap = f->qcap * 2;
        slice_t *q = malloc(cap * sizeof(*q));
        if (!q) {
            pthread_mutex_unlock(&f->mu);
            return MTE_E_NOMEM;
        }
        for (size_t i = 0; i < f->qlen; i++)
            q[i] = f->q[(f->qhead + i) % f->qcap];
        free(f->q);
        f->q = q;
        f->qcap = cap;
        f->qhead = 0;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint64_t len = lens[len_stride ? i : 0], off = offs[i], laddr = local[i];
        /* Cut at multiples of the slice size in the device's offset space, so only the
         * first and last slices of a request can be unaligned. */
        uint32_t count = 0;
        for (uint64_t o = off; o < off + len; o = (o / f->slice + 1) * f->slice)
            count++;
        mte_batch_begin(b, first + i, count);
        uint64_t o = off;
        while (o < off + len) {
            uint64_t end = (o / f->slice + 1) * f->slice;
            if (end > off + len)
                end = off + len;
            slice_t s = {.b = b, .idx = first + i, .op = op, .laddr = laddr + (o - off),
                         .off = o, .len = end - o};
            push(f, &s);                  /* room was made above */
            o = end;
        }
    }
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return 0;
}

int mte_nvf_transfer(mte_nvf_t *f, int op, uint64_t local, uint64_t off, uint64_t len,
                     int64_t deadline_ns)
{
    if (op != MTE_OP_READ && op != MTE_OP_WRITE)
        return -EINVAL;
    if (len == 0 || off > f->size || len > f->size - off)
        return MTE_E_OUT_OF_RANGE;
    if (deadline_ns && mte_now_ns() > deadline_ns)
        return MTE_E_TIMEOUT;
    char *bounce = NULL;
    mte_stage_t *stage = NULL;     /* GPU memory: a ring for this call (Python batches it) */
    int gpu = mte_regions_device_at(f->regions, local) >= 0;
    int rc = 0;
    for (uint64_t o = off; o < off + len && rc == 0; ) {
        uint64_t end = (o / f->slice + 1) * f->slice;
        if (end > off + len)
            end = off + len;
        slice_t s = {.op = op, .laddr = local + (o - off), .off = o, .len = end - o};
        /* The bounce buffer may be needed even when aligned() holds (the device can
         * turn out to want stricter memory alignment), so test the strict rule. */
        if (f->direct && (gpu || ((s.laddr | s.off | s.len) & (f->block - 1))) && !bounce &&
            !(bounce = atomic_exchange(&f->spare, NULL)) && !(bounce = bounce_new(f))) {
            rc = MTE_E_NOMEM;
            break;
        }
        rc = run_slice(f, &s, bounce, &stage);
        o = end;
    }
    mte_stage_free(stage);
    char *none = NULL;
    if (bounce && !atomic_compare_exchange_strong(&f->spare, &none, bounce))
        free(bounce);
    return rc;
}

int mte_nvf_close(mte_nvf_t *f, int wait_ms)
{
    pthread_mutex_lock(&f->mu);
    f->stop = 1;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += wait_ms / 1000;
    until.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    int stuck = 0;
    for (int i = 0; i < f->nthreads; i++) {
        if (pthread_timedjoin_np(f->threads[i], NULL, &until) != 0) {
            pthread_detach(f->threads[i]);      /* it frees f when it is the last out */
            stuck = 1;
        }
    }
    nvf_unref(f);
    return stuck;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* See gpu.h. The driver API signatures are those of the CUDA Driver API reference
 * (https://docs.nvidia.com/cuda/cuda-driver-api/); where cuda.h maps a name to a
 * versioned symbol (cuMemcpyHtoDAsync -> cuMemcpyHtoDAsync_v2, ...), the versioned
 * symbol is looked up, as cuda.h would have the linker do. */
#define _GNU_SOURCE
#include "gpu.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;

#define CU_STREAM_NON_BLOCKING 1u
#define CU_EVENT_DISABLE_TIMING 2u
#define CU_MEMHOSTALLOC_PORTABLE 1u      /* usable from every context */

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxPush)(CUcontext);
    CUresult (*CtxPop)(CUcontext *);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*EventCreate)(CUevent *, unsigned);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*HtoDAsync)(uint64_t, const void *, size_t, CUstream);
    CUresult (*DtoHAsync)(void *, uint64_t, size_t, CUstream);
    CUresult (*HostAlloc)(void **, size_t, unsigned);
    CUresult (*FreeHost)(void *);
    CUresult (*GetErrorString)(CUresult, const char **);
} cu;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static char last_err[256];

/* Remembers the first failed CUDA call (mte_gpu_error says it); with MTE_DEBUG_CUDA set,
 * every failure is also printed to stderr. */
static CUresult failed(const char *what, CUresult rc)
{
    if (rc != 0) {
        const char *s = NULL;
        if (cu.GetErrorString)
            cu.GetErrorString(rc, &s);
        if (!last_err[0])
            snprintf(last_err, sizeof(last_err), "%s failed: %s (%d)", what, s ? s : "?", rc);
        if (getenv("MTE_DEBUG_CUDA"))
            fprintf(stderr, "mooncake_te: %s failed: %s (%d)\n", what, s ? s : "?", rc);
    }
    return rc;
}
static int init_rc = MTE_E_CUDA;
static char init_err[256] = "not loaded";
static void *lib_handle;          /* the process's one dlopen of the driver (gpu.h) */
static pthread_mutex_t ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static CUcontext primary[MTE_GPU_MAX_DEVICES];

static void load(void)
{
    void *h = dlopen(MTE_CUDA_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(init_err, sizeof(init_err), "no CUDA driver (%s cannot be loaded: %s)",
                 MTE_CUDA_LIBRARY, dlerror());
        return;
    }
#define SYM(field, name)                                                              \
    do {                                                                              \
        *(void **)&cu.field = dlsym(h, name);                                         \
        if (!cu.field) {                                                              \
            snprintf(init_err, sizeof(init_err),                                      \
                     "the CUDA driver is too old: " MTE_CUDA_LIBRARY " lacks %s", name);      \
            return;                                                                   \
        }                                                                             \
    } while (0)
    SYM(Init, "cuInit");
    SYM(DeviceGet, "cuDeviceGet");
    SYM(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(CtxPush, "cuCtxPushCurrent_v2");
    SYM(CtxPop, "cuCtxPopCurrent_v2");
    SYM(StreamCreate, "cuStreamCreate");
    SYM(StreamDestroy, "cuStreamDestroy_v2");
    SYM(EventCreate, "cuEventCreate");
    SYM(EventRecord, "cuEventRecord");
    SYM(EventSynchronize, "cuEventSynchronize");
    SYM(EventDestroy, "cuEventDestroy_v2");
    SYM(HtoDAsync, "cuMemcpyHtoDAsync_v2");
    SYM(DtoHAsync, "cuMemcpyDtoHAsync_v2");
    SYM(HostAlloc, "cuMemHostAlloc");
    SYM(FreeHost, "cuMemFreeHost");
    SYM(GetErrorString, "cuGetErrorString");
#undef SYM
    CUresult rc = cu.Init(0);
    if (rc != 0) {
        const char *what = NULL;
        cu.GetErrorString(rc, &what);
        snprintf(init_err, sizeof(init_err), "cuInit failed with %s (%d): no usable GPU, or "
                 "the driver and kernel module disagree (see nvidia-smi)",
                 what ? what : "?", rc);
        return;
    }
    lib_handle = h;
    init_err[0] = 0;
    init_rc = 0;
}

static size_t env_size(const char *name, size_t dflt, size_t lo, size_t hi)
{
    const char *v = getenv(name);
    long long x = v && *v ? atoll(v) : 0;
    return x <= 0 ? dflt : (size_t)x < lo ? lo : (size_t)x > hi ? hi : (size_t)x;
}

size_t mte_stage_chunk(void)
{
    static size_t cached;
    if (!cached)
        cached = env_size("MC_GPU_STAGE_CHUNK", 2u << 20, 64u << 10, 16u << 20);
    return cached;
}

uint64_t mte_gpu_slice(void)
{
    static uint64_t cached;
    if (!cached)
        cached = env_size("MC_GPU_SLICE", 4u << 20, 64u << 10, 1u << 30);
    return cached;
}

int mte_gpu_init(void)
{
    pthread_once(&once, load);
    return init_rc;
}

const char *mte_gpu_error(void) { return init_err[0] ? init_err : last_err; }

void *mte_gpu_library(void)
{
    return mte_gpu_init() == 0 ? lib_handle : NULL;
}

/* The primary context of `device`, retained once for the life of the process (the same
 * context cudart-based libraries use). NULL on failure. */
static CUcontext ctx_of(int device)
{
    if (device < 0 || device >= MTE_GPU_MAX_DEVICES || mte_gpu_init())
        return NULL;
    pthread_mutex_lock(&ctx_mu);
    CUcontext c = primary[device];
    if (!c) {
        CUdevice d;
        if (failed("cuDeviceGet", cu.DeviceGet(&d, device)) == 0 &&
            failed("cuDevicePrimaryCtxRetain", cu.PrimaryCtxRetain(&c, d)) == 0)
            primary[device] = c;
        else
            c = NULL;
    }
    pthread_mutex_unlock(&ctx_mu);
    return c;
}

typedef struct {
    CUstream stream;
    CUevent ev[MTE_STAGE_SLOTS];
} per_device_t;

struct mte_stage {
    uint8_t *slot[MTE_STAGE_SLOTS];
    int slot_dev[MTE_STAGE_SLOTS];        /* device of the copy in flight, -1: none */
    int ring_dev;                         /* device whose context allocated the ring */
    per_device_t *dev[MTE_GPU_MAX_DEVICES];
};

mte_stage_t *mte_stage_new(void)
{
    mte_stage_t *s = calloc(1, sizeof(*s));
    if (s)
        for (int k = 0; k < MTE_STAGE_SLOTS; k++)
            s->slot_dev[k] = -1;
    return s;
}

void mte_stage_free(mte_stage_t *s)
{
    if (!s)
        return;
    mte_stage_drain(s);
    for (int d = 0; d < MTE_GPU_MAX_DEVICES; d++) {
        per_device_t *p = s->dev[d];
        if (!p)
            continue;
        CUcontext c = ctx_of(d), old;
        if (c && cu.CtxPush(c) == 0) {
            for (int k = 0; k < MTE_STAGE_SLOTS; k++)
                if (p->ev[k])
                    cu.EventDestroy(p->ev[k]);
            if (p->stream)
                cu.StreamDestroy(p->stream);
            cu.CtxPop(&old);
        }
        free(p);
    }
    if (s->slot[0]) {                     /* slot 0 owns the ring; the rest are views */
        CUcontext c = ctx_of(s->ring_dev), old;
        if (c && cu.CtxPush(c) == 0) {
            cu.FreeHost(s->slot[0]);
            cu.CtxPop(&old);
        }
    }
    free(s);
}

uint8_t *mte_stage_slot(mte_stage_t *s, int k, int device)
{
    if (!s->slot[0]) {
        /* cuMemHostAlloc needs a current context: the device's primary one. */
        CUcontext c = ctx_of(device), old;
        if (!c || failed("cuCtxPushCurrent", cu.CtxPush(c)) != 0)
            return NULL;
        /* One allocation for the ring: pinned memory is costly to set up and is kept.
         * Portable: usable by the streams of every device's context. */
        void *p = NULL;
        CUresult rc = failed("cuMemHostAlloc",
                             cu.HostAlloc(&p, (size_t)MTE_STAGE_SLOTS * mte_stage_chunk(),
                                          CU_MEMHOSTALLOC_PORTABLE));
        cu.CtxPop(&old);
        if (rc != 0)
            return NULL;
        s->ring_dev = device;
        for (int j = 0; j < MTE_STAGE_SLOTS; j++)
            s->slot[j] = (uint8_t *)p + (size_t)j * mte_stage_chunk();
    }
    return s->slot[k];
}

/* The stream and events of `device`, created on first use; the device's context is
 * pushed on return (the caller pops it). NULL on failure (nothing pushed). */
static per_device_t *enter(mte_stage_t *s, int device)
{
    CUcontext c = ctx_of(device), old;
    if (!c || failed("cuCtxPushCurrent", cu.CtxPush(c)) != 0)
        return NULL;
    per_device_t *p = s->dev[device];
    if (!p) {
        p = calloc(1, sizeof(*p));
        int ok = p && failed("cuStreamCreate",
                             cu.StreamCreate(&p->stream, CU_STREAM_NON_BLOCKING)) == 0;
        /* Events wait by spinning (the default): blocking sync was 0.62 of CPU TCP against
         * 0.75 spinning, same run (benchmarks/results/perf-2026-12-02/sweep.log). */
        for (int k = 0; ok && k < MTE_STAGE_SLOTS; k++)
            ok = failed("cuEventCreate", cu.EventCreate(&p->ev[k], CU_EVENT_DISABLE_TIMING)) == 0;
        if (!ok) {
            if (p) {
                for (int k = 0; k < MTE_STAGE_SLOTS; k++)
                    if (p->ev[k])
                        cu.EventDestroy(p->ev[k]);
                if (p->stream)
                    cu.StreamDestroy(p->stream);
                free(p);
            }
            cu.CtxPop(&old);
            return NULL;
        }
        s->dev[device] = p;
    }
    return p;
}

static int copy(mte_stage_t *s, int k, int device, void *dev_ptr, size_t n, int to_device)
{
    if (n > mte_stage_chunk() || !mte_stage_slot(s, k, device) || mte_stage_wait(s, k))
        return MTE_E_CUDA;
    per_device_t *p = enter(s, device);
    if (!p)
        return MTE_E_CUDA;
    CUresult rc = to_device
        ? failed("cuMemcpyHtoDAsync", cu.HtoDAsync((uint64_t)(uintptr_t)dev_ptr, s->slot[k], n,
                                                   p->stream))
        : failed("cuMemcpyDtoHAsync", cu.DtoHAsync(s->slot[k], (uint64_t)(uintptr_t)dev_ptr, n,
                                                   p->stream));
    if (rc == 0)
        rc = failed("cuEventRecord", cu.EventRecord(p->ev[k], p->stream));
    CUcontext old;
    cu.CtxPop(&old);
    if (rc != 0)
        return MTE_E_CUDA;
    s->slot_dev[k] = device;
    return 0;
}

int mte_stage_d2h(mte_stage_t *s, int k, int device, const void *src, size_t n)
{
    return copy(s, k, device, (void *)src, n, 0);
}

int mte_stage_h2d(mte_stage_t *s, int k, int device, void *dst, size_t n)
{
    return copy(s, k, device, dst, n, 1);
}

int mte_stage_wait(mte_stage_t *s, int k)
{
    int d = s->slot_dev[k];
    if (d < 0)
        return 0;
    s->slot_dev[k] = -1;
    /* Events need no current context to be waited for. */
    return failed("cuEventSynchronize", cu.EventSynchronize(s->dev[d]->ev[k])) == 0 ? 0
                                                                                : MTE_E_CUDA;
}

int mte_stage_drain(mte_stage_t *s)
{
    int err = 0;
    for (int k = 0; k < MTE_STAGE_SLOTS; k++) {
        int e = mte_stage_wait(s, k);
        if (e && !err)
            err = e;
    }
    return err;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* GPU memory for the native data paths, with no CUDA at build time.
 *
 * The CUDA driver library (libcuda.so.1, shipped with the driver itself, so no toolkit
 * or runtime version has to match) is opened with dlopen(3) the first time a region of
 * device memory needs moving; a process that never registers GPU memory never loads it.
 * Only the driver API calls below are used, declared here with the types of the CUDA
 * Driver API reference (handles are opaque pointers, CUresult an int).
 *
 * Bytes of device memory cross sockets through *staging*: pinned host buffers
 * (cuMemHostAlloc, allocated once per lane or server connection and reused) and, per
 * device, a non-blocking stream of the device's primary context (the context cudart,
 * CuPy and PyTorch use, so their pointers are valid in it). Copies are cut into chunks
 * over a ring of slots, so the PCIe copy of one chunk overlaps the socket I/O of the
 * previous one. */
#ifndef MTE_GPU_H
#define MTE_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"             /* MTE_E_CUDA */

#define MTE_STAGE_SLOTS 4
/* Bytes per staging slot: MC_GPU_STAGE_CHUNK (64 KiB to 16 MiB), default 2 MiB: in a
 * sweep on an H200 host (benchmarks/gpu_sweep.py, docs/benchmarks.md) GPU over TCP was
 * 0.56-0.67 of CPU over TCP with 256 KiB chunks, 0.67-0.76 with 512 KiB, 0.69-0.85 with
 * 1 MiB and 0.86-0.92 with 2 MiB. The ring is MTE_STAGE_SLOTS chunks of pinned memory
 * per lane and per served connection that touches GPU memory (8 MiB at 2 MiB). */
size_t mte_stage_chunk(void);
/* Requests from GPU memory are cut into slices of at least this size: each slice waits
 * once on each side for a copy's round trip (its first device-to-host chunk, its last
 * host-to-device one), so fewer, bigger ones keep the sockets busy; within a slice the
 * chunks are pipelined. MC_GPU_SLICE, default 4 MiB. */
uint64_t mte_gpu_slice(void);
#define MTE_GPU_MAX_DEVICES 64

/* 0 once libcuda is loaded and initialised (idempotent, thread-safe), else MTE_E_CUDA;
 * mte_gpu_error() then says why. */
int mte_gpu_init(void);
const char *mte_gpu_error(void);
/* The driver library's dlopen handle once mte_gpu_init() succeeded, else NULL: the
 * process's one loader of the driver; Python's ctypes declarations (mooncake_te/cuda)
 * wrap this handle (core._core.cuda_driver) instead of loading the library again. */
void *mte_gpu_library(void);
#define MTE_CUDA_LIBRARY "libcuda.so.1"

typedef struct mte_stage mte_stage_t;

/* A staging ring; its pinned slots are allocated on first use. NULL on ENOMEM. */
mte_stage_t *mte_stage_new(void);
void mte_stage_free(mte_stage_t *s);
/* Pinned slot k (0 <= k < MTE_STAGE_SLOTS), allocating the ring (in `device`'s context)
 * if needed; NULL when CUDA cannot be loaded or pinned memory cannot be had. */
uint8_t *mte_stage_slot(mte_stage_t *s, int k, int device);
/* Queue a copy between slot k and device memory of `device` on the stage's stream for
 * that device; the slot is busy until mte_stage_wait(s, k). 0 or MTE_E_CUDA. */
int mte_stage_d2h(mte_stage_t *s, int k, int device, const void *src, size_t n);
int mte_stage_h2d(mte_stage_t *s, int k, int device, void *dst, size_t n);
/* Waits for slot k's copy (no-op when it has none). 0 or MTE_E_CUDA. */
int mte_stage_wait(mte_stage_t *s, int k);
/* Waits for every slot. 0 or the first error. */
int mte_stage_drain(mte_stage_t *s);

#endif

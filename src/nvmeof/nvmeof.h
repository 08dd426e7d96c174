/* SPDX-License-Identifier: Apache-2.0 */
/* The NVMe-oF transport's data path: byte ranges of a storage segment (a connected
 * namespace's block device, or the backing file/device itself on the target host)
 * to and from registered memory.
 *
 * One `mte_nvf_t` per opened device: a file descriptor opened with O_DIRECT (plain
 * buffered I/O only where the file system refuses O_DIRECT), and a pool of worker
 * threads, each with an aligned bounce buffer, so several requests are in flight.
 * Requests are cut into slices at multiples of the slice size in the device's offset
 * space; a slice whose memory address, offset or length is not a multiple of the
 * logical block size goes through the bounce buffer (reads cover the enclosing blocks
 * and copy out; writes read the partial edge blocks, merge and write whole blocks,
 * holding a lock on those edge blocks so two unaligned writes sharing a block do not
 * lose each other's bytes). Each slice pins its local region (regions.h) while it runs,
 * so unregistering waits for it; a slice of GPU memory passes through the worker's pinned
 * staging ring (src/core/stage.h, the same pipeline as TCP's). Each slice finishes its
 * request through the core's batch (src/core/batch.h), so storage requests share
 * batches with every other transport.
 *
 * Why threads and not io_uring: liburing is not on every machine this builds on and
 * kernels or sandboxes (gVisor, seccomp profiles of container runtimes) often refuse
 * io_uring_setup; blocking pread/pwrite on N threads keeps N requests queued at the
 * device, which is what a deep queue needs, and works everywhere. */
#ifndef MTE_NVMEOF_H
#define MTE_NVMEOF_H

#include <stdint.h>

#include "../core/api.h"

/* Status codes (src/core/status.h): an errno from the device comes back as
 * MTE_E_STORAGE_BASE - errno; past the end of the segment is MTE_E_OUT_OF_RANGE. */

typedef struct mte_nvf mte_nvf_t;

/* Opens `path` for reading and writing. size: the bytes peers may address (0: the
 * device's or file's size). threads: requests in flight. slice: bytes per slice (a
 * multiple of 4096). NULL with *err = -errno on failure. */
mte_nvf_t *mte_nvf_open(const char *path, uint64_t size, int threads, uint64_t slice,
                        mte_regions_t *regions, int *err);
uint64_t mte_nvf_size(const mte_nvf_t *f);
uint32_t mte_nvf_block(const mte_nvf_t *f);     /* alignment O_DIRECT needs; 1 if buffered */
int mte_nvf_direct(const mte_nvf_t *f);
/* Memory alignment direct I/O needs, as learned so far (1: any address). */
uint32_t mte_nvf_memalign(mte_nvf_t *f);
/* Queues requests [first, first+n) of batch b: local addresses, device offsets, lengths
 * (len_stride 0: all lens[0]). Checks every range against the size first: status
 * MTE_E_OUT_OF_RANGE and nothing queued if one is out of range; MTE_E_CLOSED once closed;
 * MTE_E_INVALID for a bad op; MTE_E_NOMEM; else 0 (status codes of core/status.h). */
int mte_nvf_submit(mte_nvf_t *f, mte_batch_t *b, int op, const uint64_t *local,
                   const uint64_t *offs, const uint64_t *lens, int len_stride,
                   uint32_t first, uint32_t n);
/* One request on the calling thread: 0 or a status code as above. */
int mte_nvf_transfer(mte_nvf_t *f, int op, uint64_t local, uint64_t off, uint64_t len,
                     int64_t deadline_ns);
/* Stops the workers (queued slices finish with MTE_E_CLOSED) and frees f; a worker
 * blocked in the kernel longer than wait_ms (a target that went away) is left to
 * finish on its own and f is not freed (returns 1); else 0. */
int mte_nvf_close(mte_nvf_t *f, int wait_ms);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* Moving device memory through a byte stream: the one GPU staging implementation.
 *
 * recv(2), writev(2), process_vm_*(2) and pread/pwrite(2) cannot touch GPU memory, so
 * its bytes pass through a ring of pinned slots (gpu.h), in chunks: the PCIe copy of one
 * chunk runs on the GPU's copy engine while the previous chunk is on the wire (or on the
 * disk). Every data path that meets device memory (TCP and same-host lanes and server
 * connections, NVMe-oF storage workers) moves it with these two functions and its own
 * sink/source. */
#ifndef MTE_STAGE_H
#define MTE_STAGE_H

#include <stddef.h>
#include <stdint.h>

#include "gpu.h"

/* Where staged bytes go / come from: 0 or a status code. */
typedef int (*mte_sink_fn)(void *ctx, const uint8_t *p, size_t n);
typedef int (*mte_source_fn)(void *ctx, uint8_t *p, size_t n);

/* *sp, created on first use (NULL on ENOMEM). */
mte_stage_t *mte_stage_get(mte_stage_t **sp);

/* Sends n bytes of device `dev` memory at src through `sink`. Any error leaves the sink
 * short of bytes: a stream must then be dropped. */
int mte_stage_out(mte_stage_t *s, int dev, const uint8_t *src, uint64_t n, mte_sink_fn sink,
                  void *ctx);
/* Takes n bytes from `source` into device `dev` memory at dst; returns once they are in
 * device memory. The return value is the source's error; a CUDA error goes to *cuda_err,
 * and then, with `drain`, the rest of the bytes are still taken (and dropped) so a
 * stream stays in step. */
int mte_stage_in(mte_stage_t *s, int dev, uint8_t *dst, uint64_t n, mte_source_fn source,
                 void *ctx, int drain, int *cuda_err);

#endif

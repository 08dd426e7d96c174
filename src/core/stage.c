/* SPDX-License-Identifier: Apache-2.0 */
/* See stage.h. */
#include "stage.h"

#include "status.h"

mte_stage_t *mte_stage_get(mte_stage_t **sp)
{
    if (!*sp)
        *sp = mte_stage_new();
    return *sp;
}

int mte_stage_out(mte_stage_t *s, int dev, const uint8_t *src, uint64_t n, mte_sink_fn sink,
                  void *ctx)
{
    const uint64_t C = mte_stage_chunk(), chunks = (n + C - 1) / C;
    uint64_t issued = 0, sent = 0;
    int err = 0;
    while (!err && sent < chunks) {
        /* Keep every slot busy copying ahead of what the sink takes. */
        while (!err && issued < chunks && issued - sent < MTE_STAGE_SLOTS) {
            uint64_t off = issued * C;
            err = mte_stage_d2h(s, (int)(issued % MTE_STAGE_SLOTS), dev, src + off,
                                (size_t)(n - off < C ? n - off : C));
            issued++;
        }
        if (err)
            break;
        int k = (int)(sent % MTE_STAGE_SLOTS);
        uint64_t off = sent * C;
        err = mte_stage_wait(s, k);
        if (!err)
            err = sink(ctx, mte_stage_slot(s, k, dev), (size_t)(n - off < C ? n - off : C));
        sent++;
    }
    int e = mte_stage_drain(s);
    return err ? err : e;
}

int mte_stage_in(mte_stage_t *s, int dev, uint8_t *dst, uint64_t n, mte_source_fn source,
                 void *ctx, int drain, int *cuda_err)
{
    uint64_t off = 0;
    int k = 0, err = 0;
    *cuda_err = 0;
    while (off < n) {
        size_t C = mte_stage_chunk(), len = n - off < C ? (size_t)(n - off) : C;
        uint8_t *slot = NULL;
        if (!*cuda_err) {
            slot = mte_stage_slot(s, k, dev);
            *cuda_err = !slot ? MTE_E_CUDA : mte_stage_wait(s, k);
            if (*cuda_err)
                slot = NULL;
        }
        if (!slot && !drain)
            break;
        err = source(ctx, slot, len);
        if (err)
            break;
        if (slot)
            *cuda_err = mte_stage_h2d(s, k, dev, dst + off, len);
        off += len;
        k = (k + 1) % MTE_STAGE_SLOTS;
    }
    int e = mte_stage_drain(s);
    if (!*cuda_err)
        *cuda_err = e;
    return err;
}

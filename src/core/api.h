/* SPDX-License-Identifier: Apache-2.0 */
/* The core's functions as other extension modules see them: one table.
 *
 * The native core (src/core/) is compiled once, into the extension module
 * mooncake_te.core._core, which owns the only region table code, batch, GPU loader and
 * staging rings. Python loads extension modules with RTLD_LOCAL, so the transports'
 * extensions cannot link against its symbols; instead the core publishes this table as a
 * PyCapsule ("mooncake_te.core._core._C_API", the mechanism NumPy's and datetime's C APIs
 * use) and each transport module fetches it once at import (mte_core_import, import.c).
 * Transport C code includes this header and calls the core's functions by their own
 * names: outside the core build (MTE_CORE_BUILD) each name is a macro that goes through
 * the table, so no call site mentions the table and no core code is compiled twice.
 *
 * Why a capsule and not a private shared library: a libmte_core.so next to the
 * extensions needs an rpath ($ORIGIN), a setuptools build step setuptools does not have
 * (build_clib makes static archives only), and auditwheel/delocate handling; an extension
 * module with a capsule is an ordinary setuptools Extension and works in every wheel and
 * editable install. */
#ifndef MTE_CORE_API_H
#define MTE_CORE_API_H

#include <stdint.h>

#include "clock.h"
#include "batch.h"
#include "regions.h"
#include "sockio.h"
#include "gpu.h"
#include "stage.h"
#include "hmac_sha256.h"
#include "sockio.h"
#include "status.h"
#include "metrics.h"
#include "prep.h"
#include "span.h"

/* Bump when a field changes meaning or moves; appending fields keeps it. */
#define MTE_CORE_API_VERSION 1u

#define MTE_CORE_FUNCTIONS(X) \
    /* clock.h */ \
    X(mte_now_ns) \
    X(mte_spin_ns) \
    /* batch.h */ \
    X(mte_batch_new) \
    X(mte_batch_unref) \
    X(mte_batch_size) \
    X(mte_batch_add_notify) \
    X(mte_batch_notify_done) \
    X(mte_batch_abandon) \
    X(mte_batch_seal) \
    X(mte_batch_wait) \
    X(mte_batch_done) \
    X(mte_batch_cancel) \
    X(mte_batch_expire) \
    X(mte_batch_status) \
    X(mte_batch_notify_error) \
    X(mte_batch_begin) \
    X(mte_batch_slice_done) \
    X(mte_batch_deadline) \
    X(mte_batch_stopped) \
    X(mte_batch_stop_code) \
    /* regions.h */ \
    X(mte_regions_new) \
    X(mte_regions_free) \
    X(mte_regions_add) \
    X(mte_regions_add_dev) \
    X(mte_regions_remove) \
    X(mte_regions_pin) \
    X(mte_region_unpin) \
    X(mte_region_device) \
    X(mte_regions_device_at) \
    X(mte_regions_check_many) \
    /* sockio.h */ \
    X(mte_sock_send_iov) \
    X(mte_sock_send_all) \
    X(mte_sock_fill) \
    X(mte_sock_recv_into) \
    X(mte_sock_set_tick) \
    X(mte_sock_connect_tcp) \
    X(mte_sock_unix_addr) \
    X(mte_sock_connect_unix) \
    X(mte_sock_listen_unix) \
    /* gpu.h */ \
    X(mte_stage_chunk) \
    X(mte_gpu_slice) \
    X(mte_gpu_init) \
    X(mte_gpu_error) \
    X(mte_stage_new) \
    X(mte_stage_free) \
    X(mte_stage_slot) \
    X(mte_stage_d2h) \
    X(mte_stage_h2d) \
    X(mte_stage_wait) \
    X(mte_stage_drain) \
    /* stage.h */ \
    X(mte_stage_get) \
    X(mte_stage_out) \
    X(mte_stage_in) \
    /* hmac_sha256.h */ \
    X(mte_sha256) \
    X(mte_hmac_sha256) \
    X(mte_ct_compare) \
    /* metrics.h, batch.h (appended) */ \
    X(mte_metrics_group) \
    X(mte_metrics_input) \
    X(mte_metrics_clock) \
    X(mte_batch_tag) \
    X(mte_batch_begin_range) \


typedef struct mte_core_api {
    uint32_t version;                 /* MTE_CORE_API_VERSION */
    uint32_t size;                    /* sizeof(mte_core_api_t) of the core */
#define MTE_CORE_FIELD(f) __typeof__(f) *f;
    MTE_CORE_FUNCTIONS(MTE_CORE_FIELD)
#undef MTE_CORE_FIELD
} mte_core_api_t;

#ifdef MTE_CORE_BUILD
/* The core itself: the table (api.c). */
extern const mte_core_api_t mte_core_table;
#else
/* A transport module: the table, set by mte_core_import() when the module is imported. */
extern const mte_core_api_t *mte_core __attribute__((visibility("hidden")));
/* 0, or -1 with a Python exception set (the core module is missing or too old). */
int mte_core_import(void) __attribute__((visibility("hidden")));

#define mte_now_ns(...) (mte_core->mte_now_ns(__VA_ARGS__))
#define mte_spin_ns(...) (mte_core->mte_spin_ns(__VA_ARGS__))
#define mte_batch_new(...) (mte_core->mte_batch_new(__VA_ARGS__))
#define mte_batch_unref(...) (mte_core->mte_batch_unref(__VA_ARGS__))
#define mte_batch_size(...) (mte_core->mte_batch_size(__VA_ARGS__))
#define mte_batch_add_notify(...) (mte_core->mte_batch_add_notify(__VA_ARGS__))
#define mte_batch_notify_done(...) (mte_core->mte_batch_notify_done(__VA_ARGS__))
#define mte_batch_abandon(...) (mte_core->mte_batch_abandon(__VA_ARGS__))
#define mte_batch_seal(...) (mte_core->mte_batch_seal(__VA_ARGS__))
#define mte_batch_wait(...) (mte_core->mte_batch_wait(__VA_ARGS__))
#define mte_batch_done(...) (mte_core->mte_batch_done(__VA_ARGS__))
#define mte_batch_cancel(...) (mte_core->mte_batch_cancel(__VA_ARGS__))
#define mte_batch_expire(...) (mte_core->mte_batch_expire(__VA_ARGS__))
#define mte_batch_status(...) (mte_core->mte_batch_status(__VA_ARGS__))
#define mte_batch_notify_error(...) (mte_core->mte_batch_notify_error(__VA_ARGS__))
#define mte_batch_begin(...) (mte_core->mte_batch_begin(__VA_ARGS__))
#define mte_batch_slice_done(...) (mte_core->mte_batch_slice_done(__VA_ARGS__))
#define mte_batch_deadline(...) (mte_core->mte_batch_deadline(__VA_ARGS__))
#define mte_batch_stopped(...) (mte_core->mte_batch_stopped(__VA_ARGS__))
#define mte_batch_stop_code(...) (mte_core->mte_batch_stop_code(__VA_ARGS__))
#define mte_regions_new(...) (mte_core->mte_regions_new(__VA_ARGS__))
#define mte_regions_free(...) (mte_core->mte_regions_free(__VA_ARGS__))
#define mte_regions_add(...) (mte_core->mte_regions_add(__VA_ARGS__))
#define mte_regions_add_dev(...) (mte_core->mte_regions_add_dev(__VA_ARGS__))
#define mte_regions_remove(...) (mte_core->mte_regions_remove(__VA_ARGS__))
#define mte_regions_pin(...) (mte_core->mte_regions_pin(__VA_ARGS__))
#define mte_region_unpin(...) (mte_core->mte_region_unpin(__VA_ARGS__))
#define mte_region_device(...) (mte_core->mte_region_device(__VA_ARGS__))
#define mte_regions_device_at(...) (mte_core->mte_regions_device_at(__VA_ARGS__))
#define mte_regions_check_many(...) (mte_core->mte_regions_check_many(__VA_ARGS__))
#define mte_sock_send_iov(...) (mte_core->mte_sock_send_iov(__VA_ARGS__))
#define mte_sock_send_all(...) (mte_core->mte_sock_send_all(__VA_ARGS__))
#define mte_sock_fill(...) (mte_core->mte_sock_fill(__VA_ARGS__))
#define mte_sock_recv_into(...) (mte_core->mte_sock_recv_into(__VA_ARGS__))
#define mte_sock_set_tick(...) (mte_core->mte_sock_set_tick(__VA_ARGS__))
#define mte_sock_connect_tcp(...) (mte_core->mte_sock_connect_tcp(__VA_ARGS__))
#define mte_sock_unix_addr(...) (mte_core->mte_sock_unix_addr(__VA_ARGS__))
#define mte_sock_connect_unix(...) (mte_core->mte_sock_connect_unix(__VA_ARGS__))
#define mte_sock_listen_unix(...) (mte_core->mte_sock_listen_unix(__VA_ARGS__))
#define mte_stage_chunk(...) (mte_core->mte_stage_chunk(__VA_ARGS__))
#define mte_gpu_slice(...) (mte_core->mte_gpu_slice(__VA_ARGS__))
#define mte_gpu_init(...) (mte_core->mte_gpu_init(__VA_ARGS__))
#define mte_gpu_error(...) (mte_core->mte_gpu_error(__VA_ARGS__))
#define mte_stage_new(...) (mte_core->mte_stage_new(__VA_ARGS__))
#define mte_stage_free(...) (mte_core->mte_stage_free(__VA_ARGS__))
#define mte_stage_slot(...) (mte_core->mte_stage_slot(__VA_ARGS__))
#define mte_stage_d2h(...) (mte_core->mte_stage_d2h(__VA_ARGS__))
#define mte_stage_h2d(...) (mte_core->mte_stage_h2d(__VA_ARGS__))
#define mte_stage_wait(...) (mte_core->mte_stage_wait(__VA_ARGS__))
#define mte_stage_drain(...) (mte_core->mte_stage_drain(__VA_ARGS__))
#define mte_stage_get(...) (mte_core->mte_stage_get(__VA_ARGS__))
#define mte_stage_out(...) (mte_core->mte_stage_out(__VA_ARGS__))
#define mte_stage_in(...) (mte_core->mte_stage_in(__VA_ARGS__))
#define mte_sha256(...) (mte_core->mte_sha256(__VA_ARGS__))
#define mte_hmac_sha256(...) (mte_core->mte_hmac_sha256(__VA_ARGS__))
#define mte_ct_compare(...) (mte_core->mte_ct_compare(__VA_ARGS__))
#define mte_metrics_group(...) (mte_core->mte_metrics_group(__VA_ARGS__))
#define mte_metrics_input(...) (mte_core->mte_metrics_input(__VA_ARGS__))
#define mte_metrics_clock(...) (mte_core->mte_metrics_clock(__VA_ARGS__))
#define mte_batch_tag(...) (mte_core->mte_batch_tag(__VA_ARGS__))
#define mte_batch_begin_range(...) (mte_core->mte_batch_begin_range(__VA_ARGS__))
#endif

#endif

# SPDX-License-Identifier: Apache-2.0
# Declarations of src/tcp/tcp.h, nothing else.
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t
from mooncake_te.core.libcore cimport mte_regions_t, mte_batch_t, mte_prep_t

cdef extern from "tcp/tcp.h" nogil:
    ctypedef struct mte_tcp_t:
        pass
    ctypedef struct mte_peer_t:
        pass
    ctypedef struct mte_notif_t:
        mte_notif_t *next
        char *sender
        size_t len
        char *msg
    mte_tcp_t *mte_tcp_new(mte_regions_t *regions, const char *bind_host, int port,
                           const char *name, uint64_t instance, int stall_ms,
                           const void *token, size_t token_len, int *err)
    int mte_tcp_port(const mte_tcp_t *t)
    void mte_tcp_set_limits(mte_tcp_t *t, int max_conns, int max_per_peer, int auth_ms,
                            int idle_ms)
    uint64_t mte_tcp_auth_failures(const mte_tcp_t *t)
    int MTE_TCP_COUNTERS
    void mte_tcp_counters(mte_tcp_t *t, uint64_t *out)
    const char *mte_tcp_uds_name(const mte_tcp_t *t)
    void mte_tcp_free(mte_tcp_t *t)
    int mte_tcp_push_notification(mte_tcp_t *t, const char *sender, const void *msg, size_t len)
    mte_notif_t *mte_tcp_take_notifications(mte_tcp_t *t)
    void mte_tcp_wait_enter(mte_tcp_t *t)
    int mte_tcp_wait_notifications(mte_tcp_t *t, int timeout_ms)
    void mte_notif_free(mte_notif_t *n)
    mte_peer_t *mte_peer_new(mte_tcp_t *t, const char *host, int port, const char *uds,
                             uint64_t expect_instance, int lanes, uint64_t slice_size, int *err)
    void mte_peer_shutdown(mte_peer_t *p)
    void mte_peer_free(mte_peer_t *p)
    uint64_t mte_peer_seen_instance(const mte_peer_t *p)
    void mte_peer_expect_name(mte_peer_t *p, const char *name)
    int mte_peer_broken(const mte_peer_t *p)
    int mte_peer_cma(const mte_peer_t *p)
    size_t mte_peer_queued(mte_peer_t *p)
    int mte_tcp_submit(mte_peer_t *p, mte_batch_t *b, int op, const uint64_t *local,
                       const uint64_t *remote, const uint64_t *lens, int len_stride,
                       uint32_t first, uint32_t n, int run_inline)
    int mte_tcp_add_notify(mte_peer_t *p, mte_batch_t *b, const void *msg, size_t len)
    int mte_tcp_post_prepared(mte_peer_t *p, mte_batch_t *b, int op, const mte_prep_t *t,
                              const int64_t *lids, const int64_t *rids, uint32_t n)

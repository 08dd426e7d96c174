/* SPDX-License-Identifier: Apache-2.0 */
/* The table of registered memory regions of one engine.
 *
 * Every byte that moves is checked against it: remote requests against the regions
 * this engine published (with their access rights), local sources and destinations
 * against the regions the caller registered. A region is pinned for the duration of
 * each I/O that touches it, so unregistering waits for in-flight I/O instead of letting
 * a late READ land in memory the user already freed. */
#ifndef MTE_REGIONS_H
#define MTE_REGIONS_H

#include <stdint.h>

/* Access rights a peer has on a region. 0 is "local": never reachable from peers. */
#define MTE_ACC_REMOTE_READ  1u
#define MTE_ACC_REMOTE_WRITE 2u

typedef struct mte_region mte_region_t;
typedef struct mte_regions mte_regions_t;

mte_regions_t *mte_regions_new(void);
void mte_regions_free(mte_regions_t *t);

/* 0, or -EEXIST when [addr, addr+len) overlaps a registered region, -EINVAL for len 0. */
int mte_regions_add(mte_regions_t *t, uint64_t addr, uint64_t len, unsigned access);
/* The same for memory of CUDA device `device` (ordinal; -1: host memory). Data paths
 * that cannot touch device memory with the CPU (recv, writev, process_vm_*) move such
 * regions' bytes through pinned staging (src/core/gpu.h). */
int mte_regions_add_dev(mte_regions_t *t, uint64_t addr, uint64_t len, unsigned access,
                        int device);
/* Removes the region starting at addr and waits until no I/O pins it. 0 or -ENOENT. */
int mte_regions_remove(mte_regions_t *t, uint64_t addr);

/* Pins the region wholly containing [addr, addr+len) if it grants `need`.
 * Returns NULL with *why = -ENOENT (not inside one region) or -EACCES (rights). */
mte_region_t *mte_regions_pin(mte_regions_t *t, uint64_t addr, uint64_t len,
                              unsigned need, int *why);
void mte_region_unpin(mte_region_t *r);
/* The CUDA device ordinal of a region, -1 for host memory. */
int mte_region_device(const mte_region_t *r);
/* The device ordinal of the region holding addr (-1: host memory or none); cheap when
 * no GPU region was ever added. */
int mte_regions_device_at(mte_regions_t *t, uint64_t addr);

/* Index of the first [addr_i, addr_i+len_i) not inside a region granting `need`, or -1.
 * len_stride 0 means every request has length lens[0]. *why as for pin. */
int64_t mte_regions_check_many(mte_regions_t *t, const uint64_t *addrs, const uint64_t *lens,
                               int len_stride, uint64_t n, unsigned need, int *why);

#endif

/* SPDX-License-Identifier: Apache-2.0 */
/* Stress of the region table's pin/unpin against remove, for the sanitizer builds.
 *
 * Reproduces issue #20 item 1: a peer's I/O unpinning a region just as the owner
 * unregisters it. Pinner threads pin and unpin every region of a small table in a tight
 * loop while the remover thread removes each one and adds it back. If unpin touches the
 * region after its pin count reached 0, the remover may already have freed it: under
 * -fsanitize=address that is a heap-use-after-free report, under -fsanitize=thread a data
 * race report. A clean run prints "ok" and exits 0.
 *
 * Usage: regions_stress [seconds] [pinners] */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core/regions.h"

#define NREG 4
#define BASE 0x100000u
#define LEN  4096u

static mte_regions_t *table;
static atomic_int stop;
static atomic_long pins_done, removes_done;

static void *pinner(void *arg)
{
    unsigned k = (unsigned)(size_t)arg;
    while (!atomic_load(&stop)) {
        int why = 0;
        uint64_t a = BASE + (uint64_t)(k++ % NREG) * LEN * 2;
        mte_region_t *r = mte_regions_pin(table, a + 8, 64, MTE_ACC_REMOTE_READ, &why);
        if (r) {
            mte_region_unpin(r);
            atomic_fetch_add(&pins_done, 1);
        } else if (why != -ENOENT) {
            fprintf(stderr, "pin: unexpected %d\n", why);
            exit(2);
        }
    }
    return NULL;
}

static void *remover(void *arg)
{
    (void)arg;
    unsigned k = 0;
    while (!atomic_load(&stop)) {
        uint64_t a = BASE + (uint64_t)(k++ % NREG) * LEN * 2;
        if (mte_regions_remove(table, a) != 0) {
            fprintf(stderr, "remove: region %#llx missing\n", (unsigned long long)a);
            exit(2);
        }
        if (mte_regions_add(table, a, LEN, MTE_ACC_REMOTE_READ) != 0) {
            fprintf(stderr, "add: region %#llx refused\n", (unsigned long long)a);
            exit(2);
        }
        atomic_fetch_add(&removes_done, 1);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    int npin = argc > 2 ? atoi(argv[2]) : 3;
    if (npin < 1 || npin > 64)
        npin = 3;
    table = mte_regions_new();
    if (!table)
        return 2;
    for (unsigned i = 0; i < NREG; i++)
        if (mte_regions_add(table, BASE + (uint64_t)i * LEN * 2, LEN, MTE_ACC_REMOTE_READ))
            return 2;
    pthread_t th[65];
    for (int i = 0; i < npin; i++)
        pthread_create(&th[i], NULL, pinner, (void *)(size_t)i);
    pthread_create(&th[npin], NULL, remover, NULL);
    struct timespec ts = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
    atomic_store(&stop, 1);
    for (int i = 0; i <= npin; i++)
        pthread_join(th[i], NULL);
    mte_regions_free(table);
    printf("ok: %ld pins, %ld removes\n", atomic_load(&pins_done), atomic_load(&removes_done));
    return 0;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the authentication of data
 * connections. Written here rather than linked from OpenSSL so the package builds
 * without libssl-dev and the data path has no run-time dependency to go missing; the
 * tests check it against Python's hashlib/hmac. */
#ifndef MTE_HMAC_SHA256_H
#define MTE_HMAC_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define MTE_SHA256_LEN 32

void mte_sha256(const void *data, size_t len, uint8_t out[MTE_SHA256_LEN]);
/* HMAC over the concatenation of up to 4 parts (NULL parts are skipped). */
void mte_hmac_sha256(const void *key, size_t key_len, const void *const parts[],
                     const size_t lens[], int nparts, uint8_t out[MTE_SHA256_LEN]);
/* Constant-time comparison: 0 when equal. */
int mte_ct_compare(const uint8_t *a, const uint8_t *b, size_t n);

#endif

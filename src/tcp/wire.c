/* SPDX-License-Identifier: Apache-2.0 */
/* Encoding and decoding of the TCP / same-host wire format (wire.h). */
#define _GNU_SOURCE
#include "wire.h"

#include <endian.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

static void put32(uint8_t *p, uint32_t v) { v = htole32(v); memcpy(p, &v, 4); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }
void mte_wire_put64(uint8_t *p, uint64_t v) { v = htole64(v); memcpy(p, &v, 8); }
uint64_t mte_wire_get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }
#define put64 mte_wire_put64
#define get64 mte_wire_get64

void mte_wire_hello_encode(uint8_t out[MTE_WIRE_HELLO_SIZE], const mte_hello_t *h)
{
    put32(out, MTE_WIRE_MAGIC_HELLO);
    put32(out + 4, h->version);
    put64(out + 8, h->instance);
    put32(out + 16, h->name_len);
    put32(out + 20, h->flags);
    memcpy(out + 24, h->nonce, MTE_WIRE_NONCE);
    put64(out + 40, h->probe_addr);
    memcpy(out + 48, h->probe_value, 8);
}

int mte_wire_hello_decode(const uint8_t in[MTE_WIRE_HELLO_SIZE], mte_hello_t *h)
{
    h->version = get32(in + 4);
    h->instance = get64(in + 8);
    h->name_len = get32(in + 16);
    h->flags = get32(in + 20);
    memcpy(h->nonce, in + 24, MTE_WIRE_NONCE);
    h->probe_addr = get64(in + 40);
    memcpy(h->probe_value, in + 48, 8);
    return get32(in) == MTE_WIRE_MAGIC_HELLO ? 0 : MTE_E_PROTOCOL;
}

void mte_wire_reply_encode(uint8_t out[MTE_WIRE_REPLY_SIZE], const mte_hello_reply_t *r)
{
    memset(out, 0, MTE_WIRE_REPLY_SIZE);
    put32(out, MTE_WIRE_MAGIC_HELLO);
    put32(out + 4, (uint32_t)r->status);
    put64(out + 8, r->instance);
    memcpy(out + 16, r->nonce, MTE_WIRE_NONCE);
    memcpy(out + 32, r->proof, MTE_SHA256_LEN);
    put32(out + 64, r->flags);
}

int mte_wire_reply_decode(const uint8_t in[MTE_WIRE_REPLY_SIZE], mte_hello_reply_t *r)
{
    r->status = (int32_t)get32(in + 4);
    r->instance = get64(in + 8);
    memcpy(r->nonce, in + 16, MTE_WIRE_NONCE);
    memcpy(r->proof, in + 32, MTE_SHA256_LEN);
    r->flags = get32(in + 64);
    return get32(in) == MTE_WIRE_MAGIC_HELLO ? 0 : MTE_E_PROTOCOL;
}

void mte_wire_fin_encode(uint8_t out[MTE_WIRE_FIN_SIZE], int32_t status)
{
    put32(out, MTE_WIRE_MAGIC_HELLO);
    put32(out + 4, (uint32_t)status);
}

int32_t mte_wire_fin_decode(const uint8_t in[MTE_WIRE_FIN_SIZE])
{
    return get32(in) == MTE_WIRE_MAGIC_HELLO ? (int32_t)get32(in + 4) : MTE_E_PROTOCOL;
}

void mte_wire_req_encode(uint8_t out[MTE_WIRE_REQ_SIZE], const mte_wire_req_t *q)
{
    put32(out, MTE_WIRE_MAGIC_REQ);
    put32(out + 4, q->op);
    put64(out + 8, q->seq);
    put64(out + 16, q->addr);
    put64(out + 24, q->len);
}

int mte_wire_req_decode(const uint8_t in[MTE_WIRE_REQ_SIZE], mte_wire_req_t *q)
{
    q->op = get32(in + 4);
    q->seq = get64(in + 8);
    q->addr = get64(in + 16);
    q->len = get64(in + 24);
    return get32(in) == MTE_WIRE_MAGIC_REQ ? 0 : MTE_E_PROTOCOL;
}

void mte_wire_resp_encode(uint8_t out[MTE_WIRE_RESP_SIZE], const mte_wire_resp_t *r)
{
    put32(out, MTE_WIRE_MAGIC_RESP);
    put32(out + 4, (uint32_t)r->status);
    put64(out + 8, r->seq);
    put64(out + 16, r->len);
}

int mte_wire_resp_decode(const uint8_t in[MTE_WIRE_RESP_SIZE], mte_wire_resp_t *r)
{
    r->status = (int32_t)get32(in + 4);
    r->seq = get64(in + 8);
    r->len = get64(in + 16);
    return get32(in) == MTE_WIRE_MAGIC_RESP ? 0 : MTE_E_PROTOCOL;
}

void mte_wire_proof(const uint8_t *token, size_t token_len, const char *label,
                    const uint8_t *n1, const uint8_t *n2, const void *extra, size_t extra_len,
                    uint8_t out[MTE_SHA256_LEN])
{
    const void *parts[4] = {label, n1, n2, extra};
    const size_t lens[4] = {strlen(label), MTE_WIRE_NONCE, MTE_WIRE_NONCE, extra_len};
    mte_hmac_sha256(token, token_len, parts, lens, 4, out);
}

size_t mte_wire_server_identity(uint8_t out[8 + MTE_WIRE_NAME_MAX], uint64_t instance,
                                const char *name)
{
    put64(out, instance);
    size_t n = name ? strnlen(name, MTE_WIRE_NAME_MAX) : 0;
    memcpy(out + 8, name ? name : "", n);
    return 8 + n;
}

void mte_wire_nonce(uint8_t n[MTE_WIRE_NONCE])
{
    if (getrandom(n, MTE_WIRE_NONCE, 0) != MTE_WIRE_NONCE) {
        /* getrandom(2) cannot fail for 16 bytes once the pool is ready; be safe anyway. */
        int64_t t = mte_now_ns();
        for (int i = 0; i < MTE_WIRE_NONCE; i++)
            n[i] ^= (uint8_t)(t >> (i % 8 * 8)) ^ (uint8_t)rand();
    }
}

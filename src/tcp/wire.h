/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP / same-host wire format: every byte offset is here, once.
 *
 * Little-endian, after a hello exchange on each connection:
 *   request  32 B: u32 magic 'MTE2' | u32 op | u64 seq | u64 addr | u64 len
 *                  [+ u64 client address for WRITE_CMA/READ_CMA]
 *                  [+ len bytes of payload for WRITE and NOTIFY]
 *                  (op was specified as u16 op | u16 flags; flags are always 0)
 *   response 24 B: u32 magic 'MTER' | i32 status | u64 seq | u64 len [+ len bytes for READ]
 *
 * Hello: client -> 56 B: u32 'MTEH' | u32 version | u64 instance | u32 name_len |
 *                        u32 flags (1 = authenticates, 2 = prove your name) | 16 B nonce Nc |
 *                        u64 probe address | 8 B probe value (host order)  [+ name]
 *        server -> 72 B: u32 'MTEH' | i32 status | u64 instance | 16 B nonce Ns |
 *                        32 B HMAC(token, "mte-data-server" Nc Ns instance [name]) |
 *                        u32 flags (1 = cross-memory attach, 2 = proof covers the name) |
 *                        u32 0
 * With a token (both sides must have one, else status -803), the client checks the
 * server's proof, then sends HMAC(token, "mte-data-client" Ns Nc name), and the server
 * answers 8 B: u32 'MTEH' | i32 status, before any request is read.
 * Identity (issue #20 item 7): a client that sets flag 2 wants the server's proof to
 * cover the server's segment name after its instance id, and checks it against the name
 * it meant to reach, so a stale or forged descriptor that points at another engine of the
 * cluster fails before a request is sent; the server says so with reply flag 2. Without
 * the hello flag (older clients) the proof covers the instance id alone, and a server
 * without the reply flag (older servers) is checked on its instance id as before. */
#ifndef MTE_TCP_WIRE_H
#define MTE_TCP_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "../core/api.h"

#define MTE_WIRE_MAGIC_REQ   0x3245544du   /* "MTE2" */
#define MTE_WIRE_MAGIC_RESP  0x5245544du   /* "MTER" */
#define MTE_WIRE_MAGIC_HELLO 0x4845544du   /* "MTEH" */
#define MTE_WIRE_VERSION 2u
#define MTE_WIRE_NONCE 16
#define MTE_WIRE_HELLO_SIZE 56
#define MTE_WIRE_REPLY_SIZE 72
#define MTE_WIRE_FIN_SIZE 8
#define MTE_WIRE_REQ_SIZE 32
#define MTE_WIRE_CMA_EXTRA 8      /* CMA requests carry the initiator's address */
#define MTE_WIRE_RESP_SIZE 24
#define MTE_WIRE_HELLO_AUTH 1u    /* hello flag: the client has a token */
#define MTE_WIRE_HELLO_AUTH_NAMED 2u  /* hello flag: bind the server's name in its proof */
#define MTE_WIRE_REPLY_CMA 1u     /* reply flag: the server copies to and from our memory */
#define MTE_WIRE_REPLY_NAMED 2u   /* reply flag: the server's proof covers its name */
#define MTE_WIRE_NAME_MAX 255

/* Ops on the wire: the engine's MTE_OP_WRITE/READ (batch.h), and these. */
enum { MTE_OP_NOTIFY = 3,
       /* same host: the server copies with process_vm_readv/writev, no payload */
       MTE_OP_WRITE_CMA = 4, MTE_OP_READ_CMA = 5 };

typedef struct mte_hello {
    uint32_t version;
    uint64_t instance;
    uint32_t name_len;
    uint32_t flags;
    uint8_t nonce[MTE_WIRE_NONCE];
    uint64_t probe_addr;          /* 0: not offered (not same host) */
    uint8_t probe_value[8];       /* compared byte for byte with what the server reads */
} mte_hello_t;

typedef struct mte_hello_reply {
    int32_t status;
    uint64_t instance;
    uint8_t nonce[MTE_WIRE_NONCE];
    uint8_t proof[MTE_SHA256_LEN];
    uint32_t flags;
} mte_hello_reply_t;

typedef struct mte_wire_req {
    uint32_t op;
    uint64_t seq, addr, len;
} mte_wire_req_t;

typedef struct mte_wire_resp {
    int32_t status;
    uint64_t seq, len;
} mte_wire_resp_t;

void mte_wire_hello_encode(uint8_t out[MTE_WIRE_HELLO_SIZE], const mte_hello_t *h);
/* 0, or MTE_E_PROTOCOL (wrong magic). The version is returned, not checked. */
int mte_wire_hello_decode(const uint8_t in[MTE_WIRE_HELLO_SIZE], mte_hello_t *h);
void mte_wire_reply_encode(uint8_t out[MTE_WIRE_REPLY_SIZE], const mte_hello_reply_t *r);
int mte_wire_reply_decode(const uint8_t in[MTE_WIRE_REPLY_SIZE], mte_hello_reply_t *r);
void mte_wire_fin_encode(uint8_t out[MTE_WIRE_FIN_SIZE], int32_t status);
/* The status the server sent, or MTE_E_PROTOCOL for a wrong magic. */
int32_t mte_wire_fin_decode(const uint8_t in[MTE_WIRE_FIN_SIZE]);
void mte_wire_req_encode(uint8_t out[MTE_WIRE_REQ_SIZE], const mte_wire_req_t *q);
int mte_wire_req_decode(const uint8_t in[MTE_WIRE_REQ_SIZE], mte_wire_req_t *q);
void mte_wire_resp_encode(uint8_t out[MTE_WIRE_RESP_SIZE], const mte_wire_resp_t *r);
int mte_wire_resp_decode(const uint8_t in[MTE_WIRE_RESP_SIZE], mte_wire_resp_t *r);
void mte_wire_put64(uint8_t *p, uint64_t v);
uint64_t mte_wire_get64(const uint8_t *p);

/* Authentication: proofs bind both nonces, a direction label and the identity sent, so
 * a recorded exchange cannot be replayed. */
#define MTE_WIRE_SERVER_LABEL "mte-data-server"
#define MTE_WIRE_CLIENT_LABEL "mte-data-client"
void mte_wire_proof(const uint8_t *token, size_t token_len, const char *label,
                    const uint8_t *n1, const uint8_t *n2, const void *extra, size_t extra_len,
                    uint8_t out[MTE_SHA256_LEN]);
void mte_wire_nonce(uint8_t n[MTE_WIRE_NONCE]);
/* What the server's proof covers: its instance id (8 B, little-endian), then its segment
 * name when `name` is not NULL. Returns the length written to out (at most 8 + 255). */
size_t mte_wire_server_identity(uint8_t out[8 + MTE_WIRE_NAME_MAX], uint64_t instance,
                                const char *name);

#endif

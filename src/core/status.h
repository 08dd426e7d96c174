/* SPDX-License-Identifier: Apache-2.0 */
/* Every status code the native data paths return: the only list.
 *
 * A request's error (mte_batch_status, a synchronous transfer's return value) is 0 or one
 * of these, and so is what every transport's submit returns (mte_tcp_submit,
 * mte_rdma_submit, mte_nvf_submit): never an errno. The small ones are Mooncake's (include/error.h); ours sit outside Mooncake's
 * ranges. Python maps each to its own exception class (mooncake_te/errors.py); a test
 * (tests/unit/test_status_codes.py) parses this file and checks that every code below has
 * exactly one class with that `.status`, so a code added here without a class fails CI.
 *
 * Format (parsed by that test; keep one definition per line):
 *   #define MTE_E_<NAME> (<code>)   / * <meaning> * /
 * A range (an errno or a device status folded into a base) is declared with a _BASE
 * suffix and the width of the range as MTE_E_<NAME>_SPAN. */
#ifndef MTE_STATUS_H
#define MTE_STATUS_H

/* --- Mooncake's codes ------------------------------------------------------------- */
#define MTE_E_INVALID          (-1)     /* a caller's argument is wrong (bad op, index past the batch) */
#define MTE_E_REMOTE_NOT_REG   (-3)     /* the peer's address is outside its registered regions */
#define MTE_E_SOCKET           (-102)   /* a connection failed or was lost */
#define MTE_E_NOMEM            (-302)   /* memory (or pinned staging memory) ran out */
/* --- ours: requests ---------------------------------------------------------------- */
#define MTE_E_FAILED           (-800)   /* a request failed without a more precise code */
#define MTE_E_TIMEOUT          (-801)   /* the request's deadline passed */
#define MTE_E_AUTH             (-803)   /* the data connection's token handshake failed */
#define MTE_E_CANCELED         (-805)   /* the batch was canceled */
#define MTE_E_LOCAL_NOT_REG    (-1003)  /* the local address is outside the registered regions */
#define MTE_E_REMOTE_ACCESS    (-1004)  /* the peer's region forbids this direction */
#define MTE_E_PEER_RESTARTED   (-1006)  /* the peer's instance id changed */
#define MTE_E_PROTOCOL         (-1007)  /* the peer broke the wire protocol */
#define MTE_E_CLOSED           (-1008)  /* the transport or connection was closed */
#define MTE_E_CMA              (-1009)  /* same host: the peer could not reach our memory */
#define MTE_E_CUDA             (-1010)  /* a CUDA copy of device memory failed */
#define MTE_E_WRONG_PEER       (-1011)  /* the peer could not prove it is the segment asked for */
#define MTE_E_NOTIFY_FULL      (-1012)  /* the peer's notification queue is full */
#define MTE_E_OUT_OF_RANGE     (-1021)  /* beyond the end of a storage segment */
/* --- ours: RDMA (src/rdma/) -------------------------------------------------------- */
/* A work completion's error is MTE_E_RDMA_WC_BASE - ibv_wc_status (1..21). */
#define MTE_E_RDMA_WC_BASE     (-1100)  /* RDMA work completion error: base - ibv_wc_status */
#define MTE_E_RDMA_WC_SPAN     (50)
#define MTE_E_RDMA_NO_RAIL     (-1150)  /* no rail to the peer can carry the request */
#define MTE_E_RDMA_POST        (-1151)  /* ibv_post_send refused the work request */
#define MTE_E_RDMA_LOCAL_KEY   (-1152)  /* the local region is not registered with the NICs */
#define MTE_E_RDMA_PORT_DOWN   (-1153)  /* the local NIC's port went down */
/* --- ours: storage (src/nvmeof/) --------------------------------------------------- */
/* An errno e from the storage device is MTE_E_STORAGE_BASE - e. */
#define MTE_E_STORAGE_BASE     (-1400)  /* storage I/O error: base - errno */
#define MTE_E_STORAGE_SPAN     (200)

/* --- per-request states (mte_batch_status) ------------------------------------------ */
enum { MTE_ST_PENDING = 0, MTE_ST_COMPLETED = 1, MTE_ST_FAILED = 2, MTE_ST_TIMEOUT = 3,
       MTE_ST_CANCELED = 4 };

#endif

# SPDX-License-Identifier: Apache-2.0
"""What the RDMA transport declares (``mooncake_te.transports`` hands it to
:func:`mooncake_te.config.declare_transport`): its ``protocol=`` name, its
``[transfer_engine]`` keys (docs/rdma.md) with Mooncake's ``MC_*`` variables, and
``MC_FORCE_HCA``. Pure Python: read whether or not libibverbs is there."""
from __future__ import annotations

from ...config import Setting

_INT, _NUM = (int,), (int, float)

SERVES = ("auto", "rdma")

SETTINGS = (
    Setting("rdma_slice_size", _INT, 64 << 10,
            bounds=(4096, 1 << 30, "4096 bytes to 1 GiB per RDMA slice"),
            env=(("MC_SLICE_SIZE", int),)),
    Setting("rdma_qps_per_endpoint", _INT, 2,
            bounds=(1, 16, "1 to 16 queue pairs per endpoint"), env=(("MC_NUM_QP_PER_EP", int),)),
    Setting("rdma_max_wr", _INT, 256,
            bounds=(1, 1 << 15, "1 to 32768 work requests per queue pair"),
            env=(("MC_MAX_WR", int),)),
    Setting("rdma_mtu", _INT, 4096, allowed=(256, 512, 1024, 2048, 4096),
            env=(("MC_MTU", int),)),
    # NCCL's name first, so MC_GID_INDEX (applied after it) wins when both are set.
    Setting("rdma_gid_index", _INT, -1,
            bounds=(-1, 255, "a GID table index, or -1 to pick one automatically"),
            env=(("NCCL_IB_GID_INDEX", int), ("MC_GID_INDEX", int))),
    Setting("rdma_ib_port", _INT, 1,
            bounds=(1, 255, "an HCA port number (1 on almost every NIC)"),
            env=(("MC_IB_PORT", int),)),
    Setting("rdma_rail_pause_s", _NUM, 30, bounds=(0, None, "seconds, 0 or more"),
            env=(("MC_RDMA_RAIL_PAUSE_SECONDS", float),)),
    Setting("rdma_cq_entries", _INT, 4096,
            bounds=(16, 1 << 22, "16 to 4194304 completion-queue entries"),
            env=(("MC_MAX_CQE_PER_CTX", int),)),
    Setting("rdma_qp_timeout", _INT, 14,
            bounds=(1, 31, "1 to 31 (the ACK timeout is 4.096 us x 2^value)"),
            env=(("MC_RDMA_QP_TIMEOUT", int),)),
)

#: MC_FORCE_HCA: "force RDMA, error if no HCA" (Mooncake PR #1259) is protocol = "rdma".
FORCE_ENV = {"MC_FORCE_HCA": "rdma"}

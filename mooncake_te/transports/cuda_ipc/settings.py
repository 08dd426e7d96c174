# SPDX-License-Identifier: Apache-2.0
"""What the CUDA IPC transport declares (``mooncake_te.transports`` hands it to
:func:`mooncake_te.config.declare_transport`): the protocols it carries and Mooncake's
names for GPU-memory protocols, which the vLLM connector's settings accept."""
from __future__ import annotations

SERVES = ("auto", "shm")

# Mooncake's protocol names for GPU memory -> the protocol that carries it here.
# Same-host GPU memory moves by CUDA IPC, which serves "shm" and "auto"; there is no
# multi-node NVLink (fabric memory) transport, so Mooncake's "nvlink" becomes "auto":
# CUDA IPC to peers on this host, RDMA (or TCP) to the others.
ALIASES = {"cuda_ipc": "shm", "nvlink_intra": "shm", "nvlink": "auto"}

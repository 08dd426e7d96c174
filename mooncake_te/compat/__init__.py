# SPDX-License-Identifier: Apache-2.0
"""Mooncake's Python API on mooncake_te: change one import line.

>>> from mooncake_te.compat import TransferEngine     # was: from mooncake.engine import ...
>>> from mooncake_te.compat import engine             # was: from mooncake import engine

``TransferEngine`` keeps the method names, arguments, defaults and return codes of
``mooncake.engine.TransferEngine``; :mod:`mooncake_te.compat.store` is Mooncake Store's
``MooncakeDistributedStore`` over the KV pool; ``mooncake-te compat install`` makes
``import mooncake.engine`` / ``mooncake.store`` resolve to them (:mod:`.shim`).
``docs/compat.md`` lists every method and where it differs.
"""
from __future__ import annotations

from . import engine  # noqa: F401
from .engine import (  # noqa: F401
    P2PHANDSHAKE, SUPPORT_CUDA, SUPPORT_EFA, SUPPORT_HIP, SUPPORT_INTRA_NVLINK, SUPPORT_MNNVL,
    SUPPORT_MUSA, CoroRPCInterface, CudaUnavailableError, InnerTransferEngine, Read,
    ReceivedData, ReceivedTensor, RpcInterface, SharedSegment, TransferEngine,
    TransferNotify, TransferOpcode, Write, create_rpc_client, create_rpc_server,
)

__all__ = [
    "TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write", "P2PHANDSHAKE",
    "SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_INTRA_NVLINK", "SUPPORT_MNNVL",
    "SUPPORT_MUSA", "engine", "InnerTransferEngine", "RpcInterface", "CoroRPCInterface",
    "ReceivedData", "ReceivedTensor", "create_rpc_client", "create_rpc_server",
    "SharedSegment", "CudaUnavailableError",
]

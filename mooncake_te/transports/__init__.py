# SPDX-License-Identifier: Apache-2.0
"""Transports: one folder each. A transport this machine or build lacks is an
:class:`UnavailableTransport` with the reason, so ``import mooncake_te`` never fails for
lack of hardware."""
from __future__ import annotations

from .base import Transport, UnavailableTransport


def probe() -> dict:
    """name -> transport class, or UnavailableTransport saying why not."""
    out = {}
    try:
        from .tcp import TcpTransport
        out["tcp"] = TcpTransport
    except ImportError as e:  # pragma: no cover - the build always has it
        out["tcp"] = UnavailableTransport("tcp", f"native module not built: {e}")
    # Same-host peers: the TCP transport's unix-socket + cross-memory-attach mode.
    out["shm"] = out["tcp"]
    # GPU memory between processes of one host; the driver is loaded only once GPU
    # memory is registered (cuda_ipc.driver_present explains why).
    from .cuda_ipc import CudaIpcTransport, driver_present
    out["cuda_ipc"] = CudaIpcTransport if driver_present() else UnavailableTransport(
        "cuda_ipc", "no CUDA driver (libcuda.so.1) on this machine")
    from .rdma import unavailable_reason
    why = unavailable_reason()
    if why is None:
        from .rdma import RdmaTransport
        out["rdma"] = RdmaTransport
    else:
        out["rdma"] = UnavailableTransport("rdma", why)
    try:
        from .nvmeof import NvmeofTransport
        out["nvmeof"] = NvmeofTransport
    except ImportError as e:
        out["nvmeof"] = UnavailableTransport("nvmeof", f"native module not built: {e} "
                                                       f"(python setup.py build_ext --inplace)")
    return out


__all__ = ["Transport", "UnavailableTransport", "probe"]

# SPDX-License-Identifier: Apache-2.0
"""Transports: one folder each. A transport this machine or build lacks is an
:class:`UnavailableTransport` with the reason, so ``import mooncake_te`` never fails for
lack of hardware."""
from __future__ import annotations

from .base import Transport, UnavailableTransport

# Transports added from outside this package (a plug-in, the tests' in-process fake):
# name -> class. probe() lists them after the built-in ones.
_registered: dict = {}


def register(name: str, cls) -> None:
    """Offer transport class ``cls`` (a :class:`Transport`) to engines created from now on,
    under ``name`` (its ``protocol=`` value); the built-in transports need no call."""
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"transport {name!r} must be a Transport subclass, got {cls!r}")
    if not isinstance(name, str) or not name or name in _BUILTIN:
        raise ValueError(f"transport name must be a new non-empty str (not one of "
                         f"{', '.join(_BUILTIN)}), got {name!r}")
    _registered[name] = cls


def unregister(name: str) -> None:
    """Withdraw a transport offered with :func:`register` (engines running keep theirs)."""
    _registered.pop(name, None)


#: The transports of this package, in the order probe() lists them.
_BUILTIN = ("tcp", "shm", "cuda_ipc", "rdma", "nvmeof")


def probe() -> dict:
    """name -> transport class, or UnavailableTransport saying why not."""
    out: dict = {}
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
    out.update(_registered)
    return out


__all__ = ["Transport", "UnavailableTransport", "probe", "register", "unregister"]

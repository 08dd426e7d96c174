# SPDX-License-Identifier: Apache-2.0
"""Transports: one folder each. A transport this machine or build lacks is an
:class:`UnavailableTransport` with the reason, so ``import mooncake_te`` never fails for
lack of hardware."""
from __future__ import annotations

import importlib
import pkgutil

from .. import config as _config
from .base import Transport, UnavailableTransport

# Transports added from outside this package (a plug-in, the tests' in-process fake):
# name -> class. probe() lists them after the built-in ones.
_registered: dict = {}


def _declare(name: str, serves, settings=(), aliases=None, force_env=None) -> None:
    """Hand what a transport declares to the configuration (config.declare_transport):
    its own ``protocol=`` names (:attr:`Transport.serves` but "auto" and "*"), its keys,
    aliases and forcing variables."""
    _config.declare_transport(name, [p for p in serves if p not in ("auto", "*")],
                              settings, aliases, force_env)


def register(name: str, cls) -> None:
    """Offer transport class ``cls`` (a :class:`Transport`) to engines created from now on,
    under ``name`` (its ``protocol=`` value), and declare its settings (its keys, ``MC_*``
    variables and protocol names are accepted by config.toml, the environment and the
    vLLM connector from now on); the built-in transports need no call."""
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"transport {name!r} must be a Transport subclass, got {cls!r}")
    if not isinstance(name, str) or not name or name in _BUILTIN:
        raise ValueError(f"transport name must be a new non-empty str (not one of "
                         f"{', '.join(_BUILTIN)}), got {name!r}")
    if name in _registered:
        _config.withdraw_transport(name)
    _declare(name, cls.serves, cls.settings, cls.protocol_aliases, cls.force_env)
    _registered[name] = cls


def unregister(name: str) -> None:
    """Withdraw a transport offered with :func:`register` (engines running keep theirs)
    and its settings."""
    if _registered.pop(name, None) is not None:
        _config.withdraw_transport(name)


#: The transports of this package, in the order probe() lists them.
_BUILTIN = ("tcp", "shm", "cuda_ipc", "rdma", "nvmeof")


def _declare_builtin() -> None:
    """Each transport folder's ``settings`` module (pure Python, no native code):
    declared at import, so its keys are known whether or not it can run here."""
    folders = [m.name for m in pkgutil.iter_modules(__path__) if m.ispkg]
    # in probe()'s order (MC_FORCE_HCA, declared after MC_FORCE_TCP, wins when both are set)
    for name in sorted(folders, key=lambda n: (_BUILTIN.index(n) if n in _BUILTIN
                                               else len(_BUILTIN), n)):
        try:
            mod = importlib.import_module(f"{__name__}.{name}.settings")
        except ImportError:         # a folder without one, or its package cannot load
            continue
        _declare(name, mod.SERVES, getattr(mod, "SETTINGS", ()),
                 getattr(mod, "ALIASES", None), getattr(mod, "FORCE_ENV", None))


_declare_builtin()


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

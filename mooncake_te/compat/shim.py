# SPDX-License-Identifier: Apache-2.0
"""The opt-in ``mooncake`` package: ``import mooncake.engine`` / ``mooncake.store``
resolving to :mod:`mooncake_te.compat` (``mooncake-te compat install``).

Code written for Mooncake (vLLM's built-in ``MooncakeConnector`` and
``MooncakeStoreConnector``, SGLang, Mooncake's own tests) imports ``mooncake.engine``
and ``mooncake.store``. Installing writes a small package into the environment's
``site-packages``:

- ``mooncake/__init__.py``: marks the package as this shim (``MOONCAKE_TE_SHIM``);
- ``mooncake/engine.py``: makes ``mooncake.engine`` *be* :mod:`mooncake_te.compat.engine`;
- ``mooncake/store.py``, ``mooncake/mooncake_config.py``: the same for
  :mod:`mooncake_te.compat.store` and :mod:`mooncake_te.compat.mooncake_config`;
- ``mooncake/cli_client.py``: Mooncake's ``mooncake_client`` (``python -m
  mooncake.cli_client``): a real client that dummy clients (``setup_dummy``) talk to,
  :mod:`mooncake_te.compat.dummy`;
- ``mooncake/allocator.py``: an ImportError that says why (Mooncake's NVLink allocator
  for torch has no counterpart here);
- ``mooncake_te_compat_shim-<version>.dist-info``: so ``pip list`` shows it and
  ``pip uninstall mooncake-te-compat-shim`` removes it too.

It refuses to install over the real distribution (``mooncake-transfer-engine``, or any
``mooncake`` package it did not write). Uninstalling removes only what it wrote.
"""
from __future__ import annotations

import hashlib
import base64
import importlib.metadata as md
import importlib.util
import os
import shutil
import sysconfig

from .. import errors as E

MARKER = "MOONCAKE_TE_SHIM"
DIST_NAME = "mooncake-te-compat-shim"
#: distributions that ship the real ``mooncake`` package
REAL_DISTS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13",
              "mooncake-transfer-engine-non-cuda")

_INIT = '''# Written by `mooncake-te compat install`; remove with `mooncake-te compat uninstall`.
"""Not Mooncake: the ``mooncake`` names served by mooncake_te (mooncake_te.compat).

``mooncake.engine`` is ``mooncake_te.compat.engine`` and ``mooncake.store`` is
``mooncake_te.compat.store``; ``mooncake-te version`` says which ``mooncake`` is loaded.
"""
MOONCAKE_TE_SHIM = True
__version__ = "{version}+mooncake-te"


def __getattr__(name):
    if name in ("BufferPool", "RegisteredBufferPool"):
        from mooncake_te.compat import buffer_pool
        return getattr(buffer_pool, name)
    raise AttributeError(name)
'''
_ALIAS = '''# Written by `mooncake-te compat install`.
import sys as _sys
import {target} as _mod

_sys.modules[__name__] = _mod
'''


_CLI = '''# Written by `mooncake-te compat install`: Mooncake's `mooncake_client` entry point.
from {target} import main

if __name__ == "__main__":
    raise SystemExit(main())
'''


_REFUSED = '''# Written by `mooncake-te compat install`.
raise ImportError("{name} is not provided by mooncake-te's shim: {why} (docs/compat.md)")
'''


def _site(target: str | None) -> str:
    return os.path.abspath(target or sysconfig.get_paths()["purelib"])


def _dist_info(site: str) -> str | None:
    for name in os.listdir(site):
        if name.startswith("mooncake_te_compat_shim-") and name.endswith(".dist-info"):
            return os.path.join(site, name)
    return None


def real_distribution(site: str | None = None):
    """``(name, version)`` of an installed real Mooncake distribution, else None."""
    paths = [_site(site)]
    for dist in md.distributions(path=paths):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in REAL_DISTS:
            return name, dist.version
    return None


def is_shim_dir(path: str) -> bool:
    init = os.path.join(path, "__init__.py")
    try:
        with open(init) as f:
            return MARKER in f.read(4096)
    except OSError:
        return False


def install(target: str | None = None) -> str:
    """Write the shim into ``target`` (default: this interpreter's site-packages);
    return the package directory.

    Raises
    ------
    ConfigError
        The real Mooncake distribution, or a ``mooncake`` package this did not write,
        is there.
    """
    import mooncake_te
    site = _site(target)
    real = real_distribution(site)
    if real is not None:
        raise E.ConfigError(
            f"{real[0]} {real[1]} (the real Mooncake) is installed in {site}; refusing to "
            f"shadow it. Uninstall it (pip uninstall {real[0]}) to run Mooncake code on "
            f"mooncake_te, or use another virtual environment")
    pkg = os.path.join(site, "mooncake")
    if os.path.exists(pkg) and not is_shim_dir(pkg):
        raise E.ConfigError(
            f"{pkg} exists and was not written by `mooncake-te compat install`; refusing "
            f"to replace it (remove it yourself if it is a leftover)")
    os.makedirs(pkg, exist_ok=True)
    files = {
        "__init__.py": _INIT.format(version=mooncake_te.__version__),
        "engine.py": _ALIAS.format(target="mooncake_te.compat.engine"),
        "store.py": _ALIAS.format(target="mooncake_te.compat.store"),
        "mooncake_config.py": _ALIAS.format(target="mooncake_te.compat.mooncake_config"),
        "cli_client.py": _CLI.format(target="mooncake_te.compat.dummy"),
        "allocator.py": _REFUSED.format(
            name="mooncake.allocator",
            why="Mooncake's NVLinkAllocator (a torch CUDAPluggableAllocator backed by its "
                "C++ NVLink transport) has no mooncake_te counterpart; allocate GPU "
                "memory with torch and register it with the engine instead"),
    }
    for name, text in files.items():
        with open(os.path.join(pkg, name), "w") as f:
            f.write(text)
    old = _dist_info(site)
    if old:
        shutil.rmtree(old)
    info = os.path.join(site, f"mooncake_te_compat_shim-{mooncake_te.__version__}.dist-info")
    os.makedirs(info)
    meta = {
        "METADATA": f"Metadata-Version: 2.1\nName: {DIST_NAME}\n"
                    f"Version: {mooncake_te.__version__}\n"
                    f"Summary: the mooncake names served by mooncake_te.compat\n",
        "INSTALLER": "mooncake-te\n",
        "top_level.txt": "mooncake\n",
    }
    for name, text in meta.items():
        with open(os.path.join(info, name), "w") as f:
            f.write(text)
    rel = os.path.basename(info)
    rows = [f"mooncake/{n},{_hash(os.path.join(pkg, n))}" for n in files]
    rows += [f"{rel}/{n},{_hash(os.path.join(info, n))}" for n in meta]
    rows.append(f"{rel}/RECORD,,")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("\n".join(rows) + "\n")
    return pkg


def _hash(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest},{len(data)}"


def uninstall(target: str | None = None) -> bool:
    """Remove the shim from ``target``; False when it was not installed there.

    Raises
    ------
    ConfigError
        ``mooncake`` there is not the shim (it is never removed).
    """
    site = _site(target)
    pkg = os.path.join(site, "mooncake")
    found = False
    if os.path.exists(pkg):
        if not is_shim_dir(pkg):
            raise E.ConfigError(f"{pkg} is not the mooncake-te shim (it may be the real "
                                f"Mooncake); not removing it")
        shutil.rmtree(pkg)
        found = True
    info = _dist_info(site)
    if info:
        shutil.rmtree(info)
        found = True
    return found


def status() -> dict:
    """Which ``mooncake`` this interpreter would import, without importing it:
    ``{"kind": "shim"|"real"|"other"|"none", "path": ..., "version": ...}``."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return {"kind": "none", "path": None, "version": None}
    path = list(spec.submodule_search_locations)[0]
    if is_shim_dir(path):
        return {"kind": "shim", "path": path, "version": None,
                "engine": "mooncake_te.compat.engine", "store": "mooncake_te.compat.store"}
    real = real_distribution(os.path.dirname(path))
    if real is not None:
        return {"kind": "real", "path": path, "version": real[1], "distribution": real[0]}
    return {"kind": "other", "path": path, "version": None}

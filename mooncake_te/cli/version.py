# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te version``: versions of the package and what it runs on, and which
transports this build and machine offer (and, for the others, why not)."""
from __future__ import annotations

import json
import platform
import sys

# Optional packages worth naming in a bug report: module -> what it enables.
_OPTIONAL = {"rich": "tables and progress bars", "matplotlib": "bench --plot",
             "redis": "redis:// metadata", "aiohttp": "http:// metadata client/server",
             "cupy": "GPU memory", "prometheus_client": "/metrics and mooncake-te top"}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("version", help="print versions and available transports",
                              description="Print mooncake_te, Python, numpy and Cython "
                                          "versions, and which transports are available "
                                          "here and why the others are not.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _dist_version(name: str):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _native() -> dict:
    """Compiled modules: where each was loaded from, or why it could not be."""
    import importlib
    out = {}
    for mod in ("mooncake_te.core._core", "mooncake_te.transports.tcp._tcp",
                "mooncake_te.transports.nvmeof._nvmeof"):
        try:
            out[mod] = importlib.import_module(mod).__file__
        except ImportError as e:
            out[mod] = f"not built: {e}"
    return out


def collect() -> dict:
    """Everything ``version`` prints, as a dict."""
    import numpy
    import mooncake_te
    from mooncake_te.transports import probe

    transports = {}
    for name, t in probe().items():
        if getattr(t, "available", True) is False:
            transports[name] = {"available": False, "reason": t.reason}
        else:
            transports[name] = {"available": True,
                                "implementation": f"{t.__module__}.{t.__qualname__}"}
    try:
        import Cython
        cython = Cython.__version__
    except ImportError:
        # Cython is a build dependency only; a wheel runs without it.
        cython = None
    return {
        "mooncake_te": mooncake_te.__version__,
        "location": mooncake_te.__path__[0],
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "cython": cython,
        "native": _native(),
        "optional": {m: _dist_version(m) for m in _OPTIONAL},
        "transports": transports,
        "mooncake": _mooncake(),
    }


def _mooncake() -> dict:
    """Which ``mooncake`` package this Python imports (the real one, or our shim)."""
    from mooncake_te.compat.shim import status
    return status()


def run(args) -> int:
    """Print the versions; return 0."""
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"mooncake_te {info['mooncake_te']}  ({info['location']})")
    print(f"python      {info['python']} ({info['python_implementation']}, "
          f"{info['executable']})")
    print(f"platform    {info['platform']}")
    print(f"numpy       {info['numpy']}")
    print(f"cython      {info['cython'] or 'not installed (needed only to build)'}")
    for mod, where in info["native"].items():
        print(f"native      {mod.rsplit('.', 1)[-1]}: {where}")
    for mod, what in _OPTIONAL.items():
        v = info["optional"][mod]
        print(f"{mod:<11} {v or 'not installed'}  ({what})")
    from .compat import describe
    print(f"mooncake    {describe(info['mooncake'])}")
    print("transports:")
    for name, t in info["transports"].items():
        if t["available"]:
            print(f"  {name:<7} available")
        else:
            print(f"  {name:<7} unavailable: {t['reason']}")
    return 0

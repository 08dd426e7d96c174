# SPDX-License-Identifier: Apache-2.0
"""A Python with torch for the tests of the store's tensor calls (issue 39).

The dev environment has no torch; the vLLM environment (``MTE_VLLM_VENV``, CPU torch)
has, but lacks the metadata-store clients (``etcd3gw``, ``redis``) and pytest. So a
test that needs torch runs a child with :func:`torch_python` and, on its ``PYTHONPATH``,
:func:`overlay`: a directory of links to the distributions (and their requirements) that
this environment has and that Python lacks, the same files, never copies or other
versions. Both environments are one CPython version (checked), so the pure-Python
packages linked load as they do here.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.environ.get("MTE_VLLM_VENV", os.path.join(ROOT, ".venv-vllm"))
_CACHE: dict = {}


def torch_python() -> "str | None":
    """This Python when it imports torch, else ``MTE_VLLM_VENV``'s when it does and is
    this CPython version; None otherwise."""
    if "py" not in _CACHE:
        _CACHE["py"] = None
        want = f"{sys.version_info[0]}.{sys.version_info[1]}"
        for py in (sys.executable, os.path.join(VENV, "bin", "python")):
            if not os.path.exists(py):
                continue
            r = subprocess.run([py, "-c", "import sys, torch; print('%d.%d' % "
                                "sys.version_info[:2])"], capture_output=True, text=True,
                               timeout=180)
            if r.returncode == 0 and r.stdout.strip() == want:
                _CACHE["py"] = py
                break
    return _CACHE["py"]


def why_no_torch() -> str:
    return (f"no Python with torch: {sys.executable} cannot import it and "
            f"{VENV} (MTE_VLLM_VENV) is missing, lacks torch or is another CPython")


def _requires(name: str, seen: set) -> None:
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return
    seen.add(key)
    for req in dist.requires or ():
        if "extra ==" in req:
            continue
        if ";" in req:               # environment markers: keep the ones true here
            from packaging.markers import Marker
            if not Marker(req.split(";", 1)[1]).evaluate():
                continue
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)", req)
        if m:
            _requires(m.group(1), seen)


def overlay(py: str, where: str, dists=("etcd3gw", "redis", "pytest", "pytest-timeout")) -> str:
    """``where`` filled with links to ``dists`` and their requirements that ``py`` lacks
    (from this environment); returns ``where``."""
    want: set = set()
    for d in dists:
        _requires(d, want)
    r = subprocess.run([py, "-c", "import importlib.metadata as m, json, sys\n"
                        "out = []\n"
                        "for n in json.loads(sys.argv[1]):\n"
                        "    try: m.distribution(n)\n"
                        "    except m.PackageNotFoundError: out.append(n)\n"
                        "print(json.dumps(out))", json.dumps(sorted(want))],
                       capture_output=True, text=True, timeout=120)
    lacking = json.loads(r.stdout) if r.returncode == 0 else []
    os.makedirs(where, exist_ok=True)
    for name in lacking:
        dist = md.distribution(name)
        tops = {str(f).split("/", 1)[0] for f in dist.files or ()}
        for top in tops:
            if top.endswith(".pth") or top.startswith("..") or top == "__pycache__":
                continue
            src = os.path.join(str(dist.locate_file("")), top)
            dst = os.path.join(where, top)
            if os.path.exists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
    return where

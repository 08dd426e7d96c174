# SPDX-License-Identifier: Apache-2.0
"""One loader of the CUDA driver per process (issue 40, item b): the native core dlopens
and initialises it (src/core/gpu.c); mooncake_te.cuda's ctypes declarations wrap the
core's handle, and topology asks through mooncake_te.cuda."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from mooncake_te import core
from mooncake_te.cuda import _driver

ROOT = Path(__file__).resolve().parents[2]


def test_python_reports_the_cores_loader():
    handle, name, why = core.cuda_driver()
    lib, reason = _driver.load()
    if handle:                                   # a machine with a driver and a GPU
        assert lib is not None and lib._handle == handle and reason is None
    else:
        assert lib is None and reason == why and name in why


def test_one_library_name():
    header = (ROOT / "src" / "core" / "gpu.h").read_text()
    m = re.search(r'#define MTE_CUDA_LIBRARY "([^"]+)"', header)
    assert m and m.group(1) == _driver.LIBRARY == core.cuda_driver()[1]


def test_no_other_loader():
    """No Python module loads the driver with ctypes (a CDLL/PyDLL of the library
    without handle= or RTLD_NOLOAD), and no C file but the core's gpu.c dlopens it."""
    bad = []
    for path in (ROOT / "mooncake_te").rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr in ("CDLL", "PyDLL", "LoadLibrary"):
                text = ast.unparse(n)
                if ("cuda" in text.lower() or "LIBRARY" in text) \
                        and "handle=" not in text and "RTLD_NOLOAD" not in text:
                    bad.append(f"{path.relative_to(ROOT)}:{n.lineno}: {text}")
    for path in (ROOT / "src").rglob("*.c"):
        if path != ROOT / "src" / "core" / "gpu.c" and "libcuda" in path.read_text():
            bad.append(str(path.relative_to(ROOT)))
    assert not bad, bad


def test_missing_says_why_gpu_work_cannot_run(monkeypatch):
    """The GPU benchmarks' smoke modes skip with this reason: no GPU first, then the
    first module not installed, else None."""
    import mooncake_te.cuda as cuda
    monkeypatch.setattr(cuda, "available", lambda: (False, "no CUDA driver"))
    assert cuda.missing("json") == "no CUDA GPU: no CUDA driver"
    monkeypatch.setattr(cuda, "available", lambda: (True, ""))
    assert cuda.missing("json", "no_such_module_xyz", "also_missing") == \
        "no_such_module_xyz is not installed"
    assert cuda.missing("json") is None

# SPDX-License-Identifier: Apache-2.0
"""Builds and runs the C-level stress tests under AddressSanitizer+UBSan and
ThreadSanitizer (issue #20 items 1 and 3).

The C sources are compiled straight from src/ with gcc, apart from the Python
extensions, so a finding points at our code and not at the interpreter. A sanitizer
report makes the run fail: ASan/UBSan/TSan are told to halt on the first error with a
non-zero exit code.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
HERE = Path(__file__).resolve().parent

SANITIZERS = {
    "asan": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
    "tsan": ["-fsanitize=thread"],
}
ENV = {
    "ASAN_OPTIONS": "halt_on_error=1:abort_on_error=0:exitcode=86:detect_leaks=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=86",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=86:second_deadlock_stack=1",
}


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc"))


def build(kind: str, out: Path, sources: list[str | Path], extra: list[str] = ()) -> Path:
    """Compiles `sources` (paths relative to the repository) with sanitizer `kind`."""
    cmd = [compiler(), "-O1", "-g", "-std=gnu11", "-pthread", "-fno-omit-frame-pointer",
           "-Wall", "-Werror", "-Wno-unused-function", f"-I{SRC}", *SANITIZERS[kind],
           *extra, "-o", str(out), *[str(ROOT / s) for s in sources], "-ldl"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"sanitizer build failed: {' '.join(cmd)}\n{res.stderr}")
    return out


def run(binary: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, **ENV)
    return subprocess.run([str(binary), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)

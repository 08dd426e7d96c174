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
import sys
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


def runtime_libs(kind: str = "asan") -> str:
    """LD_PRELOAD value that loads the sanitizer runtimes before the interpreter."""
    names = ["libasan.so", "libubsan.so"] if kind == "asan" else ["libtsan.so"]
    out = []
    for n in names:
        p = subprocess.run([compiler(), f"-print-file-name={n}"], capture_output=True,
                           text=True).stdout.strip()
        if p and os.path.isabs(p) and os.path.exists(p):
            out.append(p)
    return ":".join(out)


def build_extensions(dest: Path) -> Path:
    """A copy of the package whose native extensions are built with ASan+UBSan, in
    ``dest`` (reused while the sources are unchanged: the build takes minutes)."""
    import hashlib
    import tarfile
    files = sorted(p for p in [*ROOT.joinpath("src").rglob("*.[ch]"),
                               *ROOT.joinpath("mooncake_te").rglob("*.py"),
                               *ROOT.joinpath("mooncake_te").rglob("*.pyx"),
                               *ROOT.joinpath("mooncake_te").rglob("*.pxd"),
                               ROOT / "setup.py"] if p.is_file())
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(ROOT)).encode())
        digest.update(p.read_bytes())
    tree = dest / f"asan-{digest.hexdigest()[:16]}"
    if (tree / ".built").exists():
        return tree
    tree.mkdir(parents=True, exist_ok=True)
    for p in files + [ROOT / "pyproject.toml"]:
        target = tree / p.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(p.read_bytes())
    flags = "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
    env = dict(os.environ, CFLAGS=flags, LDFLAGS="-fsanitize=address,undefined")
    res = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
    if res.returncode:
        raise RuntimeError(f"ASan build of the extensions failed:\n{res.stderr[-4000:]}")
    (tree / ".built").write_text("ok")
    return tree


def run(binary: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, **ENV)
    return subprocess.run([str(binary), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)

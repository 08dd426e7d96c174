# SPDX-License-Identifier: Apache-2.0
"""Packaging and the checks CI runs beside the tests (issue 23, items 13, 15-17): the
sdist builds, the wheel built from it holds what a library's wheel should (built modules,
stripped; their stubs; py.typed; LICENSE; an SPDX license string; no generated C or
Cython sources), mypy is clean over the package, and the documentation site builds with
warnings as errors."""
from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """(sdist, wheel, build log): the sdist, then the wheel built from the sdist, which
    proves the sdist builds. No isolation: the build requirements are the dev extra's, so
    CI does not download them a second time."""
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                        ROOT], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sdist = next(out.glob("*.tar.gz"))
    wheel = next(out.glob("*.whl"))
    return sdist, wheel, r.stdout + r.stderr


def _has_symtab(elf: bytes) -> bool:
    """Whether a 64-bit little-endian ELF file still has a static symbol table."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
                for i in range(shnum)]
    return any(s[1] == 2 for s in sections)            # SHT_SYMTAB


def test_wheel_contents(dists):
    _, wheel, _ = dists
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        sos = [n for n in names if n.endswith(".so")]
        assert sos, "no compiled modules in the wheel"
        for n in sos:
            assert not _has_symtab(z.read(n)), f"{n} is not stripped"
            stub = n.split(".", 1)[0] + ".pyi"
            assert stub in names, f"{n} has no type stub {stub}"
        bad = [n for n in names if n.endswith((".c", ".pyx", ".pxd"))]
        assert bad == [], f"sources in the wheel: {bad}"
        assert "mooncake_te/py.typed" in names
        lic = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert lic and b"Apache License" in z.read(lic[0])
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "Provides-Extra: rdma" not in meta and "Provides-Extra: gpu\n" not in meta
    assert re.search(r"Requires-Dist: vllm<0\.34,>=0\.26; extra == \"vllm\"", meta), meta


def test_no_license_deprecation_warning(dists):
    _, _, log = dists
    assert "project.license" not in log, "setuptools still warns about the license table"


def test_sdist_contents(dists):
    sdist, _, _ = dists
    with tarfile.open(sdist) as t:
        names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]
    for need in ("LICENSE", "pyproject.toml", "setup.py", "mooncake_te/core/_core.pyx",
                 "mooncake_te/core/_core.pxd", "src/core/regions.c",
                 "mooncake_te/py.typed"):
        assert need in names, f"{need} missing from the sdist"
    generated = [n for n in names if n.startswith("mooncake_te/") and n.endswith((".c", ".so"))]
    assert generated == [], f"generated files in the sdist: {generated}"


def _requirement(text: str) -> "tuple[str, tuple]":
    """(normalised name, lower bound as a tuple of ints) of a PEP 508 requirement."""
    m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(?:>=\s*([0-9.]+))?", text)
    assert m, text
    name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
    return name, tuple(int(x) for x in (m.group(3) or "0").split("."))


def test_dev_extra_holds_the_build_requirements():
    """Builds without isolation (the sanitizer tier's setup.py build_ext, ``python -m
    build --no-isolation`` above) use the dev venv, so ``.[dev]`` must bring every
    [build-system] requirement at its version (issue 35: setuptools 77, for the PEP 639
    license fields, was missing, and a fresh venv could not build the sanitizer tier)."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        doc = tomllib.load(f)
    have = dict(_requirement(r) for r in [*doc["project"]["dependencies"],
                                          *doc["project"]["optional-dependencies"]["dev"]])
    for req in doc["build-system"]["requires"]:
        name, low = _requirement(req)
        assert name in have, f"[dev] lacks the build requirement {req!r}"
        assert have[name] >= low, f"[dev] asks for {name} >= {have[name]}, the build {req!r}"


def test_mypy_is_clean():
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]


def test_docs_site_builds_with_warnings_as_errors(tmp_path):
    r = subprocess.run([os.path.join(ROOT, "scripts", "docs.sh"), "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ref = (tmp_path / "site" / "reference" / "index.html").read_text()
    import mooncake_te
    for name in mooncake_te.__all__:
        if name[0].isupper() and name not in ("READ", "WRITE"):
            assert f'id="mooncake_te.{name}"' in ref or f'id="mooncake_te.errors.{name}"' \
                in ref, f"{name} is missing from the API reference"


def test_every_compiled_module_has_a_stub_naming_its_public_names():
    import glob
    import importlib
    import inspect
    sos = glob.glob(os.path.join(ROOT, "mooncake_te", "**", "*.so"), recursive=True)
    assert sos, "the package is not built in place"
    for so in sos:
        mod = os.path.relpath(so, ROOT).split(".", 1)[0].replace(os.sep, ".")
        stub = so.split(".", 1)[0] + ".pyi"
        assert os.path.exists(stub), f"{mod} has no stub: run scripts/stubgen.py"
        text = open(stub).read()
        m = importlib.import_module(mod)
        own = [n for n, v in vars(m).items() if not n.startswith("_")
               and not inspect.ismodule(v) and getattr(v, "__module__", mod) == mod]
        missing = [n for n in own if not re.search(rf"^(class |def )?{re.escape(n)}\b", text,
                                                   re.M)]
        assert missing == [], f"{mod}: not in its stub: {missing}; run scripts/stubgen.py"

# SPDX-License-Identifier: Apache-2.0
"""The native core under AddressSanitizer+UBSan and ThreadSanitizer.

Each test builds a C stress program against the sources in src/ with one sanitizer and
runs it; any sanitizer report fails the test (its output is in the failure message).
"""
from __future__ import annotations

import pytest

import sanitize

pytestmark = pytest.mark.skipif(sanitize.compiler() is None, reason="no C compiler (gcc)")


@pytest.mark.parametrize("kind", sorted(sanitize.SANITIZERS))
def test_region_pin_unpin_against_remove(kind, tmp_path):
    """Issue #20 item 1: unpin must not touch a region its remover may have freed."""
    exe = sanitize.build(kind, tmp_path / f"regions_stress_{kind}",
                         ["tests/native/regions_stress.c", "src/core/regions.c"])
    res = sanitize.run(exe, "2", "3")
    assert res.returncode == 0 and "ok:" in res.stdout, (
        f"{kind}: exit {res.returncode}\n{res.stdout}\n{res.stderr[-6000:]}")


@pytest.mark.parametrize("kind", sorted(sanitize.SANITIZERS))
def test_batch_completion_from_many_threads(kind, tmp_path):
    """Issue #20 item 3: the batch finished by several transport threads at once, its
    notification delivered from another, cancels racing them."""
    exe = sanitize.build(kind, tmp_path / f"batch_stress_{kind}",
                         ["tests/native/batch_stress.c", "src/core/batch.c",
                          "src/core/clock.c", "src/core/metrics.c"])
    res = sanitize.run(exe, "2", "3")
    assert res.returncode == 0 and "ok:" in res.stdout, (
        f"{kind}: exit {res.returncode}\n{res.stdout}\n{res.stderr[-6000:]}")


@pytest.mark.timeout(1500)      # the build: about 2 min on an idle 2-core machine
def test_extensions_under_address_sanitizer(tmp_path_factory):
    """The Python extensions built with ASan+UBSan, driven through real transfers (and
    the wire fuzzer's surfaces, when atheris is there). The build is cached under
    ~/.cache/mooncake_te while the sources do not change."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mooncake_te"
    tree = sanitize.build_extensions(cache)
    env = dict(os.environ, PYTHONPATH=str(tree), LD_PRELOAD=sanitize.runtime_libs("asan"),
               **sanitize.ENV)
    env["ASAN_OPTIONS"] += ":detect_leaks=0"      # the interpreter's own arenas
    res = subprocess.run([sys.executable, str(sanitize.HERE / "asan_smoke.py")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "asan smoke ok" in res.stdout, res.stderr[-6000:]
    try:
        import atheris  # noqa: F401
    except ImportError:
        return
    res = subprocess.run([sys.executable, str(sanitize.ROOT / "fuzz" / "fuzz_wire.py"),
                          "-runs=300", "-seed=7"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=tmp_path_factory.mktemp("fuzz"))
    assert res.returncode == 0, res.stderr[-6000:]

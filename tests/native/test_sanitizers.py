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

# SPDX-License-Identifier: Apache-2.0
"""Runs the registered checks. Apart from :mod:`.base` so that the checks (which import
``base`` to register themselves) and the runner (which needs them registered) form no
import cycle: base <- checks <- runner."""
from __future__ import annotations

from typing import Iterable

from . import checks  # noqa: F401  (registers the checks)
from .base import CHECKS, Context, Finding, error, ok


def run_checks(ctx: Context, only: "Iterable[str] | None" = None) -> list[Finding]:
    """Run every registered check (or those named in ``only``) and collect findings.

    A check that raises is itself reported as an error (code ``MTE000``), so one broken
    probe cannot hide the other results.
    """
    wanted = set(only) if only else None
    out: list[Finding] = []
    for c in CHECKS:
        if wanted and c.name not in wanted:
            continue
        try:
            found = list(c.func(ctx) or [])
        except Exception as e:      # report, never crash the report
            found = [error("MTE000", f"check {c.name!r} failed: {type(e).__name__}: {e}",
                           "this is a bug in mooncake-te doctor; please report it with "
                           "this output")]
        if not found:
            found = [ok(c.codes[0], c.title)]
        for f in found:
            f.check = c.name
        out.extend(found)
    return out

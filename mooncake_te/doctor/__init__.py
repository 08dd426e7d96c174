# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te doctor``: find the configuration mistakes that cost users days, before
the first request.

>>> from mooncake_te.doctor import Context, run_checks, exit_code
>>> findings = run_checks(Context(config_path="config.toml"))
>>> exit_code(findings)          # 0 fine, 1 warnings, 2 errors

Every finding has a stable code (``MTE201``...), a severity, a message naming the values
involved and a fix; ``docs/troubleshooting.md`` has a section per code.
"""
from __future__ import annotations

from .base import CHECKS, Check, Context, Finding, Severity, exit_code
from .runner import run_checks

__all__ = ["CHECKS", "Check", "Context", "Finding", "Severity", "exit_code", "run_checks",
           "report"]


def report(findings, verbose: bool = False) -> str:
    """Findings as text: problems first with their fixes; passes and skips with
    ``verbose``."""
    order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.OK: 2, Severity.SKIP: 3}
    label = {Severity.ERROR: "ERROR", Severity.WARNING: "WARN", Severity.OK: "ok",
             Severity.SKIP: "skip"}
    lines = []
    for f in sorted(findings, key=lambda f: order[f.severity]):
        if f.severity in (Severity.OK, Severity.SKIP) and not verbose:
            continue
        lines.append(f"{label[f.severity]:<5} {f.code}  {f.message}")
        if f.fix:
            lines.append(f"{'':<5} {'':<6} fix: {f.fix}")
    n_err = sum(f.severity == Severity.ERROR for f in findings)
    n_warn = sum(f.severity == Severity.WARNING for f in findings)
    n_ok = sum(f.severity == Severity.OK for f in findings)
    lines.append(f"{n_err} error(s), {n_warn} warning(s), {n_ok} check(s) passed"
                 + ("" if verbose else " (-v lists passes and skips)"))
    return "\n".join(lines)

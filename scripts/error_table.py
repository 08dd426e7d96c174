#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write docs/api.md's table of exception classes from mooncake_te/errors.py and
src/core/status.h, between the ``<!-- errors:begin -->`` and ``<!-- errors:end -->``
markers, so the page cannot drift from the code (tests/tools/test_docs.py fails when the
table is stale).

Usage::

    .venv/bin/python scripts/error_table.py           # rewrite the table
    .venv/bin/python scripts/error_table.py --check   # exit 1 if it is stale
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_MD = os.path.join(ROOT, "docs", "api.md")
STATUS_H = os.path.join(ROOT, "src", "core", "status.h")
BEGIN, END = "<!-- errors:begin -->", "<!-- errors:end -->"
DEFINE = re.compile(r"^#define (MTE_E_\w+)\s+\((-?\d+)\)", re.M)


def _status_names() -> dict:
    """{code: MTE_E_ name} of status.h (ranges by their base)."""
    with open(STATUS_H) as f:
        found = DEFINE.findall(f.read())
    return {int(v): n for n, v in found if not n.endswith("_SPAN")}


def _classes(E) -> list:
    """Every exception class of mooncake_te.errors, depth first from MooncakeError, in
    the order they are defined."""
    order = {c: i for i, c in enumerate(v for v in vars(E).values()
                                        if isinstance(v, type) and issubclass(v, Exception))}
    out: list = []

    def walk(cls):
        if cls in out or cls.__module__ != E.__name__:
            return
        out.append(cls)
        # Under its first base only (ClosedError is a TransferError first).
        subs = [c for c in cls.__subclasses__() if c.__bases__[0] is cls]
        for sub in sorted(subs, key=lambda c: order.get(c, 1 << 30)):
            walk(sub)
    walk(E.MooncakeError)
    return out


def _doc(cls) -> str:
    """The docstring's first paragraph, reST roles and double backticks as Markdown."""
    text = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")
    return text.replace("|", "\\|")


def table() -> str:
    sys.path.insert(0, ROOT)
    from mooncake_te import errors as E
    names = _status_names()
    ranges = {cls: (lo, hi) for lo, hi, cls in E._RANGES}
    rows = ["| class | parents | `.status` | meaning |", "| --- | --- | --- | --- |"]
    for cls in _classes(E):
        also = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        if cls in ranges:
            lo, hi = ranges[cls]
            status = f"{hi}..{lo}"
            # The range's base: its first code (storage) or the code just above (RDMA).
            name = next((n for c, n in names.items()
                         if n.endswith("_BASE") and lo <= c <= hi + 1), "")
        else:
            code = cls.default_status
            status = str(code)
            name = names.get(code, "")
        if name:
            status += f" (`{name}`)"
        if cls is E.MooncakeError:
            status = "the subclass's"
        rows.append(f"| `{cls.__name__}` | {also} | {status} | {_doc(cls)} |")
    return "\n".join(rows)


def render(text: str) -> str:
    """``text`` (api.md) with the table between the markers replaced."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{API_MD} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv) -> int:
    with open(API_MD) as f:
        text = f.read()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(f"{API_MD}: the error table is stale; run scripts/error_table.py",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        with open(API_MD, "w") as f:
            f.write(new)
        print(f"wrote the error table of {API_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

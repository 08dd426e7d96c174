# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te compat install|uninstall|status``: the opt-in ``mooncake`` package that
makes ``import mooncake.engine`` / ``mooncake.store`` run on mooncake_te
(:mod:`mooncake_te.compat.shim`; docs/compat.md says when to use it)."""
from __future__ import annotations

import json


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compat", help="install the opt-in `mooncake` package (Mooncake code on mooncake_te)",
        description="Write (or remove) a small `mooncake` package in this environment so "
                    "that code written for Mooncake (`from mooncake.engine import "
                    "TransferEngine`, `from mooncake.store import "
                    "MooncakeDistributedStore`, vLLM's MooncakeConnector and "
                    "MooncakeStoreConnector) runs on mooncake_te unchanged. Refuses when "
                    "the real Mooncake (mooncake-transfer-engine) is installed.")
    sub = p.add_subparsers(dest="action", metavar="<action>")
    for name, text in (("install", "write the `mooncake` package into site-packages"),
                       ("uninstall", "remove it (only what `install` wrote)"),
                       ("status", "say which `mooncake` this Python would import")):
        q = sub.add_parser(name, help=text, description=text)
        q.add_argument("--target", metavar="DIR",
                       help="site-packages directory to use (default: this Python's)")
        q.add_argument("--json", action="store_true", help="print one JSON object")
        q.set_defaults(func=run, action=name)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run(args) -> int:
    from .. import errors as E
    from ..compat import shim
    try:
        if args.action == "install":
            path = shim.install(args.target)
            out: dict = {"installed": path}
            text = (f"installed {path}: `import mooncake.engine` is mooncake_te.compat.engine, "
                    f"`import mooncake.store` is mooncake_te.compat.store "
                    f"(undo: mooncake-te compat uninstall)")
        elif args.action == "uninstall":
            found = shim.uninstall(args.target)
            out = {"removed": found}
            text = "removed the mooncake shim" if found else "the mooncake shim was not installed"
        else:
            out = shim.status()
            text = describe(out)
    except E.MooncakeError as e:
        print(json.dumps({"error": str(e)}) if args.json else f"error: {e}")
        return 1
    print(json.dumps(out) if args.json else text)
    return 0


def describe(st: dict) -> str:
    """One line saying which ``mooncake`` is importable (also used by ``version``)."""
    if st["kind"] == "shim":
        return f"mooncake_te shim ({st['path']}; mooncake.engine -> mooncake_te.compat)"
    if st["kind"] == "real":
        return f"Mooncake {st['distribution']} {st['version']} ({st['path']})"
    if st["kind"] == "other":
        return f"a `mooncake` package of unknown origin ({st['path']})"
    return "not installed (mooncake-te compat install provides it)"

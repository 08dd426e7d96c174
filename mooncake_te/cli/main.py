# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te <command>``: each command is a module in this package exposing
``add_parser(subparsers)`` (which sets ``func``) so commands stay apart."""
from __future__ import annotations

import argparse
import importlib
import sys

# command name -> module in mooncake_te.cli
COMMANDS = {
    "bench": "bench",
    "version": "version",
    "topology": "topology",
    "doctor": "doctor",
    "metadata-server": "metadata_server",
    "nvmeof": "nvmeof",
    "lab": "lab",
    "p2p": "p2p",
    "trace": "trace",
    "top": "top",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mooncake-te",
                                description="mooncake_te: move KV cache and large buffers "
                                            "between machines, fast.")
    sub = p.add_subparsers(dest="command", metavar="<command>")
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"mooncake_te.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"mooncake_te.cli.{module}":
                raise
            continue        # command not built yet in this version
        mod.add_parser(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te <command>``: each command is a module in this package exposing
``add_parser(subparsers)`` (which sets ``func``) so commands stay apart."""
from __future__ import annotations

import argparse
import functools
import importlib
import os
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
    "compat": "compat",
    "top": "top",
    "conductor": "conductor",
}


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from ._parser import HelpFormatter, Parser
    p = Parser(prog="mooncake-te", formatter_class=HelpFormatter,
               description="mooncake_te: move KV cache and large buffers between machines, "
                           "fast. Each command has --help.")
    p.add_argument("--version", action="version", version=f"mooncake-te {__version__}",
                   help="print the version and exit (`mooncake-te version` says more)")
    # A partial is a parser class to argparse (it calls it); typeshed wants a type.
    sub = p.add_subparsers(dest="command", metavar="<command>",  # type: ignore[call-overload]
                           parser_class=functools.partial(Parser, formatter_class=HelpFormatter))
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"mooncake_te.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"mooncake_te.cli.{module}":
                raise
            continue        # command not built yet in this version
        mod.add_parser(sub)
    return p


def listen_failed(e: OSError) -> bool:
    """Whether ``e`` is a listening socket's bind failing for its address (port busy,
    address not this machine's): a bad --host/--port, not a crash."""
    import errno
    return e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


def main(argv=None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        try:
            return int(args.func(args) or 0)
        except OSError as e:
            if not listen_failed(e):
                raise
            # A busy or foreign --port/--host is a bad value, said in one line (exit 2).
            name = args.func.__module__.rsplit(".", 1)[-1].replace("_", "-")
            print(f"mooncake-te {name}: {e.strerror or e}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader left (`| head`): no traceback. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again (Python's signal docs, SIGPIPE).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141                     # 128 + SIGPIPE, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""Entry point of the loopback target child: ``python -m mooncake_te.bench._child``.

Kept out of the package ``__init__`` so ``-m`` runs it without importing it twice.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading

from .target import BenchTarget


def main(argv=None) -> int:
    """Entry of the loopback child: serve until stdin closes."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m mooncake_te.bench._child")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--buffer-size", type=int, required=True)
    p.add_argument("--metadata", default=None)
    p.add_argument("--protocol", default=None)
    p.add_argument("--devices", default=None)
    args = p.parse_args(argv)
    # Ctrl-C in the terminal reaches the whole process group; the parent decides when
    # the target stops (by closing our stdin), so a keypress must not kill us mid-batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()

    def watch_stdin():
        # os.read on the fd, not sys.stdin: a daemon thread blocked inside a buffered
        # reader makes interpreter shutdown abort ("could not acquire lock").
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        finally:
            stop.set()

    from ..errors import MooncakeError
    try:
        target = BenchTarget(args.buffer_size, host=args.host, metadata=args.metadata,
                             protocol=args.protocol, devices=args.devices)
    except MooncakeError as e:       # one line for the user, not a traceback
        print(f"mooncake-te bench target: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    threading.Thread(target=watch_stdin, daemon=True, name="stdin-watch").start()
    try:
        sys.stdout.write(json.dumps(target.info()) + "\n")
        sys.stdout.flush()
        target.serve(stop)
    finally:
        target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""Entry point of the loopback target child: ``python -m mooncake_te.bench._child``.

Kept out of the package ``__init__`` so ``-m`` runs it without importing it twice.
"""
from __future__ import annotations

import json
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
    args = p.parse_args(argv)
    # Ctrl-C in the terminal reaches the whole process group; the parent decides when
    # the target stops (by closing our stdin), so a keypress must not kill us mid-batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()

    def watch_stdin():
        try:
            while sys.stdin.buffer.read(4096):
                pass
        finally:
            stop.set()

    threading.Thread(target=watch_stdin, daemon=True, name="stdin-watch").start()
    target = BenchTarget(args.buffer_size, host=args.host, metadata=args.metadata,
                         protocol=args.protocol)
    try:
        sys.stdout.write(json.dumps(target.info()) + "\n")
        sys.stdout.flush()
        target.serve(stop)
    finally:
        target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""An RPC server alone in a process with scarce resources, for the flood tests.

argv: nofile [address-space-MiB-over-now] [token] [request-timeout-s]. Prints the port, then one JSON line of
stats for every line read on stdin ("stats"), and exits on EOF.
"""
from __future__ import annotations

import json
import resource
import sys


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (VmSize, VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def main() -> None:
    from mooncake_te.metadata.rpc import RpcServer
    nofile = int(sys.argv[1])
    extra_as = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    token = sys.argv[3].encode() if len(sys.argv) > 3 and sys.argv[3] else None
    kw = {"request_timeout": float(sys.argv[4])} if len(sys.argv) > 4 else {}
    notes = []
    srv = RpcServer("127.0.0.1", 0, lambda: b'{"name":"x"}',
                    lambda who, msg: notes.append(len(msg)), token=token, **kw)
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    if extra_as:
        # Thread stacks come out of the address space: a small margin makes
        # Thread.start() fail after a few dozen threads.
        limit = (_status_kib("VmSize") + extra_as * 1024) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(srv.port, flush=True)
    for _ in sys.stdin:
        print(json.dumps({"shed": getattr(srv, "shed", None), "rss_kib": _status_kib("VmRSS"),
                          "notes": len(notes)}), flush=True)
    srv.close()


if __name__ == "__main__":
    main()

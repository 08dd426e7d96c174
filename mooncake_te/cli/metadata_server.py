# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te metadata-server``: run the HTTP metadata server.

Same flags as Mooncake's ``mooncake_http_metadata_server`` (``--host``, ``--port``,
``--log-level``) plus ``--persist FILE``. See :mod:`mooncake_te.metadata.server`.
"""
from __future__ import annotations

import json
import logging
import sys

from ._parser import port as _port


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "metadata-server",
        help="run the HTTP metadata server (Mooncake-compatible, with TTLs and persistence)",
        description="Serve GET/PUT/DELETE /metadata?key=... as Mooncake's "
                    "mooncake_http_metadata_server does, plus per-key TTLs "
                    "(X-Mooncake-TTL), optional persistence and GET /health.")
    p.add_argument("--host", default="0.0.0.0",
                   help="address to listen on (default: 0.0.0.0, as Mooncake's server)")
    p.add_argument("--port", type=_port, default=8080, help="port (default: 8080; 0 = any free)")
    p.add_argument("--persist", metavar="FILE", default=None,
                   help="keep the keys in FILE so a restart does not lose them")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="how much the server logs")
    p.add_argument("--json", action="store_true",
                   help="print the listening address as one JSON line on start")
    p.set_defaults(func=run)


def run(args) -> int:
    """Serve until SIGINT/SIGTERM; return the exit status."""
    from ..errors import MetadataError
    from ..metadata.server import MetadataServer

    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def announce(srv):
        if args.json:
            print(json.dumps({"url": srv.url, "host": srv.host, "port": srv.port,
                              "persist": srv.store.persist_path}), flush=True)
        else:
            print(f"mooncake-te metadata server on {srv.url} (health: "
                  f"{srv.url.rsplit('/', 1)[0]}/health; persist: "
                  f"{srv.store.persist_path or 'off'})", flush=True)

    try:
        MetadataServer(args.host, args.port, args.persist).serve_forever(announce)
    except MetadataError as e:
        print(f"mooncake-te metadata-server: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"mooncake-te metadata-server: cannot listen on {args.host}:{args.port}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 1
    return 0

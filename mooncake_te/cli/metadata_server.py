# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te metadata-server``: run the HTTP metadata server.

Same flags as Mooncake's ``mooncake_http_metadata_server`` (``--host``, ``--port``,
``--log-level``) plus ``--persist FILE``, size limits and optional authentication. See
:mod:`mooncake_te.metadata.server` and docs/security.md.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys

from ._parser import port as _port
def _size(text: str) -> int:
    """``65536``, ``64K``, ``16M``, ``1G``: bytes (:func:`mooncake_te.units.parse_size`)."""
    from ..units import parse_size
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive size (e.g. 65536, 64K, 16M, 1G)") from None


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
                   help="keep the keys in FILE so a restart does not lose them (its "
                        "directory is created if missing)")
    p.add_argument("--max-value-bytes", metavar="SIZE", type=_size, default=None,
                   help="largest value a PUT may store (default: 64M)")
    p.add_argument("--quota-bytes", metavar="SIZE", type=_size, default=None,
                   help="all keys and values together (default: 1G)")
    p.add_argument("--max-batch-reply-bytes", metavar="SIZE", type=_size, default=None,
                   help="most bytes of values one POST /metadata/batch read answers "
                        "(default: 16M; 413 beyond)")
    p.add_argument("--auth-token-file", metavar="FILE", default=None,
                   help="require requests signed with the auth_token in FILE (default: "
                        "MC_AUTH_TOKEN if set, else no authentication)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="how much the server logs")
    p.add_argument("--json", action="store_true",
                   help="print the listening address as one JSON line on start")
    p.set_defaults(func=run)


def run(args) -> int:
    """Serve until SIGINT/SIGTERM; return the exit status."""
    from ..errors import MetadataError
    from ..metadata.server import MAX_BATCH_REPLY, MAX_VALUE, QUOTA, MetadataServer

    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def announce(srv):
        if args.json:
            print(json.dumps({"url": srv.url, "host": srv.host, "port": srv.port,
                              "persist": srv.store.persist_path,
                              "auth": srv.token is not None}), flush=True)
        else:
            print(f"mooncake-te metadata server on {srv.url} (health: "
                  f"{srv.url.rsplit('/', 1)[0]}/health; persist: "
                  f"{srv.store.persist_path or 'off'}; authentication: "
                  f"{'on' if srv.token else 'off'})", flush=True)

    token = os.environ.get("MC_AUTH_TOKEN", "").encode() or None
    if args.auth_token_file:
        try:
            with open(args.auth_token_file, "rb") as f:
                token = f.read().strip()
        except OSError as e:
            print(f"mooncake-te metadata-server: cannot read --auth-token-file "
                  f"{args.auth_token_file}: {e.strerror}", file=sys.stderr)
            return 2
        if not token:
            print(f"mooncake-te metadata-server: --auth-token-file {args.auth_token_file} is "
                  f"empty", file=sys.stderr)
            return 2
    try:
        MetadataServer(args.host, args.port, args.persist,
                       max_value=args.max_value_bytes or MAX_VALUE,
                       quota=args.quota_bytes or QUOTA, token=token,
                       max_batch_reply=args.max_batch_reply_bytes or MAX_BATCH_REPLY
                       ).serve_forever(announce)
    except MetadataError as e:
        print(f"mooncake-te metadata-server: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        from ..metadata.rpc import port_hint
        from .main import listen_failed
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            why = "address already in use"     # aiohttp's strerror repeats the address
        print(f"mooncake-te metadata-server: cannot listen on {args.host}:{args.port} "
              f"({why}){port_hint(e.errno, args.port)}", file=sys.stderr)
        return 2 if listen_failed(e) else 1
    return 0

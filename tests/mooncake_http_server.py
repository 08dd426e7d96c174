# SPDX-License-Identifier: Apache-2.0
"""A minimal HTTP metadata server that behaves like Mooncake's own
(``mooncake_http_metadata_server``, ``mooncake-wheel/mooncake/http_metadata_server.py``
in kvcache-ai/Mooncake, the one Mooncake's CI starts), written from its observable rules,
for the compat tests: run as a real process, spoken to over real HTTP.

The rules (all of them; nothing else is implemented, in particular no TTL):

- one route, ``/metadata``, any method; the key is the ``key`` query parameter, stripped;
  no key: 400 ``metadata key is required``;
- GET: 200 with the stored bytes, or 404 ``metadata not found``;
- PUT: stores the body; but a key containing ``rpc_meta`` that is already stored is
  refused with 400 ``Duplicate rpc_meta key not allowed`` (whatever the new value);
- DELETE: 200 ``metadata deleted``, or 404 ``metadata not found``;
- other methods: 405 ``Method not allowed``.

Usage: ``python mooncake_http_server.py PORT`` (prints ``ready <port>`` once listening;
PORT 0 picks a free one).
"""
from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_store: dict[str, bytes] = {}
_lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):      # quiet
        pass

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _key(self):
        u = urlsplit(self.path)
        if u.path != "/metadata":
            self._reply(404, b"404: Not Found")
            return None
        key = parse_qs(u.query).get("key", [""])[0].strip()
        if not key:
            self._reply(400, b"metadata key is required")
            return None
        return key

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def do_GET(self):
        key = self._key()
        if key is None:
            return
        with _lock:
            value = _store.get(key)
        if value is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, value)

    def do_PUT(self):
        body = self._body()
        key = self._key()
        if key is None:
            return
        with _lock:
            if "rpc_meta" in key and key in _store:
                refused = True
            else:
                refused = False
                _store[key] = body
        if refused:
            self._reply(400, b"Duplicate rpc_meta key not allowed")
        else:
            self._reply(200, b"metadata updated")

    def do_DELETE(self):
        key = self._key()
        if key is None:
            return
        with _lock:
            found = _store.pop(key, None) is not None
        self._reply(200 if found else 404,
                    b"metadata deleted" if found else b"metadata not found")

    def do_POST(self):
        self._body()
        if self._key() is not None:
            self._reply(405, b"Method not allowed")


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    srv.daemon_threads = True
    print(f"ready {srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()

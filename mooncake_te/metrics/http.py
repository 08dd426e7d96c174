# SPDX-License-Identifier: Apache-2.0
"""The engine's ``/metrics`` listener: a minimal HTTP/1.0 server on the shared
control-plane accept loop (:class:`~mooncake_te.metadata.listener.Listener`).

prometheus_client's ``start_http_server`` runs a ``ThreadingHTTPServer``: a thread for
every connection, with no bound and no deadline, so silent connections piled up threads
(issue #35). Here at most ``MAX_CONNECTIONS`` are served at once, the request head must
arrive within ``REQUEST_TIMEOUT`` seconds and be at most ``MAX_HEAD`` bytes, and with an
auth token a scrape must carry ``Authorization: Bearer <metrics_credential(token)>``
(Prometheus' ``authorization`` scrape setting; the credential is derived from the token,
so a scraper never holds the token itself).
"""
from __future__ import annotations

import hmac
import logging
import socket
import time
from typing import Callable

from ..metadata.framing import metrics_credential
from ..metadata.listener import Listener

log = logging.getLogger("mooncake_te.metrics")

MAX_CONNECTIONS = 16        # scrapes served at once
MAX_PER_PEER = 8            # of them from one address
REQUEST_TIMEOUT = 5.0       # s for the whole request head
MAX_HEAD = 8192             # bytes of request line and headers


class HttpMetricsServer:
    """Answers ``GET /metrics`` with ``body()`` (the exposition text) on ``host:port``."""

    def __init__(self, host: str, port: int, body: Callable[[], bytes],
                 token: bytes | None = None):
        self._body = body
        self._credential = metrics_credential(token) if token else None
        self.refused = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self.server_address = self._sock.getsockname()[:2]
        self._listener = Listener(self._sock, f"mte-metrics-{self.server_address[1]}",
                                  self._serve, MAX_CONNECTIONS, MAX_PER_PEER).start()

    @property
    def shed(self) -> int:
        return self._listener.shed

    def _read_head(self, conn: socket.socket) -> bytes | None:
        deadline = time.monotonic() + REQUEST_TIMEOUT
        head = b""
        while b"\r\n\r\n" not in head and b"\n\n" not in head:
            left = deadline - time.monotonic()
            if left <= 0 or len(head) > MAX_HEAD:
                return None
            conn.settimeout(left)
            more = conn.recv(MAX_HEAD + 1 - len(head))
            if not more:
                return None
            head += more
        return head

    def _serve(self, conn: socket.socket, peer: str = "") -> None:
        with conn:
            try:
                head = self._read_head(conn)
                if head is None:
                    self.refused += 1
                    return
                lines = head.decode("latin-1").split("\n")
                parts = lines[0].split()
                if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                    return self._reply(conn, 405, b"only GET /metrics\n")
                path = parts[1].split("?", 1)[0]
                if path not in ("/metrics", "/"):
                    return self._reply(conn, 404, b"not found: scrape /metrics\n")
                if self._credential is not None:
                    got = ""
                    for line in lines[1:]:
                        name, _, value = line.partition(":")
                        if name.strip().lower() == "authorization":
                            got = value.strip()
                    if not hmac.compare_digest(got.encode(), f"Bearer {self._credential}"
                                               .encode()):
                        self.refused += 1
                        return self._reply(conn, 401, b"this engine has an auth_token: send "
                                           b"Authorization: Bearer <metrics credential> "
                                           b"(docs/observability.md)\n")
                body = self._body()
                self._reply(conn, 200, body if parts[0] == "GET" else b"",
                            "text/plain; version=0.0.4; charset=utf-8", len(body))
            except OSError:
                pass

    @staticmethod
    def _reply(conn: socket.socket, status: int, body: bytes,
               ctype: str = "text/plain; charset=utf-8", length: int | None = None) -> None:
        reason = {200: "OK", 401: "Unauthorized", 404: "Not Found",
                  405: "Method Not Allowed"}[status]
        conn.sendall(f"HTTP/1.0 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                     f"Content-Length: {len(body) if length is None else length}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)

    def shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._listener.close()

    def server_close(self) -> None:
        pass

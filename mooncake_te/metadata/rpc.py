# SPDX-License-Identifier: Apache-2.0
"""The engine's RPC port: serves its segment descriptor (P2P handshake), probes and
notifications, one framed request per connection as Mooncake's handshake daemon does.

This is control plane (a handful of requests per peer), so plain threads are enough;
the data path never comes through here. One peer must not take the port down (issue #20
items 4 and 5), so:

- the accept loop (:class:`.listener.Listener`) survives running out of descriptors,
  memory or threads, and serves at most ``max_connections`` requests at once,
  ``max_per_peer`` from one peer address (more are shed);
- a request (authentication included) must arrive whole within ``request_timeout``
  seconds, however slowly its bytes trickle in;
- before authentication, frames are small (``framing.PRE_AUTH_MAX_FRAME``).
"""
from __future__ import annotations

import json
import logging
import socket
import time
import weakref
from typing import Callable

from ..errors import MooncakeError
from . import framing
from .listener import Listener

log = logging.getLogger("mooncake_te.rpc")

MAX_CONNECTIONS = 256       # requests served at once
MAX_PER_PEER = 64           # of them from one peer address
REQUEST_TIMEOUT = 10.0      # s for a whole request, authentication included



def port_hint(errno_: int | None, port: int) -> str:
    """What to do when binding ``port`` failed with ``errno_``: '' when there is no port
    to change (port 0, or a failure that is not about the port)."""
    import errno as _errno
    if not port or errno_ != _errno.EADDRINUSE:
        return ""
    return (f"; another process holds port {port} (`ss -ltnp 'sport = :{port}'` shows "
            f"which): pick another port, or 0 for any free one")


class RpcServer:
    """Listens on ``host:port`` and answers handshake requests.

    Parameters
    ----------
    describe : callable returning bytes
        The current segment descriptor, encoded.
    on_notify : callable(sender, message: bytes)
        Called for Notify requests.
    max_connections, max_per_peer : int
        Requests served at once, in total and from one peer address; more are shed.
    request_timeout : float
        Seconds a peer has to deliver a whole request (authentication included).
    """

    def __init__(self, host: str, port: int, describe: Callable[[], bytes],
                 on_notify: Callable[[str, bytes], None], bind_host: str | None = None,
                 token: bytes | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_per_peer: int = MAX_PER_PEER, request_timeout: float = REQUEST_TIMEOUT):
        self._token = token or None
        self.auth_failures = 0
        self.request_timeout = request_timeout
        # Weak: the accept thread must not keep an unclosed engine alive forever (then
        # it could never warn and clean up in __del__).
        self._describe = _weak(describe)
        self._on_notify = _weak(on_notify)
        self._handlers: dict = {}        # frame type -> weak handler(payload) -> bytes
        family = socket.AF_INET6 if ":" in (bind_host or host) else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((bind_host or host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(e.errno, f"cannot listen on {bind_host or host}:{port} for the RPC "
                                   f"port ({e.strerror}){port_hint(e.errno, port)}") from None
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._listener = Listener(self._sock, f"mte-rpc-{self.port}", self._serve_one,
                                  max_connections, max_per_peer).start()

    @property
    def shed(self) -> int:
        """Connections closed unserved (limits, descriptors or threads exhausted)."""
        return self._listener.shed

    def _serve_one(self, conn: socket.socket, peer: str = "") -> None:
        deadline = time.monotonic() + self.request_timeout
        with conn:
            try:
                conn.settimeout(5.0)       # Mooncake: server per-connection recv timeout 5 s
                length, kind = framing.recv_header(conn, deadline)
                if self._token or kind == framing.AUTH:
                    who = f"{conn.getpeername()[0]}:{conn.getpeername()[1]}"
                    # The AUTH exchange is small: nothing bigger is read (or buffered)
                    # from a peer that has not proven the token (issue #20 item 5).
                    # A small non-AUTH request is read (and dropped) all the same, so that
                    # closing after the refusal does not reset the connection before the
                    # peer reads why.
                    payload = b"" if kind != framing.AUTH and length > \
                        framing.PRE_AUTH_MAX_FRAME else framing.recv_payload(
                            conn, length, framing.PRE_AUTH_MAX_FRAME, deadline)
                    if not self._authenticate(conn, kind, payload, who, deadline):
                        return
                    kind, payload = framing.recv_frame(conn, deadline=deadline)
                else:
                    payload = framing.recv_payload(conn, length, deadline=deadline)
                describe, on_notify = self._describe(), self._on_notify()
                if describe is None or on_notify is None:
                    return                      # the engine is gone
                if kind == framing.METADATA:
                    reply = describe()
                elif kind == framing.PROBE:
                    reply = b'{"status":"success"}'
                elif kind == framing.NOTIFY:
                    msg = json.loads(payload)
                    # Mooncake's notify_msg is UTF-8 text.
                    try:
                        on_notify(str(msg.get("name", "")),
                                  str(msg.get("notify_msg", "")).encode("utf-8",
                                                                         "surrogateescape"))
                        reply = b'{"status":"success"}'
                    except MooncakeError as e:      # the queue is full: the sender learns it
                        reply = json.dumps({"status": "failed", "reply_msg": str(e)}).encode()
                elif kind in self._handlers:
                    fn = self._handlers[kind]()
                    if fn is None:
                        return
                    try:
                        reply = fn(payload)
                    except Exception as e:        # the handler's failure is the reply
                        log.debug("RPC handler for type %d failed: %r", kind, e)
                        reply = json.dumps({"reply_msg": f"{type(e).__name__}: {e}"}).encode()
                else:
                    reply = json.dumps({"reply_msg": f"unsupported request type {kind}"}).encode()
                framing.send_frame(conn, kind, reply)
            except Exception as e:  # a bad peer must not take the server down
                log.debug("RPC request failed: %r", e)

    def add_handler(self, kind: int, fn: Callable[[bytes], bytes]) -> None:
        """Serve requests of frame type ``kind`` (a transport's own handshake, e.g. the
        RDMA queue-pair exchange) with ``fn(payload) -> reply``, after the same
        authentication as every request. ``fn`` is held weakly when it is a bound method.
        An exception in ``fn`` is answered as ``{"reply_msg": "..."}``; clients call
        :func:`framing.request` with the same type."""
        if kind in (framing.CONNECTION, framing.METADATA, framing.NOTIFY, framing.PROBE,
                    framing.AUTH, framing.AUTH_FAILED):
            raise ValueError(f"frame type {kind} is the engine's own")
        self._handlers[kind] = _weak(fn)

    def remove_handler(self, kind: int) -> None:
        self._handlers.pop(kind, None)

    def _authenticate(self, conn, kind: int, payload: bytes, who: str,
                      deadline: float | None = None) -> bool:
        """Mutual HMAC challenge-response (framing.client_auth is the other half)."""
        why = framing.server_auth(conn, self._token, kind, payload, deadline)
        if why is None:
            return True
        if self._token:
            self.auth_failures += 1
            log.warning("refused RPC peer %s: %s", who, why)
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._listener.close()


def _weak(fn):
    """A weak reference to a bound method; plain functions are held as they are."""
    if hasattr(fn, "__self__"):
        return weakref.WeakMethod(fn)
    return lambda: fn

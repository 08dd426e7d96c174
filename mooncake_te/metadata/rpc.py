# SPDX-License-Identifier: Apache-2.0
"""The engine's RPC port: serves its segment descriptor (P2P handshake), probes and
notifications, one framed request per connection as Mooncake's handshake daemon does.

This is control plane (a handful of requests per peer), so plain threads are enough;
the data path never comes through here.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import threading
import weakref
from typing import Callable

from . import framing

log = logging.getLogger("mooncake_te.rpc")


class RpcServer:
    """Listens on ``host:port`` and answers handshake requests.

    Parameters
    ----------
    describe : callable returning bytes
        The current segment descriptor, encoded.
    on_notify : callable(sender, message: bytes)
        Called for Notify requests.
    """

    def __init__(self, host: str, port: int, describe: Callable[[], bytes],
                 on_notify: Callable[[str, bytes], None], bind_host: str | None = None,
                 token: bytes | None = None):
        self._token = token or None
        self.auth_failures = 0
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
                                   f"port ({e.strerror}); pick another port or port=0") from None
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"mte-rpc-{self.port}",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5.0)       # Mooncake: server per-connection recv timeout 5 s
                kind, payload = framing.recv_frame(conn)
                if self._token or kind == framing.AUTH:
                    who = f"{conn.getpeername()[0]}:{conn.getpeername()[1]}"
                    if not self._authenticate(conn, kind, payload, who):
                        return
                    kind, payload = framing.recv_frame(conn)
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
                    on_notify(str(msg.get("name", "")),
                              str(msg.get("notify_msg", "")).encode("utf-8", "surrogateescape"))
                    reply = b'{"status":"success"}'
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

    def _refuse(self, conn, who: str, why: str) -> bool:
        self.auth_failures += 1
        log.warning("refused RPC peer %s: %s", who, why)
        framing.send_frame(conn, framing.AUTH_FAILED, json.dumps({"reply_msg": why}).encode())
        return False

    def _authenticate(self, conn, kind: int, payload: bytes, who: str) -> bool:
        """Mutual HMAC challenge-response (framing.client_auth is the other half)."""
        if kind != framing.AUTH:
            return self._refuse(conn, who, "authentication required: this engine has an "
                                           "auth_token; set the same token on the peer")
        if not self._token:
            framing.send_frame(conn, framing.AUTH_FAILED, json.dumps(
                {"reply_msg": "this engine has no auth_token"}).encode())
            return False
        cn = bytes.fromhex(json.loads(payload)["nonce"])
        sn = os.urandom(16)
        framing.send_frame(conn, framing.AUTH, json.dumps(
            {"nonce": sn.hex(), "proof": framing.proof(self._token, b"mte-rpc-server", cn, sn)
             .hex()}).encode())
        kind, raw = framing.recv_frame(conn)
        got = bytes.fromhex(json.loads(raw).get("proof", "")) if kind == framing.AUTH else b""
        if not hmac.compare_digest(got, framing.proof(self._token, b"mte-rpc-client", sn, cn)):
            return self._refuse(conn, who, "wrong auth token")
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2.0)


def _weak(fn):
    """A weak reference to a bound method; plain functions are held as they are."""
    if hasattr(fn, "__self__"):
        return weakref.WeakMethod(fn)
    return lambda: fn

# SPDX-License-Identifier: Apache-2.0
"""The engine's RPC port: serves its segment descriptor (P2P handshake), probes and
notifications, one framed request per connection as Mooncake's handshake daemon does.

This is control plane (a handful of requests per peer), so plain threads are enough;
the data path never comes through here. One peer must not take the port down (issue #20
items 4 and 5), so:

- the accept loop survives every error ``accept()`` and ``Thread.start()`` can raise:
  out of descriptors (EMFILE/ENFILE: a spare descriptor is given up to accept and close
  the pending connection, then taken back), out of memory or threads (back off, shed);
- at most ``max_connections`` requests are served at once, ``max_per_peer`` from one
  peer address; a connection over either limit is closed at once (counted in ``shed``);
- a request (authentication included) must arrive whole within ``request_timeout``
  seconds, however slowly its bytes trickle in;
- before authentication, frames are small (``framing.PRE_AUTH_MAX_FRAME``).
"""
from __future__ import annotations

import errno
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
import weakref
from typing import Callable

from . import framing

log = logging.getLogger("mooncake_te.rpc")

MAX_CONNECTIONS = 256       # requests served at once
MAX_PER_PEER = 64           # of them from one peer address
REQUEST_TIMEOUT = 10.0      # s for a whole request, authentication included
# accept() errors that mean "out of a resource for now": shed, back off, go on.
_SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


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
        self.shed = 0                    # connections closed unserved (limits, resources)
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self.request_timeout = request_timeout
        self._active: dict = {}          # peer address -> requests being served
        self._active_total = 0
        self._active_lock = threading.Lock()
        self._spare = _spare_fd()
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
        backoff = 0.0
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError as e:
                if self._closed or e.errno in (errno.EBADF, errno.EINVAL):
                    return                              # close() shut the socket
                if e.errno in _SCARCE:
                    self._shed_pending(e)
                    backoff = min(max(backoff * 2, 0.01), 0.5)
                    time.sleep(backoff)
                else:                                   # ECONNABORTED, EPROTO, EPERM...
                    log.debug("RPC accept failed: %r", e)
                continue
            backoff = 0.0
            peer = addr[0] if isinstance(addr, tuple) else str(addr)
            if not self._enter(peer):
                self._drop(conn)
                continue
            try:
                threading.Thread(target=self._handle, args=(conn, peer), daemon=True).start()
            except RuntimeError as e:                   # can't start new thread
                self._leave(peer)
                self._drop(conn)
                log.warning("RPC port %d: cannot start a thread (%s); shedding", self.port, e)
                time.sleep(0.05)

    def _enter(self, peer: str) -> bool:
        with self._active_lock:
            n = self._active.get(peer, 0)
            if self._active_total >= self.max_connections or n >= self.max_per_peer:
                return False
            self._active[peer] = n + 1
            self._active_total += 1
            return True

    def _leave(self, peer: str) -> None:
        with self._active_lock:
            self._active_total -= 1
            n = self._active[peer] - 1
            if n:
                self._active[peer] = n
            else:
                del self._active[peer]

    def _drop(self, conn: socket.socket) -> None:
        self.shed += 1
        try:
            # RST at close: the peer learns at once, and no FIN_WAIT state stays here.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        conn.close()

    def _shed_pending(self, err: OSError) -> None:
        """Out of descriptors: give up the spare one, accept the pending connection and
        close it, so the peer is refused instead of waiting in the backlog (libev's and
        nginx's reserve descriptor)."""
        log.warning("RPC port %d: %s; shedding connections", self.port, err.strerror)
        if self._spare is None:
            return
        os.close(self._spare)
        self._spare = None
        try:
            conn, _ = self._sock.accept()
            self._drop(conn)
        except OSError:
            pass
        self._spare = _spare_fd()

    def _handle(self, conn: socket.socket, peer: str) -> None:
        try:
            self._serve_one(conn)
        finally:
            self._leave(peer)

    def _serve_one(self, conn: socket.socket) -> None:
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

    def _authenticate(self, conn, kind: int, payload: bytes, who: str,
                      deadline: float | None = None) -> bool:
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
        kind, raw = framing.recv_frame(conn, framing.PRE_AUTH_MAX_FRAME, deadline)
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
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None


def _spare_fd() -> int | None:
    try:
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _weak(fn):
    """A weak reference to a bound method; plain functions are held as they are."""
    if hasattr(fn, "__self__"):
        return weakref.WeakMethod(fn)
    return lambda: fn

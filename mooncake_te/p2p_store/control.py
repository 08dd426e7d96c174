# SPDX-License-Identifier: Apache-2.0
"""The P2P store's control port: small JSON requests between stores.

Chunk *data* never comes through here: getters read it one-sided through the transfer
engine. This port carries what the engine has no words for: which chunks a holder has
(a bitmap) and how loaded it is, a notice when a getter starts reading a chunk and the
outcome when it is done (so the holder knows its load and counts what it uploaded; a
corrupt chunk makes it check its own copy), and gossip about other holders. The two
notices are sent without waiting for an answer, so a holder busy with its own work
never delays the data path.

Framing is the engine's handshake framing (``u64 length | u8 type | payload``,
:mod:`mooncake_te.metadata.framing`) with a type of our own, so a store's port that is
mistakenly given to an engine (or the reverse) fails with a clear reply instead of
garbage. Connections are persistent: a getter keeps one per holder for the whole get.

The port is guarded like the engine's RPC port (issue #20 item 9): with the engine's
``auth_token`` a connection starts with the same HMAC challenge-response (with labels of
its own, so a proof for one port is none for the other); the accept loop is
:class:`~mooncake_te.metadata.listener.Listener` (connection limits, survives descriptor
and thread exhaustion); authentication must finish within ``AUTH_TIMEOUT``, a started
frame within ``FRAME_TIMEOUT``, and a connection idle for ``IDLE_TIMEOUT`` is closed
(clients reconnect once on their own).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import Callable

from ..errors import ERR_SOCKET, MetadataError
from ..metadata import framing, split_host_port
from ..metadata.listener import Listener
from ..metadata.rpc import port_hint

log = logging.getLogger("mooncake_te.p2p_store")

#: frame type of P2P store requests ("P"); the engine's own types are 0..3
FRAME = 0x50
#: HMAC labels of this port's authentication (framing.client_auth/server_auth)
LABELS = (b"mte-p2p-server", b"mte-p2p-client")
MAX_CONNECTIONS = 256       # connections served at once
MAX_PER_PEER = 64           # of them from one peer address
AUTH_TIMEOUT = 10.0         # s from accept to a proven token
FRAME_TIMEOUT = 10.0        # s from a frame's first byte to its last
IDLE_TIMEOUT = 120.0        # s without a request before the connection is closed


class ControlServer:
    """Accepts store-to-store requests on ``host:port`` and answers each with ``handle``.

    Parameters
    ----------
    handle : callable(request: dict, session: dict) -> dict
        Answers one request; ``session`` is per connection (the store keeps a getter's
        reads in progress there so a vanished getter's are released).
    on_close : callable(session: dict)
        Called when a connection ends.
    token : bytes, optional
        The engine's ``auth_token``: peers must prove it before their first request.
    """

    def __init__(self, host: str, port: int, handle: Callable, on_close: Callable,
                 token: bytes | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_per_peer: int = MAX_PER_PEER, idle_timeout: float = IDLE_TIMEOUT):
        self._token = token or None
        self.auth_failures = 0
        self.idle_timeout = float(idle_timeout)
        # Weak: the serving threads must not keep an unclosed store alive for ever.
        self._handle = _weak(handle)
        self._on_close = _weak(on_close)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(e.errno, f"P2P store cannot listen on {host}:{port} ({e.strerror})"
                                   f"{port_hint(e.errno, port)}") from None
        self._sock.listen(256)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._conns: set = set()
        self._lock = threading.Lock()
        self._listener = Listener(self._sock, f"mte-p2p-{self.port}", self._connection,
                                  max_connections, max_per_peer).start()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def shed(self) -> int:
        """Connections closed unserved (limits, descriptors or threads exhausted)."""
        return self._listener.shed

    def _authenticate(self, conn: socket.socket, peer: str) -> bool:
        deadline = time.monotonic() + AUTH_TIMEOUT
        try:
            length, kind = framing.recv_header(conn, deadline)
            payload = b"" if kind != framing.AUTH and length > framing.PRE_AUTH_MAX_FRAME \
                else framing.recv_payload(conn, length, framing.PRE_AUTH_MAX_FRAME, deadline)
            why = framing.server_auth(conn, self._token, kind, payload, deadline, LABELS)
        except (OSError, ConnectionError, MetadataError):
            why = "authentication did not complete"
        if why is not None:
            self.auth_failures += 1
            log.warning("refused P2P store peer %s: %s", peer, why)
            return False
        return True

    def _connection(self, conn: socket.socket, peer: str = "") -> None:
        session: dict = {}
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(FRAME_TIMEOUT)
            if self._token and not self._authenticate(conn, peer):
                return
            while not self._closed:
                try:
                    frame = framing.recv_request(conn, self.idle_timeout, FRAME_TIMEOUT)
                except (OSError, ConnectionError, MetadataError):
                    return
                if frame is None:
                    return
                kind, payload = frame
                if kind != FRAME:
                    framing.send_frame(conn, kind, json.dumps(
                        {"reply_msg": "this is a mooncake_te P2P store port, not an engine's "
                                      "RPC port"}).encode())
                    return
                handle = self._handle()
                if handle is None:
                    return                  # the store is gone
                try:
                    request = json.loads(payload)
                    reply = handle(request, session)
                except Exception as e:  # a bad request must not take the server down
                    log.debug("P2P store request failed: %r", e)
                    request, reply = {}, {"ok": False, "error": "internal", "message": repr(e)}
                if not request.get("noreply"):
                    framing.send_frame(conn, FRAME,
                                       json.dumps(reply, separators=(",", ":")).encode())
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            try:
                on_close = self._on_close()
                if on_close is not None:
                    on_close(session)
            except Exception:
                log.exception("releasing a P2P store session failed")

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
        with self._lock:
            conns = list(self._conns)
        for c in conns:         # wake the connection threads so they end
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _weak(fn):
    """A weak reference to a bound method; plain functions are held as they are."""
    if hasattr(fn, "__self__"):
        return weakref.WeakMethod(fn)
    return lambda: fn


class ControlClient:
    """One persistent connection to another store's control port (thread-safe)."""

    def __init__(self, address: str, timeout: float = 5.0, token: bytes | None = None):
        self.address = address
        self.host, self.port = split_host_port(address)
        self.timeout = timeout
        # The CLI's clients have no engine: they take the token from MC_AUTH_TOKEN.
        self.token = token or os.environ.get("MC_AUTH_TOKEN", "").encode() or None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        s = socket.create_connection((self.host, self.port), timeout=self.timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.token:
            try:
                framing.client_auth(s, self.token, f"P2P store {self.address}", LABELS)
            except BaseException:
                s.close()
                raise
        return s

    def call(self, request: dict) -> dict:
        """Send ``request``, return the reply; MetadataError when the store is unreachable."""
        payload = json.dumps(request, separators=(",", ":")).encode()
        with self._lock:
            for attempt in (0, 1):
                fresh = self._sock is None
                try:
                    if fresh:
                        self._sock = self._connect()
                    framing.send_frame(self._sock, FRAME, payload)
                    kind, raw = framing.recv_frame(self._sock)
                    break
                except (OSError, ConnectionError, MetadataError) as e:
                    self._drop()
                    # A kept connection may have been closed by an idle peer; one fresh
                    # attempt tells that apart from a dead store.
                    if fresh or attempt:
                        raise MetadataError(
                            f"P2P store at {self.address} is unreachable ({e}); is it running?",
                            status=ERR_SOCKET, errno=getattr(e, "errno", None)) from None
        if kind != FRAME:
            raise MetadataError(f"{self.address} is not a P2P store port (it answered frame "
                                f"type {kind}); give the store's address, e.g. the one "
                                f"`mooncake-te p2p publish` prints", status=ERR_SOCKET)
        try:
            reply = json.loads(raw)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or "ok" not in reply:
            # An engine's RPC port answers unknown request types with its own
            # {"reply_msg": ...} in the same framing (metadata/rpc.py).
            raise MetadataError(f"{self.address} is not a P2P store port (it answered "
                                f"{bytes(raw[:80])!r}); give the store's address "
                                f"(P2PStore.address, printed by `mooncake-te p2p publish`), "
                                f"not the engine's segment name", status=ERR_SOCKET)
        return reply

    def send(self, request: dict) -> None:
        """Send ``request`` without waiting for an answer (the server sends none).

        For reports whose answer changes nothing (a chunk's outcome): the getter moves on
        to its next chunk instead of spending a round trip. MetadataError if unreachable.
        """
        payload = json.dumps(dict(request, noreply=True), separators=(",", ":")).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = self._connect()
                framing.send_frame(self._sock, FRAME, payload)
            except OSError as e:
                self._drop()
                raise MetadataError(f"P2P store at {self.address} is unreachable ({e})",
                                    status=ERR_SOCKET, errno=e.errno) from None

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()

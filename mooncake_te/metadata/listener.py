# SPDX-License-Identifier: Apache-2.0
"""An accept loop that one peer cannot take down, for the control-plane ports (the
engine's RPC port, the P2P store's control port).

Issue #20 items 4 and 6: a thread per connection is fine for the control plane (a
handful of requests per peer), as long as

- the loop survives every error ``accept()`` and ``Thread.start()`` can raise: out of
  descriptors (EMFILE/ENFILE: a spare descriptor is given up to accept and close the
  pending connection, so the peer is refused instead of waiting in the backlog, as
  libev and nginx do), out of memory or threads (back off, shed, log once a second);
- at most ``max_connections`` connections are served at once and ``max_per_peer`` from
  one peer address; one over either limit is closed at once (counted in ``shed``).

Deadlines (authentication, whole requests, idle connections) belong to the protocol and
are kept by the handlers with :func:`framing.recv_frame`'s ``deadline``.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from typing import Callable

log = logging.getLogger("mooncake_te.listener")

# accept() errors that mean "out of a resource for now": shed, back off, go on.
_SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class Listener:
    """Accepts on ``sock`` and runs ``handle(conn, peer)`` in a thread per connection.

    Parameters
    ----------
    sock : socket.socket
        Bound and listening.
    name : str
        For thread names and logs.
    handle : callable(conn, peer_address)
        Serves one connection; must close it.
    max_connections, max_per_peer : int
        Connections served at once, in total and from one peer address.
    """

    def __init__(self, sock: socket.socket, name: str, handle: Callable,
                 max_connections: int, max_per_peer: int):
        self._sock = sock
        self.name = name
        self._handle = handle
        self.max_connections, self.max_per_peer = int(max_connections), int(max_per_peer)
        self.shed = 0                    # connections closed unserved (limits, resources)
        self._active: dict = {}          # peer address -> connections being served
        self._active_total = 0
        self._lock = threading.Lock()
        self._spare = _spare_fd()
        self._closed = False
        self._last_warning = 0.0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> "Listener":
        self._thread.start()
        return self

    @property
    def active(self) -> int:
        return self._active_total

    def _serve(self) -> None:
        backoff = 0.0
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError as e:
                if self._closed or e.errno in (errno.EBADF, errno.EINVAL):
                    return                              # close() shut the socket
                if e.errno in _SCARCE:
                    self._warn(f"{e.strerror}; shedding connections")
                    self._shed_pending()
                    backoff = min(max(backoff * 2, 0.01), 0.5)
                    time.sleep(backoff)
                else:                                   # ECONNABORTED, EPROTO, EPERM...
                    log.debug("%s: accept failed: %r", self.name, e)
                continue
            backoff = 0.0
            peer = addr[0] if isinstance(addr, tuple) else str(addr)
            if not self._enter(peer):
                self._warn(f"connection limit reached ({self._active_total} open, "
                           f"{self._active.get(peer, 0)} from {peer}); shedding")
                self._drop(conn)
                continue
            try:
                threading.Thread(target=self._run, args=(conn, peer), daemon=True,
                                 name=f"{self.name}-conn").start()
            except RuntimeError as e:                   # can't start new thread
                self._leave(peer)
                self._drop(conn)
                self._warn(f"cannot start a thread ({e}); shedding")
                time.sleep(0.05)

    def _run(self, conn: socket.socket, peer: str) -> None:
        try:
            self._handle(conn, peer)
        finally:
            self._leave(peer)

    def _warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 1.0:          # a flood must not flood the log
            self._last_warning = now
            log.warning("%s: %s", self.name, what)

    def _enter(self, peer: str) -> bool:
        with self._lock:
            n = self._active.get(peer, 0)
            if self._active_total >= self.max_connections or n >= self.max_per_peer:
                return False
            self._active[peer] = n + 1
            self._active_total += 1
            return True

    def _leave(self, peer: str) -> None:
        with self._lock:
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

    def _shed_pending(self) -> None:
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

    def close(self) -> None:
        """Stop accepting (the caller closes its socket); joins the accept thread."""
        self._closed = True
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None


def _spare_fd() -> int | None:
    try:
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None

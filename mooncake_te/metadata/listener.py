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

Issue #35: this is the one accept loop of every listener above the core (the engine's
RPC port, the P2P store's control port, the vLLM pool's lookup socket, the compat
``RpcInterface``). The native accept loop of the data port (``src/tcp/server.c``) is not
reused: it serves the data protocol itself on its own threads and cannot hand a
connection to a Python handler. For ``AF_UNIX`` sockets the loop also checks the
peer's credentials (``SO_PEERCRED``, unix(7)): only a process of our own uid is served,
and :func:`listen_private` / :func:`connect_private` put the socket in a directory only
our uid can enter and check, from the client side, that the server is of our uid too
(a squatter is detected, never talked to).
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
import tempfile
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
        # Unix sockets: only processes of our uid are served (SO_PEERCRED).
        self._unix = sock.family == socket.AF_UNIX
        self.refused_uid = 0             # unix connections refused: another uid
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
            if self._unix:
                uid = peer_uid(conn)
                if uid != os.geteuid():
                    self.refused_uid += 1
                    self._warn(f"refused a connection from uid {uid} (only uid "
                               f"{os.geteuid()} is served)")
                    self._drop(conn)
                    continue
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


_UCRED = struct.Struct("iII")           # struct ucred: pid, uid, gid (unix(7))


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket, as the kernel
    recorded it at ``connect``/``listen`` (it cannot be forged by the peer)."""
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                         _UCRED.size))


def peer_uid(conn: socket.socket) -> int:
    """The peer's uid, -1 when the kernel does not tell."""
    try:
        return peer_credentials(conn)[1]
    except OSError:
        return -1


def private_dir() -> str:
    """A directory only our uid can enter, for unix sockets: ``$MC_RUNTIME_DIR``, else
    ``$XDG_RUNTIME_DIR/mooncake_te``, else ``<tmp>/mooncake_te-<uid>``; created 0700.
    Refused (with what to do) when it exists and is not ours or is open to others: a
    directory another user made first must not host our sockets."""
    base = os.environ.get("MC_RUNTIME_DIR")
    if not base:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "mooncake_te") if xdg and os.path.isdir(xdg) else \
            os.path.join(tempfile.gettempdir(), f"mooncake_te-{os.geteuid()}")
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(
            errno.EACCES, f"{base} is not a private directory of uid {os.geteuid()} "
                          f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); "
                          f"remove it, or set MC_RUNTIME_DIR to a directory of mode 0700 "
                          f"that only this user owns")
    return base


def private_path(name: str) -> str:
    """The path of the unix socket ``name`` in :func:`private_dir` (``name`` made safe
    for a file name, and short enough for ``sun_path``'s 108 bytes)."""
    import hashlib
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    if len(safe) > 40:
        safe = safe[:20] + "-" + hashlib.sha256(name.encode()).hexdigest()[:16]
    path = os.path.join(private_dir(), safe + ".sock")
    if len(path.encode()) >= 108:
        raise OSError(errno.ENAMETOOLONG, f"unix socket path {path} is longer than 107 "
                                          f"bytes; set MC_RUNTIME_DIR to a shorter directory")
    return path


def listen_private(path: str, backlog: int = 64) -> socket.socket:
    """A listening unix socket at ``path`` (from :func:`private_path`). A socket file
    left by a dead server is replaced; one that a live server answers is not (the
    error names its pid and uid)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            s.bind(path)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(path)
                pid, uid, _ = peer_credentials(probe)
                raise OSError(errno.EADDRINUSE, f"{path} is already served by pid {pid} "
                                                f"(uid {uid}); is another instance running "
                                                f"with the same engine id?") from None
            except (ConnectionRefusedError, FileNotFoundError):
                if path.startswith("\0"):
                    raise OSError(errno.EADDRINUSE, f"{path!r} is taken") from None
                os.unlink(path)             # stale: its server is gone
                s.bind(path)
            finally:
                probe.close()
        if not path.startswith("\0"):          # abstract names have no file
            os.chmod(path, 0o600)
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s


def connect_private(address: str, timeout: float) -> socket.socket:
    """A connection to the unix socket ``address`` whose server is a process of our own
    uid; :class:`PermissionError` naming the squatter otherwise (we never send it a
    byte)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(address)
        pid, uid, _ = peer_credentials(s)
        if uid != os.geteuid():
            raise PermissionError(errno.EACCES, f"the unix socket {address!r} is served by "
                                                f"pid {pid} of uid {uid}, not by our uid "
                                                f"{os.geteuid()}: refusing to talk to it")
    except BaseException:
        s.close()
        raise
    return s

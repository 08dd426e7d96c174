# SPDX-License-Identifier: Apache-2.0
"""The store's process-to-process calls: what Mooncake's master arranges, done here by
the processes that hold the segments (issue 39).

Mooncake Store clients ask a master where to put an object and which replicas to drop;
a client with ``global_segment_size = 0`` writes into segments other processes
contributed. Here there is no master: every store that contributes a segment runs a
small service (:class:`StoreService`, TCP on its ``local_hostname`` host) and lists
itself in a directory record of the metadata store the index lives in
(``mooncake/[<cluster>/]store/<tenant>/services`` -> ``{segment: "host:port"}``). Other
stores call it to

- ``put``: store objects in that process's segment (a client without a segment, and the
  extra replicas of ``replica_num > 1``); the bytes travel in the call;
- ``get``/``size``: read an object a process holds (clients without a segment have no
  pool to read one-sided into);
- ``remove``/``remove_all``: drop that process's copies (a cluster-wide ``remove``);
- ``ping``: ``health_check``.

Wire: one connection per call, ``u64 header length | JSON header | payload`` each way
(the reply header carries ``codes`` or ``error``). The directory record is rewritten by
read-modify-write, so two stores starting at once may drop each other's entry; each
store checks its entry every ``DIRECTORY_CHECK_S`` seconds and puts it back.
Like Mooncake's master, a service takes calls from anyone who can reach its port: bind
``local_hostname`` to an address only the cluster reaches.
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading

from .. import errors as E
from ..metadata.base import key_prefix
from ..metadata.framing import _recv_exact

log = logging.getLogger("mooncake_te.compat.store")

_LEN = struct.Struct("<Q")
_MAX_HEADER = 1 << 24
_MAX_PAYLOAD = 1 << 40
DIRECTORY_CHECK_S = 2.0


def _send(sock, head: dict, payload=b"") -> None:
    raw = json.dumps(head).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw + _LEN.pack(len(payload)))
    if len(payload):
        sock.sendall(payload)


def _recv(sock) -> "tuple[dict, bytes]":
    (hlen,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if hlen > _MAX_HEADER:
        raise ValueError(f"a header of {hlen} bytes")
    head = json.loads(_recv_exact(sock, hlen))
    (plen,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if plen > _MAX_PAYLOAD:
        raise ValueError(f"a payload of {plen} bytes")
    return head, (_recv_exact(sock, plen) if plen else b"")


class ServiceGone(E.TransferError):
    """Nothing listens at a service's address any more (its process ended without
    leaving the directory)."""


def call(addr: str, head: dict, payload=b"", timeout: float = 30.0) -> "tuple[dict, bytes]":
    """One call to the service at ``addr`` (``host:port``): its reply header and payload.

    Raises
    ------
    TransferError
        The service could not be reached or answered with an error.
    """
    host, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
    except ConnectionRefusedError as e:
        raise ServiceGone(f"store service {addr} ({head.get('op')}): {e}") from None
    except (OSError, ValueError) as e:
        raise E.TransferError(f"store service {addr} ({head.get('op')}): {e}") from None
    try:
        with sock as s:
            s.settimeout(timeout)
            _send(s, head, payload)
            rh, rp = _recv(s)
    except (OSError, ValueError, ConnectionError) as e:
        raise E.TransferError(f"store service {addr} ({head.get('op')}): {e}") from None
    if "error" in rh:
        raise E.TransferError(f"store service {addr} ({head.get('op')}): {rh['error']}")
    return rh, rp


class StoreService:
    """Serves ``handler(head, payload) -> (reply head, reply payload)`` on ``host``
    (``port``, or one chosen by the kernel), one thread per connection."""

    def __init__(self, host: str, handler, port: int = 0):
        self._handler = handler
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(fam)
        if port:
            # a fixed port (a real client's) must come back at once after a restart
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self._sock.listen(64)
        port = self._sock.getsockname()[1]
        self.addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="store-service", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), name="store-service-call",
                             daemon=True).start()

    def _one(self, conn) -> None:
        with conn:
            conn.settimeout(60)
            try:
                head, payload = _recv(conn)
            except (OSError, ValueError, ConnectionError) as e:
                log.warning("store service: a bad call: %s", e)
                return
            try:
                rh, rp = self._handler(head, payload)
            except Exception as e:            # the caller learns; this process goes on
                log.error("store service: %s failed: %s: %s", head.get("op"),
                          type(e).__name__, e)
                rh, rp = {"error": f"{type(e).__name__}: {e}"}, b""
            try:
                _send(conn, rh, rp)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)


class Directory:
    """The ``{segment: service address}`` record of one tenant's stores."""

    def __init__(self, kv, tenant: str):
        self.kv = kv
        self.key = f"{key_prefix(getattr(kv, 'cluster_id', None))}store/{tenant}/services"
        self._lock = threading.Lock()

    def services(self) -> dict:
        try:
            raw = self.kv.get(self.key)
            d = json.loads(raw) if raw else {}
            return d if isinstance(d, dict) else {}
        except (ValueError, E.MooncakeError, OSError) as e:
            log.warning("store directory %s unreadable: %s", self.key, e)
            return {}

    def _update(self, fn) -> None:
        with self._lock:
            d = self.services()
            if fn(d):
                self.kv.put(self.key, json.dumps(d, sort_keys=True).encode())

    def add(self, segment: str, addr: str) -> None:
        self._update(lambda d: d.get(segment) != addr and (d.__setitem__(segment, addr) or True))

    def remove(self, segment: str) -> None:
        self._update(lambda d: d.pop(segment, None) is not None)

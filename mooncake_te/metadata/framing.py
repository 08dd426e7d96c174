# SPDX-License-Identifier: Apache-2.0
"""The handshake framing: ``u64 length | u8 type | payload``.

Mooncake's ``SocketHandShakePlugin`` (``include/common.h``) frames every control
message this way with types Connection 0, Metadata 1, Notify 2, Probe 3; the length is
in host order there, we write little-endian explicitly (the same bytes on x86 and ARM
hosts). Replies use the same framing. Frames are bounded by ``MAX_FRAME`` (Mooncake's
``MC_HANDSHAKE_MAX_LENGTH``, 1 MiB by default) so a garbage length cannot make us
allocate gigabytes, and a frame's buffer grows with the bytes that actually arrived (a
header announcing 1 MiB costs nothing until the megabyte is sent). Before a peer has
authenticated, frames are limited to ``PRE_AUTH_MAX_FRAME`` (issue #20 item 5).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import select
import socket
import ssl
import struct
import time

from ..errors import AuthenticationError, MetadataError, ERR_SOCKET

CONNECTION, METADATA, NOTIFY, PROBE = 0, 1, 2, 3
# Ours, outside Mooncake's range: the challenge-response before a request when the
# engines share an auth token, and the reply that refuses a peer.
AUTH, AUTH_FAILED = 10, 11
# Transports' own exchanges (RpcServer.add_handler): the RDMA queue-pair handshake.
RDMA_CONNECT = 20
MAX_FRAME = int(os.environ.get("MC_HANDSHAKE_MAX_LENGTH", 1 << 20))
# The AUTH frames are a few hundred bytes of JSON; nothing larger is read from a peer
# that has not proven the token yet.
PRE_AUTH_MAX_FRAME = 4096
_HDR = struct.Struct("<QB")
# Up to this size a frame is read into one buffer allocated at once; beyond, in chunks
# of this size, so memory follows what the peer sent, not what it announced.
_CHUNK = 64 << 10


def send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(_HDR.pack(len(payload), kind) + payload)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    if n > _CHUNK:
        parts, got = [], 0
        while got < n:
            part = _recv_exact(sock, min(_CHUNK, n - got), deadline)
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    timeout = sock.gettimeout() if deadline is not None else None
    while got < n:
        if deadline is not None:
            # A peer trickling a byte at a time still has to finish by the deadline.
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the peer did not send the whole frame in time")
            sock.settimeout(left if timeout is None else min(left, timeout))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the handshake connection")
        got += k
    return bytes(buf)


def recv_header(sock: socket.socket, deadline: float | None = None) -> tuple[int, int]:
    """(length, type) of the next frame; ``deadline`` is a ``time.monotonic()`` value."""
    return _HDR.unpack(_recv_exact(sock, _HDR.size, deadline))


def recv_payload(sock: socket.socket, length: int, limit: int | None = None,
                 deadline: float | None = None) -> bytes:
    """The payload of a frame whose header announced ``length``; a length above ``limit``
    (default ``MAX_FRAME``) is refused before any of it is read."""
    limit = MAX_FRAME if limit is None else min(limit, MAX_FRAME)
    if length > limit:
        what = "MC_HANDSHAKE_MAX_LENGTH" if limit == MAX_FRAME else \
            "the limit before authentication"
        raise MetadataError(f"handshake frame of {length} bytes exceeds the limit of {limit} "
                            f"({what})", status=ERR_SOCKET)
    return _recv_exact(sock, length, deadline)


def recv_request(sock: socket.socket, idle: float, frame_timeout: float,
                 limit: int | None = None) -> tuple[int, bytes] | None:
    """The next frame of a persistent connection: waits up to ``idle`` seconds for it to
    start, then gives it ``frame_timeout`` seconds to arrive whole (a stalled half
    header does not hold the connection for ever). None when the peer closed cleanly
    between frames; socket.timeout when idle too long or stalled."""
    sock.settimeout(idle)
    first = sock.recv(1)
    if not first:
        return None
    deadline = time.monotonic() + frame_timeout
    length, kind = _HDR.unpack(first + _recv_exact(sock, _HDR.size - 1, deadline))
    payload = recv_payload(sock, length, limit, deadline)
    sock.settimeout(frame_timeout)
    return kind, payload


def recv_frame(sock: socket.socket, limit: int | None = None,
               deadline: float | None = None) -> tuple[int, bytes]:
    """One frame, at most ``limit`` bytes of payload (default ``MAX_FRAME``)."""
    length, kind = recv_header(sock, deadline)
    return kind, recv_payload(sock, length, limit, deadline)


def proof(token: bytes, label: bytes, n1: bytes, n2: bytes) -> bytes:
    """HMAC-SHA256 binding a direction label and both nonces (no token on the wire, and a
    recorded exchange is useless against a fresh nonce)."""
    return hmac.new(token, label + n1 + n2, hashlib.sha256).digest()


RPC_LABELS = (b"mte-rpc-server", b"mte-rpc-client")


def metrics_credential(token: bytes | str) -> str:
    """The bearer credential a scraper sends to a ``/metrics`` guarded by ``token``
    (``Authorization: Bearer <this>``; the engine's and the metadata server's): an HMAC
    of a fixed label with the token, so a scraper's configuration never holds the token
    itself (issue #35)."""
    key = token.encode() if isinstance(token, str) else bytes(token)
    return hmac.new(key, b"mte-metrics-scrape", hashlib.sha256).hexdigest()


def client_auth(sock: socket.socket, token: bytes, where: str,
                labels: tuple[bytes, bytes] = RPC_LABELS) -> None:
    """Prove the token to the server and check that the server knows it too. ``labels``
    name the service (server, client), so a proof for one port is no proof for another."""
    cn = os.urandom(16)
    send_frame(sock, AUTH, json.dumps({"nonce": cn.hex()}).encode())
    kind, raw = recv_frame(sock, PRE_AUTH_MAX_FRAME)
    msg = _json_object(raw)
    if kind != AUTH or "nonce" not in msg:
        raise AuthenticationError(f"{where} does not authenticate peers "
                                  f"({msg.get('reply_msg', 'no challenge')}); both engines need "
                                  f"the same auth_token, or neither")
    try:
        sn = bytes.fromhex(str(msg["nonce"]))
        got = bytes.fromhex(str(msg.get("proof", "")))
    except ValueError:
        raise AuthenticationError(f"{where} sent a malformed challenge") from None
    if not hmac.compare_digest(got, proof(token, labels[0], cn, sn)):
        raise AuthenticationError(f"{where} could not prove the auth token: the engines' "
                                  f"tokens differ")
    send_frame(sock, AUTH, json.dumps({"proof": proof(token, labels[1], sn, cn).hex()})
               .encode())


def _json_object(raw: bytes) -> dict:
    """A JSON object from a peer, or {} for anything else (garbage is not a crash)."""
    try:
        msg = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return msg if isinstance(msg, dict) else {}


def server_auth(sock: socket.socket, token: bytes | None, kind: int, payload: bytes,
                deadline: float | None = None,
                labels: tuple[bytes, bytes] = RPC_LABELS) -> str | None:
    """The server half of :func:`client_auth`, given the client's first frame. None when
    the client proved the token; else the reason, already sent to the client in an
    AUTH_FAILED frame. Every frame read here is at most ``PRE_AUTH_MAX_FRAME``."""
    def refuse(why: str) -> str:
        send_frame(sock, AUTH_FAILED, json.dumps({"reply_msg": why}).encode())
        return why

    if kind != AUTH:
        return refuse("authentication required: this engine has an auth_token; set the "
                      "same token on the peer")
    if not token:
        return refuse("this engine has no auth_token")
    try:
        cn = bytes.fromhex(str(_json_object(payload)["nonce"]))
    except (ValueError, KeyError):
        return refuse("malformed authentication request")
    sn = os.urandom(16)
    send_frame(sock, AUTH, json.dumps({"nonce": sn.hex(),
                                       "proof": proof(token, labels[0], cn, sn).hex()}).encode())
    kind, raw = recv_frame(sock, PRE_AUTH_MAX_FRAME, deadline)
    try:
        got = bytes.fromhex(str(_json_object(raw).get("proof", ""))) if kind == AUTH else b""
    except ValueError:
        got = b""
    if not hmac.compare_digest(got, proof(token, labels[1], sn, cn)):
        return refuse("wrong auth token")
    return None


def request(host: str, port: int, kind: int, payload: bytes, timeout: float,
            token: bytes | None = None) -> bytes:
    """One request/reply exchange with a peer's RPC port (authenticated with ``token``)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if token:
                client_auth(s, token, f"{host}:{port}")
            send_frame(s, kind, payload)
            # An engine answers in milliseconds; silence (redis, etcd) may mean something
            # else listens there: ask what, so the caller hears it at once, not at timeout.
            if not select.select([s], [], [], min(0.25, timeout))[0]:
                _not_an_rpc_port(host, port, timeout)
            rkind, reply = recv_frame(s)
            if rkind == AUTH_FAILED:
                raise AuthenticationError(f"{host}:{port} refused the request: "
                                          f"{_json_object(reply).get('reply_msg', '')}")
            return reply
    except MetadataError:                 # a reply that is no frame (HTTP, TLS alerts)
        _not_an_rpc_port(host, port, timeout)
        raise
    except (OSError, ConnectionError) as e:
        if not isinstance(e, ConnectionRefusedError):
            _not_an_rpc_port(host, port, timeout)
        raise MetadataError(f"cannot reach the RPC port of {host}:{port} ({e}); is the peer "
                            f"engine running and is the address reachable from here?",
                            status=ERR_SOCKET, errno=getattr(e, "errno", None)) from None


def _not_an_rpc_port(host: str, port: int, timeout: float) -> None:
    """Raise a MetadataError naming the service at ``host:port`` when it is HTTP, redis,
    etcd or TLS rather than an engine's RPC port (e.g. a metadata server's address given to
    ``open_segment``); return when it cannot tell. Probes on a fresh connection: an
    HTTP/1.0 request, which redis answers ``-ERR`` and etcd with its version JSON (an engine
    drops it: the first 9 bytes make an impossible frame length), then a TLS handshake."""
    what = None
    limit = min(1.0, timeout)
    head = b""
    try:
        with socket.create_connection((host, port), timeout=limit) as s:
            s.sendall(b"GET /version HTTP/1.0\r\n\r\n")
            while len(head) < 4096:         # HTTP/1.0: the server closes after the body
                more = s.recv(4096)
                head += more
                if not more or not head.startswith(b"HTTP/"):
                    break
    except OSError:         # timed out or reset (TLS servers): what we got so far tells
        pass
    try:
        if head.startswith(b"HTTP/"):
            what = "an etcd server" if b'"etcdserver"' in head else "an HTTP server"
        elif head[:1] in (b"-", b"+") or head.startswith(b"$"):
            what = "a redis server"
        elif head[:2] in (b"\x15\x03", b"\x16\x03"):
            what = "a TLS server"
        elif not head:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            with socket.create_connection((host, port), timeout=limit) as raw, \
                    ctx.wrap_socket(raw, server_hostname=host):
                what = "a TLS server"
    except (OSError, ssl.SSLError):
        pass
    if what:
        raise MetadataError(
            f"{host}:{port} is {what}, not a transfer engine's RPC port: give the peer "
            f"engine's name (its host:rpc_port, TransferEngine.name); a metadata server's "
            f"address belongs in metadata=", status=ERR_SOCKET)

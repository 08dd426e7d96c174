# SPDX-License-Identifier: Apache-2.0
"""The handshake framing: ``u64 length | u8 type | payload``.

Mooncake's ``SocketHandShakePlugin`` (``include/common.h``) frames every control
message this way with types Connection 0, Metadata 1, Notify 2, Probe 3; the length is
in host order there, we write little-endian explicitly (the same bytes on x86 and ARM
hosts). Replies use the same framing. Frames are bounded by ``MAX_FRAME`` (Mooncake's
``MC_HANDSHAKE_MAX_LENGTH``, 1 MiB by default) so a garbage length cannot make us
allocate gigabytes.
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

from ..errors import AuthenticationError, MetadataError, ERR_SOCKET

CONNECTION, METADATA, NOTIFY, PROBE = 0, 1, 2, 3
# Ours, outside Mooncake's range: the challenge-response before a request when the
# engines share an auth token, and the reply that refuses a peer.
AUTH, AUTH_FAILED = 10, 11
# Transports' own exchanges (RpcServer.add_handler): the RDMA queue-pair handshake.
RDMA_CONNECT = 20
MAX_FRAME = int(os.environ.get("MC_HANDSHAKE_MAX_LENGTH", 1 << 20))
_HDR = struct.Struct("<QB")


def send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(_HDR.pack(len(payload), kind) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the handshake connection")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    length, kind = _HDR.unpack(_recv_exact(sock, _HDR.size))
    if length > MAX_FRAME:
        raise MetadataError(f"handshake frame of {length} bytes exceeds the limit of {MAX_FRAME} "
                            f"(MC_HANDSHAKE_MAX_LENGTH)", status=ERR_SOCKET)
    return kind, _recv_exact(sock, length)


def proof(token: bytes, label: bytes, n1: bytes, n2: bytes) -> bytes:
    """HMAC-SHA256 binding a direction label and both nonces (no token on the wire, and a
    recorded exchange is useless against a fresh nonce)."""
    return hmac.new(token, label + n1 + n2, hashlib.sha256).digest()


def client_auth(sock: socket.socket, token: bytes, where: str) -> None:
    """Prove the token to the server and check that the server knows it too."""
    cn = os.urandom(16)
    send_frame(sock, AUTH, json.dumps({"nonce": cn.hex()}).encode())
    kind, raw = recv_frame(sock)
    msg = json.loads(raw) if raw else {}
    if kind != AUTH or "nonce" not in msg:
        raise AuthenticationError(f"{where} does not authenticate peers "
                                  f"({msg.get('reply_msg', 'no challenge')}); both engines need "
                                  f"the same auth_token, or neither")
    sn = bytes.fromhex(msg["nonce"])
    if not hmac.compare_digest(bytes.fromhex(msg.get("proof", "")),
                               proof(token, b"mte-rpc-server", cn, sn)):
        raise AuthenticationError(f"{where} could not prove the auth token: the engines' "
                                  f"tokens differ")
    send_frame(sock, AUTH, json.dumps({"proof": proof(token, b"mte-rpc-client", sn, cn).hex()})
               .encode())


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
                                          f"{json.loads(reply).get('reply_msg', '')}")
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

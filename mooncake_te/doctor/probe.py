# SPDX-License-Identifier: Apache-2.0
"""Ask a TCP endpoint which protocol it speaks: redis, etcd or plain HTTP.

A metadata server that "refuses connections" is often running, just not the one the
config names: ``server_type = "redis"`` pointed at etcd's 2379, or ``"http"`` at etcd
(Mooncake issues #16 and #391). So the doctor does not stop at "the port is open": it
speaks each protocol's simplest request and reads the answer.

- redis: ``PING`` in RESP (``*1\\r\\n$4\\r\\nPING\\r\\n``); the answer is ``+PONG``, or
  ``-NOAUTH ...``/``-WRONGPASS`` when a password is set (RESP spec, redis.io/docs/reference/
  protocol-spec). Both prove redis.
- etcd: ``GET /version`` over HTTP/1.1 on the client port, which etcd serves next to gRPC
  (etcd v3 API docs, "gRPC gateway"); the body is ``{"etcdserver": "3.x", ...}``.
- HTTP: any ``HTTP/1.x`` status line. redis answers an HTTP request with a RESP error
  (``-ERR ...``) before closing, so the HTTP probe names redis too.
"""
from __future__ import annotations

import json
import socket
import ssl
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit


@dataclass
class ProbeResult:
    """What answered at ``host:port``.

    Attributes
    ----------
    kind : str or None
        ``"redis"``, ``"etcd"``, ``"http"``, ``"unknown"`` (something answered, in no
        protocol we know), or None when nothing could be reached.
    detail : str
        Version, status line or the OS error, for messages.
    """

    host: str
    port: int
    kind: "str | None"
    detail: str = ""
    reachable: bool = True


def _exchange(host: str, port: int, payload: bytes, timeout: float, tls: bool = False) -> bytes:
    """Connect, send, and read until the peer closes, 64 KiB, or the timeout."""
    with socket.create_connection((host, port), timeout=timeout) as raw:
        s = raw
        if tls:
            # Only to learn which protocol answers; the engine's own client verifies
            # certificates. An unverified context keeps a self-signed test setup probeable.
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            s = ctx.wrap_socket(raw, server_hostname=host)
        s.settimeout(timeout)
        s.sendall(payload)
        chunks = []
        total = 0
        while total < 65536:
            try:
                b = s.recv(4096)
            except socket.timeout:
                break
            if not b:
                break
            chunks.append(b)
            total += len(b)
            data = b"".join(chunks)
            # Enough to decide: a full RESP line, or HTTP headers plus a short body.
            if data[:1] in (b"+", b"-") and b"\r\n" in data:
                break
            if data.startswith(b"HTTP/") and b"\r\n\r\n" in data:
                head, _, body = data.partition(b"\r\n\r\n")
                clen = _content_length(head)
                if clen is not None and len(body) >= clen:
                    break
        return b"".join(chunks)


def _content_length(head: bytes) -> "int | None":
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


def _classify(data: bytes) -> tuple["str | None", str]:
    if data.startswith(b"+PONG"):
        return "redis", "PONG"
    if data[:1] in (b"-", b"+"):
        line = data.split(b"\r\n", 1)[0].decode(errors="replace")
        if line.startswith(("-NOAUTH", "-WRONGPASS")):
            return "redis", f"{line} (set MC_REDIS_PASSWORD)"
        return "redis", line
    if data.startswith(b"HTTP/"):
        head, _, body = data.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].decode(errors="replace")
        try:
            doc = json.loads(body.decode(errors="replace") or "null")
        except ValueError:
            doc = None
        if isinstance(doc, dict) and "etcdserver" in doc:
            return "etcd", f"etcd {doc['etcdserver']}"
        return "http", status
    if not data:
        return None, "no answer"
    return "unknown", repr(data[:40])


def probe_redis(host: str, port: int, timeout: float, tls: bool = False) -> tuple["str | None", str]:
    return _classify(_exchange(host, port, b"*1\r\n$4\r\nPING\r\n", timeout, tls))


def probe_http(host: str, port: int, timeout: float, tls: bool = False,
               path: str = "/version") -> tuple["str | None", str]:
    req = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: mooncake-te-doctor\r\n"
           f"Accept: */*\r\nConnection: close\r\n\r\n").encode()
    return _classify(_exchange(host, port, req, timeout, tls))


def identify(host: str, port: int, timeout: float = 1.5, expect: "str | None" = None,
             tls: bool = False) -> ProbeResult:
    """Find out what listens at ``host:port``.

    Parameters
    ----------
    expect : str, optional
        The protocol the config claims; its probe runs first, so a healthy server costs
        one round trip.

    Returns
    -------
    ProbeResult
        ``reachable`` False (and ``kind`` None) when the connection itself fails:
        refused, unreachable, timed out, or a name that does not resolve.
    """
    order = ["http", "redis"] if expect in ("etcd", "http") else ["redis", "http"]
    detail = ""
    seen_answer = False
    for proto in order:
        try:
            kind, detail = (probe_redis if proto == "redis" else probe_http)(host, port, timeout,
                                                                              tls)
        except socket.gaierror as e:
            return ProbeResult(host, port, None, f"cannot resolve {host!r}: {e.strerror or e}",
                               reachable=False)
        except (socket.timeout, TimeoutError):
            if not seen_answer and proto == order[0]:
                # Nothing accepted the connection in time: a firewall drop or a host that
                # is down. Do not try a second protocol for another timeout.
                return ProbeResult(host, port, None, f"no connection within {timeout:g} s",
                                   reachable=False)
            continue
        except ssl.SSLError as e:
            seen_answer = True
            detail = f"TLS handshake failed: {e.reason or e}"
            continue
        except OSError as e:
            if not seen_answer:
                return ProbeResult(host, port, None, e.strerror or str(e), reachable=False)
            continue
        seen_answer = True
        if kind in ("redis", "etcd", "http"):
            return ProbeResult(host, port, kind, detail)
    if detail in ("", "no answer"):
        detail = (f"it accepts connections but answered neither a redis PING nor an HTTP "
                  f"request within {timeout:g} s")
    return ProbeResult(host, port, "unknown" if seen_answer else None, detail, reachable=True)


DEFAULT_PORTS = {"etcd": 2379, "redis": 6379, "http": 8080}


class Endpoint(NamedTuple):
    host: str
    port: int
    path: str
    tls: bool = False


def parse_endpoints(server_type: str, address: str) -> list[Endpoint]:
    """``[Endpoint(host, port, path, tls)]`` for a config's metadata address.

    etcd takes a comma list (``h1:2379,h2:2379``); each part may carry ``http://``.
    redis takes ``host:port[/db]`` or ``redis://...``. HTTP takes a URL or ``host:port``
    (path ``/metadata``, as Mooncake's HTTP metadata server serves).

    Raises
    ------
    ValueError
        The address has no host, or a port that is not a number in range.
    """
    parts = [p.strip() for p in address.split(",")] if server_type == "etcd" else [address.strip()]
    out = []
    for part in parts:
        if not part:
            continue
        url = urlsplit(part if "://" in part else f"//{part}")
        host = url.hostname
        try:
            port = url.port
        except ValueError:
            raise ValueError(f"{part!r}: the port is not a number from 1 to 65535") from None
        if not host:
            raise ValueError(f"{part!r} names no host")
        if port is None:
            port = 443 if url.scheme == "https" else DEFAULT_PORTS.get(server_type, 80)
        path = url.path or ("/metadata" if server_type == "http" else "")
        out.append(Endpoint(host, port, path, url.scheme in ("https", "rediss")))
    if not out:
        raise ValueError("the address is empty")
    return out

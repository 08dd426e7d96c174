# SPDX-License-Identifier: Apache-2.0
"""``http://host:port/metadata``: segment descriptors in an HTTP key-value server.

The protocol is Mooncake's (``transfer_metadata_plugin.cpp`` HTTP plugin and
``mooncake_http_metadata_server``): ``GET/PUT/DELETE <url>?key=<urlencoded key>``, 200
on success, 404 with the text ``metadata not found`` for a missing key. It works
against Mooncake's own servers and against ``mooncake-te metadata-server``
(:mod:`mooncake_te.metadata.server`), which also honours a per-key TTL that this client
asks for in the ``X-Mooncake-TTL`` request header and confirms in the reply. Mooncake's
servers ignore the header (keys then live until deleted; a warning says so).

With an ``auth_token`` (the engine's, or ``MC_AUTH_TOKEN``) every request is signed
(``X-MTE-Auth``, over the method, path, query, key, TTL and body; see
:mod:`mooncake_te.metadata.server`) and every reply must carry the server's signature:
an unsigned reply (a server without authentication, or something else answering on
the path) is an ``AuthenticationError``, unless the metadata URL says ``?auth=off``
(an unauthenticating server such as Mooncake's, whose replies are then trusted
unsigned; the engines' handshake still proves each peer's name).

Mooncake's rule "one segment name, one ``rpc_meta``" holds on our server whatever the
TTL: an engine restarted under its old name, whose dead predecessor's key has not
expired yet, checks that the old RPC port no longer answers, deletes the stale key and
publishes its own. A live engine under that name is an error naming both.

Client: ``requests`` (keep-alive session; the ``[http]`` extra).
"""
from __future__ import annotations

import base64
import hmac
import json
import logging
import os
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit, urlencode

from ...errors import AuthenticationError, MetadataError, ERR_SOCKET
from ..http_protocol import AUTH_HEADER, MAX_BATCH, NOT_FOUND_TEXT, SERVER_HEADER, TTL_HEADER
from ._leased import LeasedStore, is_rpc_meta, port_hint, split_options, ttl_from

try:
    import requests as _requests
except ImportError:     # pragma: no cover - depends on the installed extras
    _requests = None

log = logging.getLogger("mooncake_te.metadata")


class HttpStore(LeasedStore):
    """Segment descriptors in an HTTP metadata server.

    Parameters
    ----------
    scheme : str
        ``"http"`` or ``"https"``.
    rest : str
        ``host:port[/path][?ttl=seconds]``; the path defaults to ``/metadata``.
    """

    kind = "http"

    def __init__(self, scheme: str, rest: str, cluster_id: str | None = None,
                 timeout: float = 3.0, token: bytes | None = None):
        if _requests is None:
            raise MetadataError("metadata='http://...' needs the requests library: "
                                "pip install 'requests>=2.28' (or '.[http]' in a mooncake_te clone)")
        base, options = split_options(rest)
        ttl = ttl_from(options)
        auth = options.pop("auth", "on").lower()
        if auth not in ("on", "off"):
            raise MetadataError(f"metadata URL option auth={auth!r}: use auth=off for a "
                                f"server that does not sign its replies, or leave it out")
        #: replies must be signed when this client has a token (auth=off: trusted unsigned)
        self._require_signed = auth == "on"
        u = urlsplit(f"{scheme}://{base}")
        try:
            self.port = u.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise MetadataError(f"HTTP metadata address {base!r} has an invalid port; "
                                f"use http://host:8080/metadata") from None
        if not u.hostname:
            raise MetadataError(f"HTTP metadata address {scheme}://{base} has no host; "
                                f"use http://host:8080/metadata")
        self.host = u.hostname
        path = u.path if u.path not in ("", "/") else "/metadata"
        rest_q = urlencode(options)
        self.url = urlunsplit((scheme, u.netloc, path, rest_q, ""))
        super().__init__(urlunsplit((scheme, u.netloc, path, "", "")), ttl, cluster_id)
        self._session = _requests.Session()
        # Mooncake's libcurl client: 1.5 s to connect, 3 s per request (reference §5).
        self._timeout = (min(1.5, timeout), timeout)
        self._ttl_warned = False
        self._batch: "bool | None" = None     # whether the server has the batch route
        token = token or os.environ.get("MC_AUTH_TOKEN", "").encode() or None
        self._token = token.encode() if isinstance(token, str) else token

    # -- requests & errors -----------------------------------------------------------------
    def _request(self, method: str, key: str, data: bytes | None = None,
                 headers: dict | None = None, path: str = ""):
        if path:        # a route below the metadata path (the batch read), no key
            u = urlsplit(self.url)
            url = urlunsplit((u.scheme, u.netloc, u.path.rstrip("/") + path, u.query, ""))
        else:
            sep = "&" if "?" in self.url else "?"
            url = f"{self.url}{sep}{urlencode({'key': key})}"
        headers, nonce = self._signed(method, key, url, data, headers)
        try:
            with self._lock:
                resp = self._session.request(method, url, data=data, headers=headers,
                                             timeout=self._timeout)
            if nonce is not None:
                self._check_reply(method, key, nonce, resp)
            return resp
        except _requests.exceptions.ConnectionError as e:
            text = str(e)
            why = ("connection refused: is the metadata server running there? "
                   "(start one with `mooncake-te metadata-server --port PORT`)"
                   if "refused" in text.lower() else
                   f"{type(e).__name__}: {' '.join(text.split())[:200]}")
            if "BadStatusLine" in text or "RemoteDisconnected" in text:
                why += "; the port answered, but not in HTTP (a redis port? use redis://)"
            raise MetadataError(f"HTTP metadata server {self.address}: {method} {key!r} "
                                f"failed: {why}.{port_hint('http', self.port)}",
                                status=ERR_SOCKET) from None
        except _requests.exceptions.RequestException as e:
            raise MetadataError(f"HTTP metadata server {self.address}: {method} {key!r} "
                                f"failed: {type(e).__name__}: {e}.{port_hint('http', self.port)}",
                                status=ERR_SOCKET) from None

    def _signed(self, method: str, key: str, url: str, data: "bytes | None",
                headers: "dict | None") -> tuple:
        """``(headers, nonce)``: ``headers`` with this client's request MAC added when it
        has a token, and the nonce the reply must be signed with (None: no token)."""
        if not self._token:
            return headers, None
        from ..server import canonical_target, sign_request
        headers = dict(headers or {})
        u = urlsplit(url)
        target = canonical_target(unquote(u.path), parse_qsl(u.query, keep_blank_values=True))
        headers[AUTH_HEADER] = sign_request(self._token, method, key,
                                            headers.get(TTL_HEADER, ""), data or b"",
                                            target=target)
        return headers, headers[AUTH_HEADER].split()[2]

    def batch_read_request(self, keys: list) -> tuple:
        """``(url, body, headers, nonce)`` of one batch read of ``keys`` (at most
        ``MAX_BATCH``), for a caller with its own HTTP client (the conductor asks from its
        event loop); pass the reply to :meth:`check_batch_reply`."""
        u = urlsplit(self.url)
        url = urlunsplit((u.scheme, u.netloc, u.path.rstrip("/") + "/batch", u.query, ""))
        body = json.dumps({"get": list(keys)}).encode()
        headers, nonce = self._signed("POST", "", url, body,
                                      {"Content-Type": "application/json"})
        return url, body, headers, nonce

    def check_batch_reply(self, nonce: "str | None", status: int, headers, content: bytes,
                          n: int) -> list:
        """The values of a batch read's reply (see :meth:`batch_read_request`), its
        signature checked when this client has a token; raises :class:`MetadataError`
        (or :class:`AuthenticationError`) otherwise."""
        from types import SimpleNamespace
        resp = SimpleNamespace(status_code=status, headers=headers, content=content)
        if nonce is not None:
            self._check_reply("POST", "", nonce, resp)
        if status != 200:
            raise MetadataError(f"HTTP metadata server {self.address}: a batch read of {n} "
                                f"keys answered HTTP {status}", status=ERR_SOCKET)
        try:
            values = json.loads(content)["values"]
            if len(values) != n:
                raise ValueError
            return [None if v is None else base64.b64decode(v) for v in values]
        except (ValueError, KeyError, TypeError):
            raise MetadataError(f"HTTP metadata server {self.address}: a batch read of "
                                f"{n} keys got a malformed answer", status=ERR_SOCKET) from None

    def _check_reply(self, method: str, key: str, nonce: str, resp) -> None:
        """A client with a token believes only replies signed with it (issue 35: an
        unsigned reply used to be accepted, so anything answering on the path could
        hand out forged descriptors or report keys missing). A 401 is let through
        unsigned: it only ever makes the call fail (``_unexpected``)."""
        from ..server import sign_reply
        mac = resp.headers.get(AUTH_HEADER)
        if mac is None:
            if not self._require_signed or resp.status_code == 401:
                return
            raise AuthenticationError(
                f"HTTP metadata server {self.address}: the reply to {method} {key!r} "
                f"(HTTP {resp.status_code}) is not signed, and this engine has an "
                f"auth_token: start the server with the same token (`mooncake-te "
                f"metadata-server --auth-token-file FILE` or MC_AUTH_TOKEN), or, for a "
                f"server that cannot sign (Mooncake's), add '?auth=off' to the metadata "
                f"URL to trust its replies unsigned", status=ERR_SOCKET)
        if not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), sign_reply(
                self._token, nonce, resp.status_code, resp.content).encode()):
            raise AuthenticationError(
                f"HTTP metadata server {self.address}: the reply to {method} {key!r} "
                f"is not signed with this engine's auth_token (a different token on "
                f"the server, or something on the path altered it)", status=ERR_SOCKET)

    def _unexpected(self, method: str, key: str, resp) -> MetadataError:
        body = " ".join(resp.text.split())[:120]
        msg = (f"HTTP metadata server {self.address}: {method} {key!r} answered "
               f"HTTP {resp.status_code} ({body!r}).")
        if resp.status_code == 404:
            msg += self._why_404()
        elif resp.status_code == 400 and "rpc_meta" in key:
            # Mooncake's servers refuse a second PUT of an rpc_meta key (Mooncake PR
            # #2311); _put_rpc_meta only gets here when the holder is alive.
            msg += (" The server refuses to replace an rpc_meta key, and the engine it "
                    "names is alive: give this engine another segment name, or stop "
                    "that engine.")
        elif resp.status_code in (401, 403):
            msg += (" The server authenticates requests: give this engine the server's "
                    "auth_token (TransferEngine(auth_token=...), [transfer_engine] auth_token "
                    "or MC_AUTH_TOKEN)." if not self._token else
                    " The server refused this engine's auth_token: the tokens differ, or the "
                    "clocks are more than a minute apart.")
            return AuthenticationError(msg, status=ERR_SOCKET)
        elif resp.status_code in (413, 507):
            msg += " The server's size limits refused the value (see docs/security.md)."
        return MetadataError(msg, status=ERR_SOCKET)

    def _why_404(self) -> str:
        """A 404 not from a metadata server: find out what answers at this port."""
        root = urlunsplit((urlsplit(self.url).scheme, urlsplit(self.url).netloc, "/version", "", ""))
        try:
            with self._lock:
                r = self._session.get(root, timeout=self._timeout)
            if r.ok and "etcdserver" in r.text:
                return (f" This is an etcd server (its /version says {r.text.strip()[:80]}), "
                        f"not an HTTP metadata server: use metadata='etcd://{self.host}:"
                        f"{self.port}' (server_type = \"etcd\").")
        except Exception:
            pass
        return (f" Nothing serves the metadata route {urlsplit(self.url).path!r} there: check "
                f"the path (Mooncake's servers use /metadata) and the port." +
                port_hint("http", self.port))

    def _is_missing(self, resp) -> bool:
        return resp.status_code == 404 and (SERVER_HEADER in resp.headers
                                            or NOT_FOUND_TEXT in resp.text)

    # -- KeyValueBackend ---------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        resp = self._request("GET", key)
        if resp.status_code == 200:
            return resp.content
        if self._is_missing(resp):
            return None
        raise self._unexpected("GET", key, resp)

    def keys(self, prefix: str) -> list[str]:
        """``GET /metadata/keys?prefix=`` (our server; Mooncake's has no listing)."""
        u = urlsplit(self.url)
        url = urlunsplit((u.scheme, u.netloc, u.path.rstrip("/") + "/keys",
                          urlencode({"prefix": prefix}), ""))
        headers = {}
        nonce = None
        if self._token:
            # The signature covers the listing's own path and query (the server checks
            # what it was sent), and the reply must be signed (issue 37: the listing was
            # signed for /metadata and every token-holding conductor got 401).
            from ..server import canonical_target, sign_request
            v = urlsplit(url)
            headers[AUTH_HEADER] = sign_request(
                self._token, "GET", "", "", b"",
                target=canonical_target(unquote(v.path),
                                        parse_qsl(v.query, keep_blank_values=True)))
            nonce = headers[AUTH_HEADER].split()[2]
        try:
            with self._lock:
                resp = self._session.get(url, headers=headers, timeout=self._timeout)
        except _requests.exceptions.RequestException as e:
            raise MetadataError(f"HTTP metadata server {self.address}: listing {prefix!r} "
                                f"failed: {type(e).__name__}: {e}", status=ERR_SOCKET) from None
        if nonce is not None:
            self._check_reply("GET", f"/keys?prefix={prefix}", nonce, resp)
        if resp.status_code != 200:
            raise self._unexpected("GET", f"/keys?prefix={prefix}", resp)
        try:
            return sorted(str(k) for k in resp.json())
        except ValueError:
            raise MetadataError(f"HTTP metadata server {self.address}: the key listing is "
                                f"not JSON (a Mooncake server? it cannot list keys)",
                                status=ERR_SOCKET) from None

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """One ``POST /metadata/batch`` per ``MAX_BATCH`` keys where the server is ours
        (halved while the server says the reply would be too big: 413);
        key by key where it is not (Mooncake's servers have no batch route: the first
        refusal is remembered)."""
        if self._batch is False or not keys:
            return [self.get(k) for k in keys]
        out: list[bytes | None] = []
        pending = [keys[i:i + MAX_BATCH] for i in range(0, len(keys), MAX_BATCH)]
        while pending:
            chunk = pending.pop(0)
            body = json.dumps({"get": chunk}).encode()
            resp = self._request("POST", "", data=body, path="/batch")
            if resp.status_code != 200 and not out and SERVER_HEADER not in resp.headers:
                self._batch = False           # not our server: no batch route there
                return [self.get(k) for k in keys]
            if resp.status_code == 413 and len(chunk) > 1:
                # The reply would pass the server's max_batch_reply: halve the batch.
                half = len(chunk) // 2
                pending[:0] = [chunk[:half], chunk[half:]]
                continue
            if resp.status_code == 413:
                out.append(self.get(chunk[0]))    # one big value: the plain GET
                continue
            if resp.status_code != 200:
                raise self._unexpected("POST", f"/batch of {len(chunk)} keys", resp)
            try:
                values = resp.json()["values"]
                if len(values) != len(chunk):
                    raise ValueError
                out.extend(None if v is None else base64.b64decode(v) for v in values)
            except (ValueError, KeyError, TypeError):
                raise MetadataError(f"HTTP metadata server {self.address}: a batch read of "
                                    f"{len(chunk)} keys got a malformed answer",
                                    status=ERR_SOCKET) from None
            self._batch = True
        return out

    def _batch_write(self, puts: dict, dels: list) -> bool:
        """One batch route call; False where the server has no batch route."""
        if self._batch is False:
            return False
        body = json.dumps({"put": {k: base64.b64encode(v).decode() for k, v in puts.items()},
                           "delete": dels}).encode()
        resp = self._request("POST", "", data=body, path="/batch")
        if resp.status_code != 200 and SERVER_HEADER not in resp.headers:
            self._batch = False
            return False
        if resp.status_code != 200:
            raise self._unexpected("POST", f"/batch of {len(puts) + len(dels)} keys", resp)
        self._batch = True
        return True

    def put_many(self, items: dict[str, bytes]) -> None:
        items = dict(items)
        keys = list(items)
        for i in range(0, len(keys), MAX_BATCH):
            chunk = {k: items[k] for k in keys[i:i + MAX_BATCH]}
            if not self._batch_write(chunk, []):
                for k, v in chunk.items():
                    self.put(k, v)

    def delete_many(self, keys: list[str]) -> None:
        keys = list(dict.fromkeys(keys))
        for i in range(0, len(keys), MAX_BATCH):
            chunk = keys[i:i + MAX_BATCH]
            if not self._batch_write({}, chunk):
                for k in chunk:
                    self.delete(k)

    def put(self, key: str, value: bytes, headers: dict | None = None) -> None:
        resp = self._request("PUT", key, data=value, headers=headers)
        if resp.status_code != 200:
            raise self._unexpected("PUT", key, resp)
        if headers and TTL_HEADER in headers and TTL_HEADER not in resp.headers \
                and not self._ttl_warned:
            self._ttl_warned = True
            log.warning("the HTTP metadata server %s does not support key TTLs (Mooncake's "
                        "servers do not): a killed engine stays listed until its keys are "
                        "deleted; `mooncake-te metadata-server` supports them", self.address)

    def delete(self, key: str) -> None:
        resp = self._request("DELETE", key)
        if resp.status_code != 200 and not self._is_missing(resp):
            raise self._unexpected("DELETE", key, resp)

    def _put_leased(self, key: str, value: bytes) -> None:
        if is_rpc_meta(key):
            self._put_rpc_meta(key, value)
        else:
            self.put(key, value, headers={TTL_HEADER: f"{self.ttl:g}"})

    def _put_rpc_meta(self, key: str, value: bytes) -> None:
        """PUT ``rpc_meta`` without a TTL, as Mooncake's engine writes it: Mooncake's
        HTTP server refuses any second PUT of the key, so it is written once and never
        renewed (the segment's liveness is its ``ram`` key's TTL). A refusal is only an
        error when the key names an engine that is alive: the same value is ours
        already, and an address where nothing listens is a dead engine's leftover
        (a SIGKILLed engine cannot delete it), replaced here."""
        resp = self._request("PUT", key, data=value)
        if resp.status_code == 200:
            return
        if resp.status_code != 400:
            raise self._unexpected("PUT", key, resp)
        if self.get(key) == value:
            return                       # ours already (republished after a restart)
        if not self._replace_stale_rpc_meta(key, value):
            raise self._unexpected("PUT", key, resp)
        resp = self._request("PUT", key, data=value)
        if resp.status_code != 200:
            raise self._unexpected("PUT", key, resp)

    def _replace_stale_rpc_meta(self, key: str, value: bytes) -> bool:
        """Another ``rpc_meta`` holds our name: True (after deleting it) when the engine it
        names is gone (its RPC port does not answer), so that a restarted engine takes
        its name back without waiting for the old key's TTL."""
        from .. import framing
        old = self.get(key)
        if old is None:
            return True                  # expired meanwhile
        try:
            info = json.loads(old)
            host, port = str(info["ip_or_host_name"]), int(info["rpc_port"])
        except (ValueError, KeyError, TypeError):
            return False
        try:
            framing.request(host, port, framing.PROBE, b"", 1.0, self._token)
        except AuthenticationError:
            return False                 # something answers there: alive
        except MetadataError:
            log.info("segment name of %s was held by a dead engine at %s:%d; replacing its "
                     "stale key", key, host, port)
            self.delete(key)
            return True
        return False

    def _renew(self, records: dict[str, bytes]) -> None:
        # Re-PUT the ram keys, not a bare "touch": a server restarted without
        # persistence gets every live engine back within one renewal period. rpc_meta
        # is not re-written (see _put_rpc_meta); it is only put back when it is gone.
        for key, value in records.items():
            if not is_rpc_meta(key):
                self._put_leased(key, value)
            elif self.get(key) is None:
                self._put_rpc_meta(key, value)

    def _close_client(self) -> None:
        self._session.close()

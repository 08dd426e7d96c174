# SPDX-License-Identifier: Apache-2.0
"""The HTTP metadata server (``mooncake-te metadata-server``).

Wire-compatible with Mooncake's ``mooncake_http_metadata_server``
(``mooncake-wheel/mooncake/http_metadata_server.py``, reference §5):
``GET/PUT/DELETE /metadata?key=<key>``, 200 on success, 400 without a key, 404 with the
text ``metadata not found`` for a missing key, and a second *different* ``rpc_meta``
value for one segment name refused with 400 (Mooncake PR #2311), so Mooncake's C++
engines can use it unchanged. Beyond Mooncake:

* **TTL.** A PUT may carry ``X-Mooncake-TTL: <seconds>``; the key then disappears that
  long after its last PUT (mooncake_te engines re-PUT every TTL/3, so a killed engine
  vanishes within one TTL). The reply repeats the header to confirm. A key with a TTL
  may be replaced by a different value (a restarted engine under the same name); the
  duplicate-``rpc_meta`` rule above applies whatever the TTL header says (issue #20 item
  8: a TTL must not be a way around it); a restarted engine replaces its dead
  predecessor's ``rpc_meta`` by deleting it first (:mod:`.stores.http` does that after
  checking that the old RPC port no longer answers). A TTL is a finite number of
  seconds, at most ``MAX_TTL``.
* **Persistence** (``--persist FILE``): every change is written (temporary file, fsync,
  rename, fsync of the directory) before the reply, so a restart does not lose every
  segment (Mooncake issue #2246). The writing happens off the event loop and
  concurrent changes share one write, so a big store does not stall renewals. Keys with
  a TTL get a fresh TTL when loaded: their engines, if alive, renew them; if dead, they
  expire one TTL later. A persistence file that is empty, truncated or unreadable stops
  the server with an error naming it; a missing directory is created.
* **Limits**: a value may be at most ``max_value`` bytes (413), all keys and values
  together at most ``quota`` bytes (507); see docs/security.md.
* **Authentication** (optional, ``--auth-token-file`` or ``MC_AUTH_TOKEN``): every
  ``/metadata`` request must carry ``X-MTE-Auth: v2 <time> <nonce> <hmac>``, an
  HMAC-SHA256 with the engines' ``auth_token`` over the method, the path and query
  (decoded, query pairs sorted: :func:`canonical_target`), key, TTL header, body hash,
  time and nonce; a request older than ``AUTH_WINDOW`` seconds or a nonce seen before
  is refused (401), so a recorded request cannot be replayed, nor sent to another route.
  Replies carry an HMAC over the request's nonce, the status and the body hash, which a
  client with a token requires (an unsigned reply is refused unless the metadata URL
  says ``?auth=off``). The token never crosses the wire. Mooncake's C++ engines do not
  sign: leave authentication off where they share the server.
* ``GET /health`` (JSON: status, key count, bytes used, uptime, persistence file; open
  without authentication for liveness probes, but with a token only ``status`` and
  ``auth`` unless the request carries the metrics credential); ``GET /metrics`` needs,
  with a token, ``Authorization: Bearer <framing.metrics_credential(token)>`` and ``GET /metadata/keys[?prefix=...]`` (JSON list of keys).
* ``POST /metadata/batch``, several keys in one round trip (at most ``MAX_BATCH``):
  ``{"get": [key, ...]}`` answers ``{"values": [base64 value or null, ...]}``, at most
  ``max_batch_reply`` bytes of values (413 beyond, naming the limit: ask for fewer keys
  per batch, or GET big values one by one), encoded off the event loop when large so
  lease renewals are answered meanwhile;
  ``{"put": {key: base64 value}, "delete": [key, ...]}`` (a re-put keeps the key's TTL,
  a new key has none; the limits and the
  ``rpc_meta`` rule as for single PUTs; deletes first, then puts, one persistence write)
  answers ``{"stored": n, "deleted": n}``, or the first refusal's status with what was
  refused (the keys before it are stored). The KV cache's owner index reads and writes
  a prompt's blocks this way. Signed like the other ``/metadata`` requests (empty key,
  the JSON as body).

Built on aiohttp, as Mooncake's server is.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import math
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlencode

from ..errors import MetadataError
from .http_protocol import AUTH_HEADER, MAX_BATCH, NOT_FOUND_TEXT, SERVER_HEADER, TTL_HEADER
from ..metrics.metadata import ServerCounters
from ..metrics.prometheus import track

try:
    from aiohttp import web
except ImportError:     # pragma: no cover - depends on the installed extras
    web = None

log = logging.getLogger("mooncake_te.metadata.server")

#: largest accepted value (--max-value-bytes); a descriptor of thousands of buffers is
#: well under a megabyte
MAX_VALUE = 64 << 20
#: all keys and values together (--quota-bytes)
QUOTA = 1 << 30
#: bytes each key costs beyond its key and value (the entry, the dict slot)
KEY_OVERHEAD = 128
#: longest accepted TTL, seconds
MAX_TTL = 365 * 86400.0
#: a signed request is accepted this many seconds either side of the server's clock
AUTH_WINDOW = 60.0
#: most bytes of (base64) values one batch read answers (``max_batch_reply``): a small
#: request naming one big key many times must not build a reply of gigabytes (issue 35,
#: item 7)
MAX_BATCH_REPLY = 16 << 20
#: a batch body or reply past this many bytes is parsed / encoded in a worker thread,
#: so the event loop keeps answering renewals meanwhile
_OFFLOAD_BYTES = 256 << 10
#: the signature scheme of ``X-MTE-Auth`` (v2: covers the path and the query)
AUTH_VERSION = "v2"
#: how often expired keys are swept (a GET also checks its key's deadline)
SWEEP_INTERVAL = 0.5
_FILE_VERSION = 1


def _require_aiohttp():
    if web is None:
        raise MetadataError("the HTTP metadata server needs aiohttp: "
                            "pip install 'aiohttp>=3.9' (or '.[http]' in a mooncake_te clone)")


@dataclass
class _Entry:
    value: bytes
    ttl: float | None = None          # seconds, None = kept until deleted
    deadline: float | None = None     # time.monotonic() after which it is gone
    b64: bytes | None = None          # the value as persisted, computed once by the writer

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


# put() outcomes
STORED, UNCHANGED, DUPLICATE, TOO_LARGE, OVER_QUOTA = range(5)
#: put(ttl=KEEP_TTL): a re-put keeps the key's TTL (the batch route has no TTL field)
KEEP_TTL = -1.0


def parse_ttl(raw: str) -> float:
    """The seconds in an ``X-Mooncake-TTL`` header: finite, positive, at most MAX_TTL."""
    ttl = float(raw)          # ValueError for text
    if not (math.isfinite(ttl) and 0 < ttl <= MAX_TTL):
        raise ValueError(raw)
    return ttl


def _body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def canonical_target(path: str, query) -> str:
    """The request target a signature covers, as both ends see it: the percent-decoded
    path, then the decoded query pairs sorted and re-encoded (so that the client's
    encoding and the server's parsing cannot differ). ``query``: (name, value) pairs."""
    return f"{path}?{urlencode(sorted((str(k), str(v)) for k, v in query))}"


def sign_request(token: bytes, method: str, key: str, ttl: str, body: bytes,
                 when: int | None = None, nonce: str | None = None,
                 target: str | None = None) -> str:
    """The ``X-MTE-Auth`` header value for one request (the client half). ``target``:
    :func:`canonical_target` of the URL sent; by default ``/metadata?key=<key>``."""
    when = int(time.time()) if when is None else when
    nonce = nonce or os.urandom(16).hex()
    if target is None:
        target = canonical_target("/metadata", [("key", key)] if key else [])
    mac = hmac.new(token, "\n".join(("mte-http-req", AUTH_VERSION, method.upper(), target,
                                      key, ttl, str(when), nonce,
                                      _body_hash(body))).encode(),
                   hashlib.sha256).hexdigest()
    return f"{AUTH_VERSION} {when} {nonce} {mac}"


def sign_reply(token: bytes, nonce: str, status: int, body: bytes) -> str:
    return hmac.new(token, "\n".join(("mte-http-resp", nonce, str(status),
                                      _body_hash(body))).encode(), hashlib.sha256).hexdigest()


class _Nonces:
    """Nonces seen within the authentication window, to refuse replays."""

    def __init__(self):
        self._seen: dict[str, float] = {}

    def fresh(self, nonce: str, now: float) -> bool:
        if len(self._seen) > 4096:
            self._seen = {n: t for n, t in self._seen.items() if t > now - 2 * AUTH_WINDOW}
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True


_BATCH_USAGE = ('a batch is JSON {"get": [key, ...]} or {"put": {key: base64 value}, '
                '"delete": [key, ...]} with non-empty string keys')


def _parse_batch(raw: bytes) -> "tuple[list | None, dict, list] | str":
    """(gets, puts decoded, deletes) of a batch body, or the usage text when malformed."""
    try:
        body = json.loads(raw)
        gets = body.get("get")
        puts = body.get("put") or {}
        dels = body.get("delete") or []
        if gets is not None and (puts or dels):
            raise TypeError
        ok = (isinstance(puts, dict) and isinstance(dels, list)
              and all(isinstance(k, str) and k.strip() for k in [*puts, *dels])
              and all(isinstance(v, str) for v in puts.values())
              and (gets is None or (isinstance(gets, list)
                                    and all(isinstance(k, str) for k in gets))))
        if not ok:
            raise TypeError
        values = {k: base64.b64decode(v, validate=True) for k, v in puts.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return _BATCH_USAGE
    return gets, values, dels


class KeyStore:
    """The server's keys, with TTLs and optional persistence to a JSON file.

    Parameters
    ----------
    persist_path : str, optional
        File holding every key; loaded at start and rewritten after every change. Its
        directory is created when missing; one that cannot be written to is an error
        here, at start, not at the first PUT.
    max_value, quota : int
        Largest value, and all keys and values together (plus ``KEY_OVERHEAD`` each).
    """

    def __init__(self, persist_path: str | None = None, max_value: int = MAX_VALUE,
                 quota: int = QUOTA):
        self.persist_path = os.path.abspath(persist_path) if persist_path else None
        self.max_value, self.quota = int(max_value), int(quota)
        self.used = 0                      # bytes counted against the quota
        self._entries: dict[str, _Entry] = {}
        if self.persist_path:
            self._check_directory()
            if os.path.exists(self.persist_path):
                self._load()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _cost(key: str, value: bytes) -> int:
        return len(key.encode("utf-8", "surrogatepass")) + len(value) + KEY_OVERHEAD

    def _drop(self, key: str) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used -= self._cost(key, entry.value)
        return entry

    def _check_directory(self) -> None:
        directory = os.path.dirname(self.persist_path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".metadata-probe-", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise MetadataError(f"cannot use the metadata persistence file "
                                f"{self.persist_path!r}: its directory {directory!r} cannot be "
                                f"created or written ({e.strerror or e}); pick a writable "
                                f"path for --persist") from None

    # -- operations (called from the event loop only, so no lock is needed) -------------
    def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expired(time.monotonic()):
            self._drop(key)
            return None
        return entry.value

    def put(self, key: str, value: bytes, ttl: float | None) -> int:
        """Store; returns STORED (persistence is due), UNCHANGED (a renewal), or the
        refusal: DUPLICATE, TOO_LARGE, OVER_QUOTA. ``ttl``: seconds, None (kept until
        deleted), or KEEP_TTL (the live key's own TTL, renewed; none for a new key)."""
        now = time.monotonic()
        old = self._entries.get(key)
        if old is not None and old.expired(now):
            self._drop(key)
            old = None
        # Mooncake PR #2311, whatever the TTL header says: one name, one rpc_meta.
        if old is not None and "rpc_meta" in key and old.value != value:
            return DUPLICATE
        if ttl == KEEP_TTL:
            ttl = old.ttl if old is not None else None
        if len(value) > self.max_value:
            return TOO_LARGE
        grow = self._cost(key, value) - (self._cost(key, old.value) if old else 0)
        if grow > 0 and self.used + grow > self.quota:
            return OVER_QUOTA
        deadline = None if ttl is None else now + ttl
        changed = old is None or old.value != value or old.ttl != ttl
        self._entries[key] = _Entry(value, ttl, deadline, None if changed else old.b64)
        self.used += grow
        return STORED if changed else UNCHANGED

    def delete(self, key: str) -> bool:
        entry = self._drop(key)
        return entry is not None and not entry.expired(time.monotonic())

    def keys(self, prefix: str = "") -> list[str]:
        now = time.monotonic()
        return sorted(k for k, e in self._entries.items()
                      if k.startswith(prefix) and not e.expired(now))

    def sweep(self) -> int:
        now = time.monotonic()
        dead = [k for k, e in self._entries.items() if e.expired(now)]
        for k in dead:
            self._drop(k)
        return len(dead)

    # -- persistence --------------------------------------------------------------------
    def snapshot(self) -> list:
        """The entries as they are now: a list of (key, entry), cheap to take on the event
        loop (entries are replaced, never changed, so the writer can encode them later)."""
        return list(self._entries.items())

    def save(self, items: list | None = None) -> None:
        """Write the keys atomically: a crash leaves the old file or the new, never half.
        Runs off the event loop (in an executor thread) for a snapshot taken on it."""
        if not self.persist_path:
            return
        items = self.snapshot() if items is None else items
        directory = os.path.dirname(self.persist_path)
        fd, tmp = tempfile.mkstemp(prefix=".metadata-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                # "count" lets a load tell a complete file from one cut short. Written in
                # bytes, value by value: no copy of the whole store is ever built, and the
                # GIL is free while the kernel takes each piece.
                f.write(f'{{"version": {_FILE_VERSION}, "saved_at": {time.time()!r}, '
                        f'"count": {len(items)}, "keys": {{'.encode())
                for i, (key, e) in enumerate(items):
                    if e.b64 is None:
                        e.b64 = base64.b64encode(e.value)
                    f.write(f'{"," if i else ""}{json.dumps(key)}: {{"value": "'.encode())
                    f.write(e.b64)
                    f.write(f'", "ttl": {json.dumps(e.ttl)}}}'.encode())
                f.write(b"}}")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.persist_path)
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)           # the rename itself survives a power cut
            finally:
                os.close(dfd)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _load(self) -> None:
        path = self.persist_path
        try:
            with open(path, "rb") as f:
                raw = f.read()
            if not raw.strip():
                # A file this server wrote is never empty (even with no keys); an empty
                # one was truncated (a full disk, a copy gone wrong). Starting empty would
                # silently drop every segment.
                raise ValueError(f"the file is empty ({len(raw)} bytes) but this server "
                                 f"never writes an empty file: it was truncated")
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != _FILE_VERSION:
                raise ValueError(f"unknown version {doc.get('version') if isinstance(doc, dict) else doc!r}")
            keys = doc.get("keys")
            if not isinstance(keys, dict):
                raise ValueError("it has no 'keys' object")
            if "count" in doc and doc["count"] != len(keys):
                raise ValueError(f"it lists {len(keys)} keys but was written with "
                                 f"{doc['count']}: it was cut short")
            now = time.monotonic()
            for key, item in keys.items():
                ttl = item.get("ttl")
                if ttl is not None:
                    # json reads NaN and Infinity: such a key would never expire.
                    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
                        raise ValueError(f"key {key!r} has TTL {ttl!r}, not a number")
                    try:
                        ttl = parse_ttl(repr(float(ttl)))
                    except (ValueError, OverflowError):
                        raise ValueError(f"key {key!r} has TTL {ttl!r}; a TTL is finite, "
                                         f"above 0 and at most {MAX_TTL:g} s (edit or "
                                         f"delete the key in the file)") from None
                value = base64.b64decode(item["value"], validate=True)
                self._entries[str(key)] = _Entry(value, ttl, None if ttl is None else now + ttl,
                                                 item["value"].encode())
                self.used += self._cost(str(key), value)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise MetadataError(f"cannot load the metadata persistence file {path!r}: {e}. "
                                f"The server does not start without its keys: restore the "
                                f"file from a backup, or move it away to start empty") from None
        log.info("loaded %d keys from %s", len(self._entries), path)


class MetadataServer:
    """An aiohttp application serving a :class:`KeyStore`.

    Parameters
    ----------
    host, port : str, int
        Where to listen; port 0 picks a free one (see :attr:`port` after start).
    persist_path : str, optional
        Persistence file (see :class:`KeyStore`).
    max_value, quota : int
        Limits of one value and of the whole store, bytes (see :class:`KeyStore`).
    max_batch_reply : int
        Most bytes of (base64) values one batch read answers (413 beyond).
    token : bytes or str, optional
        Require signed requests (``X-MTE-Auth``) made with this ``auth_token``.

    Examples
    --------
    >>> srv = MetadataServer("127.0.0.1", 0).start()      # in a background thread
    >>> url = srv.url          # 'http://127.0.0.1:PORT/metadata'
    >>> srv.stop()
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 8080,
                 persist_path: str | None = None, max_value: int = MAX_VALUE,
                 quota: int = QUOTA, token: bytes | str | None = None,
                 max_batch_reply: int = MAX_BATCH_REPLY):
        _require_aiohttp()
        self.host = host
        self.port = port
        self.max_batch_reply = int(max_batch_reply)
        self.store = KeyStore(persist_path, max_value, quota)
        self.token = token.encode() if isinstance(token, str) else (token or None)
        self.auth_failures = 0
        self._nonces = _Nonces()
        self.started = time.time()
        self._version = 0                 # changes made
        self._saved = 0                   # changes on disk
        self._saved_cond: asyncio.Condition | None = None
        self._writer = None               # the task writing the file
        self._writing = False             # ... while it runs
        self._save_error: BaseException | None = None
        self._runner = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._sweeper = None
        self._counters = ServerCounters()       # stats(), /metrics (docs/observability.md)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metadata"

    # -- the application ----------------------------------------------------------------
    def app(self):
        # The body limit: the largest value, plus room so that one just over it gets
        # our 413 with the limit named rather than aiohttp's.
        app = web.Application(client_max_size=self.store.max_value + 1,
                              middlewares=[self._counters.middleware(), self._middleware()])
        app.router.add_get("/metrics", self._counters.handle_metrics)
        app.router.add_route("*", "/metadata", self._handle_metadata)
        app.router.add_get("/metadata/keys", self._handle_keys)
        app.router.add_post("/metadata/batch", self._handle_batch)
        app.router.add_get("/health", self._handle_health)
        return app

    @staticmethod
    def _reply(text: str, status: int = 200, headers: dict | None = None, body=None):
        h = {SERVER_HEADER: "mooncake_te"}
        if headers:
            h.update(headers)
        if body is not None:
            return web.Response(body=body, status=status, headers=h,
                                content_type="application/json")
        return web.Response(text=text, status=status, headers=h,
                            content_type="application/json")

    # -- authentication -------------------------------------------------------------------
    def _middleware(self):
        @web.middleware
        async def authenticate(request, handler):
            return await self._authenticate(request, handler)
        return authenticate

    def _scraper(self, request) -> bool:
        """The request carries the metrics credential (``Authorization: Bearer``)."""
        from .framing import metrics_credential
        got = request.headers.get("Authorization", "")
        return self.token is not None and hmac.compare_digest(
            got.encode(), f"Bearer {metrics_credential(self.token)}".encode())

    async def _authenticate(self, request, handler):
        if self.token is not None and request.path == "/metrics" and \
                not self._scraper(request):
            # Issue #35: key counts, request rates and peers' traffic are not for anyone
            # who reaches the port; a scraper sends the credential derived from the token.
            self.auth_failures += 1
            return self._reply("this metadata server has an auth_token: scrape /metrics with "
                               "Authorization: Bearer <metrics credential> (see "
                               "docs/observability.md)", 401)
        if self.token is None or not request.path.startswith("/metadata"):
            return await handler(request)
        raw = request.headers.get(AUTH_HEADER, "")
        parts = raw.split()
        body = await request.read()
        why = None
        if len(parts) != 4 or not parts[0].startswith("v"):
            why = (f"authentication required: this metadata server has an auth_token; sign "
                   f"requests with the same token ({AUTH_HEADER} header)")
        elif parts[0] != AUTH_VERSION:
            why = (f"request signed with scheme {parts[0]!r}, which this server no longer "
                   f"accepts (it does not cover the path and query); upgrade the client to "
                   f"a mooncake_te that signs {AUTH_VERSION!r}")
        else:
            _, when, nonce, mac = parts
            want = sign_request(self.token, request.method, request.query.get("key", ""),
                                request.headers.get(TTL_HEADER, ""), body,
                                int(when) if when.isdigit() else 0, nonce,
                                canonical_target(request.path,
                                                 request.query.items())).split()[3]
            if not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), want.encode()):
                why = "wrong auth token (the request's signature does not check out)"
            elif abs(time.time() - int(when)) > AUTH_WINDOW:
                why = (f"signed request is {time.time() - int(when):+.0f} s off this server's "
                       f"clock (window {AUTH_WINDOW:g} s): check the clocks")
            elif not self._nonces.fresh(nonce, time.time()):
                why = "replayed request (its nonce was seen before)"
        if why is not None:
            self.auth_failures += 1
            log.warning("refused %s %s from %s: %s", request.method, request.path_qs,
                        request.remote, why)
            return self._reply(why, 401)
        resp = await handler(request)
        resp.headers[AUTH_HEADER] = sign_reply(self.token, parts[2], resp.status,
                                               resp.body or b"")
        return resp

    # -- persistence ----------------------------------------------------------------------
    async def _persist(self) -> None:
        """Returns once the changes made so far are on disk. Concurrent callers share one
        write (group commit); the file is encoded and written in an executor thread, so
        the loop keeps answering (renewals included) however big the store is."""
        if not self.store.persist_path:
            return
        self._version += 1
        mine = self._version
        started = False
        async with self._saved_cond:
            while self._saved < mine:
                if not self._writing:
                    if started:
                        raise MetadataError(f"cannot write the persistence file "
                                            f"{self.store.persist_path!r}: {self._save_error}")
                    started, self._writing, self._save_error = True, True, None
                    self._writer = asyncio.ensure_future(self._write_loop())
                await self._saved_cond.wait()

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._saved < self._version:
                target, items = self._version, self.store.snapshot()
                with self._counters.persist_timer():
                    await loop.run_in_executor(None, self.store.save, items)
                async with self._saved_cond:
                    self._saved = target
                    self._saved_cond.notify_all()
        except Exception as e:
            self._save_error = e
            log.error("writing %s failed: %s", self.store.persist_path, e)
        finally:
            async with self._saved_cond:
                self._writing = False
                self._saved_cond.notify_all()

    def stats(self) -> dict:
        """``keys``, ``requests`` ({(method, status): count}), ``persist`` (histogram of
        persistence writes in seconds), ``url``."""
        return self._counters.stats(len(self.store), self.url)

    async def _handle_metadata(self, request):
        key = request.query.get("key", "").strip()
        if not key:
            return self._reply("metadata key is required", 400)
        if request.method == "GET":
            value = self.store.get(key)
            if value is None:
                return self._reply(NOT_FOUND_TEXT, 404)
            return self._reply("", body=value)
        if request.method == "PUT":
            ttl = None
            raw_ttl = request.headers.get(TTL_HEADER)
            if raw_ttl is not None:
                try:
                    ttl = parse_ttl(raw_ttl)
                except ValueError:
                    return self._reply(f"{TTL_HEADER} must be a finite number of seconds, "
                                       f"above 0 and at most {MAX_TTL:g}, got {raw_ttl!r}", 400)
            if request.content_length is not None and \
                    request.content_length > self.store.max_value:
                return self._too_large(request.content_length)
            value = await request.read()
            outcome = self.store.put(key, value, ttl)
            if outcome == DUPLICATE:
                return self._reply("Duplicate rpc_meta key not allowed", 400)
            if outcome == TOO_LARGE:
                return self._too_large(len(value))
            if outcome == OVER_QUOTA:
                return self._reply(
                    f"metadata store full: {self.store.used} of {self.store.quota} bytes used, "
                    f"this value needs {len(value)}; delete unused keys or raise "
                    f"--quota-bytes", 507)
            if outcome == STORED:
                try:
                    await self._persist()
                except MetadataError as e:
                    return self._reply(str(e), 500)
            headers = {TTL_HEADER: f"{ttl:g}"} if ttl is not None else None
            return self._reply("metadata updated", headers=headers)
        if request.method == "DELETE":
            if not self.store.delete(key):
                return self._reply(NOT_FOUND_TEXT, 404)
            try:
                await self._persist()
            except MetadataError as e:
                return self._reply(str(e), 500)
            return self._reply("metadata deleted")
        return self._reply("Method not allowed", 405)

    def _too_large(self, n: int):
        return self._reply(f"value of {n} bytes exceeds the limit of {self.store.max_value} "
                           f"bytes (--max-value-bytes)", 413)

    async def _handle_keys(self, request):
        keys = self.store.keys(request.query.get("prefix", ""))
        return self._reply("", body=json.dumps(keys).encode())

    async def _handle_batch(self, request):
        raw = await request.read()
        if len(raw) > _OFFLOAD_BYTES:       # a big body: decode it off the event loop
            parsed = await asyncio.get_running_loop().run_in_executor(
                None, _parse_batch, raw)
        else:
            parsed = _parse_batch(raw)
        if isinstance(parsed, str):
            return self._reply(parsed, 400)
        gets, values, dels = parsed
        n = len(gets) if gets is not None else len(values) + len(dels)
        if n > MAX_BATCH:
            return self._reply(f"a batch asks for at most {MAX_BATCH} keys, this one for "
                               f"{n}: split it", 413)
        if gets is not None:
            return await self._batch_read(gets)
        values = {k.strip(): v for k, v in values.items()}
        deleted = sum(1 for k in dels if self.store.delete(k.strip()))
        stored, refused = 0, None
        for key, value in values.items():
            # No TTL field in a batch: a re-put keeps the key's TTL (a batch used to strip
            # it, so a leased key written through a batch never expired; issue 35).
            outcome = self.store.put(key, value, KEEP_TTL)
            if outcome in (STORED, UNCHANGED):
                stored += 1
                continue
            refused = {DUPLICATE: (400, f"{key!r}: Duplicate rpc_meta key not allowed"),
                       TOO_LARGE: (413, f"{key!r}: value of {len(value)} bytes exceeds the "
                                        f"limit of {self.store.max_value} bytes"),
                       OVER_QUOTA: (507, f"{key!r}: metadata store full ({self.store.used} "
                                         f"of {self.store.quota} bytes used)")}[outcome]
            break
        if deleted or stored:
            try:
                await self._persist()
            except MetadataError as e:
                return self._reply(str(e), 500)
        if refused is not None:
            return self._reply(f"{refused[1]}; {stored} stored before it", refused[0])
        return self._reply("", body=json.dumps({"stored": stored,
                                                "deleted": deleted}).encode())

    async def _batch_read(self, gets: list):
        """The values of ``gets``, bounded by ``max_batch_reply`` (issue 35, item 7: a
        709-byte request naming one big key many times built a 533 MiB reply and held
        the event loop 20 s, so engines' lease renewals timed out)."""
        got, size = [], 0
        for k in gets:
            v = self.store.get(k.strip())
            got.append(v)
            if v is not None:
                size += 4 * ((len(v) + 2) // 3) + 4          # base64 and its quotes
                if size > self.max_batch_reply:
                    return self._reply(
                        f"a batch read of {len(gets)} keys would answer more than "
                        f"{self.max_batch_reply} bytes of values (the limit, reached at "
                        f"key {len(got)}, {k.strip()!r}): ask for fewer keys per batch, or "
                        f"GET big values one by one (GET /metadata?key=...)", 413)

        def encode() -> bytes:
            return json.dumps({"values": [
                None if v is None else base64.b64encode(v).decode() for v in got]}).encode()

        if size > _OFFLOAD_BYTES:         # encode off the loop: renewals keep flowing
            body = await asyncio.get_running_loop().run_in_executor(None, encode)
        else:
            body = encode()
        return self._reply("", body=body)

    async def _handle_health(self, request):
        if self.token is not None and not self._scraper(request):
            # Open for liveness probes, but with a token it tells no more than that.
            return self._reply("", body=json.dumps({"status": "ok", "auth": True}).encode())
        return self._reply("", body=json.dumps({
            "status": "ok", "keys": len(self.store.keys()), "bytes": self.store.used,
            "quota": self.store.quota, "auth": self.token is not None,
            "uptime_s": round(time.time() - self.started, 3),
            "persist": self.store.persist_path}).encode())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            try:
                if self.store.sweep():
                    await self._persist()
            except Exception:       # a failing disk must not stop expiry
                log.exception("expiring keys failed")

    # -- running ------------------------------------------------------------------------
    async def start_async(self) -> "MetadataServer":
        """Listen on the running loop (for embedding in an asyncio program)."""
        self._saved_cond = asyncio.Condition()
        track("metadata_server", self)
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host=self.host, port=self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._sweeper = asyncio.ensure_future(self._sweep_forever())
        log.info("metadata server listening on %s (persist: %s)", self.url,
                 self.store.persist_path or "off")
        return self

    async def stop_async(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._saved_cond is not None and self.store.persist_path:
            await self._persist()

    def start(self) -> "MetadataServer":
        """Serve from a background thread; returns once the port is listening."""
        ready = threading.Event()
        error: list = []

        def run():
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.start_async())
            except BaseException as e:
                error.append(e)
                ready.set()
                self._loop.close()
                return
            ready.set()
            try:
                self._loop.run_forever()
                self._loop.run_until_complete(self.stop_async())
            finally:
                self._loop.close()
                self._stopped.set()

        self._thread = threading.Thread(target=run, name="mte-metadata-server", daemon=True)
        self._thread.start()
        ready.wait()
        if error:
            raise MetadataError(f"metadata server cannot listen on {self.host}:{self.port}: "
                                f"{error[0]}") from None
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def serve_forever(self, announce=None) -> None:
        """Serve in this thread until SIGINT/SIGTERM (the command-line entry point)."""
        async def main():
            await self.start_async()
            if announce:
                announce(self)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            try:
                await stop.wait()
            finally:
                await self.stop_async()
        asyncio.run(main())

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
  duplicate-``rpc_meta`` rule above applies to keys without one.
* **Persistence** (``--persist FILE``): every change is written (temporary file, fsync,
  rename) before the reply, so a restart does not lose every segment (Mooncake issue
  #2246). Keys with a TTL get a fresh TTL when loaded: their engines, if alive, renew
  them; if dead, they expire one TTL later.
* ``GET /health`` (JSON: status, key count, uptime, persistence file) and
  ``GET /metadata/keys[?prefix=...]`` (JSON list of keys, for operators' tooling).

Built on aiohttp, as Mooncake's server is.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass

from ..errors import MetadataError
from ..metrics.metadata import ServerCounters
from ..metrics.prometheus import track

try:
    from aiohttp import web
except ImportError:     # pragma: no cover - depends on the installed extras
    web = None

log = logging.getLogger("mooncake_te.metadata.server")

TTL_HEADER = "X-Mooncake-TTL"
SERVER_HEADER = "X-Mooncake-Metadata-Server"
NOT_FOUND_TEXT = "metadata not found"
#: largest accepted value; a descriptor of thousands of buffers is well under this
MAX_VALUE = 64 << 20
#: how often expired keys are swept (a GET also checks its key's deadline)
SWEEP_INTERVAL = 0.5
_FILE_VERSION = 1


def _require_aiohttp():
    if web is None:
        raise MetadataError("the HTTP metadata server needs aiohttp: "
                            "pip install mooncake-te[http]")


@dataclass
class _Entry:
    value: bytes
    ttl: float | None = None          # seconds, None = kept until deleted
    deadline: float | None = None     # time.monotonic() after which it is gone

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class KeyStore:
    """The server's keys, with TTLs and optional persistence to a JSON file.

    Parameters
    ----------
    persist_path : str, optional
        File holding every key; loaded at start and rewritten after every change.
    """

    def __init__(self, persist_path: str | None = None):
        self.persist_path = os.path.abspath(persist_path) if persist_path else None
        self._entries: dict[str, _Entry] = {}
        if self.persist_path and os.path.exists(self.persist_path):
            self._load()

    def __len__(self) -> int:
        return len(self._entries)

    # -- operations (called from the event loop only, so no lock is needed) -------------
    def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expired(time.monotonic()):
            del self._entries[key]
            return None
        return entry.value

    def put(self, key: str, value: bytes, ttl: float | None) -> tuple[bool, bool]:
        """Store; return (accepted, changed) where changed means persistence is due."""
        now = time.monotonic()
        old = self._entries.get(key)
        if old is not None and old.expired(now):
            old = None
        if (old is not None and old.ttl is None and ttl is None and "rpc_meta" in key
                and old.value != value):
            return False, False
        deadline = None if ttl is None else now + ttl
        changed = old is None or old.value != value or old.ttl != ttl
        self._entries[key] = _Entry(value, ttl, deadline)
        return True, changed

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        return entry is not None and not entry.expired(time.monotonic())

    def keys(self, prefix: str = "") -> list[str]:
        now = time.monotonic()
        return sorted(k for k, e in self._entries.items()
                      if k.startswith(prefix) and not e.expired(now))

    def sweep(self) -> int:
        now = time.monotonic()
        dead = [k for k, e in self._entries.items() if e.expired(now)]
        for k in dead:
            del self._entries[k]
        return len(dead)

    # -- persistence --------------------------------------------------------------------
    def snapshot(self) -> bytes:
        return json.dumps({
            "version": _FILE_VERSION,
            "saved_at": time.time(),
            "keys": {k: {"value": base64.b64encode(e.value).decode(), "ttl": e.ttl}
                     for k, e in self._entries.items()},
        }).encode()

    def save(self, data: bytes | None = None) -> None:
        """Write the keys atomically: a crash leaves the old file or the new, never half."""
        if not self.persist_path:
            return
        data = self.snapshot() if data is None else data
        directory = os.path.dirname(self.persist_path)
        fd, tmp = tempfile.mkstemp(prefix=".metadata-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.persist_path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _load(self) -> None:
        try:
            with open(self.persist_path, "rb") as f:
                doc = json.loads(f.read() or b"{}")
            if doc and doc.get("version") != _FILE_VERSION:
                raise ValueError(f"unknown version {doc.get('version')!r}")
            now = time.monotonic()
            for key, item in (doc.get("keys") or {}).items():
                ttl = item.get("ttl")
                ttl = None if ttl is None else float(ttl)
                self._entries[str(key)] = _Entry(base64.b64decode(item["value"], validate=True),
                                                 ttl, None if ttl is None else now + ttl)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise MetadataError(f"cannot load the metadata persistence file "
                                f"{self.persist_path!r}: {e}; move it away to start empty") from None
        log.info("loaded %d keys from %s", len(self._entries), self.persist_path)


class MetadataServer:
    """An aiohttp application serving a :class:`KeyStore`.

    Parameters
    ----------
    host, port : str, int
        Where to listen; port 0 picks a free one (see :attr:`port` after start).
    persist_path : str, optional
        Persistence file (see :class:`KeyStore`).

    Examples
    --------
    >>> srv = MetadataServer("127.0.0.1", 0).start()      # in a background thread
    >>> url = srv.url          # 'http://127.0.0.1:PORT/metadata'
    >>> srv.stop()
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 8080,
                 persist_path: str | None = None):
        _require_aiohttp()
        self.host = host
        self.port = port
        self.store = KeyStore(persist_path)
        self.started = time.time()
        self._save_lock: asyncio.Lock | None = None
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
        app = web.Application(client_max_size=MAX_VALUE,
                              middlewares=[self._counters.middleware()])
        app.router.add_get("/metrics", self._counters.handle_metrics)
        app.router.add_route("*", "/metadata", self._handle_metadata)
        app.router.add_get("/metadata/keys", self._handle_keys)
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

    async def _persist(self) -> None:
        if not self.store.persist_path:
            return
        data = self.store.snapshot()          # taken on the loop: a consistent view
        async with self._save_lock:
            with self._counters.persist_timer():
                await asyncio.get_running_loop().run_in_executor(None, self.store.save, data)

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
                    ttl = float(raw_ttl)
                    if not ttl > 0:
                        raise ValueError
                except ValueError:
                    return self._reply(f"{TTL_HEADER} must be a positive number of seconds, "
                                       f"got {raw_ttl!r}", 400)
            value = await request.read()
            ok, changed = self.store.put(key, value, ttl)
            if not ok:
                return self._reply("Duplicate rpc_meta key not allowed", 400)
            if changed:
                await self._persist()
            headers = {TTL_HEADER: f"{ttl:g}"} if ttl is not None else None
            return self._reply("metadata updated", headers=headers)
        if request.method == "DELETE":
            if not self.store.delete(key):
                return self._reply(NOT_FOUND_TEXT, 404)
            await self._persist()
            return self._reply("metadata deleted")
        return self._reply("Method not allowed", 405)

    async def _handle_keys(self, request):
        keys = self.store.keys(request.query.get("prefix", ""))
        return self._reply("", body=json.dumps(keys).encode())

    async def _handle_health(self, request):
        return self._reply("", body=json.dumps({
            "status": "ok", "keys": len(self.store.keys()),
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
        self._save_lock = asyncio.Lock()
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
        if self._save_lock is not None and self.store.persist_path:
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

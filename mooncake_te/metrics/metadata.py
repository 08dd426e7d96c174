# SPDX-License-Identifier: Apache-2.0
"""Counters of the HTTP metadata server (``mooncake_te.metadata.server``): requests by
method and status, persistence time; the server adds them with three lines and serves
/metrics beside /metadata."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from .cells import BUCKET_BOUNDS


class ServerCounters:
    """Requests by (method, status) and a histogram of persistence writes."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict = {}
        self._persist = [0] * len(BUCKET_BOUNDS)
        self._persist_sum = 0.0

    def middleware(self):
        """An aiohttp middleware counting every request by method and status."""
        from aiohttp import web

        @web.middleware
        async def count(request, handler):
            status = 500
            try:
                resp = await handler(request)
                status = resp.status
                return resp
            except web.HTTPException as e:
                status = e.status
                raise
            finally:
                key = (request.method, str(status))
                with self._lock:
                    self.requests[key] = self.requests.get(key, 0) + 1
        return count

    @contextmanager
    def persist_timer(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            k = next(i for i, b in enumerate(BUCKET_BOUNDS) if dt <= b)
            with self._lock:
                self._persist[k] += 1
                self._persist_sum += dt

    def stats(self, keys: int, url: str) -> dict:
        with self._lock:
            cum, buckets = 0, []
            for bound, n in zip(BUCKET_BOUNDS, self._persist):
                cum += n
                buckets.append((bound, cum))
            return {"url": url, "keys": keys, "requests": dict(self.requests),
                    "persist": {"count": cum, "sum_s": self._persist_sum, "buckets": buckets}}

    async def handle_metrics(self, request):
        """GET /metrics: the process's registry (this server and anything else tracked)."""
        from aiohttp import web
        try:
            from prometheus_client import CONTENT_TYPE_LATEST
            from .prometheus import exposition
        except ModuleNotFoundError:
            from .prometheus import MISSING
            return web.Response(status=501, text=MISSING)
        return web.Response(body=exposition(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

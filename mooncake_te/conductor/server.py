# SPDX-License-Identifier: Apache-2.0
"""The conductor's HTTP front (aiohttp): OpenAI routes in, vLLM instances behind.

Per request (``/v1/completions``, ``/v1/chat/completions``):

1. bearer token checked (when ``api_key`` is set); the client's ``kv_transfer_params``
   dropped;
2. prompt tokenized with the served model's tokenizer, block keys computed as the
   connector does, the reusable prefix on each instance found (:class:`.Cluster`);
3. plain instances only (no decode instances): the cheapest by expected TTFT gets the
   request as it is. With decode instances: the cheapest prefill instance gets a copy
   with ``max_tokens: 1`` and ``{"do_remote_decode": true}``; the decode instance with
   most room gets the request with the ``kv_transfer_params`` the prefill answered;
4. an instance that fails before its first byte (connection refused, timeout, 5xx; 429
   and 503 mean full) is marked and the request goes once to the next one; after the
   first byte the answer streams through as it arrives; a client that leaves closes the
   upstream connection, which vLLM takes as an abort.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .cluster import Cluster
from .metrics import Counters, parse_vllm_metrics
from .registry import list_instances

log = logging.getLogger("mooncake_te.conductor")

ROUTES = ("/v1/completions", "/v1/chat/completions")


class UpstreamError(Exception):
    """An instance failed before its first byte (``status``: what the client gets)."""

    def __init__(self, msg: str, status: int = 502):
        super().__init__(msg)
        self.status = status


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    tokenizer: str = ""
    health_interval_s: float = 2.0
    # Health checks that time out (an API server busy behind a prefill) before an
    # instance counts as down; a refused connection or an error status counts at once.
    down_after_slow_checks: int = 3
    discovery_interval_s: float = 2.0
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    cooldown_s: float = 1.0
    # "cost" (expected TTFT, the default); "round_robin" and "least_loaded" are the
    # baselines benchmarks/conductor_ttft.py compares against, on the same front.
    policy: str = "cost"
    extra: dict = field(default_factory=dict)


def _tokenizer(name: str):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise RuntimeError("the conductor tokenizes prompts with transformers: pip install "
                           "transformers (or mooncake-te[conductor])") from None
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:
        raise RuntimeError(f"cannot load the tokenizer {name!r} ({type(e).__name__}: {e}); "
                           f"pass --tokenizer with the model directory or name vLLM "
                           f"serves") from None


class Conductor:
    """The router. ``cluster`` holds the instances (static ones added before
    :meth:`start`); ``store`` (optional) is where instances announce themselves."""

    def __init__(self, cluster: Cluster, settings: "Settings | None" = None,
                 tokenizer=None, discovery_store=None):
        self.cluster = cluster
        self.settings = settings or Settings()
        self.tok = tokenizer
        if self.tok is None and self.settings.tokenizer:
            self.tok = _tokenizer(self.settings.tokenizer)
        self.discovery_store = discovery_store
        self.counters = Counters()
        self._session: Any = None
        self._tasks: list = []
        self._runner: Any = None
        self._rr = 0
        self._subs: dict = {}            # name -> (Subscriber, task, endpoints)
        self.url = ""

    # -- lifecycle ------------------------------------------------------------------------
    def app(self):
        from aiohttp import web
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._handle_generate)
        app.router.add_post("/v1/chat/completions", self._handle_generate)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/metrics", self._handle_metrics)
        return app

    async def start(self) -> str:
        import aiohttp
        from aiohttp import web
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            auto_decompress=False)
        if self.discovery_store is not None:
            await self.discover()
        self.sync_events()
        await self.check_health()
        self._tasks = [asyncio.ensure_future(self._loop(self.check_health,
                                                        self.settings.health_interval_s))]
        if self.discovery_store is not None:
            self._tasks.append(asyncio.ensure_future(
                self._loop(self.discover, self.settings.discovery_interval_s)))
        # handler_cancellation: a client that disconnects cancels its handler, which
        # closes the upstream connection (vLLM aborts the request).
        self._runner = web.AppRunner(self.app(), handler_cancellation=True,
                                     access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.settings.host}:{port}"
        return self.url

    async def stop(self) -> None:
        for name in list(self._subs):
            self._unsubscribe(name)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _loop(self, fn, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await fn()
            except Exception as e:           # a background check must never stop
                log.warning("conductor: %s failed: %s", fn.__name__, e)

    async def discover(self) -> None:
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                None, list_instances, self.discovery_store)
        except Exception as e:
            log.warning("conductor: listing instances in the metadata store failed: %s", e)
            return
        joined, left = self.cluster.sync(found)
        for n in joined:
            log.info("conductor: instance %s joined (%s, %s)", n, self.cluster.records[n].role,
                     self.cluster.records[n].url)
        for n in left:
            log.info("conductor: instance %s left", n)
        self.sync_events()
        if joined:
            await self.check_health(joined)

    # -- vLLM's KV events -----------------------------------------------------------------
    def sync_events(self) -> None:
        """One KV events subscription per instance that publishes (``kv_events`` in its
        record); dropped when the instance leaves or its endpoints change."""
        from .events import Subscriber, connect_endpoint
        for name in list(self._subs):
            rec = self.cluster.records.get(name)
            if rec is None or (rec.kv_events, rec.kv_events_replay) != self._subs[name][2]:
                self._unsubscribe(name)
        for name, rec in self.cluster.records.items():
            if not rec.kv_events or name in self._subs or rec.role == "decode":
                continue
            try:
                pub = connect_endpoint(rec.kv_events, rec.url)
                rep = connect_endpoint(rec.kv_events_replay, rec.url) \
                    if rec.kv_events_replay else ""
            except ValueError as e:
                log.warning("conductor: instance %s: %s; routing on what it was sent", name, e)
                self._subs[name] = (None, None, (rec.kv_events, rec.kv_events_replay))
                continue
            self.cluster.events.pop(name, None)
            sub = Subscriber(name, self.cluster.events_view(name), pub, rep)
            task = asyncio.ensure_future(self._events_loop(sub))
            self._subs[name] = (sub, task, (rec.kv_events, rec.kv_events_replay))
            log.info("conductor: instance %s: KV events from %s%s", name, pub,
                     f" (replay {rep})" if rep else "")

    async def _events_loop(self, sub) -> None:
        while True:
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception as e:            # a bad endpoint or socket: retry, slowly
                log.warning("conductor: KV events of %s failed: %s", sub.name, e)
                sub.view.complete = False
                await asyncio.sleep(2.0)

    def _unsubscribe(self, name: str) -> None:
        _sub, task, _ = self._subs.pop(name)
        if task is not None:
            task.cancel()
        self.cluster.events.pop(name, None)

    async def check_health(self, names=None) -> None:
        names = list(names or self.cluster.records)
        await asyncio.gather(*(self._check_one(n) for n in names))

    async def _check_one(self, name: str) -> None:
        import aiohttp
        rec = self.cluster.records.get(name)
        if rec is None:
            return
        st = self.cluster.states[name]
        t = aiohttp.ClientTimeout(total=max(1.0, self.settings.health_interval_s))
        try:
            async with self._session.get(rec.url + "/health", timeout=t) as r:
                ok = r.status == 200
            if ok:
                async with self._session.get(rec.url + "/metrics", timeout=t) as r:
                    m = parse_vllm_metrics(await r.text()) if r.status == 200 else {}
                st.running = int(m.get("running", st.running))
                st.waiting = int(m.get("waiting", st.waiting))
                st.kv_usage = float(m.get("kv_usage", st.kv_usage))
                cap = self.cluster.gpu_blocks or int(m.get("num_gpu_blocks", 0))
                self.cluster.shadows[name].capacity = cap
        except asyncio.TimeoutError:
            # A slow answer is not a dead instance: vLLM's API server can stall for
            # seconds behind a long prefill on a busy host. Down after a few in a row;
            # a refused connection or an error status is down at once.
            st.slow_checks += 1
            ok = st.healthy and st.slow_checks < self.settings.down_after_slow_checks
            if ok:
                log.info("conductor: instance %s answered no health check in %.1f s "
                         "(%d in a row)", name, t.total, st.slow_checks)
        except (aiohttp.ClientError, OSError):
            ok = False
        else:
            st.slow_checks = 0
        if ok != st.healthy:
            log.warning("conductor: instance %s is %s", name, "back" if ok else "down")
            sub = self._subs.get(name, (None,))[0]
            if ok and sub is not None:
                sub.restarted()               # a new vLLM: a new, empty cache
            if ok:                            # and a new, empty DRAM pool
                self.cluster.pool_restarted(name)
        st.healthy = ok

    # -- the front ------------------------------------------------------------------------
    def _authorized(self, request) -> bool:
        key = self.settings.api_key
        if not key:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {key}".encode())

    def _error(self, status: int, msg: str, kind: str = "invalid_request_error"):
        from aiohttp import web
        self.counters.inc("mooncake_te_conductor_errors_total", status=str(status))
        return web.json_response({"error": {"message": msg, "type": kind, "code": status}},
                                 status=status)

    async def _handle_health(self, request):
        from aiohttp import web
        up = [n for n, s in self.cluster.states.items() if s.healthy]
        roles = {self.cluster.records[n].role for n in up}
        ok = bool(up) and ("plain" in roles or {"prefill", "decode"} <= roles
                           or "decode" in roles)
        return web.json_response({"healthy": sorted(up), "instances": len(self.cluster.states)},
                                 status=200 if ok else 503)

    async def _handle_metrics(self, request):
        from aiohttp import web
        if not self._authorized(request):
            return self._error(401, "missing or wrong bearer token", "authentication_error")
        g = []
        for n, s in self.cluster.states.items():
            g.append(("mooncake_te_conductor_instance_healthy", {"instance": n}, int(s.healthy)))
            g.append(("mooncake_te_conductor_instance_inflight", {"instance": n}, s.inflight))
            t = s.terms(self.cluster.priors)
            g.append(("mooncake_te_conductor_instance_prefill_seconds_per_token",
                      {"instance": n}, t["tok"]))
            g.append(("mooncake_te_conductor_instance_wait_seconds_per_request",
                      {"instance": n}, t["wait"]))
            g.append(("mooncake_te_conductor_instance_shared_seconds_per_token",
                      {"instance": n}, t["shared_tok"]))
            g.append(("mooncake_te_conductor_instance_fit_residual_seconds",
                      {"instance": n}, t.get("residual", 0.0)))
            v = self.cluster.events.get(n)
            if v is not None:
                g.append(("mooncake_te_conductor_instance_gpu_blocks", {"instance": n},
                          len(v)))
                g.append(("mooncake_te_conductor_instance_kv_events_complete",
                          {"instance": n}, int(v.complete)))
                g.append(("mooncake_te_conductor_instance_kv_events_batches",
                          {"instance": n}, v.batches))
                g.append(("mooncake_te_conductor_instance_kv_events_gaps", {"instance": n},
                          v.gaps))
                g.append(("mooncake_te_conductor_instance_kv_events_restarts",
                          {"instance": n}, v.restarts))
        return web.Response(body=self.counters.exposition(g),
                            content_type="text/plain", charset="utf-8")

    async def _handle_models(self, request):
        from aiohttp import web
        if not self._authorized(request):
            return self._error(401, "missing or wrong bearer token", "authentication_error")
        for n, s in self.cluster.states.items():
            if not s.healthy:
                continue
            try:
                async with self._session.get(self.cluster.records[n].url + "/v1/models",
                                             timeout=self._timeout()) as r:
                    return web.json_response(await r.json(), status=r.status)
            except Exception:
                continue
        return self._error(503, "no healthy instance to answer /v1/models", "unavailable")

    def _timeout(self, first_byte: bool = True):
        import aiohttp
        s = self.settings
        return aiohttp.ClientTimeout(total=s.request_timeout_s, connect=s.connect_timeout_s,
                                     sock_read=s.first_byte_timeout_s)

    def tokens(self, path: str, body: dict) -> list:
        """The prompt's token ids as vLLM will see them."""
        if path.endswith("/chat/completions"):
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ValueError("'messages' must be a non-empty list")
            if self.tok is None:
                raise ValueError("no tokenizer configured (--tokenizer)")
            try:
                ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                   tokenize=True)
                return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            except Exception:        # no chat template: route on the text, vLLM decides
                text = "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
                return list(self.tok(text)["input_ids"])
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], list):
            p = p[0]                  # a batch: route on the first prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list) and all(isinstance(x, int) for x in p):
            return list(p)
        if isinstance(p, str):
            if self.tok is None:
                raise ValueError("no tokenizer configured (--tokenizer); send token ids")
            return list(self.tok(p)["input_ids"])
        raise ValueError("'prompt' must be a string, a list of token ids, or a list of them")

    async def _handle_generate(self, request):
        if not self._authorized(request):
            return self._error(401, "missing or wrong bearer token", "authentication_error")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return self._error(400, f"bad request body: {e}")
        if body.pop("kv_transfer_params", None) is not None:
            self.counters.inc("mooncake_te_conductor_dropped_kv_transfer_params_total")
        t0 = time.perf_counter()
        try:
            tokens = self.tokens(request.path, body)
        except ValueError as e:
            return self._error(400, f"bad request: {e}")
        pd = bool(self.cluster.by_role("decode"))
        roles = ("prefill",) if pd else ("plain", "prefill")
        cands, keys = self.cluster.candidates(tokens, roles)
        answers = {q: await self._owners(q[0], list(q[1]))
                   for q in self.cluster.queries(keys)}
        est, hits = self.cluster.rank(cands, tokens, keys, answers, time.monotonic())
        est = self._baseline(est)
        self.counters.inc("mooncake_te_conductor_route_seconds_total", time.perf_counter() - t0)
        if est and log.isEnabledFor(logging.DEBUG):
            log.debug("route: %d tokens -> %s; %s", len(tokens), est[0].name, "; ".join(
                f"{e.name} {e.ttft_s * 1e3:.0f} ms (queue {e.queue_s * 1e3:.0f}, ahead "
                f"{e.ahead}/{e.ahead_tokens} tok, elsewhere {e.elsewhere_tokens} tok, "
                f"{'/'.join(f'{t}={n}' for t, n in e.blocks.items() if n) or 'no hit'})"
                for e in est))
        self.counters.inc("mooncake_te_conductor_prompt_tokens_total", len(tokens))
        try:
            if pd:
                return await self._pd(request, body, tokens, est, keys)
            if not est:
                raise UpstreamError("no healthy instance with room (all down or full)", 503)
            return await self._forward(request, body, est, keys, "plain")
        except UpstreamError as e:
            return self._error(e.status, str(e), "upstream_error")

    def _baseline(self, est: list) -> list:
        """``est`` reordered by a baseline policy (candidates stay those with room)."""
        pol = self.settings.policy
        if pol == "round_robin" and est:
            order = sorted(est, key=lambda e: e.name)
            i = self._rr % len(order)
            self._rr += 1
            return order[i:] + order[:i]
        if pol == "least_loaded":
            st = self.cluster.states
            return sorted(est, key=lambda e: (st[e.name].inflight + st[e.name].waiting,
                                              st[e.name].queued_tokens, e.name))
        return est

    async def _owners(self, ns: str, keys: list) -> list:
        """:meth:`Cluster.owners`, without blocking the event loop: our HTTP metadata
        server's batch route asked from the loop (signed and its reply checked when the
        store has a token); other stores through their own client, in a thread."""
        c = self.cluster
        if c.store is None or not ns or not keys:
            return [None] * len(keys)
        st = c.store
        if getattr(st, "kind", "") != "http" or getattr(st, "_batch", None) is False \
                or len(keys) > 1000:
            return await asyncio.get_running_loop().run_in_executor(None, c.owners, ns, keys)
        import aiohttp
        try:
            url, body, headers, nonce = st.batch_read_request(c.index_keys(ns, keys))
            async with self._session.post(url, data=body, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=2)) as r:
                content = await r.read()
                vals = st.check_batch_reply(nonce, r.status, r.headers, content, len(keys))
            return c.parse_owners(vals)
        except Exception as e:          # the index is a hint: an outage is a miss
            c.index_failed(e)
            return [None] * len(keys)

    def _routed(self, e, keys, role: str) -> None:
        c = self.cluster
        st = c.states[e.name]
        st.inflight += 1
        st.queued_tokens += e.uncached
        self.counters.inc("mooncake_te_conductor_requests_total", instance=e.name, role=role)
        for tier, n in e.blocks.items():
            if n:
                self.counters.inc("mooncake_te_conductor_hit_tokens_total",
                                  n * c.records[e.name].block_size, tier=tier)
        e.keys = list(keys.get(e.name, []))
        c.shadows[e.name].add(e.keys)
        c.pool_shadows[e.name].add(e.keys)
        c.pending[e.name].add(e.keys)

    def _answered(self, e, measured: "float | None") -> None:
        st = self.cluster.states.get(e.name)
        if st is None:
            return
        p = self.cluster.pending.get(e.name)
        if p is not None and e.keys:
            p.done(e.keys, time.monotonic())
            e.keys = []
        st.inflight = max(0, st.inflight - 1)
        st.queued_tokens = max(0, st.queued_tokens - e.uncached)
        if measured is None:
            return
        self.counters.inc("mooncake_te_conductor_ttft_expected_seconds_total", e.ttft_s,
                          instance=e.name)
        self.counters.inc("mooncake_te_conductor_ttft_measured_seconds_total", measured,
                          instance=e.name)
        self.counters.inc("mooncake_te_conductor_ttft_samples_total", instance=e.name)
        self.cluster.measured(e.name, e.uncached, e.blocks, measured, e.ahead,
                              e.ahead_tokens, e.elsewhere_tokens)

    def _failed(self, name: str, why: str, full: bool = False) -> None:
        st = self.cluster.states.get(name)
        self.counters.inc("mooncake_te_conductor_failures_total", instance=name)
        if st is None:
            return
        if full:
            st.cooldown_until = time.monotonic() + self.settings.cooldown_s
        else:
            st.healthy = False           # the health check brings it back
        log.warning("conductor: instance %s failed before its first byte: %s", name, why)

    async def _open(self, name: str, path: str, body: dict):
        """POST to ``name``; the response once its status and first chunk are in:
        ``(response, first chunk)``. Raises :class:`UpstreamError` on a failure before
        the first byte (the caller may try elsewhere)."""
        import aiohttp
        url = self.cluster.records[name].url + path
        try:
            r = await self._session.post(url, json=body, timeout=self._timeout())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._failed(name, f"{type(e).__name__}: {e}")
            raise UpstreamError(f"instance {name} ({url}) failed: {type(e).__name__}: {e}")
        if r.status in (429, 503) or r.status >= 500:
            text = (await r.text())[:300]
            r.close()
            self._failed(name, f"HTTP {r.status}: {text}", full=r.status in (429, 503))
            raise UpstreamError(f"instance {name} answered {r.status}: {text}",
                                503 if r.status in (429, 503) else 502)
        try:
            first = await r.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            r.close()
            self._failed(name, f"no first byte: {type(e).__name__}: {e}")
            raise UpstreamError(f"instance {name} sent no answer: {type(e).__name__}: {e}")
        except BaseException:             # the client left: close, so vLLM aborts
            r.close()
            raise
        return r, first

    async def _first_of(self, cands, path: str, body: dict, keys: dict, role: str):
        """Try the best candidate, then (once) the next: ``(estimate, response, first
        chunk, seconds to first chunk)``."""
        last: "UpstreamError | None" = None
        tried = 0
        for e in cands:
            if tried == 2:
                break
            st = self.cluster.states.get(e.name)
            if st is None or not st.healthy:
                continue
            if tried:
                self.counters.inc("mooncake_te_conductor_retries_total")
            tried += 1
            self._routed(e, keys, role)
            t0 = time.perf_counter()
            try:
                r, first = await self._open(e.name, path, body)
            except UpstreamError as err:
                self._answered(e, None)
                last = err
                continue
            except BaseException:
                self._answered(e, None)
                raise
            return e, r, first, time.perf_counter() - t0
        raise last or UpstreamError("no healthy instance with room (all down or full)", 503)

    async def _relay(self, request, r, first: bytes):
        """Stream ``r`` (whose first chunk is ``first``) to the client as it arrives."""
        from aiohttp import web
        import aiohttp
        resp = web.StreamResponse(status=r.status)
        resp.content_type = r.content_type or "application/json"
        try:
            await resp.prepare(request)
            await resp.write(first)
            while True:
                chunk = await r.content.readany()
                if not chunk:
                    break
                await resp.write(chunk)
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.counters.inc("mooncake_te_conductor_client_disconnects_total")
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # The instance failed after its first byte: the client sees a cut stream.
            log.warning("conductor: answer from %s cut: %s", r.url.host, e)
        finally:
            r.close()
        return resp

    def _cached(self, raw: bytes) -> None:
        try:
            usage = json.loads(raw).get("usage") or {}
            n = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except (ValueError, AttributeError):
            return
        if n:
            self.counters.inc("mooncake_te_conductor_cached_tokens_total", n)

    async def _forward(self, request, body, est, keys, role: str):
        stream = bool(body.get("stream"))
        try:
            e, r, first, dt = await self._first_of(est, request.path, body, keys, role)
        except asyncio.CancelledError:
            self.counters.inc("mooncake_te_conductor_client_disconnects_total")
            raise
        one = body.get("max_tokens", body.get("max_completion_tokens")) == 1
        timed = (stream or one) and not isinstance(e, _Decode)
        self._answered(e, dt if timed else None)
        if not stream:
            try:
                data = first + await r.read()
            finally:
                r.close()
            self._cached(data)
            from aiohttp import web
            return web.Response(body=data, status=r.status,
                                content_type=r.content_type or "application/json")
        return await self._relay(request, r, first)

    async def _pd(self, request, body, tokens, est, keys):
        from aiohttp import web
        pre = dict(body, max_tokens=1, stream=False,
                   kv_transfer_params={"do_remote_decode": True})
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        params = None
        if est:
            try:
                e, r, first, dt = await self._first_of(est, request.path, pre, keys, "prefill")
                try:
                    raw = first + await r.read()
                finally:
                    r.close()
                self._answered(e, dt)
                if r.status == 200:
                    params = json.loads(raw).get("kv_transfer_params")
                else:
                    return web.Response(body=raw, status=r.status,
                                        content_type=r.content_type or "application/json")
            except UpstreamError as err:
                log.warning("conductor: no prefill instance answered (%s); the decode "
                            "instance computes the prompt", err)
        dec = dict(body)
        if params:
            dec["kv_transfer_params"] = params      # ours, never the client's
        cands = [_Decode(n) for n in self.cluster.rank_decode(time.monotonic())]
        if not cands:
            raise UpstreamError("no healthy decode instance with room", 503)
        return await self._forward(request, dec, cands, {}, "decode")


@dataclass
class _Decode:
    """A decode candidate, shaped like an :class:`~.cost.Estimate` (no TTFT model)."""

    name: str
    ttft_s: float = 0.0
    queue_s: float = 0.0
    uncached: int = 0
    ahead: int = 0
    ahead_tokens: int = 0
    elsewhere_tokens: int = 0
    blocks: dict = field(default_factory=dict)
    keys: list = field(default_factory=list)

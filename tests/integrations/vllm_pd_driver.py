# SPDX-License-Identifier: Apache-2.0
"""One vLLM instance of the P/D end-to-end test (run by the vLLM environment's Python).

``--role baseline``: no connector; greedy output for every phase's prompts.
``--role P``: prefill instance (kv_producer). For each phase: wait for ``go-<i>``
(phase 0 starts at once), prefill the phase's prompts (1 token each), optionally
overwrite its whole KV cache with noise (``corrupt``), write ``handoff-<i>.json`` (the
kv_transfer_params a proxy would forward), then keep the engine stepping (so leases are
released) until the next ``go`` or ``stop``.
``--role D``: decode instance (kv_consumer). For each phase: wait for ``handoff-<i>.json``
(and ``ready-<i>`` when the test must act first, e.g. kill P), decode with those
parameters, write ``D-<i>.json``, then ``go-<i+1>``; at the end ``stop``.

``--name`` names the output file; only the consumer named ``D`` drives the phases (a second
consumer, e.g. one with another block size, only reads).

Every wait is bounded; results and connector statistics go to JSON files in ``--dir``.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # single process: seconds, not minutes


def wait_for(path, timeout, step=None):
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > timeout:
            sys.exit(f"timed out after {timeout} s waiting for {path}")
        if step:
            step()
        time.sleep(0.05)


def dump(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["baseline", "P", "D"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--plan", required=True, help="JSON: {max_tokens, phases: [...]}")
    ap.add_argument("--kv-port", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config (JSON)")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--name", default=None, help="output name (default: the role); only "
                                                 "the consumer named D drives the phases")
    ap.add_argument("--phases", type=int, default=None, help="run only the first N phases")
    ap.add_argument("--after", default=None, help="file to wait for before starting")
    a = ap.parse_args()
    plan = json.load(open(a.plan))
    phases = plan["phases"][:a.phases]
    name = a.name or a.role

    from vllm import LLM, SamplingParams

    kw = dict(model=a.model, dtype="float32", max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=2048, enforce_eager=True, seed=0,
              block_size=a.block_size, enable_prefix_caching=False,
              kv_cache_memory_bytes=64 << 20, distributed_executor_backend="uni")
    if a.role != "baseline":
        kw["kv_transfer_config"] = dict(
            kv_connector="MooncakeTEConnector",
            kv_connector_module_path="mooncake_te.integrations.vllm",
            kv_role="kv_producer" if a.role == "P" else "kv_consumer",
            kv_port=a.kv_port, kv_load_failure_policy="recompute",
            kv_connector_extra_config=json.loads(a.extra))
    t0 = time.monotonic()
    llm = LLM(**kw)
    init_s = time.monotonic() - t0
    conn = None
    if a.role != "baseline":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        conn = get_kv_transfer_group()          # the worker side (same process: "uni")

    def stats():
        return dict(conn.stats) if conn is not None else {}

    prompts = lambda ph: [{"prompt_token_ids": p} for p in ph["prompts"]]   # noqa: E731
    greedy = dict(temperature=0.0, ignore_eos=True)
    role_out = os.path.join(a.dir, f"{name}.json")
    results = {"init_s": init_s, "phases": []}

    if a.role == "baseline":
        for ph in phases:
            outs = llm.generate(prompts(ph), SamplingParams(max_tokens=plan["max_tokens"],
                                                            **greedy), use_tqdm=False)
            results["phases"].append([list(o.outputs[0].token_ids) for o in outs])
        dump(role_out, results)
        return

    if a.role == "P":
        step = lambda: llm.llm_engine.step()    # noqa: E731  (release leases)
        for i, ph in enumerate(phases):
            if i:
                wait_for(os.path.join(a.dir, f"go-{i}"), a.timeout, step)
            sp = SamplingParams(max_tokens=1, extra_args={
                "kv_transfer_params": {"do_remote_decode": True}}, **greedy)
            t = time.monotonic()
            outs = llm.generate(prompts(ph), [sp] * len(ph["prompts"]), use_tqdm=False)
            gen_s = time.monotonic() - t
            if ph.get("corrupt"):
                import torch
                g = torch.Generator().manual_seed(i)
                for kv in conn.kv_caches.values():
                    kv.copy_(torch.randn(kv.shape, generator=g, dtype=kv.dtype) * 5)
            pool = conn._worker.pool if conn._worker is not None else None
            if pool is not None:
                # Stores reach the worker with the next step and run on its saver
                # thread: let them land (and reach the index) before the handoff, so the
                # consumer finds the blocks in the pool.
                for _ in range(5):
                    step()
                    time.sleep(0.02)
                pool.flush()
                pool.cache.flush_index()
            results["phases"].append({"gen_s": gen_s,
                                      "num_cached_tokens": [o.num_cached_tokens for o in outs]})
            results["stats"] = stats()
            dump(role_out, results)
            dump(os.path.join(a.dir, f"handoff-{i}.json"),
                 [o.kv_transfer_params for o in outs])
        wait_for(os.path.join(a.dir, "stop"), a.timeout, step)
        for _ in range(3):                       # let the last read-done notices land
            step()
            time.sleep(0.1)
        results["stats"] = stats()
        dump(role_out, results)
        return

    # D
    if a.after:
        wait_for(os.path.join(a.dir, a.after), a.timeout)
    for i, ph in enumerate(phases):
        wait_for(os.path.join(a.dir, f"handoff-{i}.json"), a.timeout)
        if ph.get("kill_producer"):
            wait_for(os.path.join(a.dir, f"ready-{i}"), a.timeout)
        params = json.load(open(os.path.join(a.dir, f"handoff-{i}.json")))
        sps = [SamplingParams(max_tokens=plan["max_tokens"],
                              extra_args={"kv_transfer_params": p}, **greedy) for p in params]
        t = time.monotonic()
        outs = llm.generate(prompts(ph), sps, use_tqdm=False)
        results["phases"].append({
            "gen_s": time.monotonic() - t,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs]})
        results["stats"] = stats()
        dump(role_out, results)
        if name == "D":
            open(os.path.join(a.dir, f"go-{i + 1}"), "w").close()
    if name == "D":
        open(os.path.join(a.dir, "stop"), "w").close()


if __name__ == "__main__":
    main()

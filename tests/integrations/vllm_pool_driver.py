# SPDX-License-Identifier: Apache-2.0
"""One vLLM instance of the KV-pool end-to-end test (run by the vLLM environment's Python).

Runs ``--steps`` (a JSON list) in order, each ``{"name", "prompts": [[token ids]...]}``,
greedy, ``max_tokens`` from the plan; after each step it writes ``<name>.json`` in
``--dir`` (tokens, ``num_cached_tokens``, the connector's counters, the pool keys of each
prompt) so the test can act between steps. ``--role baseline`` runs without any connector.
``--wait-before STEP=FILE`` waits for FILE before STEP; ``--hold FILE`` keeps the instance
(and its pool) up after the last step until FILE exists. A start that fails (a refused
configuration) writes ``{"error": message}`` and exits 3.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm_pd_driver import dump, wait_for  # noqa: E402  (same directory)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["baseline", "pool"], default="pool")
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--plan", required=True, help="JSON: {max_tokens, prompts: {name: ids}}")
    ap.add_argument("--steps", required=True, help="JSON list of [step name, [prompt names]]")
    ap.add_argument("--kv-port", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-bytes", type=int, default=2 << 20)
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config (JSON)")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--wait-before", action="append", default=[])
    ap.add_argument("--hold", default=None)
    a = ap.parse_args()
    plan = json.load(open(a.plan))
    steps = json.loads(a.steps)
    waits = dict(w.split("=", 1) for w in a.wait_before)

    from vllm import LLM, SamplingParams

    kw = dict(model=a.model, dtype="float32", max_model_len=1024, max_num_seqs=4,
              max_num_batched_tokens=1024, enforce_eager=True, seed=0,
              block_size=a.block_size, enable_prefix_caching=True,
              kv_cache_memory_bytes=a.kv_bytes, distributed_executor_backend="uni")
    if a.role == "pool":
        kw["kv_transfer_config"] = dict(
            kv_connector="MooncakeTEConnector",
            kv_connector_module_path="mooncake_te.integrations.vllm",
            kv_role="kv_both", kv_port=a.kv_port, kv_load_failure_policy="recompute",
            kv_connector_extra_config=json.loads(a.extra))
    out = os.path.join(a.dir, a.name)
    t0 = time.monotonic()
    try:
        llm = LLM(**kw)
    except Exception as e:                       # a refused configuration: report it
        msg = f"{type(e).__name__}: {e}"
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
            msg += f"\ncaused by {type(cause).__name__}: {cause}"
        dump(out + ".json", {"error": msg})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)                              # vLLM's threads would keep us alive
    init_s = time.monotonic() - t0
    conn = None
    keys_of = lambda toks: []                    # noqa: E731
    if a.role == "pool":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from mooncake_te.integrations.vllm.connector import pool_root
        from mooncake_te.integrations.vllm.pool import block_keys
        conn = get_kv_transfer_group()
        root = pool_root(llm.llm_engine.vllm_config)
        keys_of = lambda toks: [k.hex() for k in block_keys(toks, a.block_size, root)]  # noqa

    greedy = SamplingParams(max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True)
    results = {"init_s": init_s, "steps": {}}
    for name, prompt_names in steps:
        if name in waits:
            wait_for(os.path.join(a.dir, waits[name]), a.timeout)
        toks = [plan["prompts"][p] for p in prompt_names]
        t = time.monotonic()
        outs = []
        for p in toks:                           # one at a time: eviction order is known
            outs += llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)
        gen_s = time.monotonic() - t
        if conn is not None and conn._worker.pool is not None:
            # Stores are asynchronous; the test acts on what is in the pool after a step.
            llm.llm_engine.step() if llm.llm_engine.has_unfinished_requests() else None
            for _ in range(50):
                conn._worker.pool.flush()
                if not conn._worker._holds:
                    break
                time.sleep(0.02)
            conn._worker.pool.cache.flush_index()
        results["steps"][name] = {
            "gen_s": gen_s, "prompts": prompt_names,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
            "keys": [keys_of(p) for p in toks]}
        results["stats"] = dict(conn.stats) if conn is not None else {}
        results["stats"].pop("requests", None)
        dump(out + ".json", results)
    if a.hold:
        wait_for(os.path.join(a.dir, a.hold), a.timeout)
    if conn is not None:
        results["stats"] = dict(conn.stats)
        results["stats"].pop("requests", None)
        results["vllm_metrics"] = vllm_metrics(llm, results["stats"]["pool"])
        dump(out + ".json", results)
    del llm                                      # shutdown persists the DRAM tier to SSD
    results["exited"] = True
    dump(out + ".json", results)


def vllm_metrics(llm, data):
    """Feed the connector's counters through vLLM's own stats path: the periodic log
    line (KVConnectorLogging) and the Prometheus exposition (KVConnectorProm), as
    ``vllm serve`` does with what workers report."""
    from prometheus_client import REGISTRY, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging, KVConnectorProm)
    cfg = llm.llm_engine.vllm_config
    lines = []
    logging_ = KVConnectorLogging(cfg.kv_transfer_config)
    logging_.observe(data)
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    prom = KVConnectorProm(cfg, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(data, 0)
    text = generate_latest(REGISTRY).decode()
    return {"log": lines, "prometheus": [x for x in text.splitlines()
                                         if x.startswith("vllm:mooncake_te_")]}


if __name__ == "__main__":
    main()

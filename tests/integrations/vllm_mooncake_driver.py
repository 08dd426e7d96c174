# SPDX-License-Identifier: Apache-2.0
"""One vLLM instance for the compat end-to-end test (``test_compat_vllm.py``), run by the
vLLM environment's Python with the opt-in ``mooncake`` shim installed there, so vLLM's
*built-in* connectors (``"kv_connector": "MooncakeConnector"`` / ``"MooncakeStoreConnector"``,
no module path) import ``mooncake.engine`` / ``mooncake.store`` and get mooncake_te.

Roles (files in ``--dir`` coordinate them; every wait is bounded):

- ``baseline``: no connector; writes the greedy tokens of every prompt.
- ``P`` (MooncakeConnector, kv_producer): prefills each prompt with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": True, "transfer_id": ...}`` (what vLLM's proxy
  sends), writes the decode-side params, and keeps serving until ``stop`` appears.
- ``D`` (MooncakeConnector, kv_consumer): decodes with ``do_remote_prefill`` params naming
  P's engine and bootstrap server; the KV arrives through mooncake_te.
- ``store-put`` / ``store-get`` (MooncakeStoreConnector, kv_both, in two processes):
  the first stores every prompt's KV in the store and stays up (its DRAM tier holds the
  objects); the second runs the same prompts and loads their prefixes from it.

CPU only: vLLM's connectors call ``torch.accelerator.current_device_index()``, which
raises without an accelerator; that single function is replaced (returning device 0)
in this process, and nothing else is patched.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm_pd_driver import dump, wait_for  # noqa: E402  (this script's directory)


def _wait_for_stored_objects(timeout: float) -> None:
    """vLLM's MooncakeStoreConnector stores on a thread of its own, which may still be
    putting when the first instance's generate() returns: wait until the object index in
    the metadata server (MOONCAKE_CONFIG_PATH's metadata_server) stops growing."""
    import requests
    with open(os.environ["MOONCAKE_CONFIG_PATH"]) as f:
        url = json.load(f)["metadata_server"].rstrip("/")
    t0, last, since = time.monotonic(), None, time.monotonic()
    while time.monotonic() - t0 < timeout:
        n = len(requests.get(f"{url}/keys", params={"prefix": "mooncake/kvcache/store/"},
                             timeout=5).json())
        if n != last:
            last, since = n, time.monotonic()
        elif n and time.monotonic() - since > 1.0:
            return
        time.sleep(0.1)



def patch_cpu_device_index():
    """The one patch: torch.accelerator.current_device_index on a machine without one."""
    import torch
    if not torch.accelerator.is_available():
        torch.accelerator.current_device_index = lambda: 0


def corrupt_registered_kv():
    """Fill every region the connector registered with our engine (the KV tensors) with
    float noise: what D then decodes from is what mooncake_te moves out of them."""
    import ctypes
    import numpy as np
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    te = get_kv_transfer_group().connector_worker.engine      # mooncake.engine.TransferEngine
    rng = np.random.default_rng(0)
    regions = te.get_engine().regions
    assert regions, "the connector registered no memory with the engine"
    for r in regions:
        n = r.length // 4
        arr = np.ctypeslib.as_array((ctypes.c_float * n).from_address(r.address))
        arr[:] = rng.standard_normal(n, dtype=np.float32) * 5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", required=True,
                    choices=["baseline", "P", "D", "store-put", "store-get"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--bootstrap-port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--corrupt", action="store_true",
                    help="P: overwrite the KV memory it registered with noise after prefill")
    a = ap.parse_args()
    prompts = json.load(open(a.prompts))
    patch_cpu_device_index()
    import mooncake
    assert getattr(mooncake, "MOONCAKE_TE_SHIM", False), "the mooncake shim is not installed"

    from vllm import LLM, SamplingParams

    kw = dict(model=a.model, dtype="float32", max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=2048, enforce_eager=True, seed=0, block_size=32,
              enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
              distributed_executor_backend="uni")
    if a.role in ("P", "D"):
        kw["kv_transfer_config"] = dict(
            kv_connector="MooncakeConnector", engine_id=f"compat-{a.role}",
            kv_role="kv_producer" if a.role == "P" else "kv_consumer",
            kv_connector_extra_config={"mooncake_protocol": "tcp"})
    elif a.role.startswith("store"):
        # Two instances of one host run at once here: each needs its own lookup socket
        # (vLLM names it /tmp/lookup_rpc_port_<port>_host_<host>_dp_rank<r>, and a second
        # instance with the same name unlinks the first one's while it is being created).
        kw["kv_transfer_config"] = dict(kv_connector="MooncakeStoreConnector",
                                        kv_role="kv_both",
                                        kv_connector_extra_config={
                                            "lookup_rpc_port": os.getpid()})
        kw["enable_prefix_caching"] = True          # the store keys blocks by prefix hash
    llm = LLM(**kw)
    greedy = dict(temperature=0.0, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in prompts]
    out_path = os.path.join(a.dir, f"{a.role}.json")

    if a.role in ("baseline", "store-put", "store-get"):
        if a.role == "store-get":
            wait_for(os.path.join(a.dir, "store-put.json"), a.timeout)
            _wait_for_stored_objects(a.timeout)
        outs = llm.generate(ps, SamplingParams(max_tokens=a.max_tokens, **greedy),
                            use_tqdm=False)
        dump(out_path, {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                        "num_cached_tokens": [o.num_cached_tokens for o in outs]})
        if a.role == "store-put":
            wait_for(os.path.join(a.dir, "stop"), a.timeout)   # keep the objects served
        return

    if a.role == "P":
        tids = [f"xfer-{i}" for i in range(len(ps))]
        sps = [SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
            "do_remote_decode": True, "transfer_id": t}}, **greedy) for t in tids]
        llm.generate(ps, sps, use_tqdm=False)
        if a.corrupt:
            corrupt_registered_kv()
        dump(os.path.join(a.dir, "handoff.json"), [{
            "do_remote_prefill": True, "transfer_id": t, "remote_engine_id": "compat-P",
            "remote_bootstrap_addr": f"http://127.0.0.1:{a.bootstrap_port}"} for t in tids])
        t0 = time.monotonic()
        while not os.path.exists(os.path.join(a.dir, "stop")):
            if time.monotonic() - t0 > a.timeout:
                sys.exit("timed out waiting for stop")
            llm.llm_engine.step()                 # frees blocks once D has them
            time.sleep(0.05)
        dump(out_path, {"ok": True})
        return

    wait_for(os.path.join(a.dir, "handoff.json"), a.timeout)
    params = json.load(open(os.path.join(a.dir, "handoff.json")))
    sps = [SamplingParams(max_tokens=a.max_tokens, extra_args={"kv_transfer_params": p},
                          **greedy) for p in params]
    outs = llm.generate(ps, sps, use_tqdm=False)
    dump(out_path, {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                    "num_cached_tokens": [o.num_cached_tokens for o in outs]})
    open(os.path.join(a.dir, "stop"), "w").close()


if __name__ == "__main__":
    main()

# SPDX-License-Identifier: Apache-2.0
"""vLLM's *built-in* Mooncake connectors on mooncake_te through the opt-in ``mooncake``
package: the settings name ``"kv_connector": "MooncakeConnector"`` or
``"MooncakeStoreConnector"`` with no module path, exactly as for the real Mooncake.

The test installs the shim into the vLLM environment (``mooncake-te compat install``
run by that environment's Python) and removes it afterwards, so ``.venv-vllm`` is left
as it was. The instances run ``tests/integrations/vllm_mooncake_driver.py``: on this CPU-only
machine it replaces ``torch.accelerator.current_device_index`` (which raises without an
accelerator, and which vLLM's connectors call) with a function returning 0; that is the
only patch, and it is in the vLLM processes only.

- P/D: a prefill instance (kv_producer) and a decode instance (kv_consumer) with
  MooncakeConnector, the KV pushed through mooncake_te's TransferEngine (P2PHANDSHAKE,
  TCP); the decode output equals a run without a connector, token for token; with P's
  registered KV overwritten by noise after prefill, it differs (D uses the moved KV).
- Store: an instance with MooncakeStoreConnector stores its prompts' KV in
  ``mooncake.store`` (our store over the KV pool, index in our HTTP metadata server);
  a second instance, in another process, runs the same prompts and loads the prefixes
  from the first one's pool; both outputs equal the run without a connector.
- Store, ``standalone-store`` mode (issue 39): the instances contribute no memory
  (``global_segment_size = 0``); a separate store process (``mooncake_client``'s
  counterpart, ``python -m mooncake_te.compat.dummy``) owns the pool. The first instance
  puts its prompts' KV there, the second loads the prefixes from it.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from servers import HttpMetadataServer, free_port
from test_vllm_e2e import (ROOT, STEP_TIMEOUT, _env, _Procs, tiny_model,  # noqa: F401
                           vllm_python)

DRIVER = os.path.join(ROOT, "tests", "integrations", "vllm_mooncake_driver.py")
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def shim(vllm_python):
    """The opt-in installed into the vLLM environment for this module, removed after."""
    run = lambda *a: subprocess.run([vllm_python, "-m", "mooncake_te", "compat", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120, env=_env())
    r = run("install")
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(run("status", "--json").stdout)
    assert st["kind"] == "shim", st
    yield st
    r = run("uninstall")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(run("status", "--json").stdout)["kind"] == "none"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    r = random.Random(5)
    path = str(tmp_path_factory.mktemp("prompts") / "prompts.json")
    with open(path, "w") as f:
        json.dump([[r.randrange(3, 512) for _ in range(n)] for n in (300, 75)], f)
    return path


class _Run(_Procs):
    """``_Procs`` of the P/D test, starting this module's driver."""

    def __init__(self, py, model, d, prompts):
        super().__init__(py, model, d, None)
        self.prompts = prompts

    def start(self, role, env=None, *extra):
        log = open(os.path.join(self.dir, f"{role}.log"), "w")
        cmd = [self.py, DRIVER, "--role", role, "--model", self.model, "--dir", self.dir,
               "--prompts", self.prompts, "--max-tokens", str(MAX_TOKENS),
               "--timeout", str(STEP_TIMEOUT), *extra]
        self.procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=dict(_env(), **(env or {})),
                                            start_new_session=True)

    def wait(self, role):
        super().wait(role)
        with open(os.path.join(self.dir, f"{role}.json")) as f:
            return json.load(f)


@pytest.fixture(scope="module")
def baseline(vllm_python, tiny_model, prompts, tmp_path_factory):
    run = _Run(vllm_python, tiny_model, str(tmp_path_factory.mktemp("baseline")), prompts)
    try:
        run.start("baseline")
        return run.wait("baseline")["tokens"]
    finally:
        run.kill_all()


def test_builtin_mooncake_connector_pd(shim, vllm_python, tiny_model, prompts, baseline,
                                       tmp_path):
    run = _Run(vllm_python, tiny_model, str(tmp_path), prompts)
    bp = free_port()
    try:
        run.start("P", {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bp)}, "--bootstrap-port", str(bp))
        run.start("D", {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())})
        got = run.wait("D")
        run.wait("P")
    finally:
        run.kill_all()
    assert got["tokens"] == baseline
    assert all(len(t) == MAX_TOKENS for t in got["tokens"])
    log = open(os.path.join(str(tmp_path), "D.log")).read()
    assert "KV load failure" not in log, run.tail("D")
    # The KV came from P: vLLM counts the remotely prefilled tokens as cached ones.
    assert all(n > 0 for n in got["num_cached_tokens"]), got


def test_pd_decode_uses_the_transferred_kv(shim, vllm_python, tiny_model, prompts, baseline,
                                          tmp_path):
    """P overwrites its registered KV with noise after prefill: D's output changes, so D
    decodes from what mooncake_te moved, not from a recomputation."""
    run = _Run(vllm_python, tiny_model, str(tmp_path), prompts)
    bp = free_port()
    try:
        run.start("P", {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bp)}, "--bootstrap-port", str(bp),
                  "--corrupt")
        run.start("D", {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())})
        got = run.wait("D")
        run.wait("P")
    finally:
        run.kill_all()
    assert got["tokens"] != baseline
    assert all(n > 0 for n in got["num_cached_tokens"]), got


def test_builtin_mooncake_store_connector(shim, vllm_python, tiny_model, prompts, baseline,
                                          tmp_path):
    with HttpMetadataServer() as md:
        cfg = os.path.join(str(tmp_path), "mooncake.json")
        with open(cfg, "w") as f:
            json.dump({"local_hostname": "127.0.0.1", "metadata_server": md.url,
                       "master_server_address": "127.0.0.1:50051",
                       "global_segment_size": "64MB", "local_buffer_size": "16MB",
                       "protocol": "tcp", "device_name": ""}, f)
        env = {"MOONCAKE_CONFIG_PATH": cfg, "MC_STORE_MAX_OBJECT_SIZE": "256KB",
               # With a metadata server the RPC endpoint is MC_TCP_BIND_ADDRESS (else the
               # first LAN address, as in Mooncake): keep it on loopback.
               "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        run = _Run(vllm_python, tiny_model, str(tmp_path), prompts)
        try:
            run.start("store-put", env)
            run.start("store-get", env)
            got = run.wait("store-get")
            open(os.path.join(str(tmp_path), "stop"), "w").close()
            put = run.wait("store-put")
        finally:
            run.kill_all()
        import requests
        keys = requests.get(f"http://127.0.0.1:{md.port}/metadata/keys",
                            params={"prefix": "mooncake/kvcache/store/"}, timeout=5).json()
    assert put["tokens"] == baseline
    assert got["tokens"] == baseline
    # The second instance loaded its prompts' full blocks from the first one's pool.
    assert got["num_cached_tokens"][0] >= 256, got
    assert keys == [], keys          # both closed: their index records withdrawn


def test_builtin_mooncake_store_connector_standalone(shim, vllm_python, tiny_model, prompts,
                                                     baseline, tmp_path):
    """vLLM's ``standalone-store`` mode: every instance sets up with
    ``global_segment_size = 0`` and the KV lives in a separate store process's pool."""
    with HttpMetadataServer() as md:
        cfg = os.path.join(str(tmp_path), "mooncake.json")
        with open(cfg, "w") as f:
            json.dump({"local_hostname": "127.0.0.1", "metadata_server": md.url,
                       "master_server_address": "127.0.0.1:50051",
                       "mode": "standalone-store", "global_segment_size": 0,
                       "local_buffer_size": "16MB", "protocol": "tcp", "device_name": ""}, f)
        env = {"MOONCAKE_CONFIG_PATH": cfg, "MC_STORE_MAX_OBJECT_SIZE": "256KB",
               "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        holder_log = open(os.path.join(str(tmp_path), "holder.log"), "w+")
        holder = subprocess.Popen(
            [sys.executable, "-m", "mooncake_te.compat.dummy", "--host=127.0.0.1",
             f"--port={free_port()}", "--global_segment_size=256MB",
             f"--metadata_server={md.url}"], stdout=holder_log, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=ROOT, **env), start_new_session=True)
        run = _Run(vllm_python, tiny_model, str(tmp_path), prompts)
        try:
            deadline = time.monotonic() + 60
            while True:
                holder_log.seek(0)
                if "serving dummy clients" in holder_log.read():
                    break
                assert holder.poll() is None and time.monotonic() < deadline, \
                    open(holder_log.name).read()
                time.sleep(0.2)
            run.start("store-put", env)
            run.start("store-get", env)        # waits for store-put's output itself
            got = run.wait("store-get")
            open(os.path.join(str(tmp_path), "stop"), "w").close()
            put = run.wait("store-put")
        finally:
            run.kill_all()
            holder.terminate()
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
            holder_log.close()
    logs = "".join(open(os.path.join(str(tmp_path), f"{r}.log")).read()
                   for r in ("store-put", "store-get"))
    assert "mode=standalone-store" in logs, logs[-4000:]
    assert put["tokens"] == baseline
    assert got["tokens"] == baseline
    # The second instance loaded its prompts' full blocks from the store process's pool
    # (neither instance has a segment of its own).
    assert got["num_cached_tokens"][0] >= 256, got

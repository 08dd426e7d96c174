# SPDX-License-Identifier: Apache-2.0
"""Issue 41 (a newcomer's first hour, round 3), the command-line items: every one run as
a user runs it, in a subprocess, checking the exit status and what it prints."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from servers import http_metadata_server  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mte(*argv, env=None, timeout=60, pre: str = ""):
    """``mooncake-te ARGV`` in a fresh interpreter; ``pre`` runs first (to hide a module)."""
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    code = pre + "\nimport sys\nfrom mooncake_te.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


# Makes ``import prometheus_client`` fail as it does where the package is not installed.
NO_PROMETHEUS = ("import sys\n"
                 "class _Hide:\n"
                 "    def find_spec(self, name, path=None, target=None):\n"
                 "        if name == 'prometheus_client' or name.startswith('prometheus_client.'):\n"
                 "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
                 "sys.meta_path.insert(0, _Hide())\n")


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


# --- item 5: a busy --port --------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [
    ["bench", "--mode", "target", "--host", "127.0.0.1", "--port", "{port}"],
    ["metadata-server", "--host", "127.0.0.1", "--port", "{port}"],
    ["p2p", "publish", "--metadata", "p2p", "--host", "127.0.0.1", "--port", "{port}",
     "/etc/hostname"],
], ids=["bench-target", "metadata-server", "p2p-publish"])
def test_busy_port_is_one_line_and_exit_2(busy_port, argv):
    r = mte(*[a.format(port=busy_port) for a in argv])
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    msg = lines[0]
    assert msg.startswith(f"mooncake-te {argv[0]}")
    assert f"127.0.0.1:{busy_port}" in msg and "in use" in msg.lower()
    assert "another process holds port" in msg and "pick another port" in msg


def test_port_hint_only_for_a_port_that_was_asked_for():
    import errno
    from mooncake_te.metadata.rpc import port_hint
    assert "pick another port" in port_hint(errno.EADDRINUSE, 5000)
    assert port_hint(errno.EADDRINUSE, 0) == ""          # 0 already means "any free one"
    assert port_hint(errno.EADDRNOTAVAIL, 5000) == ""    # the address, not the port


@pytest.mark.timeout(60)
def test_bench_port_in_loopback_mode_is_refused():
    r = mte("bench", "--port", "5000", "--duration", "0.01")
    assert r.returncode == 2, r.stderr
    assert "--port is the RPC port of a --mode target" in r.stderr
    assert "drop --port" in r.stderr


# --- item 4: prometheus-client ----------------------------------------------------------
def test_prometheus_client_is_a_dependency():
    """Decided: required (top ships with every install, metrics_port is an engine
    setting; it is small and pure Python), so neither needs an extra a user must know."""
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert any(d.startswith("prometheus-client") for d in deps), deps


@pytest.mark.timeout(60)
def test_top_without_prometheus_client_says_what_to_install():
    r = mte("top", "--once", "127.0.0.1:9", pre=NO_PROMETHEUS)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("mooncake-te top: ") and len(r.stderr.strip().splitlines()) == 1
    assert "prometheus-client is not installed" in r.stderr
    assert "pip install 'prometheus-client" in r.stderr and ".[metrics]" in r.stderr


@pytest.mark.timeout(60)
def test_engine_metrics_port_without_prometheus_client_is_an_error():
    code = NO_PROMETHEUS + (
        "import mooncake_te as mte\n"
        "try:\n"
        "    mte.TransferEngine(host='127.0.0.1', metadata='p2p')\n"
        "except mte.MooncakeError as e:\n"
        "    print('REFUSED', e)\n"
        "else:\n"
        "    print('STARTED')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, MC_METRICS_PORT="1"))
    assert r.returncode == 0, r.stderr
    assert "REFUSED metrics_port = 1 (/metrics) need(s) prometheus-client is not installed" \
        in r.stdout, r.stdout + r.stderr


# --- item 1 (the rest): the library's own messages --------------------------------------
def test_no_message_in_the_library_installs_mooncake_te_from_pypi():
    from test_docs import PYPI_INSTALL
    found = []
    for d, _, files in os.walk(os.path.join(ROOT, "mooncake_te")):
        for f in files:
            if f.endswith((".py", ".pyx", ".pxd")):
                path = os.path.join(d, f)
                with open(path) as fh:
                    for n, line in enumerate(fh, 1):
                        if PYPI_INSTALL.search(line):
                            found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


# --- item 12: the rest ------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_empty_p2p_list_says_no_objects(http_metadata_server):  # noqa: F811
    url = http_metadata_server.url
    r = mte("p2p", "list", "--metadata", url, "--host", "127.0.0.1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"no objects published (metadata {url}); publish one with "
                                f"`mooncake-te p2p publish FILE` against the same store")
    r = mte("p2p", "list", "--metadata", url, "--host", "127.0.0.1", "--json")
    assert r.returncode == 0 and r.stdout.strip() == "[]"     # JSON stays JSON


@pytest.mark.parametrize("value", ["abc", "inf", "nan", "-1", "0", ""])
def test_transfer_timeout_message_matches_what_is_accepted(value):
    from mooncake_te.config import Config
    from mooncake_te.errors import ConfigError
    assert Config.load(env={"MC_TRANSFER_TIMEOUT": "2.5"})["transfer_engine"]["timeout_ms"] \
        == 2500
    if value == "":
        Config.load(env={"MC_TRANSFER_TIMEOUT": value})      # unset: the default
        return
    with pytest.raises(ConfigError) as ei:
        Config.load(env={"MC_TRANSFER_TIMEOUT": value})
    msg = str(ei.value)
    assert f"MC_TRANSFER_TIMEOUT={value!r}" in msg
    assert "expected a number of seconds such as 30 or 2.5" in msg and "integer" not in msg
    assert "millisecond" not in msg.split("expected")[0]       # said in the variable's units


@pytest.mark.timeout(120)
@pytest.mark.parametrize("columns", ["80", "60"])
def test_top_once_shows_whole_engine_and_peer_names(tmp_path, columns):
    """Issue 41, item 12: at 80 columns names were cut to ``127.0.0.…``, so the rows of
    two engines looked the same."""
    import numpy as np
    import mooncake_te
    from servers import free_port
    port = free_port()
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"[transfer_engine]\nmetrics_port = {port}\n")
    a = mooncake_te.TransferEngine(host="127.0.0.1", metadata="p2p", config=str(cfg))
    b = mooncake_te.TransferEngine(host="127.0.0.1", metadata="p2p", config=str(cfg))
    try:
        bufs = [np.zeros(1 << 16, np.uint8) for _ in range(2)]
        ra, rb = a.register(bufs[0]), b.register(bufs[1])
        a.write(b.name, ra.address, rb.address, 4096)
        b.write(a.name, rb.address, ra.address, 4096)
        r = mte("top", "--once", f"127.0.0.1:{port}", env={"COLUMNS": columns})
    finally:
        a.close()
        b.close()
    assert r.returncode == 0, r.stderr
    assert "\u2026" not in r.stdout                      # no ellipsis anywhere
    for header in ("failures", "p99", "queued"):           # rightmost columns not cropped
        assert header in r.stdout, r.stdout
    for name in (a.name, b.name):                          # whole, on one line
        assert any(name in line for line in r.stdout.splitlines()), r.stdout
    lines = r.stdout.splitlines()
    assert any(a.name in x and b.name in x for x in lines), r.stdout   # a -> b row
    assert any(b.name in x.split(a.name)[0] for x in lines if a.name in x and b.name in x
               and x.index(b.name) < x.index(a.name)), r.stdout         # b -> a row


# --- item 6: cache_dir, one rule for doctor and library ---------------------------------
def _doctor_and_library(tmp_path, cache_dir):
    """(doctor's exit status, its cache_dir findings, what KVCache.from_config says)."""
    import json
    cfg = tmp_path / "cache.toml"
    cfg.write_text(f"[kvcache]\ncache_dir = '{cache_dir}'\nssd_cache_gb = 0.001\n"
                   f"dram_cache_gb = 0.0001\n")
    r = mte("doctor", "--config", str(cfg), "--check", "cache_dir", "--json")
    found = [f for f in json.loads(r.stdout)["findings"] if f["check"] == "cache_dir"]
    code = ("from mooncake_te.kvcache import KVCache\n"
            f"try:\n    KVCache.from_config({str(cfg)!r}, block_bytes=4096)\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n"
            "else:\n    print('OPENED')\n")
    lib = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=ROOT))
    assert lib.returncode == 0, lib.stderr
    return r.returncode, found, lib.stdout.strip()


@pytest.mark.timeout(120)
def test_missing_parent_refused_by_both(tmp_path):
    want = tmp_path / "ssd" / "kv"                 # /mnt/ssd not mounted, say
    rc, found, lib = _doctor_and_library(tmp_path, want)
    assert rc == 2
    (f,) = [f for f in found if f["severity"] == "error"]
    assert f["code"] == "MTE400"
    assert f"nor does its parent {str(tmp_path / 'ssd')!r}" in f["message"]
    assert "is the SSD mounted?" in f["fix"] and f"mkdir -p {want}" in f["fix"]
    assert lib.startswith("ConfigError ") and f["message"] in lib and f["fix"] in lib
    assert not (tmp_path / "ssd").exists()          # nothing created on the wrong disk


@pytest.mark.timeout(120)
def test_missing_last_level_created_by_the_cache_and_said_by_doctor(tmp_path):
    want = tmp_path / "kv"
    rc, found, lib = _doctor_and_library(tmp_path, want)
    assert rc == 0, found
    assert [f["severity"] for f in found] == ["ok"]
    assert "does not exist yet; the cache creates it in" in found[0]["message"]
    assert "mounted at" in found[0]["message"]
    assert lib == "OPENED" and want.is_dir()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["under-a-file", "proc"])
def test_wrong_doctor_messages_fixed(tmp_path, case):
    if case == "under-a-file":
        (tmp_path / "a-file").write_text("x")
        path, code = tmp_path / "a-file" / "kv", "MTE400"
        says = f"{str(tmp_path / 'a-file')!r} is a file, not a directory"
    else:
        path, code = "/proc/sys/kernel", "MTE401"
        says = "on a proc file system"
    rc, found, lib = _doctor_and_library(tmp_path, path)
    assert rc == 2
    (f,) = [f for f in found if f["severity"] == "error"]
    assert f["code"] == code and says in f["message"], f
    assert "missing too" not in f["message"] and "chown" not in f["fix"], f
    assert f["fix"].startswith("point cache_dir at a directory on a local SSD")
    assert lib.startswith("ConfigError ") and f["message"] in lib


# --- item 7: doctor on the seed's settings with vLLM's own MooncakeConnector ------------
SEED = os.path.join(ROOT, "tests", "data", "vllm", "seed-settings.json")


def _seed_with_builtin_connector(tmp_path):
    """The seed's settings.json as Mooncake deployments write it: "MooncakeConnector",
    no module path (the fixture itself names our connector)."""
    import json
    with open(SEED) as f:
        doc = json.load(f)
    kv = doc["kv_transfer_config"]
    kv["kv_connector"] = "MooncakeConnector"
    del kv["kv_connector_module_path"]
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _vllm_connector_finding(path, env=None):
    import json
    r = mte("doctor", "--vllm-config", path, "--check", "vllm_connector", "--json", env=env)
    (f,) = [f for f in json.loads(r.stdout)["findings"] if f["check"] == "vllm_connector"]
    return r.returncode, f


@pytest.mark.timeout(120)
def test_doctor_offers_the_drop_in_and_our_connector(tmp_path):
    rc, f = _vllm_connector_finding(_seed_with_builtin_connector(tmp_path))
    assert rc == 2 and f["severity"] == "error" and f["code"] == "MTE505"
    assert "ModuleNotFoundError" in f["message"]
    fix = f["fix"]
    # (a) the drop-in keeps the file as it is, and says what vLLM's connector ignores
    assert "keep these settings unchanged: run `mooncake-te compat install`" in fix
    assert "use_gpu_direct" in fix.split("(b)")[0] and "are ignored that way" in fix
    # (b) our connector: the module path, and it keeps use_gpu_direct & co.
    assert '"kv_connector_module_path": "mooncake_te.integrations.vllm"' in fix
    assert "use_gpu_direct included" in fix and "enable_multi_nic" in fix.split("(b)")[1]
    assert sorted(f["data"]["ignored"]) == sorted(
        ["enable_multi_nic", "metadata_server", "mooncake_config_path",
         "transfer_engine_protocol", "use_gpu_direct"])


@pytest.mark.timeout(120)
def test_doctor_with_the_drop_in_installed_says_what_it_ignores(tmp_path):
    site = tmp_path / "site"
    r = mte("compat", "install", "--target", str(site))
    assert r.returncode == 0, r.stderr
    env = {"PYTHONPATH": os.pathsep.join([ROOT, str(site)])}
    rc, f = _vllm_connector_finding(_seed_with_builtin_connector(tmp_path), env=env)
    assert rc == 1 and f["severity"] == "warning", f
    assert "mooncake_te's drop-in" in f["message"] and "runs on mooncake_te" in f["message"]
    assert "use_gpu_direct" in f["message"] and "ignored" in f["message"]
    assert '"kv_connector_module_path": "mooncake_te.integrations.vllm"' in f["fix"]


# --- item 3: the fabric tier says how the guest run goes -------------------------------
# The guest itself is never booted here (tests/fabric is the lab's own tier): lab.run is
# replaced by one that runs the guest's pytest command on this host after a pause, so the
# reports arrive as they do from a guest; what is checked is what pytest prints meanwhile.
FAKE_LAB = '''
import subprocess, time, types
from mooncake_te import lab

def run(argv, rxe=2, nvmeof=False, env=None, timeout=None, cwd=None, out=None, log=None):
    log("preparing the guest kernel (cached)")
    time.sleep(2.5)                                   # "booting"
    r = subprocess.run(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    return types.SimpleNamespace(returncode=r.returncode, wall_s=3.0, boot_s=2.5,
                                 accel="fake")

lab.run = run
lab.has_rdma = lambda: False
'''

GUEST_TESTS = '''
import time
import pytest

@pytest.mark.rdma
@pytest.mark.parametrize("i", range(3))
def test_slow(i):
    time.sleep(1.5)
    assert i != 2
'''


@pytest.mark.timeout(120)
def test_fabric_tier_prints_progress_while_the_guest_runs(tmp_path):
    (tmp_path / "conftest.py").write_text(FAKE_LAB + "\npytest_plugins = ['fabric']\n")
    (tmp_path / "test_guest.py").write_text(GUEST_TESTS)
    env = dict(os.environ, MTE_FABRIC_PROGRESS_S="1", MOONCAKE_LAB_CACHE=str(tmp_path / "c"),
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(tmp_path)], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True, timeout=100)
    out = r.stdout
    assert r.returncode == 1, out + r.stderr                 # test_slow[2] fails
    lines = [x for x in out.splitlines() if x.startswith("fabric: ")]
    assert "fabric: preparing the guest kernel (cached)" in lines, out
    assert any("booting the guest" in x for x in lines), out
    assert any(x.endswith("1 of 3 test(s) done in the guest") for x in lines), out
    assert any(x.endswith("3 of 3 test(s) done in the guest, 1 failed") for x in lines) \
        or "guest run took" in out, out
    # before the summary: the lines come while the guest runs, not after it
    assert out.index("booting the guest") < out.index("1 failed, 2 passed")


FAKE_PYTHON = '''#!/usr/bin/env bash
# stands in for python3/pip: makes a venv's shape, installs nothing
if [[ "$1 $2" == "-m venv" ]]; then
    mkdir -p "$3/bin" && ln -s "$0" "$3/bin/python" && touch "$3/pyvenv.cfg"
fi
exit 0
'''


@pytest.mark.timeout(60)
def test_vllm_env_script_says_each_step(tmp_path):
    """scripts/vllm-env.sh ran for minutes with `pip -q` and said nothing; the Python and
    pip it drives are replaced here by a script that installs nothing (the real build is
    2.5 GB; test_vllm_e2e.py runs it, and shows these lines on pytest's terminal)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake))
    r = subprocess.run([os.path.join(ROOT, "scripts", "vllm-env.sh"), str(tmp_path / "v")],
                       capture_output=True, text=True, timeout=50, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [x for x in r.stdout.splitlines() if x.startswith("vllm-env: [")]
    assert [x[len("vllm-env: ["):].split("]")[0] for x in steps] == \
        ["1/5", "2/5", "3/5", "4/5", "5/5"], r.stdout
    assert "the long step" in steps[1] and "s so far)" in steps[1]
    assert r.stdout.strip().splitlines()[-1].startswith(f"vllm-env: {tmp_path / 'v'} is ready")
    r = subprocess.run([os.path.join(ROOT, "scripts", "vllm-env.sh"), str(tmp_path / "v")],
                       capture_output=True, text=True, timeout=50, env=env, cwd=ROOT)
    assert r.stdout.strip() == f"vllm-env: {tmp_path / 'v'} is ready"    # done once

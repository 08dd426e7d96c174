# SPDX-License-Identifier: Apache-2.0
"""Mooncake's own store test files, byte for byte, through the opt-in shim (issue 39).

The files live in kvcache-ai/Mooncake (``mooncake-wheel/tests``, Apache-2.0); they are
not copied into this repository. Point ``MTE_MOONCAKE_SRC`` at a checkout of Mooncake
(its root, or its ``mooncake-wheel`` directory) and each file runs, unchanged and from
that checkout, in a child ``pytest`` with the shim installed in a temporary
site-packages, once per metadata server (etcd, redis, our HTTP server, all on
127.0.0.1). Without the variable every case is skipped and says so: CI has no copy, and
our own tests written to the same scenarios (``test_compat_store*.py``) run there.

Two files of Mooncake's ``scripts/`` directory run the same way (``SCRIPTS``): the tensor
API suites ``test_tensor_api.py`` (the ``*_with_parallelism`` calls among them) and
``test_upsert_api.py``, which read their store settings from ``MOONCAKE_*`` variables
(``MooncakeConfig.load_from_env``).

Each case asserts that at least the recorded number of the file's tests pass (the
floor in ``EXPECTED``, measured on this machine, the Mooncake commit in docs/compat.md)
and prints the file's counts, so a regression fails and progress shows.

Files whose tests need torch (``NEEDS_TORCH``) run with a Python that has it: this one,
else ``MTE_VLLM_VENV``'s (CPU torch), with the packages that environment lacks (pytest,
the etcd and redis clients, msgpack) linked in from this one (``tests/torch_env.py``).
Mooncake's own pure-Python modules the files import (``mooncake.structured_object_store``,
``mooncake.buffer_pool``) come from the checkout: its ``tests/conftest.py`` appends its
``mooncake/`` source directory to the installed package's path, as in its CI.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from servers import EtcdServer, HttpMetadataServer, RedisServer, _serve
from torch_env import overlay, torch_python, why_no_torch

pytestmark = pytest.mark.timeout(900)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.environ.get("MTE_MOONCAKE_SRC", "")

#: file -> the fewest of its tests that must pass on each metadata server (measured with
#: Mooncake 3b5a594 on etcd, redis and our HTTP server), run without torch.
EXPECTED = {
    "test_import_structure.py": 3,
    "test_distributed_object_store.py": 16,
    "test_replicated_distributed_object_store.py": 5,
    "test_batch_replica_clear.py": 12,
    "test_buffer_pool_native.py": 16,
    "test_dummy_client.py": 6,
    "test_multi_dummy_clients.py": 2,
    "test_put_get_tensor.py": 31,
    "test_safetensor_functions.py": 6,
    "test_structured_object_store.py": 112,
    # scripts/ (torch only)
    "test_tensor_api.py": 59,
    "test_upsert_api.py": 41,
}
#: files that live in Mooncake's scripts/ directory, not mooncake-wheel/tests/
SCRIPTS = ("test_tensor_api.py", "test_upsert_api.py")
#: the floors where the file ran with a Python that has torch (its torch tests run):
#: test_dummy_client.py's two CUDA IPC tests skip without CUDA, test_put_get_tensor.py's
#: CUDA test likewise; test_structured_object_store.py's
#: test_dataproto_helper_reads_rows_with_real_store_ranges fails in Mooncake's own module
#: at 3b5a594 (``_RawDestinationBuffer`` is built with arguments but is no dataclass)
EXPECTED_WITH_TORCH = {"test_dummy_client.py": 8, "test_structured_object_store.py": 135}
#: files whose tests need torch: they run with a Python that has it (this one, else
#: MTE_VLLM_VENV's, with the packages it lacks linked in: torch_env.overlay); without
#: one, those in TORCH_ONLY are skipped and the others run here (their torch tests skip)
NEEDS_TORCH = ("test_put_get_tensor.py", "test_safetensor_functions.py",
               "test_structured_object_store.py", "test_dummy_client.py") + SCRIPTS
TORCH_ONLY = ("test_put_get_tensor.py", "test_safetensor_functions.py") + SCRIPTS
#: files that talk to a real client (Mooncake's ``mooncake_client``) on 127.0.0.1:50052
NEEDS_REAL_CLIENT = ("test_dummy_client.py", "test_multi_dummy_clients.py")
REAL_CLIENT_PORT = 50052


def _tests_dir() -> str | None:
    if not SRC:
        return None
    for cand in (os.path.join(SRC, "mooncake-wheel", "tests"), os.path.join(SRC, "tests")):
        if os.path.isfile(os.path.join(cand, "test_distributed_object_store.py")):
            return cand
    return None


@pytest.fixture(scope="module")
def tests_dir():
    d = _tests_dir()
    if d is None:
        pytest.skip("Mooncake's own test files are not on this machine: set "
                    "MTE_MOONCAKE_SRC to a kvcache-ai/Mooncake checkout (they run from "
                    "there, byte for byte, and are never copied into this repository)"
                    if not SRC else
                    f"MTE_MOONCAKE_SRC={SRC!r} holds no mooncake-wheel/tests/"
                    f"test_distributed_object_store.py")
    return d


@pytest.fixture(scope="module")
def shim_site(tmp_path_factory):
    site = str(tmp_path_factory.mktemp("shim-site"))
    r = subprocess.run([sys.executable, "-m", "mooncake_te", "compat", "install",
                        "--target", site], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return site


@pytest.fixture(scope="module", params=["etcd", "redis", "http"])
def metadata_url(request):
    cls = {"etcd": EtcdServer, "redis": RedisServer, "http": HttpMetadataServer}[request.param]
    yield from (srv.url for srv in _serve(cls))


def _env(site: str, url: str, libs: str = "") -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([site, ROOT] + ([libs] if libs else [])),
                MC_METADATA_SERVER=url, LOCAL_HOSTNAME=os.environ.get("MTE_MOONCAKE_LOCAL_HOSTNAME", "localhost"),
                PROTOCOL="tcp",
                DEVICE_NAME="", MC_TCP_BIND_ADDRESS="127.0.0.1",
                MASTER_SERVER="127.0.0.1:50051")


@contextlib.contextmanager
def real_client(site: str, url: str, tmp):
    """Mooncake's ``mooncake_client`` as its CI starts it for the dummy-client files
    (``python -m mooncake.cli_client`` through the shim), on 127.0.0.1:50052."""
    log = open(os.path.join(str(tmp), "real_client.log"), "w+")
    p = subprocess.Popen([sys.executable, "-m", "mooncake.cli_client", "--host=127.0.0.1",
                          f"--port={REAL_CLIENT_PORT}", "--global_segment_size=1GB",
                          f"--metadata_server={url}"], env=_env(site, url),
                         stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            log.seek(0)
            if "serving dummy clients" in log.read():
                break
            if p.poll() is not None:
                log.seek(0)
                raise AssertionError(f"the real client ended ({p.returncode}):\n{log.read()}")
            time.sleep(0.2)
        else:
            raise AssertionError("the real client did not start in 60 s")
        yield p
    finally:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()


def _python_for(name: str, tmp) -> "tuple[str, str]":
    """The Python a file runs with and the directory of linked packages for it."""
    if name not in NEEDS_TORCH:
        return sys.executable, ""
    py = torch_python()
    if py is None:
        if name in TORCH_ONLY:
            pytest.skip(f"{name} needs torch: {why_no_torch()}")
        return sys.executable, ""
    if py == sys.executable:
        return py, ""
    return py, overlay(py, os.path.join(str(tmp), "libs"),
                       dists=("etcd3gw", "redis", "pytest", "pytest-timeout", "msgpack"))


def _scripts_env(url: str) -> dict:
    """The settings Mooncake's scripts/ suites read (``MooncakeConfig.load_from_env``,
    ``setUpModule``): this store on 127.0.0.1 with a 1 GiB segment (their default is
    16 GiB)."""
    return {"MOONCAKE_MASTER": "127.0.0.1:50051", "MOONCAKE_TE_META_DATA_SERVER": url,
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1", "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_DEVICE": "", "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(1 << 30),
            "MOONCAKE_LOCAL_BUFFER_SIZE": str(256 << 20)}


def run_file(tests_dir: str, name: str, site: str, url: str, tmp) -> dict:
    """Run one of Mooncake's files; ``{"passed", "failed", "errors", "skipped",
    "total", "failures": [test ids], "python"}``."""
    xml = os.path.join(str(tmp), "junit.xml")
    py, libs = _python_for(name, tmp)
    env = _env(site, url, libs)
    if name in SCRIPTS:      # <Mooncake>/scripts beside <Mooncake>/mooncake-wheel/tests
        tests_dir = os.path.join(os.path.dirname(os.path.dirname(tests_dir)), "scripts")
        env.update(_scripts_env(url))
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "no:randomly", "-o", "junit_family=xunit2", "--timeout", "240"]
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "total": 0, "failures": [],
           "python": py}
    if name == "test_multi_dummy_clients.py":
        # Mooncake's CI runs it as a script, two processes (--client-id client1 /
        # client2) waiting for each other's keys; unittest's verbose lines say how each
        # test went.
        procs = [subprocess.Popen([sys.executable, name, "--client-id", cid], cwd=tests_dir,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for cid in ("client1", "client2")]
        outs = [p.communicate(timeout=850)[0] for p in procs]
        for cid, o in zip(("client1", "client2"), outs):
            for m in re.finditer(r"^(test\w+) \(([\w.]+)\).*?\.\.\. (ok|FAIL|ERROR|skipped)",
                                 o, re.M | re.S):
                out["total"] += 1
                kind = {"ok": "passed", "FAIL": "failed", "ERROR": "errors",
                        "skipped": "skipped"}[m.group(3)]
                out[kind] += 1
                if kind in ("failed", "errors"):
                    out["failures"].append(f"{m.group(2)}::{m.group(1)}[{cid}]")
        out["tail"] = "\n".join(o[-3000:] for o in outs)
        return out
    r = subprocess.run(cmd + [f"--junitxml={xml}", name], cwd=tests_dir, env=env,
                       capture_output=True, text=True, timeout=850)
    if not os.path.exists(xml):
        raise AssertionError(f"{name}: no report\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    for case in cases:
        out["total"] += 1
        tid = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            out["failed"] += 1
            out["failures"].append(tid)
        elif case.find("error") is not None:
            out["errors"] += 1
            out["failures"].append(tid)
        elif case.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    out["tail"] = r.stdout[-6000:]
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_mooncake_file(tests_dir, shim_site, metadata_url, name, tmp_path, request):
    if name in NEEDS_REAL_CLIENT:
        with real_client(shim_site, metadata_url, tmp_path):
            res = run_file(tests_dir, name, shim_site, metadata_url, tmp_path)
    else:
        res = run_file(tests_dir, name, shim_site, metadata_url, tmp_path)
    kind = metadata_url.split(":", 1)[0]
    line = (f"{name} [{kind}]: {res['passed']} passed, {res['failed']} failed, "
            f"{res['errors']} errors, {res['skipped']} skipped of {res['total']} "
            f"({res['python']})")
    print(line)
    if os.environ.get("MTE_MOONCAKE_LOG"):          # one line per case, for reports
        with open(os.environ["MTE_MOONCAKE_LOG"], "a") as f:
            f.write(line + (" | not passing: " + ", ".join(res["failures"])
                            if res["failures"] else "") + "\n")
    floor = EXPECTED[name]
    if res["python"] != sys.executable or torch_python() == sys.executable:
        floor = EXPECTED_WITH_TORCH.get(name, floor)
    assert res["passed"] >= floor, f"{line}\n{res['failures']}\n{res['tail']}"

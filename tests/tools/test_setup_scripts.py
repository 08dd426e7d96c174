# SPDX-License-Identifier: Apache-2.0
"""The README's two commands install what each uses (issue 41, items 2 and 3):
``scripts/demo.sh`` sets up only a compiler and Python (``setup.sh --demo``), never the
fabric lab's packages or the servers; ``scripts/test.sh`` (CI's command, via ``.ci/run``)
still sets up everything, and runs pytest with a skip summary. The package lists come
from ``setup.sh --list``, which prints them and stops: no apt-get runs here."""
from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETUP = os.path.join(ROOT, "scripts", "setup.sh")
# What the fabric lab, the servers and the docs' tools bring: the tests', not the demo's.
LAB_AND_SERVERS = {"qemu-system-x86", "busybox-static", "kmod", "rdma-core",
                   "ibverbs-providers", "ibverbs-utils", "perftest", "libibverbs-dev",
                   "nvme-cli", "redis-server", "etcd-server", "etcd-client", "fio", "curl"}


def _list(*args):
    r = subprocess.run(["bash", SETUP, *args, "--list"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def _script(name):
    with open(os.path.join(ROOT, "scripts", name)) as f:
        return [ln for ln in f.read().splitlines() if not ln.lstrip().startswith("#")]


def test_demo_installs_only_a_compiler_and_python():
    demo = _list("--demo")
    assert {"gcc", "python3-dev", "python3-venv"} <= demo
    assert not demo & LAB_AND_SERVERS, f"the demo installs what it does not use: " \
                                       f"{sorted(demo & LAB_AND_SERVERS)}"
    assert any(re.search(r"scripts/setup\.sh --demo\b", ln) for ln in _script("demo.sh"))


def test_the_test_command_still_installs_everything():
    full = _list()
    assert LAB_AND_SERVERS | _list("--demo") <= full
    calls = [ln for ln in _script("test.sh") if "setup.sh" in ln]
    assert calls and all("--demo" not in ln for ln in calls), calls
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "./scripts/test.sh" in f.read()


def test_setup_refuses_unknown_options():
    r = subprocess.run(["bash", SETUP, "--dmeo"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--dmeo" in r.stderr


def test_test_command_prints_a_skip_summary():
    pytest_line = next(ln for ln in _script("test.sh") if "-m pytest" in ln)
    words = pytest_line.split()
    assert "-q" in words and "-rs" in words, pytest_line

# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te lab run`` end to end: each test boots the guest (tens of seconds under
software emulation), so there are two, and each checks several things at once.

Skipped with the reason where this machine cannot run the lab (no qemu, not root, no
package archive); ``--fabric=required`` / ``MOONCAKE_FABRIC=required`` fails instead.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest

from mooncake_te import lab
from mooncake_te.lab import host


@pytest.fixture(scope="module")
def lab_ready(request):
    try:
        host.check(boot=True)
        lab.prepare(refresh=False, log=lambda m: None)
    except lab.LabUnavailableError as e:
        if request.config.getoption("fabric", "auto") == "required" or \
                os.environ.get("MOONCAKE_FABRIC") == "required":
            pytest.fail(f"the fabric lab is required here but cannot run: {e}")
        pytest.skip(f"the fabric lab cannot run here: {e}")


def _lab_cli(*args, env=None, cwd=None, timeout=360):
    """Run ``mooncake-te lab ...``; return its CompletedProcess-like result and whether a
    qemu it started is still alive afterwards (found by its run folder, which is named
    after the CLI's pid, on qemu's command line)."""
    p = subprocess.Popen([sys.executable, "-m", "mooncake_te.cli.main", "lab", *args],
                         cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=timeout)
    mark = f"/runs/run-{p.pid}-".encode()
    left = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                if mark in f.read():
                    left.append(cmdline)
        except OSError:
            pass
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), left


def test_run_passes_exit_status_cwd_env_and_output(lab_ready, tmp_path):
    """The command runs in this folder with this environment, its output streams back
    byte for byte (no carriage returns from the serial console), and its exit status
    is the command line's."""
    env = dict(os.environ, MTE_LAB_PROBE="hello from the host")
    script = ('printf "%s|%s|%s\\n" "$MTE_LAB_PROBE" "$(pwd)" "$MOONCAKE_LAB"; '
              'printf "no newline at the end"; exit 7')
    t = time.monotonic()
    r, left = _lab_cli("run", "--rxe", "0", "--timeout", "300", "--", "sh", "-c", script,
                       cwd=tmp_path, env=env)
    took = time.monotonic() - t
    assert r.returncode == 7, r.stderr.decode()
    assert r.stdout == f"hello from the host|{tmp_path}|1\nno newline at the end".encode(), \
        (r.stdout, r.stderr.decode())
    assert not left, "qemu left running"
    print(f"lab run, one boot: {took:.1f} s")


def test_timeout_kills_the_guest_and_shows_the_console(lab_ready):
    r, left = _lab_cli("run", "--rxe", "0", "--timeout", "2", "--", "sleep", "1000",
                       timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 124, err
    assert err.startswith("mooncake-te lab: the guest did not finish within 2 s") and \
        "Last console lines" in err
    assert not left, "qemu left running"

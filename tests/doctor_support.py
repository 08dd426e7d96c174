# SPDX-License-Identifier: Apache-2.0
"""What the doctor's tests share (tests/unit/test_doctor.py: checks on fake machines;
tests/metadata/test_doctor_metadata.py: the metadata checks against real servers):
the fake sysfs machines, a fake procfs, config files, running checks, reading findings."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mooncake_te.doctor import Context, Severity, run_checks

HERE = os.path.dirname(os.path.abspath(__file__))   # tests/
ROOT = os.path.dirname(HERE)


from sysfs_trees import machines  # noqa: E402,F401  (the doctor tests use it)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("sysfs")
    out = {name: build(str(base / name)) for name, build in machines.MACHINES.items()}
    out["onebox_down"] = machines.build_onebox(str(base / "onebox_down"), port_state="DOWN")
    out["onebox_nogid"] = machines.build_onebox(str(base / "onebox_nogid"), with_gids=False)
    return out


OPEN_580 = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release "
            "Build  (dvs-builder@U16-I3-B03-4-3)  Thu Apr  2 2026\nGCC version:  gcc 12.2.0\n")
PROPRIETARY_535 = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 "
                   "01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n")


def fake_proc(tmp_path, nvidia: "str | None" = OPEN_580, kernel: str = "6.8.0-45-generic"):
    """A procfs folder with the two files the GPUDirect check reads."""
    root = tmp_path / "proc"
    (root / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
    (root / "sys" / "kernel" / "osrelease").write_text(kernel + "\n")
    if nvidia is not None:
        (root / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
        (root / "driver" / "nvidia" / "version").write_text(nvidia)
    return str(root)


def toml(tmp_path, text, name="config.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def run(trees, machine="empty", config=None, vllm=None, env=None, role=None, proc=None,
        only=None, tmp_path=None, **kw):
    ctx = Context(config_path=config, vllm_config_path=vllm, sysfs_root=trees[machine],
                  proc_root=proc or (fake_proc(tmp_path) if tmp_path else "/nonexistent"),
                  env=env or {}, role=role, timeout_s=1.0, **kw)
    return run_checks(ctx, only=only)


def problems(findings, code=None):
    """(code, severity) of every error and warning, or the findings with ``code``."""
    bad = [f for f in findings if f.severity in (Severity.ERROR, Severity.WARNING)]
    if code is None:
        return sorted((f.code, str(f.severity)) for f in bad)
    return [f for f in bad if f.code == code]


def metadata_toml(tmp_path, kind, address, name="md.toml"):
    return toml(tmp_path, f"[metadata]\nserver_type = '{kind}'\nserver_address = '{address}'\n",
                name)


def _need(what: str, fix: str):
    """Skip for lack of ``what`` on a developer machine; fail under CI=true, where the
    setup installs it, so a broken setup cannot hide behind a skip (as tests/servers.py)."""
    msg = f"{what} is needed: {fix}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg)
    pytest.skip(msg)


def _cli(*argv):
    env = dict(os.environ, PYTHONPATH=ROOT)
    for k in [k for k in env if k.startswith("MC_")]:
        del env[k]
    p = subprocess.run([sys.executable, "-m", "mooncake_te", "doctor", *argv], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout

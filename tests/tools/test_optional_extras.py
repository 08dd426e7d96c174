# SPDX-License-Identifier: Apache-2.0
"""Tests of the optional extras skip, saying what to install, when the extra is missing
(issue 35: on a machine without redis, etcd3gw, aiohttp and requests nine tests errored
or failed instead). Runs a sample of them under ``tests/tools/without_extras.py``."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAMPLE = [
    "tests/metadata/test_metadata_server.py",                 # imports requests at the top
    "tests/metadata/test_metadata_server_limits.py",
    "tests/metadata/test_metadata_hardening.py",
    "tests/metadata/test_metadata_stores.py::test_bad_specs",
    "tests/metadata/test_metadata_stores.py::test_connection_refused_names_backend_and_address",
    "tests/metadata/test_metadata_stores.py::test_default_port_hint",
    "tests/metadata/test_metadata_stores.py::test_missing_client_library_names_the_extra",
    "tests/metadata/test_wrong_port.py::test_closed_store_port_fails_fast_and_quietly",
    "tests/integrations/test_compat_metadata.py::test_failed_register_leaves_nothing",
    "tests/services/test_kvcache.py::test_shared_cache_dir_across_processes",
]


@pytest.mark.timeout(300)
def test_missing_extras_skip_with_the_install_command():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "tests", "tools"), ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("CI", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "without_extras", "-q", "-rs",
                        "-p", "no:cacheprovider", "--timeout", "60", *SAMPLE],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    summary = out.strip().splitlines()[-1]
    assert "skipped" in summary and not re.search(r"\b(failed|error)", summary), summary
    # every skip says what to install
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert skips and all("pip install mooncake-te[" in line for line in skips), skips

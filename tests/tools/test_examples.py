# SPDX-License-Identifier: Apache-2.0
"""The README's examples run as they are."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_example_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "shm TransferStatus(state='completed', transferred_bytes=65536)" in out.stdout
    assert "req-42 done" in out.stdout and "not inside a region it registered" in out.stdout


def test_python_dash_m_help():
    out = subprocess.run([sys.executable, "-m", "mooncake_te", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "mooncake-te" in out.stdout

# SPDX-License-Identifier: Apache-2.0
"""Issue 41 (a newcomer's first hour, round 3), the command-line items: every one run as
a user runs it, in a subprocess, checking the exit status and what it prints."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

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

# SPDX-License-Identifier: Apache-2.0
"""The atheris fuzz targets in fuzz/, run for a bounded number of inputs in CI (issue #20
item 3), and the inputs they found, kept as regression tests."""
from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mooncake_te.errors import AuthenticationError, MetadataError
from mooncake_te.metadata import framing

ROOT = Path(__file__).resolve().parents[2]


def _has_atheris() -> bool:
    try:
        import atheris  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not _has_atheris(), reason="atheris is not installed (pip install atheris)")
@pytest.mark.parametrize("target,runs", [("fuzz_rpc.py", 20000), ("fuzz_wire.py", 600)])
def test_fuzz_target(target, runs, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "fuzz" / target), f"-runs={runs}",
                          "-seed=20", f"-artifact_prefix={tmp_path}/"],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, f"{target}: exit {res.returncode}\n{res.stderr[-6000:]}"
    assert "DONE" in res.stderr or "Done" in res.stderr


# Found by fuzz_rpc.py: a server answering the AUTH challenge with a frame that is not
# JSON made client_auth raise JSONDecodeError instead of AuthenticationError.
FOUND = ["9wgAAAAAAAAAAAAAAAAAAAD/"]


@pytest.mark.parametrize("case", FOUND)
def test_found_client_inputs(case):
    data = base64.b64decode(case)[1:]
    a, b = socket.socketpair()
    feeder = threading.Thread(target=lambda: (b.sendall(data), b.shutdown(socket.SHUT_WR)))
    feeder.start()
    try:
        a.settimeout(2.0)
        with pytest.raises((AuthenticationError, MetadataError, ConnectionError)):
            framing.client_auth(a, b"token", "fuzz")
    finally:
        feeder.join()
        a.close()
        b.close()


@pytest.mark.parametrize("answer", [b"[]", b'"x"', b"\xff\xfe", b'{"nonce": "zz"}',
                                    b'{"nonce": 5, "proof": []}'])
def test_client_auth_refuses_garbage_with_a_typed_error(answer):
    a, b = socket.socketpair()

    def serve():
        framing.recv_frame(b)
        framing.send_frame(b, framing.AUTH, answer)
        b.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=serve)
    t.start()
    try:
        a.settimeout(2.0)
        with pytest.raises(AuthenticationError):
            framing.client_auth(a, b"token", "fuzz")
    finally:
        t.join()
        a.close()
        b.close()

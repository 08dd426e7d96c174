# SPDX-License-Identifier: Apache-2.0
"""Fabric tier: real RDMA verbs devices (natively, or Soft-RoCE in the lab guest).

The RDMA transport itself is a later piece of work; these tests pin down what it will
stand on: verbs devices that libibverbs sees with ACTIVE ports, and RDMA WRITEs that
really cross from one device to another.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest

pytestmark = pytest.mark.rdma


def _lab_devices():
    """The lab's rxe devices (``MOONCAKE_LAB_RXE``), or None when not in the lab."""
    raw = os.environ.get("MOONCAKE_LAB_RXE")
    return json.loads(raw) if raw else None


def _need(tool, package):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (apt-get install {package})")


def test_ibv_devinfo_shows_active_ports():
    """libibverbs (through rdma-core's providers) lists every device with an ACTIVE port."""
    _need("ibv_devinfo", "ibverbs-utils")
    out = subprocess.run(["ibv_devinfo"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    states = dict(re.findall(r"hca_id:\s*(\S+).*?state:\s*(\S+)", out.stdout, re.S))
    assert states, f"ibv_devinfo listed no device:\n{out.stdout}{out.stderr}"
    lab = _lab_devices()
    if lab is not None:
        assert sorted(states) == sorted(d["name"] for d in lab), states
        assert all(s == "PORT_ACTIVE" for s in states.values()), states
    else:
        assert "PORT_ACTIVE" in states.values(), states


def test_lab_devices_carry_their_ipv4_gids():
    """Each lab rxe device has a RoCE v2 GID for its veth address (what RDMA CM and
    our transport will resolve peers by)."""
    lab = _lab_devices()
    if lab is None:
        pytest.skip("not in the fabric lab (MOONCAKE_LAB_RXE unset)")
    for d in lab:
        base = f"/sys/class/infiniband/{d['name']}/ports/1"
        idx = d["gid_index"]
        with open(f"{base}/gids/{idx}") as f:
            gid = f.read().strip()
        a, b, c, e = (int(x) for x in d["addr"].split("."))
        assert gid.endswith(f"ffff:{a:02x}{b:02x}:{c:02x}{e:02x}"), (d, gid)
        with open(f"{base}/gid_attrs/types/{idx}") as f:
            assert f.read().strip() == "RoCE v2"


def _counter(dev, name):
    with open(f"/sys/class/infiniband/{dev}/ports/1/hw_counters/{name}") as f:
        return int(f.read())


def _wait_listen(port, proc, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as f:
            if any(ln.split()[1].endswith(f":{port:04X}") and ln.split()[3] == "0A"
                   for ln in list(f)[1:]):
                return
        if proc.poll() is not None:
            pytest.fail(f"ib_write_bw server exited: {proc.communicate()[0]}")
        time.sleep(0.1)
    pytest.fail(f"ib_write_bw server did not listen on port {port} in {timeout} s")


def test_rdma_write_crosses_between_devices():
    """perftest's ib_write_bw moves 64 KiB RDMA WRITEs from rxe1 to rxe0 across the veth
    pair, and each device's hardware counters saw the packets (not rxe's internal
    loopback, which the lab's routing rules rule out)."""
    lab = _lab_devices()
    if not lab or len(lab) < 2:
        pytest.skip("needs the fabric lab's two rxe devices")
    _need("ib_write_bw", "perftest")
    srv, cli = lab[0], lab[1]
    sent0, rcvd0 = _counter(cli["name"], "sent_pkts"), _counter(srv["name"], "rcvd_pkts")
    port = 18600
    common = ["-s", "65536", "-n", "100", "-F", "-p", str(port)]
    server = subprocess.Popen(["ib_write_bw", "-d", srv["name"], "-x", str(srv["gid_index"]),
                               *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        _wait_listen(port, server)
        client = subprocess.run(["ib_write_bw", "-d", cli["name"], "-x",
                                 str(cli["gid_index"]), *common, srv["addr"]],
                                capture_output=True, text=True, timeout=120)
        server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert client.returncode == 0, client.stdout + client.stderr
    assert re.search(r"^\s*65536\s+100\s+", client.stdout, re.M), client.stdout
    # 100 WRITEs of 64 KiB at rxe's default 1024-byte MTU is at least 6400 packets.
    assert _counter(cli["name"], "sent_pkts") - sent0 >= 6400
    assert _counter(srv["name"], "rcvd_pkts") - rcvd0 >= 6400

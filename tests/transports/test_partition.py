# SPDX-License-Identifier: Apache-2.0
"""A real network partition: the target engine lives in a network namespace behind a
veth pair; taking the link down must turn transfers into clean timeouts, and bringing it
back must let them work again."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import mooncake_te as mte

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/


def _sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def netns():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"{os.getpid() % 10000}"
    ns, host_if, ns_if = f"mte-t{tag}", f"mteh{tag}", f"mten{tag}"
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    try:
        _sh("ip", "netns", "add", ns)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot create a network namespace here: {e}")
    try:
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _sh("ip", "link", "set", ns_if, "netns", ns)
        _sh("ip", "addr", "add", f"{net}.1/24", "dev", host_if)
        _sh("ip", "link", "set", host_if, "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{net}.2/24", "dev", ns_if)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_if, f"{net}.1", f"{net}.2"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_partition_times_out_and_recovers(netns):
    ns, host_if, host_ip, ns_ip = netns
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable,
                             os.path.join(HERE, "netns_target.py"), ns_ip],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        with mte.TransferEngine(host=host_ip) as eng:
            buf = np.arange(1 << 20, dtype=np.uint8)
            r = eng.register(buf)
            eng.write(info["name"], r.address, info["address"], 1 << 20)

            _sh("ip", "link", "set", host_if, "down")
            t0 = time.monotonic()
            with pytest.raises(mte.TransferError):       # TransferTimeoutError or lost link
                eng.write(info["name"], r.address, info["address"], 1 << 20, timeout=2)
            assert time.monotonic() - t0 < 6

            _sh("ip", "link", "set", host_if, "up")
            deadline = time.monotonic() + 20
            while True:                                 # the route comes back within seconds
                try:
                    eng.write(info["name"], r.address, info["address"], 1 << 20, timeout=3)
                    break
                except (mte.TransferError, mte.SegmentNotFoundError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            eng.read(info["name"], r.address + (1 << 19), info["address"], 4096)
            assert (buf[1 << 19: (1 << 19) + 4096] == np.arange(4096, dtype=np.uint8)).all()
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_shm_only_engine_refuses_a_peer_on_another_network_namespace(netns):
    ns, host_if, host_ip, ns_ip = netns
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable,
                             os.path.join(HERE, "netns_target.py"), ns_ip],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        with mte.TransferEngine(host=host_ip, protocol="shm") as eng:
            r = eng.register(np.zeros(4096, np.uint8))
            with pytest.raises(mte.TransportUnavailableError, match="on this host only"):
                eng.write(info["name"], r.address, info["address"], 4096)
        with mte.TransferEngine(host=host_ip) as eng:             # auto: falls to TCP
            r = eng.register(np.zeros(4096, np.uint8))
            b = eng.submit_arrays(mte.WRITE, info["name"], [r.address], [info["address"]], 4096)
            b.wait()
            assert b.transport == "tcp"
    finally:
        proc.stdin.close()
        proc.wait(10)

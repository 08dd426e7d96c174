# SPDX-License-Identifier: Apache-2.0
"""This host's addresses (mooncake_te/netif.py): the engine's default host is the first UP
non-loopback IPv4 interface, else 127.0.0.1 (Mooncake's rule). Checked in network
namespaces of our own, where the interfaces are ours to make (nothing is connected to)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from mooncake_te.netif import default_host, interface_address


def test_loopback_and_a_missing_interface():
    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("mte-none0") is None


def _in_netns(setup: str) -> str:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("needs root, unshare and ip to make a network namespace")
    code = "from mooncake_te.netif import default_host; print(default_host())"
    # a mount namespace too: sysfs shows the interfaces of the netns that mounts it
    r = subprocess.run(["unshare", "-n", "-m", "sh", "-c", "mount -t sysfs sysfs /sys && "
                        f"{setup} {sys.executable} -c '{code}'"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    if r.returncode and "Operation not permitted" in r.stderr:
        pytest.skip(f"no network namespaces here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_only_loopback_gives_127_0_0_1():
    assert _in_netns("ip link set lo up &&") == "127.0.0.1"


def test_first_up_non_loopback_interface_wins():
    up = ("ip link set lo up && ip link add mte0 type veth peer name mte1 && "
          "ip addr add 10.99.0.7/24 dev mte0 && ip link set mte0 up &&")
    assert _in_netns(up) == "10.99.0.7"
    # an interface that is down is not an address peers can reach
    down = "ip link add mte0 type veth peer name mte1 && ip addr add 10.99.0.7/24 dev mte0 &&"
    assert _in_netns(down) == "127.0.0.1"


def test_the_host_default_is_an_address_of_this_host():
    h = default_host()
    assert h == "127.0.0.1" or any(interface_address(n) == h for _, n in
                                   __import__("socket").if_nameindex())

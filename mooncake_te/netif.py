# SPDX-License-Identifier: Apache-2.0
"""This host's addresses, as the kernel reports them."""
from __future__ import annotations

import fcntl
import socket
import struct

from .topology.sysfs import SysfsTree

_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8          # linux/if.h
_SIOCGIFADDR = 0x8915                      # linux/sockios.h


def interface_address(ifname: str) -> str | None:
    """The IPv4 address of interface ``ifname`` (SIOCGIFADDR), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        return socket.inet_ntoa(res[20:24])
    except OSError:
        return None


def default_host() -> str:
    """First UP non-loopback IPv4 interface address, else 127.0.0.1 (Mooncake's rule)."""
    sysfs = SysfsTree()
    for _, ifname in socket.if_nameindex():
        text = sysfs.read(f"class/net/{ifname}/flags")
        if text is None:
            continue
        flags = int(text, 16)
        if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
            continue
        addr = interface_address(ifname)
        if addr is not None:
            return addr
    return "127.0.0.1"

# SPDX-License-Identifier: Apache-2.0
"""This host's identity, as every transport compares it.

Two engines with the same ``HOST_ID`` share a kernel boot, a PID namespace (pids mean the
same) and a network namespace (abstract unix sockets are per network namespace), so
same-host shortcuts (shared memory, cross-memory attach, CUDA IPC, local block devices)
are possible between them.
"""
from __future__ import annotations

import os


def host_id() -> str:
    """The identity of this kernel boot, PID and network namespace; "" when unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


HOST_ID = host_id()

# SPDX-License-Identifier: Apache-2.0
"""The fabric lab: real RDMA verbs devices and a real NVMe-oF target on any Linux box.

A guest kernel (Debian's own, fetched with apt) boots under qemu with the host's ``/``
as its root filesystem over 9p, loads Soft-RoCE (``rdma_rxe``) on veth pairs and an
``nvmet`` target over TCP, and runs one command: the same Python, virtualenv and build
as on the host. Software emulation makes it slow (for correctness, not for speed).

>>> from mooncake_te import lab
>>> lab.prepare()                                        # doctest: +SKIP
>>> lab.run(["ibv_devinfo"], rxe=2).returncode           # doctest: +SKIP
0

See ``docs/fabric-lab.md``; ``mooncake-te lab --help`` is the command line.
"""
from __future__ import annotations

from .errors import GuestError, GuestTimeoutError, LabError, LabUnavailableError
from .guest import Result, run
from .host import DEBIAN_PACKAGES, has_nvmeof, has_rdma, in_guest
from .kernel import cache_dir
from .cache import Prepared, prepare

__all__ = ["run", "prepare", "Result", "Prepared", "cache_dir", "has_rdma", "has_nvmeof",
           "in_guest", "DEBIAN_PACKAGES", "LabError", "LabUnavailableError", "GuestError",
           "GuestTimeoutError"]

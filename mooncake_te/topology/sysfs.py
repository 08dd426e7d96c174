# SPDX-License-Identifier: Apache-2.0
"""Reading a sysfs tree rooted anywhere.

Discovery never assumes the tree is ``/sys``: tests point it at a folder of plain files
and *relative* symlinks laid out as the kernel lays out sysfs, and every path here is
resolved inside that root. The layout facts used are from the kernel's ABI documents:

- ``Documentation/ABI/testing/sysfs-bus-pci`` (``class``, ``vendor``, ``numa_node``),
- ``Documentation/ABI/stable/sysfs-class-infiniband`` (``ports/<n>/state``, ``rate``,
  ``link_layer``, ``gids/<i>``, ``gid_attrs/{types,ndevs}/<i>``),
- ``Documentation/ABI/stable/sysfs-devices-node`` (``node<N>/cpulist``),
- ``Documentation/ABI/testing/sysfs-class-nvme`` and ``drivers/nvme/host/sysfs.c``
  (``transport``, ``address``, ``subsysnqn``, namespace ``size`` in 512-byte sectors).
"""
from __future__ import annotations

import os
import re

# A PCI function address as sysfs names it: domain:bus:device.function (lower-case hex).
BDF_RE = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# A PCI host bridge (root complex) node directly under /sys/devices.
HOST_BRIDGE_RE = re.compile(r"^pci[0-9a-f]{4,}:[0-9a-f]{2}$")


def read_attr(path: str, default: "str | None" = None) -> "str | None":
    """Contents of one sysfs or configfs attribute file at ``path``, stripped; ``default``
    if absent or unreadable. The one reader of kernel attribute files in the package
    (topology, the NVMe-oF admin, the lab guest).

    Some attributes raise EINVAL/EIO on read when the hardware cannot answer (an IB
    port's ``rate`` while the link is down); those count as absent.
    """
    try:
        with open(path, "r", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return default


class SysfsTree:
    """A sysfs tree at ``root`` (``/sys`` on a live system).

    Parameters
    ----------
    root : str or os.PathLike
        Folder holding ``class/``, ``bus/`` and ``devices/`` as the kernel lays them out.
    """

    def __init__(self, root: "str | os.PathLike" = "/sys"):
        self.root = os.path.realpath(os.fspath(root))

    def __repr__(self) -> str:
        return f"SysfsTree({self.root!r})"

    @property
    def is_live(self) -> bool:
        """True when this is the running kernel's own sysfs."""
        return self.root == os.path.realpath("/sys")

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def exists(self, *parts: str) -> bool:
        return os.path.exists(self.path(*parts))

    def listdir(self, *parts: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(*parts)))
        except OSError:
            return []

    def read(self, *parts: str, default: "str | None" = None) -> "str | None":
        """Contents of one attribute file, stripped; ``default`` if absent or unreadable
        (see :func:`read_attr`)."""
        return read_attr(self.path(*parts), default)

    def read_int(self, *parts: str, default: "int | None" = None, base: int = 0) -> "int | None":
        text = self.read(*parts)
        if text is None or text == "":
            return default
        try:
            return int(text.split()[0].rstrip(":"), base)
        except ValueError:
            return default

    def realpath(self, *parts: str) -> "str | None":
        """Resolve symlinks; None if the path does not exist or leaves the root."""
        p = self.path(*parts)
        if not os.path.lexists(p):
            return None
        real = os.path.realpath(p)
        if real != self.root and not real.startswith(self.root + os.sep):
            return None
        return real

    def device_components(self, real: str) -> list[str]:
        """Path components of a resolved device below ``<root>/devices``."""
        rel = os.path.relpath(real, self.path("devices"))
        if rel.startswith(".."):
            return []
        return [c for c in rel.split(os.sep) if c and c != "."]


def pci_chain(components: list[str]) -> list[str]:
    """The PCI part of a device path: host bridge, then each bridge, then the function.

    ``["pci0000:17", "0000:17:00.0", "0000:18:00.0", "0000:1a:00.0", "net", "eth2"]``
    gives the first four. A path without a host bridge (a virtual device) gives ``[]``.
    Non-PCI parents between the bridge and the function (``virtio2`` under a virtio PCI
    device) end the chain, so a virtio netdev maps to its PCI function.
    """
    if not components or not HOST_BRIDGE_RE.match(components[0]):
        return []
    chain = [components[0]]
    for c in components[1:]:
        if BDF_RE.match(c):
            chain.append(c)
        else:
            break
    return chain if len(chain) > 1 else []


def parse_cpulist(text: "str | None") -> list[int]:
    """Expand a kernel cpulist (``"0-3,8,10-11"``) into CPU numbers.

    Format: ``Documentation/admin-guide/kernel-parameters.rst`` ("cpu lists").
    """
    cpus: list[int] = []
    if not text:
        return cpus
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        stride = 1
        if ":" in part:          # "0-15:2/4" group syntax (rare in sysfs output)
            part, _, groups = part.partition(":")
            stride = int(groups.split("/")[0]) if groups else 1
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1, max(1, stride)))
        else:
            cpus.append(int(part))
    return cpus


def format_cpulist(cpus: list[int]) -> str:
    """The inverse of :func:`parse_cpulist` (ranges collapsed)."""
    out: list[str] = []
    cpus = sorted(set(cpus))
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)

# SPDX-License-Identifier: Apache-2.0
"""What the host needs to run the lab, and whether it already has the real thing.

Every requirement names the Debian package that provides it, so a missing one becomes
one line a user can act on (``apt-get install ...``).
"""
from __future__ import annotations

import glob
import os
import platform
import shutil
import struct
from dataclasses import dataclass

from .errors import LabUnavailableError

#: The static busybox that becomes the guest's initramfs (busybox-static installs it
#: here; the dynamic ``busybox`` package installs a binary of the same name that cannot
#: run in an initramfs holding no libc).
BUSYBOX = "/bin/busybox"


@dataclass(frozen=True)
class Tool:
    """A program the lab runs, and the Debian package that provides it."""

    name: str
    package: str
    why: str

    def hint(self) -> str:
        return f"{self.name} ({self.why}): apt-get install --no-install-recommends {self.package}"


# Needed on the host to prepare the guest (fetch and unpack its kernel, index modules).
PREPARE_TOOLS = (
    Tool("apt-get", "apt", "fetches the guest kernel package"),
    Tool("apt-cache", "apt", "finds the current guest kernel package"),
    Tool("dpkg", "dpkg", "unpacks the guest kernel package"),
    Tool("depmod", "kmod", "indexes the guest kernel's modules"),
)
# Needed to boot the guest.
BOOT_TOOLS = (
    Tool("qemu-system-x86_64", "qemu-system-x86", "runs the guest"),
)
# Run inside the guest from the host's own root filesystem (shared over 9p), so they
# must be installed on the host.
GUEST_TOOLS = (
    Tool("modprobe", "kmod", "loads the guest kernel's modules"),
    Tool("ip", "iproute2", "makes the veth pairs the Soft-RoCE devices sit on"),
    Tool("rdma", "iproute2", "creates the Soft-RoCE (rxe) devices"),
)
GUEST_NVMEOF_TOOLS = (
    Tool("nvme", "nvme-cli", "connects the NVMe-oF namespace"),
)
# Used by `mooncake-te lab selftest` and the fabric tests; rdma-core's provider
# library (ibverbs-providers) is what makes rxe devices visible to libibverbs.
SELFTEST_TOOLS = (
    Tool("ibv_devinfo", "ibverbs-utils", "lists verbs devices and port states"),
    Tool("ib_write_bw", "perftest", "moves data between rxe devices"),
)

#: Every Debian package the lab and its tests use (for CI setup scripts and the docs).
DEBIAN_PACKAGES = ("qemu-system-x86", "busybox-static", "kmod", "iproute2", "rdma-core",
                   "ibverbs-providers", "ibverbs-utils", "perftest", "nvme-cli")


def missing_tools(tools) -> list[tuple[str, str]]:
    """The tools not found on ``PATH`` (plus /sbin and /usr/sbin), as ``(name, hint)``."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [(t.name, t.hint()) for t in tools if shutil.which(t.name, path=path) is None]


def is_static_elf(path: str) -> bool:
    """True when ``path`` is an ELF executable with no program interpreter.

    A dynamically linked binary has a PT_INTERP program header naming its loader
    (elf(5)); the initramfs has no loader, so only a static busybox can run there.
    """
    try:
        with open(path, "rb") as f:
            ident = f.read(64)
            if ident[:4] != b"\x7fELF" or ident[4] != 2:        # ELFCLASS64 only
                return False
            endian = "<" if ident[5] == 1 else ">"
            phoff, = struct.unpack_from(endian + "Q", ident, 32)
            phentsize, phnum = struct.unpack_from(endian + "HH", ident, 54)
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                p_type, = struct.unpack(endian + "I", f.read(4))
                if p_type == 3:                                   # PT_INTERP
                    return False
            return True
    except OSError:
        return False


def check(*, prepare: bool = False, boot: bool = True, rxe: bool = True,
          nvmeof: bool = False, selftest: bool = False) -> None:
    """Raise :class:`LabUnavailableError` naming everything this host lacks.

    Parameters
    ----------
    prepare : bool
        Also check the tools that fetch and unpack the guest kernel.
    boot : bool
        Check what booting the guest needs (root, qemu, the guest-side tools).
    rxe : bool
        Also check the tools that make Soft-RoCE devices.
    nvmeof : bool
        Also check the NVMe-oF initiator tools.
    selftest : bool
        Also check the tools the self-test runs.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise LabUnavailableError(
            f"the lab runs an x86-64 Linux guest and needs an x86-64 Linux host "
            f"(this is {platform.system()} {platform.machine()})")
    missing: list[tuple[str, str]] = []
    tools = list(PREPARE_TOOLS if prepare else ())
    if boot:
        tools += BOOT_TOOLS + (GUEST_TOOLS if rxe else GUEST_TOOLS[:2])
        if nvmeof:
            tools += GUEST_NVMEOF_TOOLS
        if selftest:
            tools += SELFTEST_TOOLS + GUEST_NVMEOF_TOOLS
    missing += missing_tools(dict.fromkeys(tools))
    if prepare and not is_static_elf(BUSYBOX):
        missing.append(("busybox-static", f"{BUSYBOX} must be statically linked (the guest's "
                        "initramfs): apt-get install busybox-static"))
    if boot and os.geteuid() != 0:
        # The guest's root filesystem is the host's /, shared over 9p with
        # security_model=passthrough: qemu must be able to read and write every file as
        # its owner, which only root can (qemu docs, "-virtfs ... security_model").
        missing.append(("root", "the guest shares the host's / over 9p passthrough: "
                                "run as root (sudo mooncake-te lab ...)"))
    if missing:
        names = ", ".join(m[0] for m in missing)
        hints = "; ".join(m[1] for m in missing)
        raise LabUnavailableError(f"this host lacks {names}. {hints}", missing=missing)


def has_rdma() -> bool:
    """True when this kernel already shows RDMA verbs devices (real NICs or rxe)."""
    return bool(glob.glob("/sys/class/infiniband/*"))


def has_nvmeof() -> bool:
    """True when this kernel can be an NVMe-oF target (nvmet's configfs is mounted)."""
    return os.path.isdir("/sys/kernel/config/nvmet") and shutil.which("nvme") is not None


def in_guest() -> bool:
    """True inside a lab guest (stage 2 sets ``MOONCAKE_LAB=1`` for the command)."""
    return os.environ.get("MOONCAKE_LAB") == "1"

# SPDX-License-Identifier: Apache-2.0
"""The guest's initramfs: a static busybox, the modules that reach the 9p root, /init.

Written as a "newc" cpio archive by this module itself (the format is five lines of
spec: the kernel's Documentation/driver-api/early-userspace/buffer-format.rst), so the
host needs no ``cpio`` and the device node ``/dev/console`` can be made without root.

/init loads virtio and 9p, mounts the host's ``/`` (shared by qemu over 9p) and
``switch_root``s into it, running stage 2 (:mod:`mooncake_te.lab.stage2`) with the
host's own Python. Everything after that runs from the host's files.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
from pathlib import Path

from .host import BUSYBOX
from .kernel import Kernel, cache_dir, load_order

#: Modules /init loads with insmod to reach the root filesystem, dependencies first.
BOOT_MODULES = ("virtio_pci", "9pnet_virtio", "9p")

#: The 9p mount tag qemu's ``-virtfs ... mount_tag=`` gives the host's root.
MOUNT_TAG = "hostroot"

# Markers on the console: stage 2 prints them around the command's output so the host
# can tell the command's bytes from boot messages (see guest.py).
INIT_FAIL = "mooncake-lab: initramfs:"

# Kernel command line keys (read from /proc/cmdline: keys with a dot are module
# parameters to the kernel and are not passed to /init as arguments or environment,
# see Documentation/admin-guide/kernel-parameters.rst).
INIT_SCRIPT = r"""#!/bin/busybox sh
# mooncake-te lab, stage 1: reach the host's root over 9p, then hand over to stage 2.
/bin/busybox mkdir -p /bin /sbin /proc /sys /dev /newroot
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() {
    echo "@INIT_FAIL@ $*"
    echo o > /proc/sysrq-trigger
    sleep 60
}
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        mte.python=*) PY="${arg#mte.python=}" ;;
        mte.stage2=*) STAGE2="${arg#mte.stage2=}" ;;
        mte.run=*) RUNDIR="${arg#mte.run=}" ;;
    esac
done
[ -n "$PY" ] && [ -n "$STAGE2" ] && [ -n "$RUNDIR" ] || fail "no mte.python/stage2/run on the kernel command line"
for m in @MODULES@; do
    insmod "/modules/$m" || fail "insmod $m failed"
done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose @TAG@ /newroot || fail "mounting the host's root over 9p failed"
[ -x "/newroot$PY" ] || fail "no Python at $PY on the host's root"
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
exec switch_root /newroot "$PY" -S -E -s "$STAGE2" "$RUNDIR"
"""


class _Cpio:
    """Writer of a newc cpio archive (buffer-format.rst: "070701" headers)."""

    def __init__(self):
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev=(0, 0), nlink=1):
        nameb = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1],
                  len(nameb), 0]
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08X" % f for f in fields))
        self.buf.write(nameb)
        self.buf.write(b"\0" * (-(110 + len(nameb)) % 4))     # header+name pad to 4
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))

    def dir(self, name):
        self._entry(name, stat.S_IFDIR | 0o755, nlink=2)

    def file(self, name, data: bytes, mode=0o644):
        self._entry(name, stat.S_IFREG | mode, data)

    def chardev(self, name, major, minor, mode=0o600):
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def read_cpio(blob: bytes) -> dict[str, tuple[int, bytes]]:
    """Parse a newc archive back into ``{name: (mode, data)}`` (for tests)."""
    out, pos = {}, 0
    while True:
        h = blob[pos:pos + 110]
        assert h[:6] == b"070701", h[:6]
        f = [int(h[6 + 8 * i:14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = f[1], f[6], f[11]
        pos += 110
        name = blob[pos:pos + namesize - 1].decode()
        pos += namesize + (-(110 + namesize) % 4)
        data = blob[pos:pos + size]
        pos += size + (-size % 4)
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, data)


def init_script(modules) -> str:
    return (INIT_SCRIPT.replace("@MODULES@", " ".join(os.path.basename(m) for m in modules))
            .replace("@TAG@", MOUNT_TAG).replace("@INIT_FAIL@", INIT_FAIL))


def build(kernel: Kernel, busybox: str = BUSYBOX) -> bytes:
    """The gzip-compressed initramfs for ``kernel`` (a static ``busybox`` inside)."""
    mods = load_order(kernel, BOOT_MODULES)
    c = _Cpio()
    for d in ("bin", "dev", "modules", "proc", "sys", "newroot"):
        c.dir(d)
    # The kernel opens /dev/console for init's stdin/out/err before devtmpfs is mounted
    # (init/main.c, console_on_rootfs); without it /init has no output at all.
    c.chardev("dev/console", 5, 1)
    c.file("bin/busybox", Path(busybox).read_bytes(), 0o755)
    for m in mods:
        c.file("modules/" + os.path.basename(m), (kernel.modules / m).read_bytes())
    c.file("init", init_script(mods).encode(), 0o755)
    # mtime=0: the same inputs give the same bytes, so the cache key stays honest.
    return gzip.compress(c.finish(), compresslevel=6, mtime=0)


def ensure(kernel: Kernel, busybox: str = BUSYBOX) -> Path:
    """Path of the cached initramfs for ``kernel``, building it when inputs changed."""
    bb = Path(busybox)
    key = hashlib.sha256(f"{kernel.release}|{bb.stat().st_size}|{bb.stat().st_mtime_ns}|"
                         f"{INIT_SCRIPT}|{BOOT_MODULES}".encode()).hexdigest()[:16]
    path = kernel.root.parent / f"initramfs-{key}.img"
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(build(kernel, busybox))
        os.replace(tmp, path)
        for old in kernel.root.parent.glob("initramfs-*.img"):
            if old != path:
                old.unlink()
    return path


def run_root() -> Path:
    """Where each guest run keeps its spec and result (shared with the guest over 9p)."""
    return cache_dir() / "runs"

# SPDX-License-Identifier: Apache-2.0
"""The guest kernel: found in the distribution's archive, fetched, unpacked, cached.

The kernel is Debian's own ``linux-image-<abi>-amd64``, the one the
``linux-image-amd64`` metapackage depends on today. Its ABI number changes with every
security update, so it is looked up each ``prepare`` rather than written down here.
Everything the lab needs (virtio, 9p, veth, rdma_rxe, nvmet, nvme_tcp, ...) is a module
in that kernel (its ``/boot/config-*`` has them ``=m``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import LabError, LabUnavailableError

#: The metapackage that always depends on the current kernel image.
METAPACKAGE = "linux-image-amd64"


def cache_dir() -> Path:
    """The lab's cache folder.

    ``$MOONCAKE_LAB_CACHE`` when set, else ``$XDG_CACHE_HOME/mooncake-te/lab``, else
    ``~/.cache/mooncake-te/lab`` (XDG Base Directory Specification).
    """
    env = os.environ.get("MOONCAKE_LAB_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).resolve() / "mooncake-te" / "lab"


@dataclass(frozen=True)
class Kernel:
    """An unpacked guest kernel in the cache.

    Attributes
    ----------
    package : str
        The Debian package name (``linux-image-6.1.0-57-amd64``).
    version : str
        The package version (``6.1.192-3``).
    release : str
        The kernel release, ``uname -r`` in the guest and the folder under
        ``lib/modules``.
    root : Path
        Where the package is unpacked; ``modprobe -d root`` finds the modules.
    """

    package: str
    version: str
    release: str
    root: Path

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.release}"

    @property
    def modules(self) -> Path:
        return self.root / "lib" / "modules" / self.release

    def to_json(self) -> dict:
        return {"package": self.package, "version": self.version, "release": self.release,
                "root": str(self.root)}


def parse_depends(text: str) -> str | None:
    """The kernel image package named in ``apt-cache depends linux-image-amd64`` output."""
    for line in text.splitlines():
        m = re.match(r"\s*\|?Depends:\s*(linux-image-\S+)", line)
        if m and not m.group(1).startswith("<"):
            return m.group(1)
    return None


def current_package() -> str:
    """Ask apt which kernel image package ``linux-image-amd64`` depends on now.

    ``$MOONCAKE_LAB_KERNEL_PACKAGE`` overrides the lookup (a pinned kernel).
    """
    forced = os.environ.get("MOONCAKE_LAB_KERNEL_PACKAGE")
    if forced:
        return forced
    try:
        out = subprocess.run(["apt-cache", "depends", METAPACKAGE], capture_output=True,
                             text=True, timeout=120)
    except FileNotFoundError:
        raise LabUnavailableError("apt-cache is not installed: the lab fetches its guest "
                                  "kernel from a Debian-family archive with apt") from None
    pkg = parse_depends(out.stdout)
    if out.returncode != 0 or not pkg:
        raise LabUnavailableError(
            f"apt knows no kernel package behind {METAPACKAGE} "
            f"({(out.stderr.strip() or 'no Depends line').splitlines()[-1]}): run "
            f"'apt-get update' (as root) and try again, or set "
            f"MOONCAKE_LAB_KERNEL_PACKAGE to a linux-image-*-amd64 package")
    return pkg


def _kernels_dir() -> Path:
    return cache_dir() / "kernels"


def cached(package: str | None = None) -> Kernel | None:
    """The cached kernel for ``package`` (default: the newest one prepared), or None."""
    kdir = _kernels_dir()
    manifests = []
    if package:
        manifests = [kdir / package / "kernel.json"]
    elif kdir.is_dir():
        manifests = sorted(kdir.glob("*/kernel.json"), key=lambda p: p.stat().st_mtime)
    for mf in reversed(manifests):
        try:
            d = json.loads(mf.read_text())
        except (OSError, ValueError):
            continue
        k = Kernel(d["package"], d["version"], d["release"], mf.parent / "root")
        if k.vmlinuz.is_file() and (k.modules / "modules.dep").is_file():
            return k
    return None


def _run(argv, cwd=None, what="", error=LabError, hint=""):
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        lines = [ln for ln in (out.stderr + out.stdout).splitlines()
                 if ln.strip() and not ln.startswith("W:")]
        raise error(f"{what} failed: {' '.join(map(str, argv))}: "
                    f"{lines[-1] if lines else 'exit ' + str(out.returncode)}{hint}")
    return out


def fetch(package: str, log=print) -> Kernel:
    """Download ``package`` with apt, unpack it and index its modules, into the cache.

    Works in a temporary folder beside the final one and renames it into place last,
    so an interrupted fetch never leaves a half-unpacked kernel that looks ready.
    """
    kdir = _kernels_dir()
    kdir.mkdir(parents=True, exist_ok=True)
    final = kdir / package
    tmp = Path(tempfile.mkdtemp(prefix=f".{package}.", dir=kdir))
    try:
        t0 = time.monotonic()
        # apt drops to the _apt user for downloads unless told otherwise, and that user
        # cannot write into root's cache (apt.conf(5), APT::Sandbox::User).
        _run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package],
             cwd=tmp, what=f"downloading {package}", error=LabUnavailableError,
             hint=" (is the package name right? run 'apt-get update' and check that "
                  "this machine reaches its Debian mirror)")
        debs = list(tmp.glob(f"{package}_*.deb"))
        if not debs:
            raise LabError(f"apt-get download {package} left no .deb in {tmp}")
        deb = debs[0]
        version = deb.name[len(package) + 1:].rsplit("_", 1)[0].replace("%3a", ":")
        log(f"downloaded {deb.name} ({deb.stat().st_size / 1e6:.1f} MB) in "
            f"{time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        _run(["dpkg", "-x", str(deb), str(tmp / "root")], what=f"unpacking {deb.name}")
        deb.unlink()
        vmlinuz = sorted((tmp / "root" / "boot").glob("vmlinuz-*"))
        if not vmlinuz:
            raise LabError(f"{package} holds no boot/vmlinuz-*: is it a kernel image package?")
        release = vmlinuz[0].name[len("vmlinuz-"):]
        # The .deb ships no modules.dep (the postinst runs depmod on the installed
        # system); modprobe needs it, and -b points depmod at our unpacked tree.
        _run(["depmod", "-b", str(tmp / "root"), release], what="indexing modules")
        (tmp / "kernel.json").write_text(json.dumps(
            {"package": package, "version": version, "release": release}, indent=1))
        log(f"unpacked kernel {release} and indexed its modules in "
            f"{time.monotonic() - t0:.1f} s")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    k = cached(package)
    assert k is not None
    return k


def prune(keep: Kernel) -> list[str]:
    """Remove every cached kernel but ``keep``; returns the packages removed."""
    gone = []
    for d in _kernels_dir().iterdir():
        if d.is_dir() and d.name != keep.package:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
    return gone


def module_deps(kernel: Kernel) -> dict[str, list[str]]:
    """``modules.dep`` as ``{name: [path, dep paths...]}`` (names with ``_`` for ``-``)."""
    deps = {}
    for line in (kernel.modules / "modules.dep").read_text().splitlines():
        if ":" not in line:
            continue
        path, rest = line.split(":", 1)
        name = os.path.basename(path).split(".ko")[0].replace("-", "_")
        deps[name] = [path] + rest.split()
    return deps


def load_order(kernel: Kernel, names) -> list[str]:
    """Module paths (relative to the modules folder) to ``insmod`` for ``names``.

    Dependencies come first. ``modules.dep`` lists a module's dependencies with the
    deepest last (kmod's depmod writes them in reverse load order), so each line read
    backwards is a valid load order; merging lines keeps the first occurrence.
    """
    deps = module_deps(kernel)
    builtin = set()
    bfile = kernel.modules / "modules.builtin"
    if bfile.is_file():
        builtin = {os.path.basename(p).split(".ko")[0].replace("-", "_")
                   for p in bfile.read_text().split()}
    order: list[str] = []
    for name in names:
        n = name.replace("-", "_")
        if n in builtin:
            continue
        if n not in deps:
            raise LabError(f"kernel {kernel.release} has no module {name}")
        line = deps[n]
        for p in list(reversed(line[1:])) + [line[0]]:
            if p not in order:
                order.append(p)
    return order

# SPDX-License-Identifier: Apache-2.0
"""The lab's cache: ``prepare`` fetches the guest kernel and builds the initramfs, once."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from . import host, initramfs, kernel as _kernel


@dataclass
class Prepared:
    """The lab's cached pieces.

    Attributes
    ----------
    kernel : Kernel
        The unpacked guest kernel.
    initramfs : Path
        The initramfs built for it.
    downloaded : bool
        Whether this call fetched the kernel (False: it was cached).
    seconds : float
        How long this call took.
    """

    kernel: _kernel.Kernel
    initramfs: Path
    downloaded: bool
    seconds: float


def prepare(*, refresh: bool = True, log=print) -> Prepared:
    """Make sure the current guest kernel and its initramfs are in the cache.

    Parameters
    ----------
    refresh : bool
        Ask apt which kernel ``linux-image-amd64`` points to now and fetch it when the
        cache holds another (an older ABI after a security update). With False a cached
        kernel is used as it is, without asking apt.
    log : callable
        Receives one line per step.

    Raises
    ------
    LabUnavailableError
        A needed tool is missing, or apt knows no kernel package.
    LabError
        Downloading or unpacking failed.
    """
    t0 = time.monotonic()
    host.check(prepare=True, boot=False)
    k = None if refresh else _kernel.cached()
    downloaded = False
    if k is None:
        package = _kernel.current_package()
        k = _kernel.cached(package)
        if k is None:
            log(f"fetching {package} from the package archive (apt-get download)")
            k = _kernel.fetch(package, log=log)
            downloaded = True
            for gone in _kernel.prune(k):
                log(f"removed the older cached kernel {gone}")
    initrd = initramfs.ensure(k)
    return Prepared(k, initrd, downloaded, time.monotonic() - t0)

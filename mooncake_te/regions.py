# SPDX-License-Identifier: Apache-2.0
"""An engine's registered memory: the native region table, the MemoryRegion objects
beside it, and where each region lives (host NUMA node or CUDA device)."""
from __future__ import annotations

import errno as _errno
import os
import threading

import numpy as np

from . import errors as E
from .core import ACC_READ, ACC_WRITE, Regions
from .memory import ACCESS, MemoryRegion, cpu_location, intake

_ACCESS_BITS = {"rw": ACC_READ | ACC_WRITE, "r": ACC_READ, "local": 0}


class RegionBook:
    """The regions of one engine.

    ``table`` is the native table every transport checks requests against; ``add`` and
    ``remove`` keep it, this book and every transport (``transports``: objects with
    ``register``/``unregister``) in step.
    """

    def __init__(self):
        self.table = Regions()
        self._mrs: dict[int, MemoryRegion] = {}     # by address, in registration order
        self._lock = threading.RLock()
        self.transports: list = []
        # Bumped after every add and remove: routes cached under an older version are
        # stale (a transport's route may depend on where local memory lives).
        self.version = 0
        self._gpu: dict = {}     # start -> end of each region in GPU memory

    @property
    def has_gpu(self) -> bool:
        """Whether any registered region is GPU memory."""
        return bool(self._gpu)

    def on_gpu(self, addresses) -> bool:
        """Whether any of ``addresses`` (an int or a uint64 array) lies in a registered
        region of GPU memory."""
        gpu = self._gpu
        if not gpu:
            return False
        a = np.atleast_1d(np.asarray(addresses, dtype=np.uint64))
        with self._lock:
            starts = np.fromiter(gpu, np.uint64, len(gpu))
            ends = np.fromiter(gpu.values(), np.uint64, len(gpu))
        hit = np.zeros(len(a), bool)
        for s, e in zip(starts, ends):
            hit |= (a >= s) & (a < e)
        return bool(hit.any())

    def __len__(self) -> int:
        return len(self._mrs)

    def all(self) -> list:
        with self._lock:
            return list(self._mrs.values())

    def published(self) -> list:
        """Regions peers may see (access other than ``"local"``)."""
        with self._lock:
            return [r for r in self._mrs.values() if r.access != "local"]

    def get(self, address: int) -> MemoryRegion | None:
        with self._lock:
            return self._mrs.get(address)

    # --- intake ----------------------------------------------------------------------
    @staticmethod
    def intake(obj, location, access) -> MemoryRegion:
        """A MemoryRegion for a user object (buffer protocol, CUDA array interface,
        DLPack), checked against the requested access and location."""
        it = intake(obj)
        if it.readonly and access == "rw":
            raise E.InvalidArgumentError(
                f"{type(obj).__name__} is read-only, so peers cannot write it; register it with "
                f"access='r' (peers may read) or 'local'")
        if it.device != "cpu":
            # GPU memory: its device is what the driver says (memory.intake); a location
            # given by the caller must agree.
            if location not in ("auto", "*", None) and location != it.device:
                raise E.InvalidArgumentError(
                    f"location {location!r}, but the driver places this {type(obj).__name__} "
                    f"on {it.device}; pass location='auto' or {it.device!r}")
            location = it.device
        elif isinstance(location, str) and location.startswith("cuda"):
            # The exporter says host memory: a transfer treating it as GPU memory would
            # fail later (or, without CUDA, never work); refuse now with the reason.
            from . import cuda
            ok, why = cuda.available()
            raise E.InvalidArgumentError(
                f"location {location!r}, but this {type(obj).__name__} is host memory"
                + ("" if ok else f" (and {why})")
                + "; pass location='auto' or 'cpu:<numa node>', or register a GPU array "
                  "(cupy, torch on cuda)")
        return MemoryRegion(it.address, it.length, location, access, it.owner, it.readonly,
                            it.export)

    # --- add / remove ----------------------------------------------------------------
    def add(self, mr: MemoryRegion, known: bool = False) -> MemoryRegion:
        """Enter ``mr`` in the table and tell every transport. ``known``: the memory came
        through :meth:`intake`, which already asked the driver where it lives; raw
        addresses (register_address) are located here."""
        if mr.access not in ACCESS:
            raise E.InvalidArgumentError(f"access must be one of {', '.join(ACCESS)}, "
                                         f"got {mr.access!r}")
        mr.location, device = locate(mr, known)
        rc = self.table.add(mr.address, mr.length, _ACCESS_BITS[mr.access], device)
        if rc != 0:
            mr.release()       # not registered: the owner may resize its memory again
        if rc == -_errno.EEXIST:
            raise E.AddressOverlappedError(
                f"[{mr.address:#x}, {mr.end:#x}) overlaps a region already registered; "
                f"unregister it first or register the union once")
        if rc != 0:
            raise E.InvalidArgumentError(f"cannot register [{mr.address:#x}, +{mr.length}): "
                                         f"{os.strerror(-rc)}")
        with self._lock:
            self._mrs[mr.address] = mr
            if device >= 0:
                self._gpu[mr.address] = mr.address + mr.length
        try:
            for t in self.transports:
                t.register(mr)
        except BaseException:
            self.remove(mr)
            raise
        with self._lock:
            self.version += 1
        return mr

    def remove(self, mr: MemoryRegion) -> None:
        # The table first: remove() waits for I/O in flight on the region and refuses new
        # I/O, so no transport touches it once its own unregister runs.
        self.table.remove(mr.address)
        for t in self.transports:
            t.unregister(mr)
        with self._lock:
            del self._mrs[mr.address]
            self._gpu.pop(mr.address, None)
            self.version += 1
        mr.release()           # the buffer export: the owner may resize it again


def locate(mr: MemoryRegion, known: bool = False) -> "tuple[str, int]":
    """(location, CUDA ordinal or -1) of a region about to be registered. GPU memory is
    told by the driver's pointer attributes; raw addresses are only asked about when this
    process already uses CUDA (mooncake_te.cuda.loaded)."""
    from . import cuda
    loc = mr.location
    if known:                 # memory.intake asked the driver already
        if isinstance(loc, str) and loc.startswith("cuda:"):
            return loc, int(loc[5:])
        if loc in ("auto", "*", None):
            return cpu_location(mr.address), -1
    if loc in ("auto", "*", None):
        if cuda.loaded() and cuda.available()[0]:
            is_dev, ordinal = cuda.pointer_info(mr.address)
            if is_dev:
                return f"cuda:{ordinal}", ordinal
        return cpu_location(mr.address), -1
    if isinstance(loc, str) and loc.startswith("cpu"):
        if cuda.loaded() and cuda.available()[0] and cuda.pointer_info(mr.address)[0]:
            raise E.InvalidArgumentError(
                f"location {loc!r}, but [{mr.address:#x}, +{mr.length}) is GPU memory of "
                f"{'cuda:%d' % cuda.pointer_info(mr.address)[1]}; pass location='auto'")
        return loc, -1
    if isinstance(loc, str) and loc.startswith("cuda:") and loc[5:].isdigit():
        ok, reason = cuda.available()
        if not ok:
            # Nothing at this address can be memory of a GPU this process cannot see.
            raise E.InvalidArgumentError(f"cannot register {loc} memory: {reason}; register "
                                         f"host memory with location='auto' or 'cpu:<node>'")
        is_dev, ordinal = cuda.pointer_info(mr.address)
        if not is_dev or ordinal != int(loc[5:]):
            where = f"cuda:{ordinal}" if is_dev else "host memory"
            raise E.InvalidArgumentError(
                f"location {loc!r}, but the driver says [{mr.address:#x}, +{mr.length}) is "
                f"{where}; pass location='auto'")
        return loc, ordinal
    raise E.InvalidArgumentError(f"location {loc!r}: use 'auto', 'cpu:<numa node>' or "
                                 f"'cuda:<ordinal>'")

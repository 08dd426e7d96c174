# SPDX-License-Identifier: Apache-2.0
"""NVMe-oF transport: transfers between registered memory and storage segments.

A *storage segment* is a namespace (or file) an engine publishes with
``TransferEngine.register_storage``: its descriptor carries, under ``storage``, each
namespace's name, subsystem NQN, nsid, size, how hosts reach the target (transport,
address, service id) and, for the target host itself, the backing path. Peers name it
``"<engine name>/<storage name>"`` and use ordinary ``submit``/``read``/``write`` with
the byte offset as the target address.

This transport carries a group of requests to a storage segment when

* this host has connected to the subsystem (found in sysfs by NQN: the namespace's
  block device, ``mooncake_te.nvmeof_admin.host``), or
* this is the host that published it (same ``host_id``) and the backing path is there.

The bytes move in C (``src/nvmeof``): O_DIRECT, bounce buffers for unaligned slices,
a pool of workers per opened device. GPU memory passes through the core's pinned staging
ring (``src/core/stage.h``, the one the TCP transport uses too), one per worker, so the
device copy of one chunk overlaps the storage I/O of the previous one.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

from ... import errors as E
from ...metadata.storage import resolve, storage_descriptor, storage_name  # noqa: F401
from ...batch import register_status_text
from ..base import Capabilities, Transport
from . import settings as _declared
from ._nvmeof import OUT_OF_RANGE, STORAGE_BASE, Device

log = logging.getLogger("mooncake_te.nvmeof")

#: Requests in flight per opened device (worker threads); ``MC_NVMEOF_QUEUE_DEPTH``.
QUEUE_DEPTH = 16
#: Bytes per slice; large requests are cut into slices that run in parallel.
SLICE_SIZE = 1 << 20


def error_message(code: int) -> str | None:
    """What a storage status code means (batch.error_for uses it)."""
    if STORAGE_BASE - 200 < code <= STORAGE_BASE:
        err = STORAGE_BASE - code
        return (f"the storage device failed the I/O ({os.strerror(err)}); if the NVMe-oF "
                f"target went away, the controller gives up after ctrl_loss_tmo "
                f"(mooncake-te nvmeof list shows its state)")
    if code == OUT_OF_RANGE:
        return "the byte range is outside the storage segment"
    return None



def _status_text(code, what, target, op, remote, length) -> str | None:
    msg = error_message(code)
    return f"{what}: {msg}" if msg else None


register_status_text(OUT_OF_RANGE, OUT_OF_RANGE, _status_text)
register_status_text(STORAGE_BASE - 199, STORAGE_BASE, _status_text)

class StorageSegment:
    """A storage segment this engine publishes (returned by ``register_storage``)."""

    def __init__(self, engine_name: str, entry: dict):
        self._entry = entry
        self.name = f"{engine_name}/{entry['name']}"

    storage = property(lambda self: self._entry["name"])
    path = property(lambda self: self._entry["path"])
    nqn = property(lambda self: self._entry.get("nqn"))
    nsid = property(lambda self: self._entry.get("nsid", 1))
    size = property(lambda self: self._entry["size"])
    transport = property(lambda self: self._entry.get("transport"))
    address = property(lambda self: self._entry.get("address"))
    service_id = property(lambda self: self._entry.get("service_id"))

    def to_json(self) -> dict:
        return dict(self._entry, segment=self.name)

    def __repr__(self) -> str:
        return (f"StorageSegment({self.name!r}, nqn={self.nqn!r}, size={self.size}, "
                f"path={self.path!r})")


class NvmeofTransport(Transport):
    name = "nvmeof"
    capabilities = Capabilities(sync=True, storage=True, gpu_memory=True)
    serves = _declared.SERVES   # storage segments, whatever protocol carries memory
    priority = 10

    def __init__(self, ctx):
        self._regions = ctx.regions
        self._owner = ctx.name
        self._host_id = ctx.host_id
        self._new_batch = ctx.new_batch
        self._published: dict[str, dict] = {}     # storage name -> descriptor entry
        self._devices: dict[str, Device] = {}     # opened path -> Device
        self._gpu: list = []                      # registered GPU regions
        self._paths: dict = {}                    # segment -> (path, valid until, entry)
        self._lock = threading.Lock()
        self._closed = False
        try:
            self.depth = int(os.environ.get("MC_NVMEOF_QUEUE_DEPTH", QUEUE_DEPTH))
        except ValueError:
            raise E.ConfigError(f"MC_NVMEOF_QUEUE_DEPTH must be an int, got "
                                f"{os.environ['MC_NVMEOF_QUEUE_DEPTH']!r}") from None
        if not 1 <= self.depth <= 1024:
            raise E.ConfigError(f"MC_NVMEOF_QUEUE_DEPTH must be 1..1024, got {self.depth}")

    # --- publishing ------------------------------------------------------------------
    def describe(self) -> dict:
        with self._lock:
            entries = [dict(e) for e in self._published.values()]
        return {"storage": entries} if entries else {}

    def protocols(self) -> list:
        return ["nvmeof"] if self._published else []

    def add_storage(self, name: str, **where) -> StorageSegment:
        """Publish storage ``name``; ``where``: register_storage's path, nqn, nsid, size,
        transport, address, service_id (validated and completed by storage_entry)."""
        from ...nvmeof_admin.segment import storage_entry
        entry = storage_entry(name, **where)
        entry["host_id"] = self._host_id
        with self._lock:
            if entry["name"] in self._published:
                raise E.InvalidArgumentError(
                    f"storage {entry['name']!r} is registered already; unregister_storage it "
                    f"first or pick another name")
            self._published[entry["name"]] = entry
        return StorageSegment(self._owner, entry)

    def remove_storage(self, name: str) -> dict:
        with self._lock:
            entry = self._published.pop(name, None)
        if entry is None:
            raise E.SegmentNotFoundError(f"no storage named {name!r} registered with this "
                                         f"engine; registered: "
                                         f"{', '.join(self._published) or 'none'}")
        return entry

    def storage(self) -> list:
        with self._lock:
            return [StorageSegment(self._owner, e) for e in self._published.values()]

    # --- memory ----------------------------------------------------------------------
    def register(self, region) -> None:
        if str(getattr(region, "location", "cpu")).startswith("cuda"):
            with self._lock:
                self._gpu.append((region.address, region.address + region.length,
                                  region.location))

    def unregister(self, region) -> None:
        with self._lock:
            self._gpu = [g for g in self._gpu if g[0] != region.address]

    # --- routing ---------------------------------------------------------------------
    def device_path(self, desc) -> str | None:
        """What this host opens for storage segment ``desc``: the connected namespace's
        block device, else (on the publishing host) the backing path; None if neither.
        Looked up in sysfs at most once a second per segment (a scan costs more than a
        small I/O); a controller that stops being live is noticed within that second."""
        entry = desc.extra.get("nvmeof")
        if not entry:
            return None
        now = time.monotonic()
        hit = self._paths.get(desc.name)
        if hit is not None and hit[1] > now and hit[2] == entry:
            return hit[0]
        path = self._find_path(entry)
        if path is not None and path.startswith("/dev/nvme"):
            self._check_live(entry["nqn"], desc.name)
        self._paths[desc.name] = (path, now + 1.0, entry)
        return path

    def _find_path(self, entry) -> str | None:
        if entry.get("nqn"):
            from ...nvmeof_admin.host import find_namespace
            dev = find_namespace(entry["nqn"], int(entry.get("nsid", 1)))
            if dev:
                return dev
        if entry.get("host_id") and entry.get("host_id") == self._host_id and \
                os.path.exists(entry.get("path", "")):
            # The publishing host uses the backing path itself; for a namespace published
            # by NQN only while this host still exports it (a deleted target must fail
            # here as it fails everywhere else).
            from ...nvmeof_admin.target import NVMET
            if not entry.get("nqn") or os.path.isdir(f"{NVMET}/subsystems/{entry['nqn']}"):
                return entry["path"]
        return None

    def route(self, desc, op, local=None, remote=None) -> str | None:
        entry = desc.extra.get("nvmeof")
        if not entry:
            return None                 # a memory segment: other transports carry it
        if self.device_path(desc) is None and not entry.get("nqn"):
            raise E.TransportUnavailableError(
                f"storage segment {desc.name} is the file or device {entry.get('path')!r} "
                f"of {desc.host}, published without an NVMe-oF subsystem, so only that host "
                f"reaches it; export it (mooncake-te nvmeof target create) and register it "
                f"with nqn= for other hosts")
        if self.device_path(desc) is None:
            raise E.TransportUnavailableError(
                f"storage segment {desc.name} (subsystem {entry.get('nqn')!r}) is not "
                f"connected on this host (or its target was deleted and the connection "
                f"timed out); connect first: mooncake-te nvmeof connect "
                f"--transport {entry.get('transport', 'tcp')} --address "
                f"{entry.get('address')} --service-id {entry.get('service_id')} "
                f"{entry.get('nqn')}")
        return "nvmeof"

    def _device(self, desc) -> Device:
        path = self.device_path(desc)
        entry = desc.extra["nvmeof"]
        if path is None:
            self.route(desc, 0)          # raises the explanation
        try:
            st = os.stat(path)
            ident = (st.st_dev, st.st_ino, st.st_rdev)
        except OSError:
            ident = None
        dev = self._devices.get(path)
        if dev is None or dev.ident != ident:
            with self._lock:
                if self._closed:
                    raise E.TransferError("the engine is closed")
                dev = self._devices.get(path)
                if dev is not None and dev.ident != ident:
                    # Another namespace now has this name (disconnect, connect again):
                    # the old descriptor points at a device that is gone.
                    self._devices.pop(path)
                    threading.Thread(target=dev.close, daemon=True).start()
                    dev = None
                if dev is None:
                    try:
                        dev = Device(path, self._regions, 0, self.depth, SLICE_SIZE)
                    except PermissionError as e:
                        raise E.TransportUnavailableError(
                            f"cannot open {path} for storage segment {desc.name}: "
                            f"{e.strerror}; the engine needs read-write access to the device "
                            f"(root, or a udev rule / group for it)", errno=e.errno) from None
                    except OSError as e:
                        raise E.TransferError(f"cannot open {path} for storage segment "
                                              f"{desc.name}: {e.strerror}",
                                              errno=e.errno) from None
                    dev.ident = ident
                    self._devices[path] = dev
        if dev.size < int(entry["size"]):
            raise E.TransferError(
                f"{path} has {dev.size} bytes but storage segment {desc.name} was published "
                f"with {entry['size']}; is it the right namespace?")
        return dev

    @staticmethod
    def _check_live(nqn: str, name: str) -> None:
        """Fail at once, with the reason, while the controller is not live (the target
        went away and the kernel is reconnecting): I/O would wait for ctrl_loss_tmo."""
        from ...nvmeof_admin.host import _controllers
        ctrls = _controllers(nqn)
        if ctrls and not any(c.state == "live" for c in ctrls):
            raise E.TransferError(
                f"storage segment {name}: the NVMe-oF connection to {nqn!r} is not live "
                f"({', '.join(f'{c.name} {c.state}' for c in ctrls)}): the target is "
                f"unreachable or was deleted; the kernel keeps trying until ctrl_loss_tmo")

    def _check(self, desc, local, remote, lens) -> None:
        size = int(desc.extra["nvmeof"]["size"])
        lens = lens if len(lens) == len(remote) else np.full(len(remote), lens[0], np.uint64)
        over = remote + lens
        bad = np.nonzero((over > size) | (over < remote))[0]
        if len(bad):
            k = int(bad[0])
            raise E.AddressNotRegisteredError(
                f"[{int(remote[k])}, +{int(lens[k])}) is outside storage segment {desc.name} "
                f"({size} bytes); target_address is a byte offset in the namespace, and "
                f"offset + length must be at most {size}")

    def _ordinals(self, local) -> np.ndarray | None:
        """CUDA ordinal of each local address (-1: host memory), or None if all are host
        memory. GPU memory needs the CUDA driver (mooncake_te.cuda) for staging."""
        if not self._gpu:
            return None
        ords = np.full(len(local), -1, np.int64)
        for lo, hi, loc in list(self._gpu):
            ords[(local >= lo) & (local < hi)] = int(loc.split(":")[1])
        if not (ords >= 0).any():
            return None
        try:
            from ... import cuda
        except ImportError:
            cuda = None
        ok, why = cuda.available() if cuda is not None else (False, "mooncake_te.cuda is "
                                                                     "not in this build")
        if not ok:
            raise E.TransportUnavailableError(f"GPU memory to or from storage needs the CUDA "
                                              f"driver for staging: {why}")
        return ords

    def submit(self, batch, desc, op, local, remote, lens, first, run_inline) -> str:
        self._check(desc, local, remote, lens)
        dev = self._device(desc)
        self._ordinals(local)          # GPU memory: the core's staging (src/core/stage.h)
        rc = dev.submit(batch, op, local, remote, lens, first)
        if rc != 0:
            why = error_message(rc)
            raise E.error_class(rc)(f"cannot queue {len(local)} requests to {desc.name}"
                                    f"{': ' + why if why else ''} (status {rc})", status=rc)
        return "nvmeof"

    def transfer_sync(self, desc, op, local, remote, length, deadline_ns) -> tuple:
        one = np.array([remote], np.uint64)
        self._check(desc, np.array([local], np.uint64), one, np.array([length], np.uint64))
        dev = self._device(desc)
        gpu = self._ordinals(np.array([local], np.uint64)) is not None
        if length <= SLICE_SIZE and not gpu:
            return "nvmeof", dev.transfer(op, local, remote, length, deadline_ns)
        # Large, or GPU memory: in slices on the workers (each with its staging ring).
        b = self._new_batch(1, deadline_ns)
        rc = dev.submit(b, op, np.array([local], np.uint64), one,
                        np.array([length], np.uint64), 0)
        if rc != 0:
            b.abandon(0, 1)
            b.seal()
            return "nvmeof", rc
        b.seal()
        if not b.wait(deadline_ns):
            b.expire()
            return "nvmeof", E.ERR_TRANSFER_TIMEOUT
        _, _, errs = b.status()
        return "nvmeof", int(errs[0])

    def forget_peer(self, name: str) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            devices, self._devices = list(self._devices.values()), {}
        for d in devices:
            if d.close():
                log.warning("an I/O on %s is still blocked in the kernel (target gone?); "
                            "its worker is left to finish on its own", d.path)

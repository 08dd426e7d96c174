# SPDX-License-Identifier: Apache-2.0
"""Same-host transport for GPU memory: CUDA IPC.

The owner publishes, for each GPU region peers may reach, a CUDA IPC handle of the
allocation holding it (``cuIpcGetMemHandle``; handles name whole allocations, so the
region's offset in it goes along, which is what makes a slice of a PyTorch caching
allocator block work) in the segment descriptor's ``cuda_ipc`` field, with the host id
of the TCP transport (same kernel boot, PID and network namespace). A peer on the same
host maps the allocation once (``cuIpcOpenMemHandle``, peer access enabled lazily when
it lives on another GPU) and copies with ``cuMemcpyAsync`` on streams of its own, one per
device: device to device (peer to peer when the GPUs allow it) with no host memory, no
socket and no CPU copy. Two engines of one process use each other's pointers directly.

Routing: a (peer, op) group goes here when the peer is on this host and *every* remote
address lies in a GPU region it published this way; the local side may be GPU or host
memory (the copy engine reads and writes host memory too). A group that touches the
peer's host memory goes to the TCP transport's same-host path instead, which stages GPU
memory through pinned buffers: CUDA IPC cannot map host memory, and splitting one group
over two transports would buy nothing for the usual case of a KV cache wholly on GPUs.

Safety: a mapping cannot be revoked, so unregister waits for importers through a slot
table in /dev/shm (``slots.py``) and importers refuse a region whose slot is no longer
live: peers cannot touch a region after ``unregister`` returns, as on every transport.
"""
from __future__ import annotations

import bisect
import logging
import os
import queue
import threading

import numpy as np

from ... import cuda
from ...cuda import kvcopy
from ...errors import MooncakeError
from ..base import Capabilities, Transport
from . import host_dma
from . import settings as _declared
from ...addresses import AddressTable
from .slots import SlotTable, SlotView

log = logging.getLogger("mooncake_te")

from ...core import OP_WRITE as _WRITE
from ...errors import (ERR_ADDRESS_NOT_REGISTERED as _E_REMOTE_NOT_REG, ERR_CUDA as _E_CUDA,
                       ERR_LOCAL_NOT_REGISTERED as _E_LOCAL_NOT_REG,
                       ERR_REMOTE_ACCESS as _E_REMOTE_ACCESS)
from ...core import ACC_READ as _ACC_READ, ACC_WRITE as _ACC_WRITE


# A group of GPU-to-GPU copies goes to the mte_copy_pieces kernel when it has at least
# this many pieces of less than this mean length; else to the copy engines.
KERNEL_MIN_PIECES = 16
KERNEL_MAX_MEAN = 1 << 20


class _NoSlots:
    """Host-DMA copies hold region pins, not IPC slots."""

    @staticmethod
    def release(slot) -> None:
        pass


class _Group:
    """The requests of one device's copies in a group: batch indices and lengths."""

    __slots__ = ("idx", "lens")

    def __init__(self, idx: np.ndarray, lens: np.ndarray):
        self.idx, self.lens = idx, lens


class _SlotRelease:
    """A peer's IPC slots held for a group, released with the group's other pins."""

    def __init__(self, slots):
        self.slots = slots

    def unpin(self, slots) -> None:
        self.slots.release_many(slots)


def driver_present() -> bool:
    """Whether a CUDA driver library is installed, without loading it (loading and
    initialising CUDA in a process that never uses it would break CUDA in children it
    forks): the dynamic linker's cache or the usual driver directories."""
    if cuda.loaded():
        return True
    try:
        with open("/etc/ld.so.cache", "rb") as f:
            if cuda.LIBRARY.encode() in f.read():
                return True
    except OSError:
        pass
    dirs = os.environ.get("LD_LIBRARY_PATH", "").split(":") + [
        "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
        "/usr/local/nvidia/lib64", "/usr/lib/wsl/lib"]
    return any(d and os.path.exists(os.path.join(d, cuda.LIBRARY)) for d in dirs)


class _Buffer:
    __slots__ = ("addr", "end", "access", "handle", "offset", "slot", "epoch", "bus")

    def __init__(self, rec):
        self.addr, length, self.access, handle, self.offset, self.slot, self.epoch, \
            self.bus = rec
        self.end = self.addr + length
        self.handle = bytes.fromhex(handle)


class _PeerView:
    """A peer's published GPU regions, parsed once per descriptor."""

    def __init__(self, desc, info: dict):
        self.desc = desc
        self.name = desc.name
        self.instance = desc.instance_id
        self.same_process = info.get("pid") == os.getpid()
        bufs = [_Buffer(r) for r in info.get("buffers", [])]
        self.table = AddressTable(bufs, [(b.addr, b.end) for b in bufs])
        self.buffers = self.table.items          # sorted by address
        self.slots_path = info.get("slots", "")
        self.slots = None

    def covers(self, remote) -> bool:
        """Every address lies in a published GPU region."""
        return self.table.covers(remote)

    def find(self, address: int, length: int):
        return self.table.find(address, length)


class CudaIpcTransport(Transport):
    """Moves bytes between GPU memory of processes on one host (see the module doc)."""

    name = "cuda_ipc"
    capabilities = Capabilities(gpu_memory=True, same_host=True)
    serves = _declared.SERVES
    protocol_aliases = _declared.ALIASES
    priority = 20

    def __init__(self, ctx):
        # Nothing here touches CUDA: an engine that never registers GPU memory never
        # loads the driver (see driver_present).
        self.regions = ctx.regions
        self._timeout = max(ctx.config.get("timeout_ms", 30000), 1000) / 1000
        self._tag = f"{ctx.instance:016x}"
        self._host_id = ctx.host_id
        self._mu = threading.Lock()
        self._exports: dict = {}        # region address -> published record
        self._dev_starts: list = []     # local GPU regions, sorted: starts, (end, ordinal)
        self._dev_info: dict = {}
        self._table = None
        self._views: dict = {}          # peer name -> _PeerView
        self._slotviews: dict = {}      # a peer's slot table path -> SlotView
        self._opened: dict = {}         # (peer, instance, handle) -> (base, ordinal)
        self._same: dict = {}           # same-process peers: (peer, instance, addr) -> same
        self._streams: dict = {}
        self._peer_access: set = set()
        self._bus = None
        self._q = queue.SimpleQueue()
        self._thread = None
        self._host: dict = {}           # our host regions (page-locked by a local peer?)
        self._key = (ctx.name, ctx.instance)
        # Engines of this process find each other's host regions through their
        # transports (this object sees every register/unregister of its engine).
        host_dma.add(ctx.name, ctx.instance, self)

    # --- our regions ---------------------------------------------------------------
    def host_regions(self) -> list:
        """This engine's registered host-memory regions (an engine of this process
        copies to and from them directly: host_dma)."""
        return list(self._host.values())

    def register(self, region) -> None:
        loc = region.location or ""
        if not loc.startswith("cuda:"):
            self._host[region.address] = region
            return
        ordinal = int(loc[5:])
        with self._mu:
            bisect.insort(self._dev_starts, region.address)
            self._dev_info[region.address] = (region.end, ordinal)
        if region.access == "local":
            return
        try:
            handle, offset, _, _ = cuda.ipc_get_handle(region.address)
        except cuda.CudaError as e:
            # cudaMallocAsync pools and cuMemCreate allocations have no legacy IPC handle;
            # peers still reach the region through the TCP transport's staging.
            log.info("GPU region %#x is not shared by CUDA IPC: %s", region.address, e)
            return
        with self._mu:
            if self._table is None:
                self._table = SlotTable(self._tag)
            slot, epoch = self._table.add()
            self._exports[region.address] = [region.address, region.length, region.access,
                                              handle.hex(), offset, slot, epoch,
                                              self._bus_id(ordinal)]

    def unregister(self, region) -> None:
        if self._host.pop(region.address, None) is not None:
            host_dma.unlock(region)      # page-locked by an engine of this process
        with self._mu:
            rec = self._exports.pop(region.address, None)
            if region.address in self._dev_info:
                del self._dev_info[region.address]
                self._dev_starts.remove(region.address)
        if rec is not None:
            self._table.retire(rec[5], self._timeout)

    def _bus_id(self, ordinal: int) -> str:
        if self._bus is None:
            self._bus = cuda.pci_bus_ids()
        return self._bus[ordinal] if ordinal < len(self._bus) else ""

    def _devices(self) -> tuple:
        """(starts, [(end, ordinal)], AddressTable) of our GPU regions, sorted."""
        with self._mu:
            dstarts = list(self._dev_starts)
            dinfo = [self._dev_info[x] for x in dstarts]
        return dstarts, dinfo, AddressTable(dstarts, [(s, e) for s, (e, _) in
                                                      zip(dstarts, dinfo)])

    def _local_device(self, address: int) -> int:
        """CUDA ordinal of a local registered address, -1 for host memory."""
        k = bisect.bisect_right(self._dev_starts, address) - 1
        if k >= 0:
            end, ordinal = self._dev_info[self._dev_starts[k]]
            if address < end:
                return ordinal
        return -1

    def describe(self) -> dict:
        if not self._exports:
            return {}
        with self._mu:
            bufs = list(self._exports.values())
        return {"cuda_ipc": {"host_id": self._host_id, "pid": os.getpid(),
                             "slots": self._table.path, "buffers": bufs}}

    def protocols(self) -> list:
        return ["cuda_ipc"] if self._exports else []

    # --- peers ---------------------------------------------------------------------
    def _view(self, desc):
        v = self._views.get(desc.name)
        if v is None or v.desc is not desc:
            info = desc.extra.get("cuda_ipc")
            v = _PeerView(desc, info)
            self._views[desc.name] = v
        return v

    def route_by_address(self, desc) -> bool:
        # GPU memory here or the peer's: the route depends on where each address lives.
        return bool(desc.extra.get("cuda_ipc")) or self._host_peer(desc) is not None

    def route(self, desc, op, local, remote):
        # local/remote: arrays for batches, ints for a synchronous single request.
        other = self._host_peer(desc) if local is not None else None
        if other is not None:
            loc = np.atleast_1d(np.asarray(local, dtype=np.uint64))
            if len(loc) and self._local_device(int(loc[0])) >= 0:
                if host_dma.host_regions(other).covers(remote):
                    return "cuda_dma"
        info = desc.extra.get("cuda_ipc")
        if not info:
            return None
        if not self._host_id or info.get("host_id") != self._host_id:
            return None
        remote = np.atleast_1d(np.asarray(remote, dtype=np.uint64))
        return "cuda_ipc" if self._view(desc).covers(remote) else None

    def _open(self, view, b) -> "tuple[int, int]":
        """(base address here, our ordinal of its GPU) of the peer allocation holding
        buffer ``b``."""
        if view.same_process:
            key = (view.name, view.instance, b.addr)
            hit = self._same.get(key)
            if hit is None:
                hit = self._same[key] = (b.addr - b.offset, cuda.pointer_info(b.addr)[1])
            return hit
        key = (view.name, view.instance, b.handle)
        hit = self._opened.get(key)
        if hit is None:
            with self._mu:
                hit = self._opened.get(key)
                if hit is None:
                    # Open in the context of our ordinal for the peer's GPU (PCI bus ids
                    # match devices across processes whatever CUDA_VISIBLE_DEVICES says).
                    if self._bus is None:
                        self._bus = cuda.pci_bus_ids()
                    ordinal = self._bus.index(b.bus) if b.bus in self._bus else 0
                    hit = (cuda.ipc_open(b.handle, ordinal), ordinal)
                    self._opened[key] = hit
        return hit

    def _stream(self, ordinal: int):
        s = self._streams.get(ordinal)
        if s is None:
            with self._mu:
                s = self._streams.get(ordinal)
                if s is None:
                    s = self._streams[ordinal] = cuda.Stream(ordinal)
        return s

    def _enable_peer(self, a: int, b: int) -> None:
        # Same-process copies between two GPUs (IPC mappings enable it lazily themselves).
        if a != b and b >= 0 and (a, b) not in self._peer_access:
            cuda.enable_peer_access(a, b)
            self._peer_access.add((a, b))

    def _host_peer(self, desc):
        """The engine of this process ``desc`` names, when it runs this transport (which
        undoes the page-locking of its regions on unregister), else None."""
        other = host_dma.lookup(desc)
        if other is None:
            return None
        return other

    def _submit_host(self, other, batch, op, local, remote, lens, first) -> str:
        """GPU memory here <-> host memory of an engine of this process: one cuMemcpyAsync
        a request, the host region page-locked once (host_dma). Checks and pins are done
        for the whole group with numpy, per region; the per-request loop only queues the
        copy (its cost bounds small blocks: docs/benchmarks.md, section 6.6)."""
        n = len(local)
        lens = lens if len(lens) == n else np.full(n, lens[0], dtype=np.uint64)
        codes = np.zeros(n, np.int32)
        host = host_dma.host_regions(other)
        mrs = host.items
        k = host.index(remote, lens)
        codes[k < 0] = _E_REMOTE_NOT_REG
        dstarts, dinfo, devs = self._devices()
        lk = devs.index(local, lens)
        codes[(lk < 0) & (codes == 0)] = _E_LOCAL_NOT_REG
        need = _ACC_WRITE if op == _WRITE else _ACC_READ
        extra: list = []                # (table, pin) released after the copies
        for rk in np.unique(k[codes == 0]).tolist():
            h = other.regions.pin(mrs[rk].address, 1, need)
            if h:
                extra.append((other.regions, h))
            else:                       # the right is missing, or the region just went
                codes[(k == rk) & (codes == 0)] = _E_REMOTE_ACCESS
        for li in np.unique(lk[codes == 0]).tolist():
            h = self.regions.pin(dstarts[li], 1)
            if h:
                extra.append((self.regions, h))
            else:
                codes[(lk == li) & (codes == 0)] = _E_LOCAL_NOT_REG
        for j in np.flatnonzero(codes).tolist():
            batch.begin(first + j, 1)
            batch.finish(first + j, 0, int(codes[j]))
        good = np.flatnonzero(codes == 0)
        issued: dict = {}
        dsts = (remote if op == _WRITE else local)[good].tolist()
        srcs = (local if op == _WRITE else remote)[good].tolist()
        lns = lens[good].tolist()
        ords = [dinfo[x][1] for x in lk[good].tolist()]
        idx = good.tolist()
        lib = cuda._lib()
        cur = [None]                    # the ordinal whose context this thread pushed
        handled = 0                     # idx[:handled] are begun (and finished or issued)
        try:
            for rk in np.unique(k[good]).tolist():
                host_dma.lock(mrs[rk], ords[0])        # portable: every context
            h = None
            for m, j in enumerate(idx):
                i, ordinal = first + j, ords[m]
                if ordinal != cur[0] or h is None:
                    h = self._stream(ordinal).handle
                    self._switch(ordinal, cur)
                batch.begin(i, 1)
                handled = m + 1
                if lib.cuMemcpyAsync(dsts[m], srcs[m], lns[m], h) != 0:
                    batch.finish(i, 0, _E_CUDA)
                    continue
                issued.setdefault(ordinal, []).append((i, dsts[m], srcs[m], lns[m], 0, None))
        except MooncakeError as e:       # page-locking or a context switch failed
            log.warning("GPU <-> host copy in this process: %s", e)
            for j in idx[handled:]:
                batch.begin(first + j, 1)
                batch.finish(first + j, 0, _E_CUDA)
        finally:
            if cur[0] is not None:
                cuda.pop_device()
        if not issued:
            for table, h in extra:
                table.unpin(h)
            return "cuda_dma"
        last = list(issued)[-1]
        for ordinal, items in issued.items():
            self._finish_on_event(ordinal, items, _NoSlots, batch,
                                  extra if ordinal == last else ())
        return "cuda_dma"

    def _copy(self, ordinal: int, cur: list, dst: int, src: int, n: int) -> None:
        """Queue one copy on ``ordinal``'s stream, first making its context current if
        ``cur[0]`` (the ordinal pushed on this thread, or None) is another; ``cur[0]``
        always says what is pushed, also when this raises (the caller pops it)."""
        stream = self._stream(ordinal)
        self._switch(ordinal, cur)
        cuda.memcpy_async(dst, src, n, stream)

    @staticmethod
    def _switch(ordinal: int, cur: list) -> None:
        """Make ``ordinal``'s context the one this thread pushed (``cur[0]``, kept true
        also when this raises)."""
        if ordinal != cur[0]:
            if cur[0] is not None:
                cuda.pop_device()
                cur[0] = None
            cuda.push_device(ordinal)
            cur[0] = ordinal

    def _finish_on_event(self, ordinal, items, slots, batch, extra=()) -> None:
        stream = self._stream(ordinal)
        event, err = None, 0
        try:
            event = cuda.Event(ordinal)
            event.record(stream)
        except MooncakeError as e:
            log.warning("CUDA copy failed: %s", e)
            err = _E_CUDA
            if event is not None:
                event.close()
                event = None
            stream.synchronize()               # what was queued must end before unpin
        self._completions().put((event, err, items, slots, batch, extra))

    def submit(self, batch, desc, op, local, remote, lens, first, run_inline):
        other = self._host_peer(desc)
        if other is not None and len(local) and self._local_device(int(local[0])) >= 0:
            if host_dma.host_regions(other).covers(remote[:1]):
                return self._submit_host(other, batch, op, local, remote, lens, first)
        view = self._view(desc)
        if view.slots is None:
            # One view of a peer's slot table per path, shared by its descriptors.
            with self._mu:
                sv = self._slotviews.get(view.slots_path)
                if sv is None:
                    sv = self._slotviews[view.slots_path] = SlotView(view.slots_path)
            view.slots = sv
        return self._submit_ipc(view, batch, op, local, remote, lens, first)

    def _submit_ipc(self, view, batch, op, local, remote, lens, first) -> str:
        """A group to a peer's published GPU regions. The checks run with numpy for the
        whole group, once per remote buffer (access, slot, mapping) and local region (a
        pin), so a KV load of thousands of 32 KiB pieces costs no Python per piece; the
        copies go out per device in one call: one ``mte_copy_pieces`` launch
        (``mooncake_te.cuda.kvcopy``: every piece, long ones cut, at HBM speed) or, on
        drivers without stream-ordered allocation, one batched copy."""
        n = len(local)
        local = np.asarray(local, dtype=np.uint64)
        remote = np.asarray(remote, dtype=np.uint64)
        lens = np.asarray(lens if len(lens) == n else np.full(n, lens[0]), dtype=np.uint64)
        codes = np.zeros(n, np.int32)
        k = view.table.index(remote, lens)
        codes[k < 0] = _E_REMOTE_NOT_REG
        nb = max(len(view.buffers), 1)
        delta = np.zeros(nb, np.int64)            # peer address -> address here
        rord = np.full(nb, -1, np.int64)          # our ordinal of each buffer's GPU
        bcode = np.zeros(nb, np.int32)            # a refusal for every request to it
        extra: list = []                          # (table, handle) released after the copies
        cand = np.flatnonzero(codes == 0)
        used = np.flatnonzero(np.bincount(k[cand], minlength=nb))
        want = []
        for bk in used.tolist():
            if op == _WRITE and view.buffers[bk].access != "rw":
                bcode[bk] = _E_REMOTE_ACCESS
            else:
                want.append(bk)
        # Every buffer's slot in one go (a lock per run of slots, not one per buffer).
        held = view.slots.acquire_many([view.buffers[bk].slot for bk in want],
                                       [view.buffers[bk].epoch for bk in want])
        got = [bk for bk, h in zip(want, held) if h]
        if got:
            extra.append((_SlotRelease(view.slots), [view.buffers[bk].slot for bk in got]))
        for bk, h in zip(want, held):
            b = view.buffers[bk]
            if not h:
                bcode[bk] = _E_REMOTE_NOT_REG     # unregistered by its owner
                continue
            try:
                base, other = self._open(view, b)
            except MooncakeError as e:
                log.warning("CUDA IPC to %s: %s", view.name, e)
                bcode[bk] = _E_CUDA
                continue
            delta[bk] = (base + b.offset) - b.addr
            rord[bk] = other
        codes[cand] = bcode[k[cand]]
        # Local side: GPU regions of ours pinned once each; anything else (host memory)
        # pinned per request.
        dstarts, dinfo, devs = self._devices()
        ds = dstarts
        dord = np.array([o for _, o in dinfo] or [-1], np.int64)
        lk = devs.index(local, lens)
        on_gpu = lk >= 0
        lcand = np.flatnonzero(on_gpu & (codes == 0))
        lcode = np.zeros(max(len(ds), 1), np.int32)
        for li in np.flatnonzero(np.bincount(lk[lcand], minlength=len(lcode))).tolist():
            h = self.regions.pin(dstarts[li], 1)
            if h:
                extra.append((self.regions, h))
            else:                                 # unregistered meanwhile
                lcode[li] = _E_LOCAL_NOT_REG
        codes[lcand] = lcode[lk[lcand]]
        for j in np.flatnonzero(~on_gpu & (codes == 0)).tolist():
            h = self.regions.pin(int(local[j]), int(lens[j]))
            if h:
                extra.append((self.regions, h))
            else:
                codes[j] = _E_LOCAL_NOT_REG
        for j in np.flatnonzero(codes).tolist():
            batch.begin(first + j, 1)
            batch.finish(first + j, 0, int(codes[j]))
        good = np.flatnonzero(codes == 0)
        if not len(good):
            for table, h in extra:
                table.unpin(h)
            return "cuda_ipc"
        kg = k[good]
        rptr = (remote[good].astype(np.int64) + delta[kg]).astype(np.uint64)
        lg = local[good]
        ordinal = np.where(on_gpu[good], dord[np.maximum(lk[good], 0)], rord[kg])
        if view.same_process:
            for a, b in set(zip(ordinal.tolist(), rord[kg].tolist())):
                self._enable_peer(a, b)
        dst, src = (rptr, lg) if op == _WRITE else (lg, rptr)
        glens = lens[good]
        idx = (good + first).astype(np.uint32)
        batch.begin_many(idx, 1)
        # By device, and by whether our side is GPU memory: only then may the kernel
        # touch it (host memory may be pageable; the copy engine takes it, one copy a
        # request, as before).
        gpu = on_gpu[good]
        groups = sorted(set(zip(ordinal.tolist(), gpu.tolist())))
        for m, (o, dev_local) in enumerate(groups):
            sel = (ordinal == o) & (gpu == dev_local)
            group = _Group(np.ascontiguousarray(idx[sel]), np.ascontiguousarray(glens[sel]))
            items: "_Group | list" = group
            stream = self._stream(o)
            gl = glens[sel]
            # Many small pieces (a KV load of scattered blocks): the kernel; a few large
            # ones (coalesced runs): the copy engines, one batched call.
            small = len(gl) >= KERNEL_MIN_PIECES and int(gl.sum()) < KERNEL_MAX_MEAN * len(gl)
            try:
                with cuda.device(o):
                    if not (dev_local and small and kvcopy.copy_pieces_async(
                            o, dst[sel], src[sel], gl, stream)):
                        kvcopy.copy_many(dst[sel], src[sel], gl, stream, batched=dev_local)
            except MooncakeError as e:
                log.warning("CUDA IPC to %s: %s", view.name, e)
                try:
                    stream.synchronize()        # what was queued ends before the unpins
                except MooncakeError:
                    pass
                batch.finish_many(group.idx, np.zeros(len(group.idx), np.uint64), _E_CUDA)
                items = []
            last = m == len(groups) - 1
            # The completion thread takes jobs in order, so the last group's pins are
            # released only after every group's copies ended.
            self._finish_on_event(o, items, _NoSlots, batch, extra if last else ())
        return "cuda_ipc"

    # --- completion ----------------------------------------------------------------
    def _completions(self):
        if self._thread is None:
            with self._mu:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._complete, daemon=True,
                                                    name="mte-cuda-ipc")
                    self._thread.start()
        return self._q

    def _complete(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            event, err, items, slots, batch, extra = job
            if event is not None:
                try:
                    event.synchronize()            # ctypes releases the GIL meanwhile
                except MooncakeError:
                    err = _E_CUDA
                event.close()
            for table, h in extra:                 # host-DMA region pins
                table.unpin(h)
            if isinstance(items, _Group):           # checked and pinned as a group
                batch.finish_many(items.idx, items.lens if not err else
                                  np.zeros(len(items.idx), np.uint64), err)
                continue
            for i, _, _, ln, pin, slot in items:
                self.regions.unpin(pin)
                slots.release(slot)
                batch.finish(i, 0 if err else ln, err)

    def forget_peer(self, name: str) -> None:
        # Mappings stay open until close(): copies may still be in flight through them.
        self._views.pop(name, None)

    def close(self) -> None:
        host_dma.remove(*self._key)
        for region in list(self._host.values()):
            host_dma.unlock(region)
        self._host.clear()
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=self._timeout)
            self._thread = None
        with self._mu:
            exports, self._exports = list(self._exports.values()), {}
        for rec in exports:
            self._table.retire(rec[5], self._timeout)
        for (_, _, _), (base, ordinal) in list(self._opened.items()):
            try:
                cuda.ipc_close(base, ordinal)
            except MooncakeError:
                pass
        self._opened.clear()
        self._same.clear()
        for sv in self._slotviews.values():
            sv.close()
        self._slotviews.clear()
        self._views.clear()
        for s in self._streams.values():
            s.close()
        self._streams.clear()
        if self._table is not None:
            self._table.close()
            self._table = None

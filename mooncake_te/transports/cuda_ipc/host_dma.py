# SPDX-License-Identifier: Apache-2.0
"""GPU memory <-> another engine's host memory in the same process: one DMA per block.

What a KV-cache offload does (GPU blocks to a host DRAM pool and back). Over the TCP or
same-host paths each byte is staged through pinned buffers and copied by a CPU; when the
pool belongs to an engine of this very process its memory is directly addressable, so
the pool's region is page-locked once with ``cuMemHostRegister`` (portable, so every
device's copy engines reach it) and each block is one ``cuMemcpyAsync`` between GPU
memory and the pool: no staging, no CPU copy, no socket.

Engines of this process find each other here by (name, instance). Safety is the usual:
the pool's region is pinned in its owner's region table (with the remote-read or
remote-write right the op needs) while the copies run, so the owner's ``unregister``
waits for them; then the owner's transport unregisters the page-locking.
"""
from __future__ import annotations

import threading
import weakref

from ... import cuda
from ...addresses import AddressTable

_mu = threading.Lock()
_engines: dict = {}        # (name, instance hex) -> weak ref. to that engine's cuda_ipc transport
_locked: dict = {}         # page-locked host region start -> (end, ordinal)


def add(name: str, instance: int, transport) -> None:
    """``transport``: the cuda_ipc transport of an engine of this process (weakly held)."""
    ref = transport if isinstance(transport, weakref.ProxyTypes) else weakref.proxy(transport)
    with _mu:
        _engines[(name, f"{instance:016x}")] = ref


def remove(name: str, instance: int) -> None:
    with _mu:
        _engines.pop((name, f"{instance:016x}"), None)


def lookup(desc):
    """The live engine of this process that ``desc`` describes, or None."""
    eng = _engines.get((desc.name, desc.instance_id or ""))
    if eng is None:
        return None
    try:
        eng.regions                      # noqa: B018 (a dead proxy raises here)
        return eng
    except ReferenceError:
        return None


def host_regions(t) -> AddressTable:
    """The host-memory regions of ``t``'s engine (``t.host_regions()``: the transport's
    public list) as an :class:`AddressTable` (``items``: the MemoryRegions, sorted)."""
    return AddressTable(t.host_regions())


def lock(region, ordinal: int) -> None:
    """Page-lock a host region for the copy engines, once per process."""
    if region.address in _locked:
        return
    with _mu:
        if region.address in _locked:
            return
        if cuda.host_register(region.address, region.length, ordinal):
            _locked[region.address] = (region.address + region.length, ordinal)


def unlock(region) -> None:
    """Called by the owner's transport when the region is unregistered (its copies have
    ended: the region table waited for their pins)."""
    with _mu:
        hit = _locked.pop(region.address, None)
    if hit is not None:
        try:
            cuda.host_unregister(region.address, hit[1])
        except cuda.CudaError:
            pass


__all__ = ["add", "remove", "lookup", "host_regions", "lock", "unlock"]

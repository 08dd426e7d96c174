# SPDX-License-Identifier: Apache-2.0
"""Segments: ours (the descriptor this engine publishes) and peers' (resolved through
the metadata backend and cached; dropped when a peer restarts or goes away)."""
from __future__ import annotations

import weakref

from . import errors as E
from .metadata import BufferInfo, SegmentCache, SegmentDescriptor
from .metadata.storage import resolve as resolve_storage


class Segment:
    """A peer's segment as it published it."""

    def __init__(self, desc: SegmentDescriptor):
        self._desc = desc

    name = property(lambda self: self._desc.name)
    protocol = property(lambda self: self._desc.protocol)
    buffers = property(lambda self: list(self._desc.buffers))
    instance_id = property(lambda self: self._desc.instance_id)
    descriptor = property(lambda self: self._desc)

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, protocol={self.protocol!r}, buffers={len(self.buffers)})"


def target_name(target) -> str:
    """The segment name a ``target`` argument (a name or a Segment) stands for."""
    if isinstance(target, Segment):
        return target.name
    if isinstance(target, str) and target:
        return target
    raise E.InvalidArgumentError(f"target must be a segment name or Segment, got {target!r}")


class Peers:
    """Peers' descriptors, cached, and what happens when one of them changes.

    Parameters
    ----------
    backend : MetadataBackend
        Where descriptors are published and fetched.
    forget : callable
        ``forget(name)``: drop connections to a peer (every transport's ``forget_peer``).
    timeout : float
        Longest wait for a descriptor (seconds).
    """

    def __init__(self, backend, forget, timeout: float):
        self.backend = backend
        self.cache = SegmentCache(backend)
        self._forget = forget
        self.timeout = min(timeout, 5.0)
        if hasattr(backend, "on_change"):
            # Store backends poll the peers we fetched; a restarted (new instance id) or
            # vanished peer drops out of the cache before our next transfer to it. Weak, so
            # the backend's renewal thread does not keep the engine alive.
            ref = weakref.WeakMethod(self._on_change)
            backend.on_change = lambda name, inst: (ref() or (lambda *a: None))(name, inst)

    def get(self, name: str, refresh: bool = False) -> SegmentDescriptor:
        return self.cache.get(name, timeout=self.timeout, refresh=refresh)

    def refresh(self, name: str) -> SegmentDescriptor:
        """``name``'s descriptor fetched afresh (a transport's ``refresh_peer``)."""
        return self.cache.get(name, timeout=5.0, refresh=True)

    def resolve(self, name: str) -> SegmentDescriptor:
        """The descriptor of ``name`` (``"<engine>/<storage>"``: a storage segment)."""
        if "/" in name:
            return resolve_storage(self.cache, name, timeout=self.timeout)
        return self.cache.get(name, timeout=self.timeout)

    def invalidate(self, name: str) -> None:
        self.cache.invalidate(name)

    def lost(self, name: str) -> None:
        """A connection to ``name`` failed or it restarted: re-resolve it before its next
        use (the Batch's and the sync path's ``on_peer_lost``)."""
        self.cache.invalidate(name)
        self._forget(name)

    def _on_change(self, name: str, instance_id) -> None:
        if self.cache.invalidate(name, instance_id):
            self._forget(name)


def describe(name: str, protocol: str, host: str, rpc_port: int, instance: int,
             devices: list, regions: list, transports: list) -> SegmentDescriptor:
    """The descriptor an engine publishes: its published ``regions`` with every
    transport's keys, and every transport's fields."""
    keyed = [t for t in transports if t.capabilities.wants_keys]
    buffers = []
    for r in regions:
        rkeys, lkeys = (), ()
        for t in keyed:
            rkeys, lkeys = t.buffer_keys(r)
        buffers.append(BufferInfo(r.address, r.length, r.location, r.access,
                                  tuple(rkeys), tuple(lkeys)))
    extra, protocols = {}, []
    for t in transports:
        extra.update(t.describe())
        protocols += [p for p in t.protocols() if p not in protocols]
    d = SegmentDescriptor(name=name, protocol=protocol, host=host, rpc_port=rpc_port,
                          instance_id=f"{instance:016x}", buffers=buffers,
                          protocols=protocols, devices=[{"name": d} for d in devices])
    d.extra.update(extra)
    d.tcp_data_port = d.extra.pop("tcp_data_port", 0)
    # The RDMA transport publishes its NICs (name, GID, LID, MTU) and the NIC priority
    # matrix in Mooncake's own fields.
    d.devices = d.extra.pop("devices", d.devices)
    d.priority_matrix = d.extra.pop("priority_matrix", d.priority_matrix)
    return d

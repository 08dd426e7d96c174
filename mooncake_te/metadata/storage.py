# SPDX-License-Identifier: Apache-2.0
"""Storage segments in metadata: ``"<engine>/<storage>"`` names and the descriptor a
peer builds for one from its owner's published ``storage`` list.

Pure metadata (no I/O of its own beyond the cache): the engine resolves storage names
here whether or not its NVMe-oF transport runs, and that transport reads the entries.
"""
from __future__ import annotations

from .. import errors as E
from .descriptor import BufferInfo, SegmentDescriptor

__all__ = ["storage_name", "storage_descriptor", "resolve"]


def storage_name(name: str) -> tuple[str, str] | None:
    """``"<engine>/<storage>"`` -> (engine, storage), else None."""
    owner, sep, st = name.rpartition("/")
    return (owner, st) if sep and owner and st else None


def storage_descriptor(owner: SegmentDescriptor, name: str) -> SegmentDescriptor | None:
    """The descriptor of storage segment ``name`` published by ``owner``, or None."""
    for entry in owner.extra.get("storage", ()):
        if entry.get("name") == name:
            return SegmentDescriptor(
                name=f"{owner.name}/{name}", protocol="nvmeof", host=owner.host,
                rpc_port=owner.rpc_port, instance_id=owner.instance_id, tcp_data_port=0,
                buffers=[BufferInfo(0, int(entry["size"]), "storage", "rw")],
                protocols=["nvmeof"], extra={"nvmeof": dict(entry), "owner": owner.name})
    return None


def resolve(cache, name: str, timeout: float) -> SegmentDescriptor:
    """Resolve ``"<engine>/<storage>"`` through the owning engine's descriptor (any
    metadata backend: with p2p the owner's RPC port answers); a name that is not a
    storage segment is fetched as it is."""
    parts = storage_name(name)
    if parts is None:
        return cache.get(name, timeout=timeout)
    owner_name, st = parts
    try:
        owner = cache.get(owner_name, timeout=timeout)
    except (E.SegmentNotFoundError, E.InvalidArgumentError):
        return cache.get(name, timeout=timeout)       # a store name that contains '/'
    desc = storage_descriptor(owner, st)
    if desc is None:           # registered after we cached the owner?
        owner = cache.get(owner_name, timeout=timeout, refresh=True)
        desc = storage_descriptor(owner, st)
    if desc is None:
        have = [e.get("name") for e in owner.extra.get("storage", ())]
        raise E.SegmentNotFoundError(
            f"{owner_name} publishes no storage segment {st!r} (it has: "
            f"{', '.join(map(str, have)) or 'none'}); the owner registers it with "
            f"eng.register_storage({st!r}, ...)")
    return desc

# SPDX-License-Identifier: Apache-2.0
"""The metadata backend contract and the key layout shared by every store.

A backend answers three questions: publish my descriptor, withdraw it, and fetch a
peer's. ``p2p`` asks the peer itself over its RPC port; the stores (etcd, redis, http)
are :class:`KeyValueBackend` subclasses that implement only ``get``/``put``/``delete``
of bytes under Mooncake's keys (``../reference/mooncake-te.md`` §5):

* ``mooncake/[<cluster>/]ram/<segment name>`` holds the segment descriptor JSON;
* ``mooncake/[<cluster>/]rpc_meta/<segment name>`` holds
  ``{"ip_or_host_name", "rpc_port"}``.
"""
from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod

from ..errors import SegmentNotFoundError
from .descriptor import SegmentDescriptor


def key_prefix(cluster_id: str | None = None) -> str:
    cluster = os.environ.get("MC_METADATA_CLUSTER_ID", "") if cluster_id is None else cluster_id
    return f"mooncake/{cluster}/" if cluster else "mooncake/"


def ram_key(name: str, cluster_id: str | None = None) -> str:
    # Mooncake uses names containing '/' verbatim (e.g. nvmeof segments).
    return key_prefix(cluster_id) + (name if "/" in name else f"ram/{name}")


def rpc_meta_key(name: str, cluster_id: str | None = None) -> str:
    return key_prefix(cluster_id) + f"rpc_meta/{name}"


class MetadataBackend(ABC):
    """Where segment descriptors live."""

    #: short name shown in reprs and errors ("p2p", "etcd", ...)
    kind = "?"

    @abstractmethod
    def publish(self, desc: SegmentDescriptor) -> None:
        """Make ``desc`` visible to peers (called again after every change)."""

    @abstractmethod
    def unpublish(self, name: str) -> None:
        """Withdraw a descriptor (engine shutdown)."""

    @abstractmethod
    def fetch(self, name: str, timeout: float) -> SegmentDescriptor:
        """Return the descriptor a peer published; raise SegmentNotFoundError if none."""

    def close(self) -> None:
        pass


class KeyValueBackend(MetadataBackend):
    """Backends that are a key-value store: they implement get/put/delete of bytes."""

    def __init__(self, cluster_id: str | None = None):
        self.cluster_id = cluster_id

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def put(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Values of ``keys``, ``None`` where missing, in order. Stores that can answer
        several keys in one round trip (redis MGET, an etcd transaction, our HTTP
        server's batch route) override this; the default asks key by key."""
        return [self.get(k) for k in keys]

    def put_many(self, items: dict[str, bytes]) -> None:
        """Store every ``key: value`` (one round trip where the store can; as
        :meth:`get_many`). Not atomic: on an error some may be stored."""
        for k, v in items.items():
            self.put(k, v)

    def delete_many(self, keys: list[str]) -> None:
        """Delete every key (missing ones are fine)."""
        for k in keys:
            self.delete(k)

    def keys(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix`` (a listing: what joined a directory such as
        the conductor's instances). Stores that cannot list raise ``NotImplementedError``."""
        raise NotImplementedError(f"the {self.kind} metadata store cannot list keys")

    def records(self, desc: SegmentDescriptor) -> list[tuple[str, bytes]]:
        """The (key, value) pairs that publish ``desc``; stores with leases re-put them."""
        return [(ram_key(desc.name, self.cluster_id), desc.encode()),
                (rpc_meta_key(desc.name, self.cluster_id),
                 json.dumps({"ip_or_host_name": desc.host, "rpc_port": desc.rpc_port}).encode())]

    def publish(self, desc: SegmentDescriptor) -> None:
        for key, value in self.records(desc):
            self.put(key, value)

    def unpublish(self, name: str) -> None:
        self.delete(ram_key(name, self.cluster_id))
        self.delete(rpc_meta_key(name, self.cluster_id))

    def fetch(self, name: str, timeout: float) -> SegmentDescriptor:
        raw = self.get(ram_key(name, self.cluster_id))
        if raw is None:
            raise SegmentNotFoundError(
                f"no segment named {name!r} in the {self.kind} metadata store "
                f"(key {ram_key(name, self.cluster_id)!r}); is the peer running and does it use "
                f"the same metadata server and MC_METADATA_CLUSTER_ID?")
        return SegmentDescriptor.decode(raw)

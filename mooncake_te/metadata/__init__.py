# SPDX-License-Identifier: Apache-2.0
"""Metadata: where engines find each other's segment descriptors."""
from __future__ import annotations

from ..errors import MetadataError
from .base import MetadataBackend, KeyValueBackend, ram_key, rpc_meta_key, key_prefix
from .cache import SegmentCache
from .descriptor import BufferInfo, SegmentDescriptor
from .p2p import P2PBackend, split_host_port
from .url import STORE_SCHEMES, MetadataUrl, parse as parse_url

__all__ = ["MetadataBackend", "KeyValueBackend", "SegmentCache", "BufferInfo",
           "SegmentDescriptor", "P2PBackend", "open_backend", "ram_key", "rpc_meta_key",
           "key_prefix", "split_host_port", "MetadataUrl", "parse_url"]


def open_backend(spec: str, local_descriptor=None, token: bytes | None = None) -> MetadataBackend:
    """Open the backend a ``metadata=`` string names.

    ``"p2p"`` (also Mooncake's ``"P2PHANDSHAKE"``) needs no server. Store backends are
    ``etcd://h:2379[,h2:2379]``, ``redis://h:6379[/db]`` and ``http://h:port/metadata``;
    a bare ``host:port`` means etcd, as in Mooncake. ``token`` (the engines'
    ``auth_token``) signs requests to an HTTP metadata server that wants them.
    """
    url = parse_url(spec)
    if url.is_p2p:
        return P2PBackend(local_descriptor, token)
    if url.scheme in STORE_SCHEMES:
        try:
            from . import stores
        except ImportError as e:   # pragma: no cover - depends on the installed extras
            raise MetadataError(f"metadata backend {url.scheme!r} is not available: {e}") from None
        return stores.open_store(url.scheme, url.address, url.spec, token=token)
    raise MetadataError(f"unknown metadata backend {spec!r}; use 'p2p', 'etcd://host:2379', "
                        f"'redis://host:6379' or 'http://host:port/metadata'")

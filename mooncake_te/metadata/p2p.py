# SPDX-License-Identifier: Apache-2.0
"""The embedded default: no server; a peer's descriptor is asked of the peer itself.

In this mode a segment name is ``host:rpc_port`` (as in Mooncake's P2PHANDSHAKE mode),
so the name alone says where to ask.
"""
from __future__ import annotations

from ..errors import AuthenticationError, SegmentNotFoundError, InvalidArgumentError
from . import framing
from .base import MetadataBackend
from .descriptor import SegmentDescriptor


def split_host_port(name: str) -> tuple[str, int]:
    """``"10.0.0.2:15003"`` or ``"[::1]:15003"`` -> (host, port)."""
    host, sep, port = name.strip().lstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgumentError(
            f"segment name {name!r} is not 'host:port'; with metadata='p2p' a peer is named by "
            f"the address of its RPC port, e.g. '127.0.0.1:15003' (see TransferEngine.name)")
    return host.strip("[]"), int(port)


class P2PBackend(MetadataBackend):
    kind = "p2p"

    def __init__(self, local_descriptor=None, token: bytes | None = None):
        self._local = local_descriptor     # callable -> bytes, so peers get ours in exchange
        self.token = token

    def publish(self, desc: SegmentDescriptor) -> None:
        pass    # the RPC server serves the live descriptor

    def unpublish(self, name: str) -> None:
        pass

    def fetch(self, name: str, timeout: float) -> SegmentDescriptor:
        host, port = split_host_port(name)
        try:
            raw = framing.request(host, port, framing.METADATA,
                                  self._local() if self._local else b"{}", timeout,
                                  token=self.token)
        except AuthenticationError:
            raise
        except Exception as e:
            raise SegmentNotFoundError(f"segment {name!r} not found: {e}",
                                       status=getattr(e, "status", None)) from None
        desc = SegmentDescriptor.decode(raw)
        return desc

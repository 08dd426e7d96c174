# SPDX-License-Identifier: Apache-2.0
"""Segment descriptors: what an engine publishes about itself.

The JSON layout follows Mooncake's ``encodeSegmentDesc`` for TCP segments
(``mooncake-transfer-engine/src/transfer_metadata.cpp``): ``name``, ``protocol``,
``devices``, ``priority_matrix``, ``buffers[{name, addr, length, rkey, lkey}]``,
``tcp_data_port``, ``timestamp``; so operators' tooling that reads
``mooncake/ram/<name>`` keeps working. We add ``instance_id`` (changes whenever the
engine restarts, so a cached descriptor of a restarted peer is noticed, as Mooncake
RFC #2762 proposes), ``access`` per buffer, and the RPC endpoint.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ..addresses import AddressTable
from ..errors import MetadataError, ERR_MALFORMED_JSON


@dataclass(frozen=True)
class BufferInfo:
    """One registered buffer as a peer published it."""

    address: int
    length: int
    location: str = "cpu:0"
    access: str = "rw"
    rkey: tuple = ()
    lkey: tuple = ()

    def contains(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.address + self.length

    def to_json(self) -> dict:
        return {"name": self.location, "addr": self.address, "length": self.length,
                "rkey": list(self.rkey), "lkey": list(self.lkey), "access": self.access}

    @classmethod
    def from_json(cls, d: dict) -> "BufferInfo":
        return cls(address=int(d["addr"]), length=int(d["length"]),
                   location=str(d.get("name", "cpu:0")), access=str(d.get("access", "rw")),
                   rkey=tuple(d.get("rkey", ())), lkey=tuple(d.get("lkey", ())))


@dataclass
class SegmentDescriptor:
    """Everything a peer needs to reach an engine and address its memory."""

    name: str
    protocol: str
    host: str
    rpc_port: int
    instance_id: str
    tcp_data_port: int = 0
    buffers: list = field(default_factory=list)          # list[BufferInfo]
    devices: list = field(default_factory=list)          # [{"name", "lid", "gid"}]
    priority_matrix: dict = field(default_factory=dict)
    protocols: list = field(default_factory=list)        # every transport this engine serves
    extra: dict = field(default_factory=dict)            # transport-specific fields
    timestamp: str = ""

    def buffer_table(self) -> AddressTable:
        """Which published buffer holds an address (:class:`AddressTable` over
        :attr:`buffers`), built once per list of buffers."""
        t = self.__dict__.get("_buffer_table")
        if t is None or t[0] is not self.buffers or len(t[1]) != len(self.buffers):
            t = self.__dict__["_buffer_table"] = (self.buffers, AddressTable(self.buffers))
        return t[1]

    def to_json(self) -> dict:
        d = {
            "name": self.name,
            "protocol": self.protocol,
            "protocols": list(self.protocols or [self.protocol]),
            "devices": list(self.devices),
            "priority_matrix": dict(self.priority_matrix),
            "buffers": [b.to_json() for b in self.buffers],
            "tcp_data_port": self.tcp_data_port,
            "tcp_proto_version": 2,
            "timestamp": self.timestamp or time.strftime("%Y-%m-%dT%H:%M:%S"),
            "instance_id": self.instance_id,
            "ip_or_host_name": self.host,
            "rpc_port": self.rpc_port,
        }
        d.update(self.extra)
        return d

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, d: dict) -> "SegmentDescriptor":
        try:
            known = {"name", "protocol", "protocols", "devices", "priority_matrix", "buffers",
                     "tcp_data_port", "tcp_proto_version", "timestamp", "instance_id",
                     "ip_or_host_name", "rpc_port"}
            return cls(
                name=str(d["name"]),
                protocol=str(d["protocol"]),
                protocols=list(d.get("protocols") or [d["protocol"]]),
                host=str(d.get("ip_or_host_name", "")),
                rpc_port=int(d.get("rpc_port", 0)),
                instance_id=str(d.get("instance_id", "")),
                tcp_data_port=int(d.get("tcp_data_port", 0)),
                buffers=[BufferInfo.from_json(b) for b in d.get("buffers", ())],
                devices=list(d.get("devices", ())),
                priority_matrix=dict(d.get("priority_matrix", {})),
                timestamp=str(d.get("timestamp", "")),
                extra={k: v for k, v in d.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise MetadataError(f"malformed segment descriptor ({e!r}); "
                                f"the peer may run an incompatible version",
                                status=ERR_MALFORMED_JSON) from None

    @classmethod
    def decode(cls, raw: bytes) -> "SegmentDescriptor":
        try:
            d = json.loads(raw)
        except ValueError as e:
            raise MetadataError(f"segment descriptor is not JSON: {e}",
                                status=ERR_MALFORMED_JSON) from None
        if not isinstance(d, dict):
            raise MetadataError("segment descriptor is not a JSON object", status=ERR_MALFORMED_JSON)
        return cls.from_json(d)

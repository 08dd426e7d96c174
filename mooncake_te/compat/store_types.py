# SPDX-License-Identifier: Apache-2.0
"""Mooncake Store's return codes and value types, below the store that uses them.

``mooncake.store`` (:mod:`.store`) re-exports every name here; this module exists so
the parts of the compat layer that speak the store's types without running a store (the
dummy client, :mod:`.dummy_client`, and the tensor calls) import them without importing
the store itself (no import cycle: docs/architecture.md). Return codes are Mooncake
Store's (``mooncake-store/include/types.h``).
"""
from __future__ import annotations

import enum

import numpy as np

from .. import errors as E
from ..units import parse_size

OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
NOT_SUPPORTED = -1012
FILE_NOT_FOUND = -1100
TASK_NOT_FOUND = -1400


def _parse_size(value) -> int:
    """``4194304``, ``"4MB"``, ``"64 KB"`` -> bytes (the units vLLM's config accepts;
    :func:`mooncake_te.units.parse_size`)."""
    if isinstance(value, int):
        return value
    try:
        return parse_size(value, minimum=0)
    except ValueError:
        raise E.InvalidArgumentError(f"size {value!r} is not a number of bytes (e.g. 4MB)"
                                     ) from None


class ReplicaStatus(enum.IntEnum):
    """A replica's state, as Mooncake's ``ReplicaStatus``; every replica this store
    reports is ``COMPLETE`` (a put returns once its bytes and index record are in)."""
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(enum.IntEnum):
    """Mooncake's ``TaskType``: what ``create_copy_task`` / ``create_move_task`` made."""
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    """Mooncake's ``TaskStatus``, with its names and values (see :class:`TaskType`)."""
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class QueryTaskResponse:
    """Mooncake's answer to ``query_task``: the task's id, type, status, times (ms since
    the epoch), the client that ran it and a message."""

    def __init__(self):
        self.id = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.PENDING
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client = (0, 0)
        self.message = ""


class SoftPinAction(enum.IntEnum):
    """What a put asks of the object's soft pin (``ReplicateConfig.soft_pin_action``),
    with Mooncake's names and values (``mooncake-store/include/replica.h``). Accepted;
    this store has no pins: objects are evicted least recently used first."""
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """What an object holds, with Mooncake's names and values
    (``mooncake-store/include/types.h``; vLLM's EC connector tags embeddings with it).
    Accepted and not stored: every object is bytes here."""
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


_U64 = 1 << 64


class BufferHandle(np.ndarray):
    """An object's bytes as ``get_buffer``/``batch_get_buffer`` return them: a numpy
    ``uint8`` array (so ``memoryview(h)``, ``np.asarray(h)`` are zero-copy views) with
    Mooncake's ``ptr()`` and ``size()``. The memory is this handle's: valid while it
    lives (Mooncake's handle points into the client's registered buffer)."""

    def ptr(self) -> int:
        return int(self.ctypes.data)

    def size(self) -> int:           # type: ignore[override]
        return int(self.nbytes)


class ReplicateConfig:
    """Mooncake's ``ReplicateConfig``: how a put places its replicas.

    Every field is accepted; placement follows it where this store can: one memory
    replica, in the putting process's pool (``replica_num`` above 1, NVMe-oF and DFS
    replicas are not made). ``preferred_segment`` is honoured when it names this
    process's segment and otherwise falls back to it, as Mooncake falls back when the
    preferred segment has no room. ``group_ids`` are recorded and do not change
    placement.
    """

    def __init__(self):
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: list = []
        self.soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: "int | None" = None
        self.data_type = ObjectDataType.UNKNOWN
        self.preferred_nof_segments: list = []

    @property
    def soft_pin_ttl_ms(self) -> "int | None":
        """None (the default TTL) or milliseconds, 0 to 2**64-1; anything else is a
        TypeError, as in Mooncake's binding."""
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < _U64):
            raise TypeError(f"soft_pin_ttl_ms must be None or an integer in [0, 2**64), "
                            f"not {value!r}")
        self._soft_pin_ttl_ms = value

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, preferred_segment="
                f"{self.preferred_segment!r}, group_ids={len(self.group_ids or ())} ids)")


class MemoryDescriptor:
    """Where a memory replica lives: ``buffer_descriptor`` (segment, address, size)."""

    def __init__(self, segment: str, address: int, size: int):
        self.buffer_descriptor = BufferDescriptor(segment, address, size)


class BufferDescriptor:
    """Mooncake's ``Descriptor`` (``AllocatedBuffer::Descriptor``): a replica's buffer,
    read as ``size``, ``buffer_address``, ``transport_endpoint`` (Mooncake's Python
    names; the C++ member names with a trailing ``_`` are kept too)."""

    def __init__(self, segment: str = "", address: int = 0, size: int = 0):
        self.transport_endpoint_ = segment
        self.segment_name = segment
        self.buffer_address_ = address
        self.size_ = size

    size = property(lambda self: self.size_,
                    lambda self, v: setattr(self, "size_", int(v)))
    buffer_address = property(lambda self: self.buffer_address_,
                              lambda self, v: setattr(self, "buffer_address_", int(v)))
    transport_endpoint = property(lambda self: self.transport_endpoint_,
                                  lambda self, v: setattr(self, "transport_endpoint_",
                                                          str(v)))

    def __repr__(self) -> str:
        return f"BufferDescriptor({self.segment_name!r}, {self.buffer_address_:#x}, {self.size_})"


class DiskDescriptor:
    """Where a disk replica lives: ``file_path`` and ``object_size``."""

    def __init__(self, file_path: str, object_size: int):
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica of an object, as ``batch_get_replica_desc`` returns them (Mooncake's
    ``Replica::Descriptor``): ``status`` and the predicates vLLM's connector calls."""

    def __init__(self, kind: str, segment: str = "", address: int = 0, size: int = 0,
                 path: str = ""):
        self._kind = kind             # "memory", "local_disk"
        self.status = "COMPLETE"
        self._mem = MemoryDescriptor(segment, address, size) if kind == "memory" else None
        self._disk = DiskDescriptor(path, size) if kind != "memory" else None

    def is_memory_replica(self) -> bool:
        return self._kind == "memory"

    def is_disk_replica(self) -> bool:
        return False                  # a shared-filesystem replica: never made here

    def is_local_disk_replica(self) -> bool:
        return self._kind == "local_disk"

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._mem is None:
            raise E.InvalidArgumentError("not a memory replica (check is_memory_replica())")
        return self._mem

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self._disk is None:
            raise E.InvalidArgumentError("not a disk replica (check is_local_disk_replica())")
        return self._disk

    def __repr__(self) -> str:
        return f"<ReplicaDescriptor {self._kind} {self.status}>"

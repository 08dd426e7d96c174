# SPDX-License-Identifier: Apache-2.0
"""mooncake_te: a transfer engine for KV cache and other large buffers.

>>> import mooncake_te as mte
>>> eng = mte.TransferEngine(host="127.0.0.1")        # doctest: +SKIP
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: F401
    MooncakeError, InvalidArgumentError, AddressNotRegisteredError, AddressOverlappedError,
    SegmentNotFoundError, TransferError, TransferTimeoutError, TransferCanceledError,
    MetadataError, DeviceNotFoundError, TransportUnavailableError, AuthenticationError,
    ConfigError,
)
from .batch import Batch, Notification, Op, READ, WRITE, TransferRequest, TransferStatus  # noqa: F401
from .config import Config  # noqa: F401
from .memory import MemoryRegion  # noqa: F401
from .metadata import BufferInfo  # noqa: F401
from .engine import Segment, TransferEngine  # noqa: F401

__all__ = [
    "TransferEngine", "Segment", "Batch", "Notification", "Op", "READ", "WRITE",
    "TransferRequest", "TransferStatus", "MemoryRegion", "BufferInfo", "Config",
    "MooncakeError", "InvalidArgumentError", "AddressNotRegisteredError",
    "AddressOverlappedError", "SegmentNotFoundError", "TransferError", "TransferTimeoutError",
    "TransferCanceledError", "MetadataError", "DeviceNotFoundError",
    "TransportUnavailableError", "AuthenticationError", "ConfigError", "__version__",
]

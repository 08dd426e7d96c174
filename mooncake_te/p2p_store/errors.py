# SPDX-License-Identifier: Apache-2.0
"""Errors of the P2P store, each a :class:`mooncake_te.errors.MooncakeError`.

They subclass the engine's tree where the meaning matches (an object nobody publishes
is "not found" like a segment; every holder failing is a failed transfer), so callers
that catch the engine's errors catch these too, and they pickle like the rest.
"""
from __future__ import annotations

from ..errors import (ERR_METADATA, InvalidArgumentError, MooncakeError, SegmentNotFoundError,
                      TransferError)


class ObjectNotFoundError(SegmentNotFoundError):
    """No object of that name is published (or it was unregistered)."""

    default_status = ERR_METADATA


class ObjectUnregisteredError(ObjectNotFoundError):
    """The object was unregistered (or replaced) by its publisher while being fetched."""


class ObjectExistsError(InvalidArgumentError):
    """The name is already published, or this store already holds it."""


class NoHolderError(TransferError):
    """No reachable holder could supply some chunks (all failed, all corrupt, or none)."""


__all__ = ["ObjectNotFoundError", "ObjectUnregisteredError", "ObjectExistsError",
           "NoHolderError", "MooncakeError"]

# SPDX-License-Identifier: Apache-2.0
"""The one contract every transport implements, and the stand-in for a missing one.

A transport moves bytes between this engine's registered memory and a peer's. The
engine owns the region table (every transport checks requests against it); a transport
adds what it needs on top (RDMA: memory registrations and rkeys).
"""
from __future__ import annotations

from abc import ABC, abstractmethod


class Transport(ABC):
    name = "?"
    available = True
    reason = ""

    def describe(self) -> dict:
        """Fields this transport adds to the segment descriptor."""
        return {}

    def register(self, region) -> None:
        """Called after a region entered the table."""

    def unregister(self, region) -> None:
        """Called before a region leaves the table."""

    @abstractmethod
    def submit(self, batch, desc, op, local, remote, lens, first: int, run_inline: bool) -> None:
        """Queue requests [first, first+len(local)) of ``batch`` to the peer ``desc``."""

    @abstractmethod
    def add_notify(self, batch, desc, message: bytes) -> None:
        """Deliver ``message`` to ``desc`` once the batch's data has landed."""

    def forget_peer(self, name: str) -> None:
        """Drop connections to a peer (it restarted or went away)."""

    def notifications(self) -> list:
        return []

    @abstractmethod
    def close(self) -> None: ...


class UnavailableTransport:
    """A transport this build or machine cannot offer, and why (CuPy's _UnavailableModule)."""

    available = False

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason

    def __repr__(self) -> str:
        return f"<transport {self.name}: unavailable ({self.reason})>"

# SPDX-License-Identifier: Apache-2.0
"""Which transports an engine runs, and which one carries each group of requests.

The engine does not name transports: each declares the ``protocol=`` values it serves,
its ``priority`` (the order routes are asked in) and its :class:`Capabilities`
(``mooncake_te.transports.base``). The transport with ``notifications`` always runs (it
serves peers and carries notifications) even where it moves no data (``protocol="rdma"``).
"""
from __future__ import annotations

import logging
from typing import NoReturn

from . import errors as E
from .transports import probe as probe_transports
from .transports.base import TransportContext
# The core's services, handed to transports through their context.
from .core import HOST_ID, NativeBatch

log = logging.getLogger("mooncake_te")

__all__ = ["Transports", "HOST_ID", "NativeBatch", "probe_transports"]


def _distinct(known: dict) -> list:
    """(name, transport class) without aliases ("shm" is TCP's same-host mode), by
    priority."""
    seen, out = set(), []
    for name, cls in known.items():
        if id(cls) in seen:
            continue
        seen.add(id(cls))
        out.append((name, cls))
    return sorted(out, key=lambda nc: nc[1].priority)


def _serves(cls, protocol: str) -> bool:
    return "*" in cls.serves or protocol in cls.serves


class Transports:
    """The transports of one engine: started once, asked for routes, closed together.

    Parameters
    ----------
    known : dict
        name -> transport class or UnavailableTransport (``transports.probe()``).
    protocol : str
        What the user asked for (``"auto"``, ``"tcp"``, ``"shm"``, ``"rdma"``).
    """

    def __init__(self, known: dict, protocol: str):
        self.known = known
        self.asked = protocol
        self.protocol = self._choose(protocol)
        self.running: dict = {}       # name -> Transport, in priority order
        self.routing: list = []       # those that carry data for this protocol
        self.notifier = None          # the one with Capabilities.notifications
        self.new_batch = NativeBatch  # (n, deadline_ns) -> the native batch every transport finishes
        # The engine's registered memory (has_gpu, on_gpu(addresses)): a group whose local
        # memory is on a GPU goes only to transports that declare gpu_memory.
        self.book = None
        self.host_only = False        # set by start(): some routing transport lacks gpu_memory

    # --- set-up ----------------------------------------------------------------------
    def _general(self):
        """Transports that reach any peer (not storage, not same-host only)."""
        return [(n, c) for n, c in _distinct(self.known)
                if not c.capabilities.same_host and not c.capabilities.storage]

    def _choose(self, protocol: str) -> str:
        known = self.known
        if protocol == "auto":
            # The best this machine has; the notification carrier (TCP) always works.
            return next(n for n, c in self._general() if getattr(c, "available", False))
        if protocol not in known:
            raise E.InvalidArgumentError(f"unknown protocol {protocol!r}; use one of "
                                         f"auto, {', '.join(known)}")
        t = known[protocol]
        if getattr(t, "available", True) is False:
            raise E.TransportUnavailableError(f"transport {protocol!r} is unavailable: "
                                              f"{t.reason}; use protocol='tcp' or 'auto'")
        return protocol

    def context(self, **kw) -> TransportContext:
        """The context every transport of this engine gets (``kw``: the engine's data and
        services, see TransportContext)."""
        return TransportContext(protocol=self.asked, host_id=HOST_ID, new_batch=NativeBatch,
                                **kw)

    def start(self, ctx: TransportContext) -> None:
        asked = self.asked
        for name, cls in _distinct(self.known):
            always = cls.capabilities.notifications
            if not (always or _serves(cls, asked)):
                continue
            if not getattr(cls, "available", False):
                if name == asked:          # asked for by name: never fall back silently
                    raise E.TransportUnavailableError(
                        f"transport {name!r} is unavailable: {cls.reason}; use "
                        f"protocol='tcp' or 'auto'")
                continue
            try:
                t = cls(ctx)
            except E.MooncakeError:
                if name == asked or always:
                    raise
                log.info("transport %s not started", name, exc_info=True)
                continue
            self.running[name] = t
            if always and self.notifier is None:
                self.notifier = t
            if _serves(cls, asked):
                self.routing.append(t)
        # Some transport that carries data moves no GPU memory: pick() then looks at
        # where each group's local memory is (every built-in transport moves it).
        self.host_only = any(not t.capabilities.gpu_memory for t in self.routing)
        if self.protocol not in self.running and asked == "auto":
            # The best one could not start here: the next that did.
            self.protocol = next(n for n, _ in self._general() if n in self.running)

    def close(self) -> None:
        for t in reversed(list(self.running.values())):
            t.close()

    # --- queries ---------------------------------------------------------------------
    def with_capability(self, what: str):
        """The first running transport that declares capability ``what``, or None."""
        return next((t for t in self.running.values() if getattr(t.capabilities, what)),
                    None)

    def pick(self, desc, op: int, local, remote):
        """(transport, route) that carries ``op`` requests to ``desc``."""
        if self.host_only:
            return self._pick_by_memory(desc, op, local, remote)
        for t in self.routing:
            r = t.route(desc, op, local, remote)
            if r:
                return t, r
        self._no_route(desc)

    def _pick_by_memory(self, desc, op: int, local, remote):
        """:meth:`pick` when some transport does not declare gpu_memory: a group whose
        local memory is on a GPU skips it."""
        book = self.book
        gpu = book is not None and book.has_gpu and book.on_gpu(local)
        skipped = []
        for t in self.routing:
            if gpu and not t.capabilities.gpu_memory:
                skipped.append(t.name)
                continue
            r = t.route(desc, op, local, remote)
            if r:
                return t, r
        if skipped:
            movers = [t.name for t in self.routing if t.capabilities.gpu_memory]
            raise E.TransportUnavailableError(
                f"the local memory of these requests to {desc.name} is GPU memory, which "
                f"{', '.join(skipped)} cannot move (it declares no gpu_memory) and "
                + (f"no transport that can ({', '.join(movers)}) reaches {desc.name}"
                   if movers else "no transport of this engine that moves GPU memory runs")
                + "; use protocol='auto' (TCP stages GPU memory) or copy the bytes to a "
                  "registered host buffer first")
        self._no_route(desc)

    def _no_route(self, desc) -> NoReturn:
        for t in self.routing:
            why = t.no_route_reason(desc)
            if why:
                raise E.TransportUnavailableError(why)
        names = ", ".join(t.name for t in self.routing)
        raise E.TransportUnavailableError(
            f"no transport of this engine ({names}) reaches {desc.name}, which serves "
            f"{', '.join(desc.protocols) or 'nothing'}; use protocol='auto' on both engines")

    def cacheable(self, desc, t) -> bool:
        """Whether ``pick(desc, ...)`` answers ``t`` for every address: neither ``t`` nor
        any transport asked before it routes ``desc`` by address (or, with GPU memory
        registered, lacks gpu_memory)."""
        for r in self.routing:
            if r.route_by_address(desc) or (
                    not r.capabilities.gpu_memory and self.book is not None
                    and self.book.has_gpu):
                return False
            if r is t:
                return True
        return False

    def forget(self, name: str) -> None:
        for t in self.running.values():
            t.forget_peer(name)

    def auth_failures(self) -> int:
        return sum(t.auth_failures for t in self.running.values())

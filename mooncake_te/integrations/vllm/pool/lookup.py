# SPDX-License-Identifier: Apache-2.0
"""Scheduler -> worker lookups: how long a prefix the worker's pool holds, by tier.

The scheduler (:class:`PoolLookup`) asks the worker's server (:class:`_LookupServer`,
answering with :meth:`~.worker.PoolWorker.lookup`) over an ``AF_UNIX`` socket
(:func:`lookup_address`), so it works whether vLLM runs the worker in the scheduler's
process or another. Wire format, little-endian:

    request  u32 number of keys, u8 flags (1: also ask the tiers that are not local),
             then the keys (16 bytes each)
    reply    u8 number of tiers T, u8 length L of the names, L bytes of tier names
             (ASCII, comma-separated, the worker's registry order), then T u32 counts

The reply names its tiers, so the two sides need not agree on a registry: a tier
registered in the worker (:mod:`mooncake_te.kvcache.tiers`) reaches the scheduler's
counts, the hit-rate line and the metrics as data.

The socket is a control-plane listener (issue #35 item 4): it lives in a directory only
our uid can enter (:func:`~mooncake_te.metadata.listener.private_path`; a fixed abstract
name could be taken by anyone first), the server serves only our uid and the client talks
only to a server of our uid (``SO_PEERCRED``); the accept loop is the shared
:class:`~mooncake_te.metadata.listener.Listener` (survives EMFILE, at most
``MAX_CONNECTIONS``); a request announces at most ``MAX_KEYS`` keys (checked before
anything is read for them), must arrive whole within ``FRAME_TIMEOUT`` once started, and
a connection idle for ``IDLE_TIMEOUT`` is closed (the client reconnects).
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import time

from ....kvcache.keys import KEY_BYTES
from ....kvcache.tiers import names as tier_names
from ....metadata.framing import _recv_exact
from ....metadata.listener import Listener, connect_private, listen_private, private_path

log = logging.getLogger("mooncake_te.integrations.vllm")

_REQ = struct.Struct("<IB")           # number of keys, flags (1: also ask peers)
_REP = struct.Struct("<BB")           # number of tiers, bytes of their names
#: keys in one lookup (a prompt of 4 Mi tokens at 16 tokens a block); a longer prefix is
#: looked up by its first MAX_KEYS blocks
MAX_KEYS = 1 << 18
MAX_CONNECTIONS = 16        # lookup connections served at once (one per scheduler)
FRAME_TIMEOUT = 5.0         # s from a request's first byte to its last
IDLE_TIMEOUT = 300.0        # s without a request before the connection is closed


class TierCounts(tuple):
    """Blocks of a prefix by tier: a tuple of counts (``(3, 2, 0)``) with ``names``
    (``("dram", "ssd", "remote")``), in the registry's order. Compares equal to the
    plain tuple of its counts."""

    names: tuple

    def __new__(cls, counts=(), names=None):
        if isinstance(counts, dict):
            names, counts = tuple(counts), tuple(counts.values())
        elif isinstance(counts, TierCounts) and names is None:
            names = counts.names
        counts = tuple(int(n) for n in counts)
        if names is None:
            reg = tier_names()
            names = reg[:len(counts)] if len(counts) <= len(reg) else reg + tuple(
                f"tier{i}" for i in range(len(reg), len(counts)))
        names = tuple(names)
        if len(names) != len(counts):
            raise ValueError(f"{len(counts)} tier counts for {len(names)} names {names}")
        self = super().__new__(cls, counts)
        self.names = names
        return self

    @classmethod
    def zero(cls) -> "TierCounts":
        """No block in any registered tier."""
        reg = tier_names()
        return cls((0,) * len(reg), reg)

    def __reduce__(self):
        return (TierCounts, (tuple(self), self.names))

    def __repr__(self) -> str:
        return f"TierCounts({self.as_dict()!r})"

    def as_dict(self) -> dict:
        return dict(zip(self.names, self))

    def clip(self, n: int) -> "TierCounts":
        """The first ``n`` blocks of the prefix, by tier."""
        out = []
        for t in self:
            out.append(min(t, n))
            n -= out[-1]
        return TierCounts(out, self.names)

    def pack(self) -> bytes:
        names = ",".join(self.names).encode("ascii")
        return _REP.pack(len(self), len(names)) + names + struct.pack(f"<{len(self)}I", *self)

    @classmethod
    def read(cls, sock) -> "TierCounts":
        n, ln = _REP.unpack(_recv_exact(sock, _REP.size))
        names = _recv_exact(sock, ln).decode("ascii").split(",") if ln else []
        counts = struct.unpack(f"<{n}I", _recv_exact(sock, 4 * n))
        return cls(counts, names)


def lookup_address(engine_id: str, tp_rank: int = 0) -> str:
    """The ``AF_UNIX`` path the worker of ``engine_id`` answers lookups on: in a
    directory only our uid can enter (``$MC_RUNTIME_DIR``, ``$XDG_RUNTIME_DIR`` or
    ``<tmp>/mooncake_te-<uid>``; see :func:`~mooncake_te.metadata.listener.private_dir`)."""
    return private_path(f"vllm-pool-{engine_id}-{int(tp_rank)}")


class PoolLookup:
    """The scheduler's view of the worker's pool: ``lookup(keys)`` -> the tiers of the
    longest prefix of ``keys`` held, as :class:`TierCounts` (``(dram, ssd, remote)``
    block counts with the registered tiers)."""

    def __init__(self, address: str, timeout_s: float = 2.0):
        self.address = address
        self.timeout_s = timeout_s
        self._sock: "socket.socket | None" = None
        self.errors = 0

    def lookup(self, keys, remote: bool = True) -> TierCounts:
        if not keys:
            return TierCounts.zero()
        keys = keys[:MAX_KEYS]              # the server refuses more: a prefix of them
        msg = _REQ.pack(len(keys), 1 if remote else 0) + b"".join(keys)
        for attempt in (0, 1):
            try:
                if self._sock is None:
                    # A server of another uid (a squatter) is refused, never asked.
                    self._sock = connect_private(self.address, self.timeout_s)
                self._sock.sendall(msg)
                return TierCounts.read(self._sock)
            except OSError as e:
                self.close()
                if attempt:
                    self.errors += 1
                    if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                        log.warning("mooncake_te connector: pool lookup failed (%d so far): "
                                    "%s; counting a miss", self.errors, e)
        return TierCounts.zero()

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


class _LookupServer:
    """Answers :class:`PoolLookup` with ``answer(keys, remote)`` (a :class:`TierCounts`
    or a dict ``{tier: blocks}``), on the shared control-plane accept loop."""

    def __init__(self, address: str, answer):
        self._answer = answer
        self.address = address
        self._srv = listen_private(address)
        self._closed = False
        self.refused = 0                    # requests refused (too many keys, stalled)
        self._listener = Listener(self._srv, "mte-vllm-lookup", self._serve,
                                  MAX_CONNECTIONS, MAX_CONNECTIONS).start()

    @property
    def listener(self) -> Listener:
        return self._listener

    def _read(self, conn):
        """The next request's (keys, flags); None when the peer closed, was idle for
        IDLE_TIMEOUT, stalled mid-request or announced too many keys."""
        try:
            conn.settimeout(IDLE_TIMEOUT)
            first = conn.recv(1)
            if not first:
                return None
            deadline = time.monotonic() + FRAME_TIMEOUT
            n, flags = _REQ.unpack(first + _recv_exact(conn, _REQ.size - 1, deadline))
            if n > MAX_KEYS:
                self.refused += 1
                log.warning("mooncake_te connector: a pool lookup of %d keys refused (at "
                            "most %d)", n, MAX_KEYS)
                return None
            raw = _recv_exact(conn, n * KEY_BYTES, deadline)
        except (OSError, ConnectionError):
            return None
        return [raw[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)], flags

    def _serve(self, conn, peer=None) -> None:
        with conn:
            while not self._closed:
                req = self._read(conn)
                if req is None:
                    return
                keys, flags = req
                try:
                    rep = self._answer(keys, bool(flags & 1))
                except Exception as e:          # answer a miss rather than hang the scheduler
                    log.warning("mooncake_te connector: pool lookup failed: %s", e)
                    rep = TierCounts.zero()
                try:
                    conn.sendall(TierCounts(rep).pack())
                except OSError:
                    return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._srv.close()
        self._listener.close()
        if not self.address.startswith("\0"):
            try:
                os.unlink(self.address)
            except OSError:
                pass

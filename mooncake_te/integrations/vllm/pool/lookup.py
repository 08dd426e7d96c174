# SPDX-License-Identifier: Apache-2.0
"""Scheduler -> worker lookups: how long a prefix the worker's pool holds, by tier.

The scheduler (:class:`PoolLookup`) asks the worker's server (:class:`_LookupServer`,
answering with :meth:`~.worker.PoolWorker.lookup`) over an ``AF_UNIX`` socket in the
abstract namespace (:func:`lookup_address`), so it works whether vLLM runs the worker in
the scheduler's process or another. Wire format, little-endian:

    request  u32 number of keys, u8 flags (1: also ask the tiers that are not local),
             then the keys (16 bytes each)
    reply    u8 number of tiers T, u8 length L of the names, L bytes of tier names
             (ASCII, comma-separated, the worker's registry order), then T u32 counts

The reply names its tiers, so the two sides need not agree on a registry: a tier
registered in the worker (:mod:`mooncake_te.kvcache.tiers`) reaches the scheduler's
counts, the hit-rate line and the metrics as data.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading

from ....kvcache.keys import KEY_BYTES
from ....kvcache.tiers import names as tier_names
from ....metadata.framing import _recv_exact

log = logging.getLogger("mooncake_te.integrations.vllm")

_REQ = struct.Struct("<IB")           # number of keys, flags (1: also ask peers)
_REP = struct.Struct("<BB")           # number of tiers, bytes of their names


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
    """The abstract ``AF_UNIX`` name the worker of ``engine_id`` answers lookups on."""
    return f"\0mooncake_te/vllm-pool/{engine_id}/{int(tp_rank)}"


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
        msg = _REQ.pack(len(keys), 1 if remote else 0) + b"".join(keys)
        for attempt in (0, 1):
            try:
                if self._sock is None:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(self.timeout_s)
                    s.connect(self.address)
                    self._sock = s
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
    or a dict ``{tier: blocks}``), one thread per connection."""

    def __init__(self, address: str, answer):
        self._answer = answer
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(address)
        self._srv.listen(8)
        self._closed = False
        threading.Thread(target=self._accept, name="mte-vllm-lookup", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="mte-vllm-lookup-conn").start()

    def _serve(self, conn) -> None:
        with conn:
            while not self._closed:
                try:
                    n, flags = _REQ.unpack(_recv_exact(conn, _REQ.size))
                    raw = _recv_exact(conn, n * KEY_BYTES)
                except (OSError, ConnectionError):
                    return
                keys = [raw[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]
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
        self._closed = True
        try:
            self._srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._srv.close()



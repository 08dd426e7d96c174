# SPDX-License-Identifier: Apache-2.0
"""Prepared descriptor lists: check once, then post transfers by block indices.

What NIXL calls ``prep_xfer_dlist`` + ``make_prepped_xfer``. A paged KV cache moves the
same kind of transfer again and again: the same peer, the same local and remote regions,
the same block size, only the block ids change. :meth:`TransferEngine.prepare` takes
the block-address tables once, checks every local block against the registered regions
and every remote block against the peer's published buffers, resolves the peer and picks
the route, and copies the tables into the native core (``core.PreparedTable``,
src/core/prep.h). :meth:`PreparedTransfer.post` is then, over TCP and the same-host
transport, one native call (``post_prepared``) that checks the indices and writes the
requests straight into the peer's queue: no per-block Python, no gathered address
arrays, no region lookup, no routing. Other transports (RDMA, CUDA IPC) gather the
addresses in one native loop (``core.gather_blocks``) and queue them as a batch.

Tables are 1-D (one entry per block slot: ``post`` takes indices into it) or 2-D
``[regions, blocks]`` (block ``b`` of every region: ``post`` takes block ids and moves
that block of every region, region-major, as vLLM's per-layer K and V planes are).

Safety does not depend on the checks at prepare time staying true: the data path pins
each local region while its bytes move (a region unregistered since is a per-request
error, never a write to freed memory), and the owning side checks every remote address
against its regions, as for any transfer.
"""
from __future__ import annotations

import os
import time

import numpy as np

from . import errors as E
from . import submit as S
from .batch import Batch, Op
from .core import PreparedTable, gather_blocks
from .segments import target_name

__all__ = ["PreparedTransfer"]

_OPS = frozenset(int(o) for o in Op)
_INT64 = np.dtype(np.int64)
_getpid = os.getpid
_monotonic_ns = time.monotonic_ns


def _ids(ids, what: str, cols: int) -> np.ndarray:
    """``ids`` as a C-contiguous 1-D int64 array, or a clear error (a uint64 id that
    would wrap as int64 is refused here, not wrapped)."""
    if isinstance(ids, range):
        ids = np.arange(ids.start, ids.stop, ids.step, dtype=np.int64)
    a = np.asarray(ids)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise E.InvalidArgumentError(f"{what} must be a 1-D array (or range) of integer "
                                     f"block indices, got {ids!r:.80}")
    if a.dtype.kind == "u" and len(a) and a.max() >= cols:
        k = int(np.argmax(a >= cols))
        raise E.InvalidArgumentError(f"{what} holds an index outside [0, {cols}): "
                                     f"{what}[{k}] = {int(a[k])}")
    return np.ascontiguousarray(a, dtype=np.int64)


class _Blocks:
    """The addresses a post moved, computed when asked (a failed request's error
    message): ``rows[k // n, ids[k % n]]``, region-major as the requests are."""

    __slots__ = ("rows", "ids")

    def __init__(self, rows: np.ndarray, ids: np.ndarray):
        self.rows, self.ids = rows, ids

    def __len__(self) -> int:
        return self.rows.shape[0] * len(self.ids)

    def __getitem__(self, k):
        n = len(self.ids)
        return self.rows[k // n, self.ids[k % n]]


def _table(values, what: str) -> np.ndarray:
    try:
        a = np.ascontiguousarray(values, dtype=np.uint64)
    except (TypeError, ValueError, OverflowError):
        raise E.InvalidArgumentError(f"{what} must be non-negative integer addresses, got "
                                     f"{values!r:.80}") from None
    if isinstance(values, np.ndarray) and values.dtype.kind == "i" and (values < 0).any():
        raise E.InvalidArgumentError(f"{what} must be non-negative addresses")
    if a.ndim not in (1, 2) or a.size == 0:
        raise E.InvalidArgumentError(f"{what} must be a non-empty 1-D table of block "
                                     f"addresses or a 2-D [regions, blocks] one; got shape "
                                     f"{a.shape}")
    return a


class PreparedTransfer:
    """Block transfers to one peer, checked once (:meth:`TransferEngine.prepare`).

    Attributes
    ----------
    target : str
        The peer's segment name.
    transport : str
        The route chosen at preparation (the name of the transport's route).
    native : bool
        Whether that transport posts in one native call (its ``prepared`` capability);
        otherwise each post gathers addresses and queues a batch.
    local_blocks, remote_blocks : int
        Valid index range of :meth:`post` on each side (blocks per region for 2-D tables).
    """

    def __init__(self, engine, target, local, remote, block_size):
        self._eng = core = engine.internal
        self.target = target_name(target)
        self._local = _table(local, "local")
        self._remote = _table(remote, "remote")
        # [rows, blocks] views of both tables (a 1-D table is one row): what post()
        # gathers from, natively.
        self._lrows = self._local.reshape(-1, self._local.shape[-1])
        self._rrows = self._remote.reshape(-1, self._remote.shape[-1])
        if self._local.ndim != self._remote.ndim or (
                self._local.ndim == 2 and self._local.shape[0] != self._remote.shape[0]):
            raise E.InvalidArgumentError(
                f"local {self._local.shape} and remote {self._remote.shape} tables must both "
                f"be 1-D, or both 2-D with the same number of regions (rows)")
        rows = self._local.shape[0] if self._local.ndim == 2 else 1
        bs = np.ascontiguousarray(block_size, dtype=np.uint64).reshape(-1)
        if len(bs) not in (1, rows) or not bs.all():
            raise E.InvalidArgumentError(
                f"block_size must be a positive int, or one per region ({rows}); got "
                f"{block_size!r:.80}")
        self._bs = bs
        self.local_blocks = self._local.shape[-1]
        self.remote_blocks = self._remote.shape[-1]
        # Every block, checked now: local ones against our regions, remote ones against
        # the buffers the peer publishes.
        lens = (np.broadcast_to(bs[:, None], self._local.shape).ravel() if len(bs) > 1
                else bs)
        src = self._local.ravel()
        bad, _ = core.regions.check_many(src, lens, 0)
        if bad >= 0:
            n = int(lens[bad] if len(lens) > 1 else lens[0])
            raise E.AddressNotRegisteredError(
                f"local block {bad} [{int(src[bad]):#x}, +{n}) is not inside a region "
                f"registered with this engine; register the KV cache first")
        desc = core.resolve(self.target)
        rlens = (np.broadcast_to(bs[:, None], self._remote.shape).ravel() if len(bs) > 1
                 else np.full(self._remote.size, bs[0], np.uint64))
        _check_remote(desc, self._remote.ravel(), rlens)
        self._rlens = rlens
        self._desc = desc
        self._routes = {}        # op -> (transport, route), picked on first use
        tr, self.transport = self._route(int(Op.WRITE))
        self.native = bool(tr.capabilities.prepared)
        self._lens = {}          # number of descriptors -> lengths array (cached)
        self._per_id = int(bs.sum()) if len(bs) > 1 else int(bs[0]) * self._lrows.shape[0]
        self._table = self._native_table()

    def __repr__(self) -> str:
        return (f"<PreparedTransfer to {self.target} via {self.transport}: "
                f"{self._local.shape} local, {self._remote.shape} remote>")

    def _native_table(self) -> PreparedTable:
        """The tables in C, for the transports' one-call post (src/core/prep.h)."""
        return PreparedTable(np.ascontiguousarray(self._lrows),
                             np.ascontiguousarray(self._rrows), self._bs,
                             self._eng.regions, self._mergeable(self._bs))

    def _mergeable(self, bs: np.ndarray) -> np.ndarray:
        """Per row, 1 where blocks with consecutive ids may move as one request: the row
        is back to back on both sides (block b at base + b * length) and lies whole in
        one of our regions and one buffer the peer publishes (so a merged request never
        spans two)."""
        rows = self._lrows.shape[0]
        blen = np.broadcast_to(bs, (rows,))
        out = np.ones(rows, np.uint8)
        for tab, cols in ((self._lrows, self.local_blocks), (self._rrows, self.remote_blocks)):
            if cols > 1:
                out &= (tab[:, 1:] - tab[:, :-1] == blen[:, None]).all(axis=1)
        span = blen * np.uint64(self.local_blocks)
        for r in np.flatnonzero(out):
            if self._eng.regions.check_many(self._lrows[r, :1].copy(),
                                             span[r:r + 1].copy(), 0)[0] >= 0:
                out[r] = 0
        rspan = blen * np.uint64(self.remote_blocks)
        for r in np.flatnonzero(out):
            try:
                _check_remote(self._desc, self._rrows[r, :1].copy(), rspan[r:r + 1].copy())
            except E.AddressNotRegisteredError:
                out[r] = 0
        return out

    def _gather(self, table, ids, what):
        """Addresses of blocks ``ids`` of ``table`` (every row's, row by row), in one
        native loop (core.gather_blocks)."""
        if not (type(ids) is np.ndarray and ids.dtype is _INT64 and ids.ndim == 1):
            ids = _ids(ids, what, table.shape[-1])
        rows = self._lrows if table is self._local else self._rrows
        try:
            out = gather_blocks(rows, ids)
        except TypeError:               # a strided view of int64 ids
            ids = np.ascontiguousarray(ids)
            out = gather_blocks(rows, ids)
        if isinstance(out, int):
            raise E.InvalidArgumentError(
                f"{what} holds an index outside [0, {table.shape[-1]}): {what}[{out}] = "
                f"{int(ids[out])}")
        return out

    def _route(self, op: int):
        r = self._routes.get(op)
        if r is None:
            r = self._routes[op] = self._eng.pick(self._desc, op, self._local.ravel(),
                                               self._remote.ravel())
        return r

    def post(self, op, local_ids, remote_ids, notify: bytes | None = None,
             timeout: float | None = None) -> Batch:
        """Start a batch moving blocks ``remote_ids`` <-> ``local_ids``.

        Parameters
        ----------
        op : mte.READ or mte.WRITE
            READ pulls the remote blocks into the local ones, WRITE pushes.
        local_ids, remote_ids : numpy.ndarray of int, or range
            Equal-length 1-D arrays: indices into the 1-D tables, or block ids of the 2-D
            tables (each id is moved in every region). C-contiguous int64 arrays take the
            fastest path; other integer arrays are converted.
        notify : bytes, optional
            Delivered to the peer's ``notifications()`` after the last byte landed.
        timeout : float, optional
            Seconds; default the engine's.

        Returns
        -------
        Batch
        """
        eng = self._eng
        if op not in _OPS:
            raise E.InvalidArgumentError(f"op must be mte.READ or mte.WRITE, got {op!r}")
        if eng.closed or _getpid() != eng.pid:
            eng.check_open()
        # The descriptor cache drops a peer whose connection failed or who restarted; take
        # the current one (one dict lookup when nothing changed).
        desc = self._desc
        if "/" in self.target or eng.cached(self.target) is not desc:
            desc = eng.resolve(self.target)
            if desc is not self._desc:       # re-resolved (restarted peer): check again
                _check_remote(desc, self._remote.ravel(), self._rlens)
                self._desc, self._routes = desc, {}
                self._table = self._native_table()
        op = int(op)
        r = self._routes.get(op)
        tr, route = r if r is not None else self._route(op)
        fast = tr.post_prepared if tr.capabilities.prepared else None
        if notify is not None:
            S.check_notify(notify)
            notify = bytes(notify)
        if fast is None:
            return self._post_gathered(tr, route, desc, op, local_ids, remote_ids, notify,
                                       timeout)
        # One native call: ids checked, requests written into the peer's queue.
        lids, rids = local_ids, remote_ids
        try:
            n = len(lids)
        except TypeError:
            n = -1
        if timeout is None:
            deadline = _monotonic_ns() + int(eng.timeout * 1e9) + self._per_id * max(n, 0)
        else:
            deadline = S.deadline(eng.timeout, self._per_id * max(n, 0), timeout)
        tm = eng.transfer_metrics
        cell = tm.cell(desc.name, route, op) if tm is not None else 0
        try:
            native, taken = fast(desc, self._table, op, lids, rids, deadline, cell, notify)
        except TypeError:       # not C-contiguous int64 arrays: convert, then again
            lids = _ids(local_ids, "local_ids", self.local_blocks)
            rids = _ids(remote_ids, "remote_ids", self.remote_blocks)
            native, taken = fast(desc, self._table, op, lids, rids, deadline, cell, notify)
        n = len(lids)
        k = self._lrows.shape[0] * n
        lens = self._lens.get(k)
        if lens is None:
            lens = self._bs if len(self._bs) == 1 else np.repeat(self._bs, n)
            self._lens[k] = lens
        return Batch(native, taken, deadline,
                     [(desc.name, 0, _Blocks(self._lrows, lids.copy()),
                       _Blocks(self._rrows, rids.copy()), lens, op)], eng.lost_peers)

    def _post_gathered(self, tr, route, desc, op, local_ids, remote_ids, notify, timeout):
        """The general path: addresses gathered (one native loop), queued as a batch."""
        src = self._gather(self._local, local_ids, "local_ids")
        dst = self._gather(self._remote, remote_ids, "remote_ids")
        if len(src) != len(dst):
            raise E.InvalidArgumentError(f"{len(local_ids)} local_ids but {len(remote_ids)} "
                                         f"remote_ids")
        n = len(src)
        lens = self._lens.get(n)
        if lens is None:
            lens = self._bs if len(self._bs) == 1 else np.repeat(self._bs, n // len(self._bs))
            self._lens[n] = lens
        nbytes = int(lens[0]) * n if len(lens) == 1 else int(lens.sum())
        return self._eng.submit_group(tr, route, desc, op, src, dst, lens, n, nbytes,
                                      notify, timeout)


def _check_remote(desc, addrs: np.ndarray, lens: np.ndarray) -> None:
    """Every [addr, addr+len) inside one buffer the peer publishes, or a typed error."""
    if not desc.buffers:
        raise E.AddressNotRegisteredError(f"{desc.name} publishes no buffers")
    i = desc.buffer_table().first_outside(addrs, lens)
    if i >= 0:
        raise E.AddressNotRegisteredError(
            f"remote block {i} [{int(addrs[i]):#x}, +{int(lens[i])}) is not inside a buffer "
            f"{desc.name} published; check the peer's KV cache layout")

# SPDX-License-Identifier: Apache-2.0
"""Turning a caller's requests into groups a transport carries, checked once.

Every transfer (``submit``, ``submit_arrays``, ``write``/``read``, a notification) goes
through :func:`check_local`: one set of rules and one set of messages for bad input,
raised before anything is queued.
"""
from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from . import arguments
from . import errors as E
from .batch import Batch, Op, TransferRequest
from .segments import target_name

MAX_NOTIFY = 1 << 20


def u64(values, what: str) -> np.ndarray:
    """``values`` as a contiguous 1-D uint64 array, or InvalidArgumentError
    (:func:`mooncake_te.arguments.u64_array`: integers only, nothing cast silently)."""
    return arguments.u64_array(values, what)


def op_of(op, index: int | None = None) -> Op:
    try:
        return Op(op)
    except ValueError:
        where = "" if index is None else f"request {index}: "
        raise E.InvalidArgumentError(f"{where}op must be mte.READ or mte.WRITE, "
                                     f"got {op!r}") from None


def deadline(default_s: float, nbytes: int, timeout: float | None) -> int:
    """The monotonic deadline (ns) of a transfer of ``nbytes``."""
    t = arguments.timeout(timeout, default_s)
    # Like Mooncake's Python wrapper: the timeout plus 1 ns per byte for huge batches.
    return time.monotonic_ns() + int(t * 1e9) + int(nbytes)


def check_notify(notify) -> None:
    if notify is not None and not isinstance(notify, (bytes, bytearray, memoryview)):
        raise E.InvalidArgumentError(f"notify must be bytes, got {type(notify).__name__}")
    if notify is not None and len(notify) > MAX_NOTIFY:
        raise E.InvalidArgumentError(f"notify is {len(notify)} bytes; at most 1 MiB")


def check_one(src, dst, length) -> "tuple[int, int, int]":
    """One synchronous request's (``write``/``read``) numbers as ints: any integral
    (numpy integers too), never bool, float or str."""
    return (arguments.integer(src, "source_address"), arguments.integer(dst, "target_address"),
            arguments.integer(length, "length"))


def check_local(table, src, lens, caller=None) -> None:
    """Raise for the first request with a zero length, or whose local range is not inside
    a region of ``table``. ``src``/``lens`` are ints (one request) or uint64 arrays
    (``lens`` of length one applies to all); ``caller`` maps an index in them to the
    caller's request index."""
    if isinstance(src, int):
        bad = 0 if lens == 0 else (0 if table.check(src, lens, 0) != 0 else -1)
        zero = lens == 0
    else:
        zero = len(lens) and not lens.all()
        bad = int(np.argmin(lens)) if zero else table.check_many(src, lens, 0)[0]
    if bad < 0:
        return
    k = bad if caller is None else caller(bad)
    if zero:
        raise E.InvalidArgumentError(f"request {k}: length must be positive, got 0")
    if isinstance(src, int):
        addr, length = src, lens
    else:
        addr, length = int(src[bad]), int(lens[bad] if len(lens) > 1 else lens[0])
    raise E.AddressNotRegisteredError(
        f"request {k}: local [{addr:#x}, +{length}) is not inside a region registered with "
        f"this engine; register the buffer first (eng.register(...)), or check the address "
        f"and length")


def group(requests) -> "tuple[dict, int, int]":
    """``submit``'s requests grouped by (target name, op): ({key: (caller indices,
    sources, target addresses, lengths)}, count, total bytes)."""
    groups: dict = defaultdict(lambda: ([], [], [], []))
    nbytes = 0
    n = 0
    for i, r in enumerate(requests):
        n += 1
        if not isinstance(r, TransferRequest):
            r = TransferRequest(*r)
        op = op_of(r.op, i)
        g = groups[(target_name(r.target), int(op))]
        g[0].append(i)
        g[1].append(r.source)
        g[2].append(r.target_address)
        g[3].append(r.length)
        nbytes += arguments.integer(r.length, f"request {i}: length")
    arrays = {key: (idx, u64(src, "source"), u64(dst, "target_address"), u64(lens, "length"))
              for key, (idx, src, dst, lens) in groups.items()}
    return arrays, n, nbytes


def arrays(op, target, sources, target_addresses, lengths) -> "tuple[dict, int, int]":
    """``submit_arrays``' arguments as one group: ({key: group}, count, total bytes)."""
    op = op_of(op)
    src = u64(sources, "sources")
    dst = u64(target_addresses, "target_addresses")
    lens = u64(lengths, "lengths")
    if len(dst) != len(src) or len(lens) not in (1, len(src)):
        raise E.InvalidArgumentError(
            f"sources ({len(src)}), target_addresses ({len(dst)}) and lengths ({len(lens)}) "
            f"must have the same length (lengths may be one int)")
    nbytes = int(lens[0]) * len(src) if len(lens) == 1 else int(lens.sum())
    return {(target_name(target), int(op)): (None, src, dst, lens)}, len(src), nbytes


def one(name: str, op: int, src: int, dst: int, length: int) -> dict:
    """One request as a group (a sync request on a transport without a sync path)."""
    a = lambda v: np.array([v], dtype=np.uint64)     # noqa: E731
    return {(name, op): (None, a(src), a(dst), a(length))}


def notice(name: str) -> dict:
    """An empty group to ``name``: a batch that only carries a notification."""
    e = np.empty(0, np.uint64)
    return {(name, int(Op.WRITE)): ([], e, e, e)}


def plan(groups: dict, table, resolve, pick, checked: bool = False) -> list:
    """Check every group and find who carries it, before anything is queued: [(name, op,
    caller indices, local, remote, lengths, descriptor, transport, route)]. ``checked``: the
    caller ran :func:`check_local` already (a sync request)."""
    out = []
    for (name, op), (idx, src, dst, lens) in groups.items():
        if not checked:
            check_local(table, src, lens, None if idx is None else (lambda k, idx=idx: idx[k]))
        desc = resolve(name)
        out.append((name, op, idx, src, dst, lens, desc, *pick(desc, op, src, dst)))
    return out


def queue(plan, n, notify, deadline, new_batch, notifier, peers, protocol,
          metrics=None) -> Batch:
    """Queue a checked plan in one native batch; on a failure part-way, the batch is
    finished so nothing waits on it. ``metrics``: the engine's TransferMetrics (each
    request is tagged with its cell before it is queued), or None."""
    native = new_batch(n, deadline)
    parts = []
    routes = set()
    order = np.empty(n, dtype=np.int64) if any(p[2] is not None for p in plan) else None
    first = 0
    try:
        for name, op, idx, src, dst, lens, desc, tr, route in plan:
            if order is not None:
                # submit(): requests are carried grouped by (target, op); remember where
                # each one came from so status() and errors use the caller's indices.
                order[idx] = np.arange(first, first + len(src))
            if metrics is not None:     # counted when they finish (src/core/metrics.h)
                native.tag(first, len(src), metrics.cell(name, route, op))
            routes.add(tr.submit(native, desc, op, src, dst, lens, first, False))
            parts.append((name, first, src, dst, lens, op))
            first += len(src)
        if notify is not None:
            for name in dict.fromkeys(p[0] for p in plan):
                notifier.add_notify(native, peers.get(name), bytes(notify))
    except BaseException:
        # Part of the batch may be queued already: stop what has not started, count
        # what was never queued, and let the batch finish so nothing waits on it.
        native.cancel()
        native.abandon(first, n - first)
        native.seal()
        raise
    native.seal()
    return Batch(native, ",".join(sorted(routes)) or protocol, deadline, parts, peers.lost,
                 order)

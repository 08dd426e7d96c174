# SPDX-License-Identifier: Apache-2.0
"""The verified READ: objects fetched from their owners over the transfer engine into
registered memory, each checked before anyone may use it.

Every owner's READs are in flight at once (one batch per owner), then each item is
checked by the caller's ``check(i)`` (a checksum against the record, a header, a keyed
tag). A failed submit, a failed batch or a failed check is a miss for that item, never an
exception for the whole read, and nothing is written outside the destinations: each READ
lands only at the local address and length the caller named, inside memory it registered
(the engine refuses a local range outside a registered region), and with ``bounds`` an
item whose READs would pass its destination (a record naming more bytes than the slot
holds) is refused before anything is read.
"""
from __future__ import annotations

import logging

import numpy as np

from ..batch import READ
from ..errors import MooncakeError

log = logging.getLogger("mooncake_te.objdir")


def read_verified(engine, items, check, what: str = "objdir", timeout=None,
                  errors: "dict | None" = None,
                  logger: "logging.Logger | None" = None, bounds=None) -> list:
    """READ each of ``items`` and check it: a list of bool, True where the item arrived
    and ``check(i)`` accepted it.

    Parameters
    ----------
    engine : TransferEngine
        The engine whose registered memory the destinations are in.
    items : list
        Per item, ``(segment, local, remote, length)`` (one READ) or a list of them
        (several READs from one segment, e.g. a chunk split over regions).
    check : callable
        ``check(i) -> bool`` for an item that arrived (a checksum of what is now at its
        destination).
    what : str
        The caller's name in the log.
    timeout : float, optional
        Of each batch (the engine's default when None).
    logger : logging.Logger, optional
        Where failed READs are logged (INFO; the caller's logger, else objdir's).
    bounds : list, optional
        Per item, ``(address, size)`` of its destination: an item with a READ that
        would land outside it (a record naming more bytes than the destination holds)
        is a miss, and is not read at all.
    errors : dict, optional
        Filled with ``{item: the MooncakeError of its READ}`` for items that did not
        arrive (a check that failed is not an error: the item is simply False).
    """
    logger = logger or log
    by_seg: dict = {}
    for i, it in enumerate(items):
        pieces = [it] if isinstance(it[0], str) else list(it)
        if bounds is not None:
            lo, size = bounds[i]
            if not all(lo <= p[1] and p[1] + p[3] <= lo + size for p in pieces):
                logger.warning("%s: a read of %d bytes from %s does not fit its "
                               "destination of %d bytes; not read", what,
                               sum(p[3] for p in pieces), pieces[0][0], size)
                continue
        for seg, local, remote, length in pieces:
            g = by_seg.setdefault(seg, ([], [], [], []))
            g[0].append(i)
            g[1].append(local)
            g[2].append(remote)
            g[3].append(length)
    ok = [False] * len(items)
    batches = []
    kw = {} if timeout is None else {"timeout": timeout}
    for seg, (idx, local, remote, lens) in by_seg.items():
        try:
            batches.append((seg, idx, engine.submit_arrays(
                READ, seg, np.array(local, np.uint64), np.array(remote, np.uint64),
                np.array(lens, np.uint64), **kw)))
        except MooncakeError as e:
            logger.info("%s: read from %s failed: %s", what, seg, e)
            if errors is not None:
                errors.update(dict.fromkeys(idx, e))
    arrived: set = set()
    failed: set = set()
    for seg, idx, batch in batches:
        try:
            batch.wait()
        except MooncakeError as e:
            logger.info("%s: read from %s failed: %s", what, seg, e)
            failed.update(idx)
            if errors is not None:
                errors.update(dict.fromkeys(idx, e))
            continue
        arrived.update(idx)
    for i in arrived - failed:
        ok[i] = bool(check(i))
    return ok

# SPDX-License-Identifier: Apache-2.0
"""Saves: a finished request's blocks copied into the pool on the saver thread, through a
bounded queue (:class:`SaveQueue`), so a busy pool costs saves, never a stalled forward
pass."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....kvcache.tiers import HUB

log = logging.getLogger("mooncake_te.integrations.vllm")


@dataclass
class SaveSpec:
    """Store ``block_ids`` under ``keys`` (same length); ``request_id`` keeps its blocks
    until this is done."""

    request_id: str
    keys: list
    block_ids: list
    #: The copier's fence (a GPU copier's event on vLLM's stream), set when queued.
    fence: Any = None
    #: A layer-wise save: the copier's staged copy of the blocks (GPU KV caches), whose
    #: block ``i`` is row ``i``.
    staged: Any = None
    #: The request's blocks stay allocated until this save is done (vLLM's delay_free;
    #: a layer-wise save holds none: its blocks are staged).
    hold: bool = True


class SaveQueue:
    """Jobs of known size run in order on one thread; at most ``max_bytes`` queued or
    running. :meth:`submit` never blocks: a job that does not fit is refused (the caller
    counts it as dropped), so a busy pool costs saves, never a stalled forward pass.

    ``run(job)`` does the work; ``done(job, ok)`` is called after it, on the same thread.
    """

    def __init__(self, max_bytes: int, run, done=None, name: str = "mte-vllm-saver"):
        self.max_bytes = int(max_bytes)
        self._run, self._done = run, done
        self._q: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.inflight_bytes = 0
        self.max_inflight_seen = 0
        self.accepted = self.refused = self.failed = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, nbytes: int, job) -> bool:
        with self._lock:
            if self.inflight_bytes + nbytes > self.max_bytes:
                self.refused += 1
                return False
            self.inflight_bytes += nbytes
            self.max_inflight_seen = max(self.max_inflight_seen, self.inflight_bytes)
            self.accepted += 1
        self._q.put((nbytes, job))
        return True

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            nbytes, job = item
            ok = True
            try:
                self._run(job)
            except Exception as e:      # a failed save costs a block, never the server
                ok = False
                log.warning("mooncake_te connector: storing KV blocks in the pool failed: %s",
                            e)
            if self._done is not None:
                try:
                    self._done(job, ok)
                except Exception:       # pragma: no cover - bookkeeping must not kill it
                    log.exception("mooncake_te connector: save bookkeeping failed")
            with self._lock:
                if not ok:
                    self.failed += 1
                self.inflight_bytes -= nbytes
                self._idle.notify_all()

    def wait_progress(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the next job to finish (at once if none
        is queued or running)."""
        with self._lock:
            if self.inflight_bytes:
                self._idle.wait(timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every accepted job ran."""
        with self._lock:
            return self._idle.wait_for(lambda: self.inflight_bytes == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._q.put(None)
        self._thread.join(timeout=5)


#: Bytes of blocks a ``put(fill=)`` moves at a time (the cache's lock is held meanwhile).
FILL_CHUNK_BYTES = 64 << 20


def _chunks(items: list, block_bytes: int):
    n = max(1, FILL_CHUNK_BYTES // max(1, block_bytes))
    for lo in range(0, len(items), n):
        yield items[lo:lo + n]


def save_blocks(cache, copier, spec: SaveSpec) -> dict:
    """Copy ``spec``'s blocks the hub does not hold yet into ``cache`` (the saver
    thread's job); returns the counts to add (``blocks_saved``, ``bytes_saved``,
    ``blocks_save_skipped``, ``save_s``)."""
    t0 = time.perf_counter()
    todo = [(k, b) for k, b in zip(spec.keys, spec.block_ids) if cache.tier(k) != HUB]
    layered = {}
    if spec.staged is not None:
        # Copied out layer by layer during the forward pass: from the staged rows.
        rows = [i for i, k in enumerate(spec.keys) if cache.tier(k) != HUB]
        try:
            for part in _chunks(rows, copier.block_bytes):
                cache.put([spec.keys[i] for i in part],
                          fill=copier.layer_fill(spec.staged, part))
        finally:
            copier.layer_release(spec.staged)
            spec.staged = None
        layered = {"blocks_layer_saved": len(rows)}
    elif todo:
        keys, ids = [k for k, _ in todo], [b for _, b in todo]
        fill = getattr(copier, "fill", None)
        if fill is not None:
            # Straight into the pool's slots, a chunk at a time: the cache is locked
            # while a chunk lands and is checksummed, and lookups and loads wait for it.
            kw = {"after": spec.fence} if spec.fence is not None else {}
            for part in _chunks(list(range(len(keys))), copier.block_bytes):
                cache.put([keys[i] for i in part], fill=fill([ids[i] for i in part], **kw))
        else:
            buf = np.empty((len(todo), copier.block_bytes), dtype=np.uint8)
            copier.gather_many(ids, buf)
            cache.put(keys, buf)
    if spec.fence is not None:
        spec.fence.close()
        spec.fence = None
    return {"blocks_saved": len(todo), "bytes_saved": len(todo) * copier.block_bytes,
            "blocks_save_skipped": len(spec.keys) - len(todo),
            "save_s": time.perf_counter() - t0, **layered}

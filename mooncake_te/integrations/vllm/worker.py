# SPDX-License-Identifier: Apache-2.0
"""The worker side of the connector: one :class:`~mooncake_te.TransferEngine` per worker,
the KV cache registered once, reads of remote blocks, leases on the producer's blocks.

Threads: vLLM calls the worker hooks from its model-runner thread (the "step thread").
A load from a producer is submitted there, without blocking: one READ batch per request
(built with numpy, with a notification that tells the producer its blocks may be freed),
polled each step in :meth:`WorkerSide.collect`, so no forward pass waits on the network
and the transfer runs in the transport's native threads. Only what may block goes to the
loader thread: the handshake on first contact with a producer, and telling a producer to
free blocks after a failed read. (Waiting on a background Python thread instead cost a
GIL switch interval, 5 ms beside vLLM's busy engine loop, after each submit and each
wait: a 31 MiB load ran at a quarter of the transport's speed.)
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import replace

import numpy as np

from ... import READ, TransferEngine
from ...errors import MooncakeError
from ...hugepages import anon_huge_bytes, back_with_hugepages
from . import handshake
from .layout import KVLayout, layout_from_tensors, plan
from .leases import LeaseTable
from .scheduler import LoadSpec, Work

log = logging.getLogger("mooncake_te.integrations.vllm")

# + request id, space, lease key: the producer may free its blocks (leases.py)
READ_DONE = b"mte-vllm/read-done "
LEASE_MARGIN_S = 1.0


class _Peer:
    """An accepted producer: its layout, matched to ours; ``prepared``: its block tables
    checked once (TransferEngine.prepare), or None where loads take plan + coalescing."""

    def __init__(self, name: str, layout: KVLayout, doc: dict):
        self.name, self.layout, self.doc = name, layout, doc
        self.prepared = None


class WorkerSide:
    """Everything a vLLM worker's connector does, without vLLM types.

    Parameters
    ----------
    settings : ConnectorSettings
    compat : dict
        :func:`handshake.compat_fields` of this instance.
    host, port : str, int
        Where this worker's engine listens (``kv_port + tp_rank``).
    tp_rank : int
        Added to a producer's advertised port to reach the matching rank.
    """

    def __init__(self, settings, compat: dict, host: str, port: int, tp_rank: int = 0,
                 is_producer: bool = True, is_consumer: bool = True):
        self.settings = settings
        self.compat = compat
        self.compat_hash = handshake.compat_hash(compat)
        self.host, self.port, self.tp_rank = host, int(port), int(tp_rank)
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.engine: "TransferEngine | None" = None
        self.layout: "KVLayout | None" = None
        self.kv_caches: dict = {}
        self.leases = LeaseTable(settings.lease_s)
        self._peers: dict = {}                  # engine name -> _Peer | str (refusal)
        self._jobs: "queue.Queue" = queue.Queue()
        self._done_lock = threading.Lock()
        self._recv_ok: set = set()
        self._recv_failed: dict = {}            # request id -> local block ids
        self._inflight: list = []               # (spec, engine name, Batch, record)
        self._idle = False                      # this step runs no forward pass
        self._ready: list = []                  # (spec, record): handshake done, submit
        self._thread: "threading.Thread | None" = None
        self._closing = False
        # The pool (settings.pool enabled): see pool/.
        self.pool = None
        self.pool_namespace = None
        self._holds: dict = {}                  # request id -> reasons its blocks stay
        self._free_now: set = set()             # delay-freed requests nothing holds
        self._parts: dict = {}                  # request id -> [loads pending, all ok]
        self._lookups: dict = {}                # lookup_blocks, vllm_hit_blocks, hit_<tier>, ...
        self.hit_rate_log = None
        self.stats = {"registration_s": 0.0, "registered_bytes": 0, "storages": 0,
                      "handshakes": 0, "handshake_s": 0.0, "refused_peers": 0,
                      "loads": 0, "load_failures": 0, "blocks_read": 0, "bytes_read": 0,
                      "descriptors_before": 0, "descriptors_after": 0, "transfer_s": 0.0,
                      "leases_released_by_reader": 0, "leases_expired": 0,
                      "read_done_refused": 0,
                      "requests": [], "errors": []}

    # -- registration -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, num_blocks: "int | None") -> None:
        t0 = time.perf_counter()
        self.kv_caches = kv_caches
        self.layout, storages = layout_from_tensors(kv_caches, num_blocks)
        s = self.settings
        self.engine = TransferEngine(name=f"{self.host}:{self.port}", metadata=s.metadata,
                                     protocol=s.protocol, devices=s.devices, host=self.host,
                                     port=self.port, config=s.config,
                                     auth_token=s.auth_token)
        doc = {"compat": self.compat, "hash": self.compat_hash, "engine": self.engine.name,
               "layout": self.layout.to_json()}
        blob = np.frombuffer(bytearray(handshake.encode(doc)), dtype=np.uint8)
        # The handshake document first, so it is buffers[0] of our segment; peers may
        # only read it and the KV cache (the pull protocol never writes to a producer).
        self._blob = self.engine.register(blob, access="r")
        views = [_byte_view(t) for _, _, t in storages]
        host = [v for v in views if isinstance(v, np.ndarray)]
        remapped = 0
        if self.settings.hugepages and host:
            # torch.zeros wrote the host KV cache onto 4 KiB pages; a same-host READ into
            # (or out of) it costs a third more CPU per byte than on 2 MiB pages, CPU the
            # load shares with the model's threads (mooncake_te/hugepages.py). It is
            # still all zeros: hand its pages back to be refilled as huge pages.
            t1 = time.perf_counter()
            res = [back_with_hugepages(v) for v in host]
            remapped = sum(r.remapped for r in res)
            self.stats["hugepages_s"] = time.perf_counter() - t1
            if not remapped:
                log.info("mooncake_te connector: KV cache stays on small pages (%s)",
                         "; ".join(sorted({r.reason for r in res if r.reason})))
        if self.is_consumer or self.settings.pool.enabled or remapped:
            # Map every page now: a page first touched by a load would pay its fault
            # inside the transfer (the P/D READ ran at ~2 GB/s where warm memory takes
            # 8-10), and pages just handed back are refilled as huge pages here.
            t1 = time.perf_counter()
            n = sum(_prefault(v) for v in host)
            self.stats["prefault_s"] = time.perf_counter() - t1
            self.stats["prefault_bytes"] = n
        self.stats["hugepage_bytes"] = anon_huge_bytes([(int(v.ctypes.data), v.nbytes)
                                                         for v in host])
        if host and _libgomp_spins():
            log.info("mooncake_te connector: vLLM's OpenMP threads (libgomp) spin-wait some "
                     "ms after each forward pass, on the CPUs that a KV transfer right after "
                     "a prefill needs; GOMP_SPINCOUNT=10000 in vLLM's environment shortens "
                     "that (docs/vllm.md, 'CPU hosts')")
        self.engine.register_many(views, access="r")
        self._scratch = np.zeros(handshake.MAX_BYTES, dtype=np.uint8)
        self._scratch_mr = self.engine.register(self._scratch, access="local")
        self.stats["registration_s"] = time.perf_counter() - t0
        self.stats["registered_bytes"] = int(sum(n for _, n, _ in storages))
        self.stats["storages"] = len(storages)
        log.info("mooncake_te connector: engine %s (%s), %d KV regions in %d storages "
                 "(%d MiB, %d MiB in huge pages) registered in %.1f ms", self.engine.name,
                 self.engine.protocol, len(self.layout), len(storages),
                 self.stats["registered_bytes"] >> 20, self.stats["hugepage_bytes"] >> 20,
                 self.stats["registration_s"] * 1e3)
        if self.settings.pool.enabled:
            from .pool import PoolWorker
            # Only byte-identical layouts share blocks: the compatibility hash names model,
            # dtype, layout, layers and TP size; the rank picks this worker's shard.
            self.pool_namespace = f"vllm-{self.compat_hash}-tp{self.tp_rank}"
            pool = rank_pool_settings(self.settings.pool, self.tp_rank,
                                      int(self.compat.get("tp_size", 1)))
            self.pool = PoolWorker(pool, self.layout, self.engine, self.pool_namespace,
                                   self.settings.pool_lookup_address, logger=log)
        from .counters import HitRateLogger
        self.hit_rate_log = HitRateLogger(log, self.settings.pool.log_interval_s
                                          if self.settings.pool is not None else 10.0)
        if self.is_consumer:
            self._thread = threading.Thread(target=self._loader, name="mte-vllm-loader",
                                            daemon=True)
            self._thread.start()

    # -- per step -----------------------------------------------------------------------
    def start(self, work: Work) -> None:
        """Take this step's work from the scheduler (called from start_load_kv)."""
        self._idle = bool(getattr(work, "idle", False))
        for item in work.leases:
            req_id, key = (item, None) if isinstance(item, str) else item
            self.leases.add(req_id, key)
            self._holds[req_id] = self._holds.get(req_id, 0) + 1
        for spec in getattr(work, "saves", ()):
            if self.pool is not None and self.pool.save(spec):
                self._holds[spec.request_id] = self._holds.get(spec.request_id, 0) + 1
            elif spec.request_id not in self._holds:
                self._free_now.add(spec.request_id)     # dropped (counted): free at once
        # A request may load from the pool and from a producer: done when both are.
        for spec in getattr(work, "pool_loads", ()):
            self._add_part(spec.request_id, spec.block_ids)
        for spec in work.loads:
            self._add_part(spec.request_id, spec.local_block_ids)
        for spec in getattr(work, "pool_loads", ()):
            if self.pool is not None:
                self.pool.load(spec)
            else:
                self._part_done(spec.request_id, False)
        self._submit_ready()
        for spec in work.loads:
            self._begin_load(spec)
        for item in work.releases:
            self._jobs.put(("release", tuple(item) + (None,) * (3 - len(item))))
        lk = self._lookups
        for asked, vllm_hit, tiers in getattr(work, "lookups", ()):
            lk["lookup_blocks"] = lk.get("lookup_blocks", 0) + asked
            lk["vllm_hit_blocks"] = lk.get("vllm_hit_blocks", 0) + vllm_hit
            lk["lookups"] = lk.get("lookups", 0) + 1
            # The tiers are named by the lookup's reply (pool/lookup.py: TierCounts).
            for name, n in zip(tiers.names, tiers):
                lk[f"hit_{name}"] = lk.get(f"hit_{name}", 0) + n

    def begin_layer_saves(self, work: Work) -> None:
        """The step's layer saves, before its forward pass (vLLM binds the step's
        metadata then; ``start_load_kv`` comes after the forward's launch in vLLM 0.32)."""
        if self.pool is not None and getattr(work, "layer_saves", None):
            self.pool.begin_layer_saves(work.layer_saves)

    def save_layer(self, layer_name: str) -> None:
        """vLLM's ``save_kv_layer``: this layer's part of the step's layer saves."""
        if self.pool is not None:
            self.pool.save_layer(layer_name)

    def end_layer_saves(self) -> None:
        """vLLM's ``wait_for_save``: queue what is left of the step's layer saves."""
        if self.pool is not None:
            self.pool.end_layer_saves()

    def _add_part(self, req_id: str, block_ids) -> None:
        with self._done_lock:
            part = self._parts.setdefault(req_id, [0, True, []])
            part[0] += 1
            part[2].extend(block_ids)

    def _part_done(self, req_id: str, ok: bool) -> None:
        with self._done_lock:
            part = self._parts.get(req_id)
            if part is None:                    # pragma: no cover - defensive
                (self._recv_ok.add(req_id) if ok else
                 self._recv_failed.__setitem__(req_id, []))
                return
            part[0] -= 1
            part[1] = part[1] and ok
            if part[0] > 0:
                return
            del self._parts[req_id]
            if part[1]:
                self._recv_ok.add(req_id)
            else:
                self._recv_failed[req_id] = part[2]

    def collect(self):
        """``(finished_sending, finished_recving, failed_recving)`` since the last call;
        failed requests are in both of the last two (vLLM's contract)."""
        wait_notes = self._idle_wait() if self._idle else 0.0
        self._idle = False
        self._poll_loads()
        if self.engine is not None and self.is_producer:
            for n in self.engine.notifications(timeout=wait_notes):
                if n.message.startswith(READ_DONE):
                    rid, key = _parse_read_done(n.message)
                    self.leases.read_done(rid, key)
        released = list(self.leases.collect())
        self.stats["leases_released_by_reader"] = self.leases.released_by_reader
        self.stats["leases_expired"] = self.leases.expired
        self.stats["read_done_refused"] = self.leases.refused
        if self.pool is not None:
            saved, loaded = self.pool.collect()
            released += saved
            for rid, ok in loaded.items():
                self._part_done(rid, ok)
        sending, self._free_now = self._free_now, set()
        for rid in released:
            n = self._holds.get(rid, 1) - 1
            if n > 0:
                self._holds[rid] = n
            else:
                self._holds.pop(rid, None)
                sending.add(rid)
        with self._done_lock:
            ok, self._recv_ok = self._recv_ok, set()
            failed, self._recv_failed = self._recv_failed, {}
        return sending, ok | set(failed), failed

    def _idle_wait(self) -> float:
        """A step without a forward pass. vLLM's engine loop steps again at once while
        any request waits on this connector (a load, a lease, a save), so returning at
        once would spin a core through empty steps, the core a copy needs. Instead wait,
        GIL released, for the first thing that ends a wait: the oldest READ landing, a
        reader's read-done (returned: the notification wait's timeout, for the caller), a
        pool save finishing. At most ``idle_wait_s`` (5 ms by default), since vLLM admits
        no new request while a step waits."""
        wait = self.settings.idle_wait_s
        if self._inflight:
            self._inflight[0][2].poll(timeout=wait)
        elif self.is_producer and self.engine is not None and len(self.leases):
            return wait
        elif self.pool is not None:
            self.pool.wait_saves(wait)
        return 0.0

    def take_pool_stats(self) -> dict:
        """The pool's counters since the last call, with the lookups the scheduler made
        (empty dict without a pool)."""
        if self.pool is None:
            return {}
        c = self.pool.take_counters()
        lk, self._lookups = self._lookups, {}
        c.update(dict.fromkeys(("lookup_blocks", "vllm_hit_blocks", "lookups"), 0))
        c.update((f"hit_{t}", 0) for t in self.pool.tiers)
        c.update(lk)
        return c

    # -- loads from producers -----------------------------------------------------------
    def _begin_load(self, spec: LoadSpec) -> None:
        """Submit ``spec``'s READ now if we know its producer, else handshake first (on
        the loader thread; the READ is submitted by the step after it)."""
        rec = {"request_id": spec.request_id, "blocks": len(spec.local_block_ids),
               "handshake_s": 0.0, "transfer_s": 0.0}
        name = self._remote_name(spec)
        peer = self._peers.get(name)
        if peer is None:
            self._jobs.put(("handshake", (spec, rec)))
            return
        self._submit_load(spec, name, peer, rec)

    def _submit_ready(self) -> None:
        with self._done_lock:
            ready, self._ready = self._ready, []
        for spec, rec in ready:
            name = self._remote_name(spec)
            self._submit_load(spec, name, self._peers.get(name), rec)

    def _submit_load(self, spec: LoadSpec, name: str, peer, rec: dict) -> None:
        try:
            if isinstance(peer, str):
                raise _Refused(peer)
            if peer is None:                    # its handshake failed
                raise _Refused(rec.pop("error", None) or f"no handshake with {name}")
            self._check_lease(spec, "before reading")
            t0 = time.perf_counter()
            notify = _read_done(spec.remote_request_id, spec.lease_key)
            if peer.prepared is not None:
                # One native call: ids checked, blocks queued (consecutive ones merged).
                lids, rids = spec.local_block_ids, spec.remote_block_ids
                n = len(lids) * len(self.layout)
                batch = peer.prepared.post(READ, lids, rids, notify=notify,
                                           timeout=self.settings.timeout_s)
                rec.update(descriptors_before=n, descriptors_after=n, path="prepared",
                           bytes=int(self.layout.block_len.sum()) * len(lids),
                           plan_s=time.perf_counter() - t0)
            else:
                local, remote, lens, before = plan(self.layout, peer.layout,
                                                   spec.local_block_ids,
                                                   spec.remote_block_ids)
                rec.update(descriptors_before=before, descriptors_after=len(local),
                           path="coalesced", bytes=int(lens.sum()),
                           plan_s=time.perf_counter() - t0)
                batch = self.engine.submit_arrays(READ, name, local, remote, lens,
                                                  notify=notify,
                                                  timeout=self.settings.timeout_s)
        except (MooncakeError, ValueError, KeyError, OSError, _Refused) as e:
            self._load_failed(spec, name, rec, e)
            return
        self._inflight.append((spec, name, batch, rec))

    def _poll_loads(self) -> None:
        """Finish the loads whose READ is done (or past its deadline); never blocks."""
        self._submit_ready()
        if not self._inflight:
            return
        pending = []
        for item in self._inflight:
            spec, name, batch, rec = item
            if not batch.poll():
                pending.append(item)
                continue
            try:
                batch.raise_for_status()
                rec["transfer_s"] = batch.elapsed or 0.0
                rec["transport"] = batch.transport
                # Blocks freed by the producer while we read may have been reused already.
                self._check_lease(spec, "while reading")
            except (MooncakeError, _Refused) as e:
                self._load_failed(spec, name, rec, e)
                continue
            st = self.stats
            st["loads"] += 1
            st["blocks_read"] += len(spec.local_block_ids) * len(self.layout)
            st["bytes_read"] += rec["bytes"]
            st["descriptors_before"] += rec["descriptors_before"]
            st["descriptors_after"] += rec["descriptors_after"]
            st["transfer_s"] += rec["transfer_s"]
            self._record(rec)
            self._part_done(spec.request_id, True)
        self._inflight = pending

    def _load_failed(self, spec: LoadSpec, name: str, rec: dict, e: Exception) -> None:
        msg = str(e)
        log.warning("mooncake_te connector: loading KV for request %s from %s failed: "
                    "%s; vLLM recomputes it", spec.request_id, name, msg)
        if not isinstance(e, _Refused):
            self._peers.pop(name, None)         # re-handshake next time (restarted peer)
        rec["error"] = msg
        self.stats["load_failures"] += 1
        self.stats["errors"].append(msg)
        del self.stats["errors"][:-100]
        self._record(rec)
        # Best effort: let a live producer free its blocks now rather than at lease end
        # (on the loader thread: the producer may be unreachable).
        self._jobs.put(("release", (name, spec.remote_request_id, spec.lease_key)))
        self._part_done(spec.request_id, False)

    # -- loader thread ------------------------------------------------------------------
    def _loader(self) -> None:
        while not self._closing:
            try:
                kind, item = self._jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "stop":
                return
            if kind == "release":
                self._notify(*item)
                continue
            self._handshake(*item)

    def _remote_name(self, spec: LoadSpec) -> str:
        if self.tp_rank == 0:
            return spec.remote_engine
        host, _, port = spec.remote_engine.rpartition(":")
        return f"{host}:{int(port) + self.tp_rank}"

    def _handshake(self, spec: LoadSpec, rec: dict) -> None:
        name = self._remote_name(spec)
        try:
            self._peer(name, rec)
        except (MooncakeError, ValueError, KeyError, OSError) as e:
            # The step thread reports it (as a failed load) when it takes the spec back.
            self._peers.pop(name, None)
            rec["error"] = f"handshake with {name} failed: {e}"
        with self._done_lock:
            self._ready.append((spec, rec))

    def _prepare_loads(self, name: str, remote: KVLayout):
        """Block tables of our cache and ``name``'s, checked once, for loads by block id
        (PreparedTransfer.post): over TCP and the same-host transport a load is then one
        native call that queues the READ, merging blocks whose ids follow each other as
        ``plan`` coalesced them. Measured at vLLM's shapes (docs/benchmarks.md): posting
        takes 0.15-0.25 of plan + submit_arrays, and the READ lands no later. None where
        it would not win or cannot be made (other transports keep plan + submit_arrays,
        whose coalesced descriptors suit RDMA and CUDA IPC; unmeasured here)."""
        if not self.settings.prepared_loads:
            return None
        try:
            local = self.layout
            remote = remote.reordered(local.names)
            if (remote.block_len != local.block_len).any():
                return None             # plan() names the region in its refusal
            lt = local.base[:, None] + (np.arange(local.num_blocks, dtype=np.uint64)[None, :]
                                        * local.stride[:, None])
            rt = remote.base[:, None] + (np.arange(remote.num_blocks,
                                                   dtype=np.uint64)[None, :]
                                         * remote.stride[:, None])
            prep = self.engine.prepare(name, lt, rt, local.block_len)
        except (MooncakeError, ValueError, KeyError) as e:
            log.info("mooncake_te connector: loads from %s take plan + submit_arrays (%s)",
                     name, e)
            return None
        return prep if prep.native else None     # a native post, else plan + coalescing

    def _check_lease(self, spec: LoadSpec, when: str) -> None:
        # LEASE_MARGIN_S: clock skew between the hosts and the producer's step latency.
        if spec.lease_deadline is not None and time.time() > spec.lease_deadline - LEASE_MARGIN_S:
            raise _Refused(f"the producer's lease on these blocks ran out {when} (raise "
                           f"lease_s in kv_connector_extra_config on the producer, or decode "
                           f"sooner)")

    def _record(self, rec: dict) -> None:
        reqs = self.stats["requests"]
        reqs.append(rec)
        del reqs[:-1000]                         # bounded: a long-running server

    def _peer(self, name: str, rec: dict):
        peer = self._peers.get(name)
        if peer is not None:
            return peer
        t0 = time.perf_counter()
        seg = self.engine.open_segment(name, refresh=True)
        if not seg.buffers:
            raise ValueError(f"{name} has registered no memory; is it running "
                             f"MooncakeTEConnector with its KV cache allocated?")
        first = seg.buffers[0]
        n = min(int(first.length), handshake.MAX_BYTES)
        self.engine.read(name, self._scratch_mr.address, first.address, n,
                         timeout=self.settings.handshake_timeout_s)
        doc = handshake.decode(self._scratch[:n], peer=name)
        dt = time.perf_counter() - t0
        rec["handshake_s"] = dt
        self.stats["handshakes"] += 1
        self.stats["handshake_s"] += dt
        if doc.get("hash") != self.compat_hash and self.settings.enforce_handshake_compat:
            msg = handshake.mismatch_message(name, self.compat, doc.get("compat") or {})
            log.error("mooncake_te connector: %s", msg)
            self.stats["refused_peers"] += 1
            self._peers[name] = msg
            return msg
        peer = _Peer(name, KVLayout.from_json(doc["layout"]), doc)
        peer.prepared = self._prepare_loads(name, peer.layout)
        self._peers[name] = peer
        log.info("mooncake_te connector: handshake with %s in %.1f ms (compat %s)", name,
                 dt * 1e3, doc.get("hash"))
        return peer

    def _notify(self, engine: str, remote_request_id, lease_key=None) -> None:
        if engine is None or remote_request_id is None:
            return
        try:
            self.engine.send_notification(engine, _read_done(str(remote_request_id),
                                                             lease_key),
                                          timeout=self.settings.handshake_timeout_s)
        except MooncakeError as e:
            log.info("mooncake_te connector: could not tell %s to free request %s: %s",
                     engine, remote_request_id, e)

    # -- end ----------------------------------------------------------------------------
    def close(self) -> None:
        self._closing = True
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._thread is not None:
            self._jobs.put(("stop", None))
            self._thread.join(timeout=5)
            self._thread = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def rank_pool_settings(pool, tp_rank: int, tp_size: int):
    """The pool settings of TP rank ``tp_rank`` of ``tp_size``: with ``tp_size > 1`` its
    SSD tier lives in ``<cache_dir>/tp<rank>-of-<size>``, created (and proven writable) here.

    Each rank's SSD tier locks its directory (``flock``) and writes a manifest naming its
    namespace, which holds the rank, so ranks cannot share one: rank 1 would be refused
    at start. ``tp_size`` is in the name so that a cache written at another TP size (other
    shards, another namespace) is never opened. With one rank the settings are returned
    as they are: a TP=1 cache stays in ``cache_dir`` itself, where earlier versions put it.

    Raises
    ------
    ConfigError
        The subdirectory cannot be created or written (as for ``cache_dir``).
    """
    if tp_size <= 1 or not pool.cache_dir:
        return pool
    if pool.ssd_bytes > 0:
        from ...kvcache.ssd import _writable_dir
        _writable_dir(pool.cache_dir)      # cache_dir itself first (its last level made)
    mine = replace(pool, cache_dir=os.path.join(pool.cache_dir,
                                                f"tp{int(tp_rank)}-of-{int(tp_size)}"))
    mine.check(mine.block_size)            # cache_dir's checks, on the subdirectory
    return mine


def _read_done(request_id: str, lease_key: "str | None") -> bytes:
    msg = READ_DONE + request_id.encode()
    return msg + b" " + lease_key.encode() if lease_key else msg


def _parse_read_done(message: bytes) -> tuple:
    """``(request id, lease key or None)`` of a read-done message (ids may hold spaces;
    keys are hex)."""
    body = message[len(READ_DONE):].decode("utf-8", "replace")
    rid, sep, key = body.rpartition(" ")
    if sep and key and all(c in "0123456789abcdef" for c in key):
        return rid, key
    return body, None


class _Refused(Exception):
    """The producer failed the compatibility check."""


def _libgomp_spins() -> bool:
    """Whether this process runs GNU OpenMP with its default spin-wait (neither
    ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY`` set): its idle threads then burn a CPU for
    ~300,000 spins (about 9 ms on the 2-core test VM) after every parallel region."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return False


def _prefault(view: np.ndarray) -> int:
    """Map every page of a host buffer for writing without changing a byte (each page's
    first byte is read and written back); returns the bytes covered."""
    page = 4096
    head = (-view.ctypes.data) % page           # first page boundary inside the buffer
    sl = view[head::page]
    sl[:] = sl.copy()
    if head:
        view[:1] = view[:1].copy()
    return int(view.nbytes)


def _byte_view(tensor) -> np.ndarray:
    """The whole storage under ``tensor`` as one flat uint8 buffer (any dtype, no copy):
    a numpy array for host memory, a uint8 tensor for GPU memory (the engine registers it
    through ``__cuda_array_interface__`` / DLPack). Either keeps the storage alive while it
    is registered."""
    import torch

    u8 = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    u8.set_(tensor.untyped_storage())
    return u8 if u8.device.type != "cpu" else u8.numpy()

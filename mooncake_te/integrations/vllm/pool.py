# SPDX-License-Identifier: Apache-2.0
"""KV cache tiering for the connector: vLLM's computed blocks stored in, and prefix hits
loaded back from, :class:`mooncake_te.kvcache.KVCache` (a DRAM pool registered with the
worker's engine, an SSD tier under ``cache_dir``, and through the metadata store's owner
index the DRAM pools of other instances). Nothing here imports vLLM.

One pool block is one vLLM block of every layer: the regions of
:class:`~.layout.KVLayout` one after another (``block_bytes = sum(block_len)``), under a
key chained over the block's tokens and every token before it
(:func:`mooncake_te.kvcache.prefix_hashes`) from a root that names the model and the
block size (:func:`namespace_root`); the cache's ``namespace`` adds the KV layout, dtype,
TP size and rank (the handshake's compatibility hash), so only byte-identical layouts
ever share blocks, in DRAM, on SSD and through the index.

Threads. The scheduler asks :class:`PoolLookup` (an ``AF_UNIX`` socket in the abstract
namespace, so it works whether vLLM runs the worker in the scheduler's process or
another) how long a prefix the pool holds. The worker's :class:`PoolWorker` does saves
and loads on its own threads: a finished request's blocks stay allocated (vLLM's
``delay_free``) until the saver thread has copied them into the pool, so the forward pass
never waits for a save; a load runs while the request waits in WAITING_FOR_REMOTE_KVS.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import queue
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError, MooncakeError
from ...kvcache import KVCache, as_key, prefix_hashes
from ...kvcache.keys import KEY_BYTES
from ...metadata.framing import _recv_exact

log = logging.getLogger("mooncake_te.integrations.vllm")

_GIB = 1 << 30
KEY_SCHEME = "mte-vllm-kv/1"          # bump when the key derivation changes


# --- keys --------------------------------------------------------------------------------
def namespace_root(model: str, block_size: int, extra: str = "") -> bytes:
    """The parent key of a sequence's first block: equal for every process and machine
    serving ``model`` with ``block_size`` tokens per block (``extra``: a LoRA adapter or
    anything else that changes the KV of the same tokens)."""
    return as_key(f"{KEY_SCHEME}|{model}|block {int(block_size)}|{extra}")


def block_keys(token_ids, block_size: int, root: bytes, start: int = 0,
               stop: "int | None" = None) -> list:
    """Keys of the full blocks ``start .. stop-1`` of ``token_ids`` (all full blocks when
    ``stop`` is None). Key ``i`` names block ``i`` and every block before it."""
    n = len(token_ids) // block_size
    stop = n if stop is None else max(0, min(int(stop), n))
    if stop <= start:
        return []
    keys = prefix_hashes(np.asarray(token_ids[:stop * block_size], dtype=np.int64),
                         block_size, parent=root)
    return keys[start:stop]


# --- settings ----------------------------------------------------------------------------
@dataclass
class PoolSettings:
    """``[kvcache]`` as the connector uses it. ``dram_cache_gb = 0`` (the default): no pool.

    Attributes
    ----------
    block_size_set : bool
        ``block_size`` was given explicitly (in the file or the extra config): it must then
        equal vLLM's block size.
    """

    dram_bytes: int = 0
    ssd_bytes: int = 0
    cache_dir: str = ""
    policy: str = "lru"
    block_size: int = 16
    block_size_set: bool = False
    save_queue_bytes: int = 256 << 20
    remote: bool = True
    persist_on_exit: bool = True
    log_interval_s: float = 10.0
    source: str = "<defaults>"

    @property
    def enabled(self) -> bool:
        return self.dram_bytes > 0

    def check(self, vllm_block_size: int) -> None:
        """Refuse what cannot work, before any memory is registered.

        Raises
        ------
        ConfigError
            ``block_size`` differs from vLLM's (both values named), or ``cache_dir`` cannot
            be written.
        """
        if not self.enabled:
            return
        if self.block_size_set and self.block_size != int(vllm_block_size):
            raise ConfigError(
                f"KVCache block size mismatch: [kvcache] block_size = {self.block_size} "
                f"({self.source}) but vLLM runs with block_size = {vllm_block_size}; a pool "
                f"block is one vLLM block, so set [kvcache] block_size = {vllm_block_size} "
                f"(or start vLLM with --block-size {self.block_size})")
        if self.ssd_bytes > 0:
            if not self.cache_dir:
                raise ConfigError(f"[kvcache] ssd_cache_gb = {self.ssd_bytes / _GIB:g} needs "
                                  f"cache_dir, a directory on a local SSD ({self.source})")
            from ...kvcache.ssd import _writable_dir
            _writable_dir(self.cache_dir)


_EXTRA_KEYS = ("cache_dir", "dram_cache_gb", "ssd_cache_gb", "eviction_policy", "block_size",
               "save_queue_mb", "remote", "persist_on_exit", "log_interval_s")


def pool_settings(config, config_path: "str | None", extra: "dict | None") -> PoolSettings:
    """``[kvcache]`` of the connector's ``config.toml`` (``mooncake_config_path``),
    overridden key by key by ``kv_connector_extra_config["kvcache"]`` (a table with the
    same keys, plus ``save_queue_mb``, ``remote``, ``persist_on_exit``,
    ``log_interval_s``)."""
    from ...config import read_toml, validate
    k = dict(config["kvcache"])
    src = config_path or "<defaults>"
    explicit = set()
    if config_path:
        raw = read_toml(config_path).get("kvcache") or {}
        explicit |= set(raw)
    s = PoolSettings()
    extra = dict(extra or {})
    for key, v in extra.items():
        if key not in _EXTRA_KEYS:
            raise ConfigError(f"kv_connector_extra_config.kvcache has an unknown key {key!r} "
                              f"(known: {', '.join(_EXTRA_KEYS)})")
    for key in ("cache_dir", "dram_cache_gb", "ssd_cache_gb", "eviction_policy", "block_size"):
        if key in extra:
            k[key] = validate("kvcache", key, extra[key], "kv_connector_extra_config.kvcache")
            explicit.add(key)
            src = "kv_connector_extra_config.kvcache" if not config_path else \
                f"{config_path} + kv_connector_extra_config.kvcache"
    s.dram_bytes = int(float(k["dram_cache_gb"]) * _GIB)
    s.ssd_bytes = int(float(k["ssd_cache_gb"]) * _GIB)
    s.cache_dir = str(k["cache_dir"] or "")
    s.policy = str(k["eviction_policy"])
    s.block_size = int(k["block_size"])
    s.block_size_set = "block_size" in explicit
    s.source = src
    if "save_queue_mb" in extra:
        v = extra["save_queue_mb"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"kv_connector_extra_config.kvcache.save_queue_mb = {v!r}: "
                              f"expected MiB >= 0 (bytes of blocks waiting to be stored)")
        s.save_queue_bytes = int(v * (1 << 20))
    for key in ("remote", "persist_on_exit"):
        if key in extra:
            if not isinstance(extra[key], bool):
                raise ConfigError(f"kv_connector_extra_config.kvcache.{key} = {extra[key]!r}:"
                                  f" expected true or false")
            setattr(s, key, extra[key])
    if "log_interval_s" in extra:
        v = extra["log_interval_s"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"kv_connector_extra_config.kvcache.log_interval_s = {v!r}: "
                              f"expected seconds >= 0 (0: never)")
        s.log_interval_s = float(v)
    return s


# --- block images ------------------------------------------------------------------------
# libc's memmove through ctypes.PyDLL, whose calls keep the GIL (CDLL's and ctypes.memmove
# let go of it): see BlockCopier.scatter_held.
_memmove_held = ctypes.PyDLL(None).memmove
_memmove_held.restype = ctypes.c_void_p
_memmove_held.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class BlockCopier:
    """Copies vLLM blocks (R regions, ``block_len[r]`` bytes each) to and from flat block
    images (the regions one after another), through numpy views of host memory."""

    def __init__(self, layout):
        self.layout = layout
        self.offsets = np.concatenate(([0], np.cumsum(layout.block_len.astype(np.int64))))
        self.block_bytes = int(self.offsets[-1])
        self._views = []
        for base, stride, blen in zip(layout.base, layout.stride, layout.block_len):
            nbytes = int(stride) * (layout.num_blocks - 1) + int(blen)
            buf = (ctypes.c_uint8 * nbytes).from_address(int(base))
            self._views.append((np.frombuffer(buf, dtype=np.uint8), int(stride), int(blen)))
        self._regions = [(int(base), int(stride), int(blen), int(off)) for base, stride, blen,
                         off in zip(layout.base, layout.stride, layout.block_len, self.offsets)]

    def scatter_held(self, block_id: int, src: np.ndarray) -> None:
        """A block image (``block_bytes`` contiguous bytes, say a slot of the pool's DRAM
        tier) into block ``block_id`` of every region, one ``memmove`` per region with
        the GIL held: numpy's copies let go of it, and beside vLLM's engine loop each
        let-go costs a switch interval (see :meth:`scatter_many`), so a block at a time
        is only cheap this way. For :meth:`KVCache.get`'s ``copy=``."""
        b = int(block_id)
        if not 0 <= b < self.layout.num_blocks:
            raise IndexError(f"block id {b} is outside vLLM's {self.layout.num_blocks} "
                             f"blocks")
        if src.nbytes < self.block_bytes or not src.flags.c_contiguous:
            raise ValueError(f"a block image must be {self.block_bytes} contiguous bytes, "
                             f"got {src.nbytes}")
        a = src.ctypes.data
        for base, stride, blen, off in self._regions:
            _memmove_held(base + b * stride, a + off, blen)

    def gather(self, block_id: int, out: np.ndarray) -> None:
        """Block ``block_id`` of every region into ``out`` (``block_bytes`` bytes)."""
        b = int(block_id)
        for (v, stride, blen), off in zip(self._views, self.offsets):
            out[off:off + blen] = v[b * stride:b * stride + blen]

    def scatter(self, block_id: int, src) -> None:
        """A block image (from :meth:`gather`) into block ``block_id`` of every region."""
        b = int(block_id)
        for (v, stride, blen), off in zip(self._views, self.offsets):
            v[b * stride:b * stride + blen] = src[off:off + blen]

    # The many-block forms copy with one numpy operation per region, not one per block
    # and region. That matters beyond the per-call cost: each copy releases the GIL, and
    # beside vLLM's engine loop (a busy Python thread) every release costs this thread a
    # switch interval (5 ms) before it runs again. Block by block, a 61-block load took
    # 50 s there; region by region it is 8 hand-offs.
    def _rows(self, v: np.ndarray, stride: int, blen: int) -> np.ndarray:
        return np.lib.stride_tricks.as_strided(v, shape=(self.layout.num_blocks, blen),
                                               strides=(stride, 1), writeable=True)

    def gather_many(self, block_ids, out: np.ndarray) -> None:
        """Blocks ``block_ids`` into the rows of ``out`` (``[len(block_ids), block_bytes]``)."""
        ids = np.asarray(block_ids, dtype=np.intp)
        for (v, stride, blen), off in zip(self._views, self.offsets):
            out[:, off:off + blen] = self._rows(v, stride, blen)[ids]

    def scatter_many(self, block_ids, images: np.ndarray) -> None:
        """The rows of ``images`` into blocks ``block_ids`` of every region."""
        ids = np.asarray(block_ids, dtype=np.intp)
        for (v, stride, blen), off in zip(self._views, self.offsets):
            self._rows(v, stride, blen)[ids] = images[:, off:off + blen]


# --- the bounded save queue ----------------------------------------------------------------
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


# --- scheduler -> worker lookups ---------------------------------------------------------
_REQ = struct.Struct("<IB")           # number of keys, flags (1: also ask peers)
_REP = struct.Struct("<III")          # dram, ssd, remote blocks of the prefix


def lookup_address(engine_id: str, tp_rank: int = 0) -> str:
    """The abstract ``AF_UNIX`` name the worker of ``engine_id`` answers lookups on."""
    return f"\0mooncake_te/vllm-pool/{engine_id}/{int(tp_rank)}"


class PoolLookup:
    """The scheduler's view of the worker's pool: ``lookup(keys)`` -> the tiers of the
    longest prefix of ``keys`` held, as ``(dram, ssd, remote)`` block counts."""

    def __init__(self, address: str, timeout_s: float = 2.0):
        self.address = address
        self.timeout_s = timeout_s
        self._sock: "socket.socket | None" = None
        self.errors = 0

    def lookup(self, keys, remote: bool = True) -> tuple:
        if not keys:
            return (0, 0, 0)
        msg = _REQ.pack(len(keys), 1 if remote else 0) + b"".join(keys)
        for attempt in (0, 1):
            try:
                if self._sock is None:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(self.timeout_s)
                    s.connect(self.address)
                    self._sock = s
                self._sock.sendall(msg)
                return _REP.unpack(_recv_exact(self._sock, _REP.size))
            except OSError as e:
                self.close()
                if attempt:
                    self.errors += 1
                    if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                        log.warning("mooncake_te connector: pool lookup failed (%d so far): "
                                    "%s; counting a miss", self.errors, e)
        return (0, 0, 0)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


class _LookupServer:
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
                    rep = (0, 0, 0)
                try:
                    conn.sendall(_REP.pack(*rep))
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        try:
            self._srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._srv.close()


# --- the worker's pool ---------------------------------------------------------------------
@dataclass
class SaveSpec:
    """Store ``block_ids`` under ``keys`` (same length); ``request_id`` keeps its blocks
    until this is done."""

    request_id: str
    keys: list
    block_ids: list


@dataclass
class PoolLoadSpec:
    """Load the pool blocks ``keys`` into ``block_ids``."""

    request_id: str
    keys: list
    block_ids: list
    tiers: tuple = (0, 0, 0)          # what the scheduler's lookup saw: dram, ssd, remote


COUNTER_NAMES = ("blocks_saved", "bytes_saved", "blocks_save_skipped", "blocks_dropped",
                 "save_s", "blocks_loaded", "bytes_loaded", "load_s", "loads",
                 "loaded_dram", "loaded_ssd", "loaded_remote", "failed_loads",
                 "failed_blocks")


class PoolWorker:
    """The pool of one vLLM worker.

    Parameters
    ----------
    settings : PoolSettings
    layout : KVLayout
        This worker's KV cache (host memory).
    engine : TransferEngine
        The connector's engine: the DRAM pool is registered with it (peers read it) and
        remote blocks are read through it.
    namespace : str
        Layout and rank identity (the handshake's compatibility hash and the TP rank).
    lookup_address : str
        Where the scheduler asks (:func:`lookup_address`).
    """

    def __init__(self, settings: PoolSettings, layout, engine, namespace: str,
                 lookup_address: str, logger=None):
        self.settings = settings
        self.copier = BlockCopier(layout)
        self.log = logger or log
        from ...metadata.base import KeyValueBackend
        md = getattr(engine, "metadata", None) if engine is not None else None
        self.remote = bool(settings.remote and isinstance(md, KeyValueBackend))
        self.cache = KVCache(
            self.copier.block_bytes, settings.dram_bytes, settings.ssd_bytes,
            settings.cache_dir or None, policy=settings.policy, engine=engine,
            namespace=namespace, block_tokens=settings.block_size if settings.block_size_set
            else 16, log_interval_s=0)
        self._lock = threading.Lock()
        self._c: dict = dict.fromkeys(COUNTER_NAMES, 0)
        self._c.update(save_s=0.0, load_s=0.0)
        self._saved: set = set()              # request ids whose save finished
        self._loaded: dict = {}               # request id -> True (ok) / False (failed)
        self._saver = SaveQueue(settings.save_queue_bytes, self._save, self._save_done)
        self._server = _LookupServer(lookup_address, self.lookup)
        self._closed = False
        # A process that exits without vLLM shutting the connector down (a script that
        # just returns) still writes its DRAM tier to cache_dir for the next start. It
        # must run before concurrent.futures refuses new work at interpreter shutdown (the
        # SSD tier's I/O pool), i.e. among threading's exit hooks, which run in reverse
        # order of registration and before atexit's.
        ref = weakref.ref(self)

        def hook():
            worker = ref()
            if worker is not None:
                worker.close()
        getattr(threading, "_register_atexit", atexit.register)(hook)
        s = self.cache.stats()
        self.log.info("mooncake_te connector: KV pool of %d blocks of %d KiB in DRAM "
                      "(%.2f GiB)%s%s, %s", s["dram_capacity_blocks"],
                      self.copier.block_bytes >> 10, s["dram_capacity_bytes"] / _GIB,
                      f", {s['ssd_capacity_blocks']} on SSD in {settings.cache_dir} "
                      f"({s['ssd_recovered_blocks']} found there)" if self.cache.ssd else "",
                      ", shared through the metadata store" if self.remote else "",
                      settings.policy)

    # -- lookups (any thread) -------------------------------------------------------------
    def lookup(self, keys, remote: bool = True) -> tuple:
        dram = ssd = 0
        for k in keys:
            t = self.cache.tier(k)
            if t == "dram":
                dram += 1
            elif t == "ssd":
                ssd += 1
            else:
                break
        rem = 0
        if remote and self.remote and dram + ssd < len(keys):
            idx = self.cache._index
            if idx is not None:
                rem = idx.lookup_prefix(keys[dram + ssd:])
        return (dram, ssd, rem)

    # -- saves --------------------------------------------------------------------------
    def save(self, spec: SaveSpec) -> bool:
        """Queue a save; False when the queue is full (the blocks are dropped, counted)."""
        n = len(spec.keys)
        if not n:
            return False
        if self._saver.submit(n * self.copier.block_bytes, spec):
            return True
        with self._lock:
            self._c["blocks_dropped"] += n
        return False

    def _save(self, spec: SaveSpec) -> None:
        t0 = time.perf_counter()
        todo = [(k, b) for k, b in zip(spec.keys, spec.block_ids)
                if self.cache.tier(k) != "dram"]
        skipped = len(spec.keys) - len(todo)
        if todo:
            bb = self.copier.block_bytes
            buf = np.empty((len(todo), bb), dtype=np.uint8)
            self.copier.gather_many([b for _, b in todo], buf)
            self.cache.put([k for k, _ in todo], buf)
        with self._lock:
            c = self._c
            c["blocks_saved"] += len(todo)
            c["bytes_saved"] += len(todo) * self.copier.block_bytes
            c["blocks_save_skipped"] += skipped
            c["save_s"] += time.perf_counter() - t0

    def _save_done(self, spec: SaveSpec, ok: bool) -> None:
        with self._lock:
            self._saved.add(spec.request_id)

    # -- loads --------------------------------------------------------------------------
    def load(self, spec: PoolLoadSpec) -> None:
        """Load ``spec``'s blocks now, on the calling thread (the step's); the result is
        reported by :meth:`collect`. A background loader looked better on paper and was
        20-1000x slower in vLLM: beside its engine loop (a busy Python thread) such a
        thread waits a switch interval (5 ms) for the GIL after every copy or read that
        releases it, so a 61-block load from DRAM took 50 s instead of tens of
        milliseconds (docs/vllm.md, TTFT benchmark). Here a load costs the step its
        memcpy, reads and (other pools) one-sided READs, nothing more."""
        self._load_one(spec)

    def _load_one(self, spec: PoolLoadSpec) -> None:
        ok = False
        try:
            ok = self._load(spec)
        except Exception as e:
            self.log.warning("mooncake_te connector: loading %d pool blocks for request "
                             "%s failed: %s; vLLM recomputes them", len(spec.keys),
                             spec.request_id, e)
        with self._lock:
            if not ok:
                self._c["failed_loads"] += 1
                self._c["failed_blocks"] += len(spec.keys)
            self._loaded[spec.request_id] = ok

    def _load(self, spec: PoolLoadSpec) -> bool:
        t0 = time.perf_counter()
        keys, ids = spec.keys, spec.block_ids
        tiers = [self.cache.tier(k) for k in keys]
        bb = self.copier.block_bytes
        wrong = []

        def copy(i, block):
            # Straight from the pool's slot (an SSD block after it was read there and
            # checked) into vLLM's block: no intermediate image, no GIL hand-off.
            if block.nbytes != bb:
                wrong.append(block.nbytes)
                return
            self.copier.scatter_held(ids[i], block)

        got = self.cache.get(keys, copy=copy, remote=self.remote)   # lengths
        bad = [i for i, g in enumerate(got) if g is None]
        if bad:
            # A block evicted since the lookup, a corrupt SSD record, a failed peer read:
            # none of it is served; vLLM recomputes the request's external tokens.
            self.log.warning("mooncake_te connector: %d of %d pool blocks for request %s "
                             "could not be loaded (evicted, corrupt or unreachable); vLLM "
                             "recomputes them", len(bad), len(keys), spec.request_id)
            return False
        if wrong:
            self.log.warning("mooncake_te connector: a pool block for request %s is %d "
                             "bytes, expected %d; recomputing", spec.request_id, wrong[0], bb)
            return False
        dt = time.perf_counter() - t0
        with self._lock:
            c = self._c
            c["loads"] += 1
            c["blocks_loaded"] += len(keys)
            c["bytes_loaded"] += len(keys) * bb
            c["load_s"] += dt
            c["loaded_dram"] += sum(1 for t in tiers if t == "dram")
            c["loaded_ssd"] += sum(1 for t in tiers if t == "ssd")
            c["loaded_remote"] += sum(1 for t in tiers if t is None)
        return True

    # -- per step -------------------------------------------------------------------------
    def collect(self):
        """``(saved request ids, {request id: load ok})`` since the last call."""
        with self._lock:
            saved, self._saved = self._saved, set()
            loaded, self._loaded = self._loaded, {}
        return saved, loaded

    def take_counters(self) -> dict:
        """Counters since the last call (and zero them), plus the cache's current sizes."""
        with self._lock:
            c, self._c = self._c, dict.fromkeys(COUNTER_NAMES, 0)
            self._c.update(save_s=0.0, load_s=0.0)
        s = self.cache.stats()
        c.update(dram_blocks=s["dram_blocks"], ssd_blocks=s["ssd_blocks"],
                 dram_capacity_blocks=s["dram_capacity_blocks"],
                 ssd_capacity_blocks=s["ssd_capacity_blocks"],
                 ssd_bytes=s["ssd_disk_bytes"], corrupt_dropped=s["corrupt_dropped"],
                 save_queue_bytes=self._saver.inflight_bytes)
        return c

    def wait_saves(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the next queued save to finish (at once
        if none is queued)."""
        self._saver.wait_progress(timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued saves (tests, shutdown)."""
        return self._saver.flush(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.close()
        self._saver.close()
        try:
            self.cache.close(persist=self.settings.persist_on_exit)
        except (MooncakeError, OSError) as e:
            self.log.warning("mooncake_te connector: closing the KV pool: %s", e)

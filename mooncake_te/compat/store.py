# SPDX-License-Identifier: Apache-2.0
"""``mooncake.store`` on mooncake_te: ``MooncakeDistributedStore`` over our KV pool.

Mooncake Store (``mooncake-integration/store/store_py.cpp``, documented in
``docs/source/api-reference/python/mooncake-store.md`` of kvcache-ai/Mooncake) is an
object store: string keys, byte values, replicas placed by a master service in the
memory segments every client contributes (``global_segment_size``), read with one-sided
transfers. Here the same API runs on :class:`mooncake_te.kvcache.KVCache`:

- **Data**: each process's share lives in its KV pool's DRAM tier (registered with its
  engine, so peers READ it one-sided) and, with ``enable_ssd_offload``, its SSD tier.
  An object spans as many pool slots (chunks, 64 KiB by default) as it needs, so any
  object up to the segment fits. A ``put`` stores the object in the putting process's
  own pool (Mooncake's ``prefer_alloc_in_same_node`` placement) and returns once its
  index records are written (every client reads it at once); a ``get`` of an object
  another process holds reads its chunks from that holder's DRAM tier, checking each
  slot header's key and CRC, and keeps no copy.
- **Index**: in the metadata store the engines already use (etcd, redis, or an HTTP
  metadata server): the KV pool's owner index, one record per chunk
  (``mooncake/kvcache/<tenant>/<key hash>`` -> holder, address, length). A stale record
  (the holder evicted the object or died) costs one failed read and counts as a miss,
  never returns wrong bytes, so records need no lease.
- **No master**: ``master_server_address`` is accepted and not contacted (when
  ``metadata_server`` is ``P2PHANDSHAKE``, a ``master_server_address`` written as a store
  URL such as ``redis://host:6379`` holds the index instead). What the master arranges
  between clients, the stores do through each other's store services
  (:mod:`.store_service`): puts from clients with ``global_segment_size = 0``, the extra
  copies of ``replica_num > 1``, cluster-wide removes, the copy and move tasks.

Return codes are Mooncake Store's (``mooncake-store/include/types.h``): 0 success,
-704 ``OBJECT_NOT_FOUND``, -600 ``INVALID_PARAMS``, -200 ``NO_AVAILABLE_HANDLE``
(the object does not fit the segment, or no store has a segment), -800
``TRANSFER_FAIL``, -1 ``INTERNAL_ERROR``. A put of a key that exists succeeds without
rewriting it, as Mooncake's ``PutStart`` treats ``OBJECT_ALREADY_EXISTS``.

Raw pointers (``register_buffer``, ``put_from``, ``get_into`` and their batch forms) are
checked before a byte is copied, so a wrong one is a return code, never a crash (issue
35): ``register_buffer`` takes only a range this process has mapped readable and
writable (``/proc/self/maps``), and every piece a zero-copy call names must be a
non-NULL pointer with a size of 0 or more lying inside one buffer registered with
``register_buffer`` (or a region of the engine), as Mooncake requires, or inside one
CUDA allocation (device memory needs no registering: Mooncake's local copy takes it
with ``cudaMemcpy``, ours with ``cuMemcpy``, never ``memmove``); otherwise that key gets
-600 ``INVALID_PARAMS`` and the log says which range was refused.
``docs/compat.md`` lists every method and where the semantics differ.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
import weakref

import numpy as np

from .. import cuda
from .. import errors as E
from ..kvcache.keys import as_key
from ..kvcache.record import HEADER_SIZE, slot_size_for
from ._maps import mapped_rw as _mapped_rw
from .dummy_client import DummyClient, add_forwarders, become_dummy
# Mooncake's shared host memory for dummy clients (mooncake.store.MooncakeHostMemAllocator)
from .dummy_client import MooncakeHostMemAllocator  # noqa: F401
# Mooncake Store's return codes and types: mooncake.store.<name> for each
from .store_types import (BUFFER_OVERFLOW, INTERNAL_ERROR, INVALID_PARAMS,  # noqa: F401
                          LEASE_EXPIRED, NO_AVAILABLE_HANDLE, NOT_SUPPORTED,
                          OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND, OK, TASK_NOT_FOUND,
                          TRANSFER_FAIL,
                          QueryTaskResponse, TaskStatus, TaskType,
                          BufferDescriptor, BufferHandle, DiskDescriptor, MemoryDescriptor,
                          ObjectDataType, ReplicaDescriptor, ReplicaStatus, ReplicateConfig,
                          SoftPinAction, _parse_size)
from .parallelism import ParallelismCalls
# Mooncake's request objects of the *_with_parallelism calls (mooncake.store.ParallelAxis, ...)
from .parallelism import ParallelAxis, ReadTarget, TensorParallelism  # noqa: F401
from .tensor import TensorCalls
# Mooncake's module-level tensor helpers (mooncake.store._serialize_tensor, ...)
from .tensor import deserialize_tensor as _deserialize_tensor  # noqa: F401
from .tensor import serialize_tensor as _serialize_tensor  # noqa: F401
from .tensor import tensor_metadata_size as _tensor_metadata_size  # noqa: F401

log = logging.getLogger("mooncake_te.compat.store")

_MIB = 1 << 20
#: health_check's answers (Mooncake's HC_* codes)
HC_HEALTHY, HC_NOT_INITIALIZED, HC_MASTER_UNREACHABLE = 0, 1, 2
#: Payload bytes of one pool slot (a chunk of an object; MC_STORE_CHUNK_SIZE): an object
#: of any size up to the segment spans as many slots as it needs.
DEFAULT_CHUNK = (64 << 10) - 64
#: Bytes at the start of an object's first chunk: magic, the writer's chunk size, total
#: length, version nonce (readers lay the object out by the writer's chunk size).
_OBJ = struct.Struct("<4sIQI")
_OBJ_MAGIC = b"MCS1"


def default_chunk(segment_size: int) -> int:
    """Chunk (slot payload) bytes: 64 KiB slots, or smaller so that the segment holds at
    least 16 (a slot is the chunk plus a 64-byte header, rounded up to 4 KiB)."""
    slot = max(4096, min(DEFAULT_CHUNK + 64, segment_size // 16) // 4096 * 4096)
    return slot - 64


def n_chunks(total: int, chunk: int) -> int:
    """Slots an object of ``total`` bytes takes (its first chunk also holds a 16-byte
    object header)."""
    first = chunk - _OBJ.size
    return 1 + max(0, -(-(total - first) // chunk))


# Mooncake's binding exports these two enums' values at module level too.
globals().update({m.name: m for m in ObjectDataType})
globals().update({m.name: m for m in ReplicaStatus})
#: Mooncake's name for a replica's buffer descriptor (AllocatedBuffer::Descriptor)
Descriptor = BufferDescriptor
globals().update({m.name: m for m in TaskType})
globals().update({m.name: m for m in TaskStatus})


#: Where Mooncake's store client picks the port it adds to a bare local_hostname.
PORT_RANGE = (12300, 14300)


def _free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` in :data:`PORT_RANGE`, tried in random order."""
    import random
    ports = list(range(PORT_RANGE[0], PORT_RANGE[1] + 1))
    # Not the random module's shared generator: frameworks seed it (vLLM: seed=0), and
    # every process would then try the same ports in the same order.
    random.SystemRandom().shuffle(ports)
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports[:200]:
        with socket.socket(fam) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise E.InvalidArgumentError(f"no free port on {host} in {PORT_RANGE[0]}-"
                                 f"{PORT_RANGE[1]} (Mooncake's range for store clients); "
                                 f"give local_hostname as host:port")


class MooncakeDistributedStore(TensorCalls, ParallelismCalls):
    """Drop-in for ``mooncake.store.MooncakeDistributedStore`` (see the module
    docstring). Create it, call :meth:`setup` (0 on success), then put and get.

    Examples
    --------
    >>> s = MooncakeDistributedStore()                                # doctest: +SKIP
    >>> s.setup("127.0.0.1", "redis://127.0.0.1:6379", 64 << 20, 16 << 20, "tcp", "",
    ...         "127.0.0.1:50051")
    0
    >>> s.put("k", b"v"), s.get("k")
    (0, b'v')
    """

    def __init__(self):
        self._cache = None
        self._te = None              # a compat TransferEngine we created (closed by us)
        self._te_key = None          # its (local_hostname, metadata_server) in _ENGINES
        self._eng = None
        self._remote = False
        self._lock = threading.Lock()
        self._buffers: dict[int, object] = {}
        self._heads: dict = {}           # first-chunk key -> name, objects stored here
        self._service = None             # our StoreService (a store with a segment)
        self._directory = None           # the tenant's {segment: service} record
        self._dir_stop = threading.Event()
        self._dir_thread = None
        self._segmentless = False        # global_segment_size = 0: objects live elsewhere
        self._local_buffer = 16 * _MIB
        self._rr = 0
        self._warned_preferred = False
        #: key -> when its lease ends (time.monotonic()): granted by a put here and by
        #: a read through this store, as Mooncake's master grants one on put and on
        #: each read; batch_replica_clear skips objects whose lease is running
        self._leases: dict = {}
        self._lease_s = float(os.environ.get("MC_STORE_KV_LEASE_TTL", "5000")) / 1000
        #: the session calls' state (batch_put_session_start / batch_get_session_start):
        #: key -> _PutSession, key -> _GetSession
        self._put_sessions: dict = {}
        self._get_sessions: dict = {}
        self._sessions_lock = threading.Lock()
        #: reads that went to this store's SSD offload tier (get_offload_rpc_read_count)
        self._offload_reads = 0
        #: task id -> QueryTaskResponse of the copy/move tasks this store ran
        self._tasks: dict = {}
        self._client_id = tuple(int.from_bytes(os.urandom(8), "little") for _ in range(2))

    # --- set-up --------------------------------------------------------------------------
    def setup(self, local_hostname, metadata_server: str = "", global_segment_size=16 * _MIB,
              local_buffer_size=16 * _MIB, protocol: str = "tcp", rdma_devices: str = "",
              master_server_addr: str = "127.0.0.1:50051", engine=None,
              enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300, **extra) -> int:
        """Start the store; 0, or -1 (the reason is logged).

        Takes Mooncake's positional arguments or one dict (``setup({"local_hostname":
        ..., "metadata_server": ...})``). ``global_segment_size`` is this process's
        DRAM share of the pool; ``engine`` reuses a transfer engine (a
        :class:`mooncake_te.compat.TransferEngine`, a :class:`mooncake_te.TransferEngine`
        or a ``get_engine_ptr()`` handle). Beyond Mooncake: ``chunk_size`` (dict key,
        or ``MC_STORE_CHUNK_SIZE``; the old names ``max_object_size`` and
        ``MC_STORE_MAX_OBJECT_SIZE`` too; default 64 KiB slots, smaller when the
        segment would hold fewer than 16) is what one pool slot holds of an object,
        ``ssd_offload_size`` (or ``MC_STORE_SSD_BYTES``; default 4x the segment) the
        SSD tier's size. ``global_segment_size = 0`` makes a client that keeps no
        objects: it puts into and reads from other stores' segments.
        """
        if isinstance(local_hostname, dict):
            cfg = dict(local_hostname)
            try:
                local_hostname = cfg.pop("local_hostname")
                metadata_server = cfg.pop("metadata_server")
            except KeyError as e:
                log.error("setup: the config dict needs %s", e)
                return -1
            for mooncake_name, ours in (("master_server_address", "master_server_addr"),
                                        ("device_name", "rdma_devices")):
                if mooncake_name in cfg:
                    cfg.setdefault(ours, cfg.pop(mooncake_name))
            return self.setup(local_hostname, metadata_server, **cfg)
        try:
            self._local_buffer = _parse_size(local_buffer_size)
            self._setup(str(local_hostname), str(metadata_server),
                        _parse_size(global_segment_size), protocol or "tcp",
                        rdma_devices or "", str(master_server_addr or ""), engine,
                        bool(enable_ssd_offload), ssd_offload_path or "",
                        str(tenant_id or "default"), extra)
        except Exception as e:
            log.error("setup: %s: %s", type(e).__name__, e)
            self.close()
            return -1
        _LIVE.add(self)
        return 0

    def _setup(self, hostname, metadata, segment_size, protocol, devices, master, engine,
               ssd, ssd_path, tenant, extra) -> None:
        from ..kvcache import KVCache
        from ..metadata.base import KeyValueBackend
        from .engine import TransferEngine as CompatEngine, engine_from_ptr
        if self._cache is not None:
            raise E.InvalidArgumentError("setup was called already; close() first")
        if engine is None:
            if metadata.strip().upper() != "P2PHANDSHAKE" and ":" not in hostname.strip("[]"):
                # A store segment needs a name unique in the cluster; Mooncake's client
                # adds a port to a bare host the same way.
                hostname = f"{hostname}:{_free_port(_host_of(hostname))}"
            te = _shared_engine(hostname, metadata)
            if te is None:
                te = CompatEngine()
                if te.initialize(hostname, metadata, protocol, devices) != 0:
                    raise E.MetadataError(f"the transfer engine did not start with "
                                          f"local_hostname={hostname!r}, metadata_server="
                                          f"{metadata!r} (see the mooncake_te.compat log)")
                _ENGINES[(hostname, metadata)] = [te, 1]
            self._te, self._te_key, eng = te, (hostname, metadata), te.get_engine()
        elif isinstance(engine, int):
            eng = engine_from_ptr(engine)
            if eng is None:
                raise E.InvalidArgumentError(f"engine handle {engine:#x} is not one "
                                             f"get_engine_ptr() returned, or its engine "
                                             f"was closed")
        else:
            eng = engine.get_engine() if hasattr(engine, "get_engine") else engine
            if eng is None:
                raise E.InvalidArgumentError("the engine passed is not initialized")
        self._eng = eng
        index = None
        if not isinstance(getattr(eng, "metadata", None), KeyValueBackend):
            if "://" in master:
                index = master        # P2PHANDSHAKE: the index lives where master says
            else:
                log.warning("metadata_server %r has no store for the object index: this "
                            "store only sees its own objects (give metadata_server, or "
                            "master_server_address, as etcd://, redis:// or http:// URL to "
                            "share objects between processes)", metadata)
        chunk = _parse_size(extra.pop("chunk_size", None) or extra.pop("max_object_size", None)
                            or os.environ.get("MC_STORE_CHUNK_SIZE")
                            or os.environ.get("MC_STORE_MAX_OBJECT_SIZE")
                            or default_chunk(segment_size or 1 << 40))
        if chunk <= _OBJ.size:
            raise E.InvalidArgumentError(f"chunk_size {chunk} is too small; give at least "
                                         f"4096 bytes (MC_STORE_CHUNK_SIZE)")
        ssd_bytes = 0
        if ssd:
            if not ssd_path:
                raise E.InvalidArgumentError("enable_ssd_offload needs ssd_offload_path")
            ssd_bytes = _parse_size(extra.pop("ssd_offload_size", None)
                                    or os.environ.get("MC_STORE_SSD_BYTES")
                                    or 4 * segment_size)
        for k in extra:
            log.info("setup: %s=%r accepted and not used by this store", k, extra[k])
        if segment_size < 0:
            raise E.InvalidArgumentError(f"global_segment_size {segment_size} is negative")
        self._segmentless = segment_size == 0
        pool = segment_size
        if self._segmentless:
            # No share of the pool: objects are put in other processes' segments through
            # their store services; reads land in a private staging pool (the size of the
            # local buffer, at least 64 slots) and are not kept.
            if index is None and not isinstance(getattr(eng, "metadata", None),
                                                KeyValueBackend):
                raise E.InvalidArgumentError(
                    "global_segment_size = 0 needs a metadata store (etcd://, redis:// or "
                    "http:// metadata_server, or master_server_address as such a URL) to "
                    "find the processes that hold the objects")
            if ssd_bytes:
                raise E.InvalidArgumentError("enable_ssd_offload needs a segment "
                                             "(global_segment_size > 0)")
            pool = max(self._local_buffer, 64 * slot_size_for(chunk))
        # Mooncake Store shares objects between clients without any authentication, and
        # its users and tests expect that: the drop-in does the same unless told otherwise
        # (MC_KVCACHE_SHARE_WITHOUT_TOKEN=0, or [kvcache] share_without_token in the
        # engine's config). With MC_AUTH_TOKEN on every process the index records and
        # reads are authenticated (docs/kvcache.md, "Sharing between instances").
        share = None if "MC_KVCACHE_SHARE_WITHOUT_TOKEN" in os.environ else True
        if share and index is not None and not getattr(eng, "authenticated", False):
            log.warning("store: objects are shared between clients without authentication, "
                        "as Mooncake Store does; set MC_AUTH_TOKEN on every process to "
                        "authenticate them (docs/compat.md)")
        self._cache = KVCache(block_bytes=chunk, dram_bytes=pool,
                              ssd_bytes=ssd_bytes, cache_dir=ssd_path or None,
                              engine=eng, index=index, namespace=f"store/{tenant}",
                              log_interval_s=0, share_without_token=share)
        self._cache.publish_reads = False
        self._remote = self._cache._index is not None
        self.chunk_size = chunk
        #: the largest object: every slot of the segment
        self.max_object_size = self._cache.dram_slots * chunk - _OBJ.size
        if self._remote:
            from .store_service import Directory, StoreService
            self._directory = Directory(self._cache._index.store, tenant)
            if not self._segmentless:
                # The service and the directory thread hold this store weakly, so an
                # unclosed store is still collected (its finalizer closes it).
                self._service = StoreService(_host_of(hostname),
                                             _weak_call(self, "_serve_call"))
                self._directory.add(eng.name, self._service.addr)
                self._dir_thread = threading.Thread(target=_keep_listed,
                                                    args=(weakref.ref(self), self._dir_stop),
                                                    name="store-directory", daemon=True)
                self._dir_thread.start()
        log.info("store segment %s: %d slots of %d bytes, ssd %d bytes, index %s%s",
                 eng.name, self._cache.dram_slots, chunk, ssd_bytes,
                 "shared" if self._remote else "local only",
                 " (no segment: objects go to other processes)" if self._segmentless else "")

    def _peers(self) -> dict:
        """``{segment: service address}`` of the other stores of this tenant."""
        if self._directory is None:
            return {}
        me = self._eng.name if self._eng is not None and not self._segmentless else None
        return {k: v for k, v in self._directory.services().items() if k != me}

    def _call_peers(self, head: dict, payload=b"", targets=None) -> list:
        """Call every other store (or ``targets``, ``{segment: addr}``); ``(segment,
        reply head)`` of each that answered."""
        from .store_service import ServiceGone, call
        out = []
        for seg, addr in (self._peers() if targets is None else targets).items():
            try:
                out.append((seg, call(addr, head, payload)[0]))
            except ServiceGone as e:
                # Its process ended without leaving the directory: drop the entry (a
                # live store puts its own back within DIRECTORY_CHECK_S).
                log.info("%s; removing %s from the store directory", e, seg)
                if self._directory is not None:
                    self._directory.remove(seg)
            except E.MooncakeError as e:
                log.warning("%s", e)
        return out

    def _serve_call(self, head: dict, payload: bytes):
        """Another store's call (:mod:`.store_service`)."""
        op = head.get("op")
        if op == "ping":
            self._c()
            return {"ok": 1}, b""
        if op == "put":
            keys, sizes = list(head["keys"]), [int(n) for n in head["sizes"]]
            if sum(sizes) != len(payload):
                raise E.InvalidArgumentError("sizes do not add up to the payload")
            mv, views, off = memoryview(payload), [], 0
            for n in sizes:
                views.append(mv[off:off + n])
                off += n
            return {"codes": self._put_many(keys, views, replace=bool(head.get("replace")),
                                            forward=False)}, b""
        if op == "remove":
            return {"found": self._remove_objects(list(head["keys"]), forward=False)}, b""
        if op == "leases":
            return {"active": self._active_leases(list(head["keys"]))}, b""
        if op == "has":
            cache = self._c()
            return {"found": [cache.size_of(_key(k)) is not None for k in head["keys"]]}, b""
        if op == "drop":
            self._drop_here(list(head["keys"]))
            return {"ok": 1}, b""
        if op == "remove_all":
            return {"n": self._remove_all_here()}, b""
        if op == "remove_regex":
            return {"n": self._remove_regex_here(str(head["pattern"]))}, b""
        raise E.InvalidArgumentError(f"unknown store call {op!r}")

    def _c(self):
        if self._cache is None:
            raise E.InvalidArgumentError("the store is not set up; call setup(...) first "
                                         "and check it returns 0")
        return self._cache

    def close(self) -> int:
        """Withdraw this process's objects from the index, release the pool and the
        engine this store started. 0. Idempotent."""
        self._dir_stop.set()
        _LIVE.discard(self)
        svc, self._service = self._service, None
        if svc is not None:
            try:
                if self._directory is not None and self._eng is not None:
                    self._directory.remove(self._eng.name)
            except Exception as e:
                log.warning("close: the store directory: %s", e)
            svc.close()
        cache, self._cache = self._cache, None
        if cache is not None:
            try:
                cache.close()
            except E.MooncakeError as e:
                log.warning("close: %s", e)
        eng = self._eng
        self._eng = None
        for addr in list(self._buffers):
            region = self._buffers.pop(addr)
            try:
                if eng is not None and not getattr(eng, "_closed", True):
                    eng.unregister(region)
            except E.MooncakeError:
                pass
        te, self._te = self._te, None
        if te is not None and _release_engine(getattr(self, "_te_key", None), te):
            te.close()
        return 0

    def __del__(self):
        # Not on the collecting thread: the cyclic GC runs this at any allocation, maybe
        # while that thread holds a lock close() needs (the metadata client's, the
        # metrics registry's). A thread of its own closes the store (which that thread
        # keeps alive until then); inline only where no thread can start (shutdown).
        if self._cache is None and self._te is None:
            return
        if sys.is_finalizing():
            # No thread starts now (Thread.start would wait forever: the interpreter
            # is exiting) and atexit has closed every store that was open; what is
            # left goes with the process.
            return
        try:
            threading.Thread(target=_close_quietly, args=(self,), name="store-finalizer",
                             daemon=True).start()
        except RuntimeError:
            _close_quietly(self)

    def get_hostname(self) -> str:
        """This store's segment name (peers find its objects under it)."""
        return self._eng.name if self._eng is not None else ""

    # --- buffers -------------------------------------------------------------------------
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register memory for the zero-copy calls (``put_from``, ``get_into``, the batch
        and multi-buffer forms). 0, or a negative code (-600 for a NULL pointer, a size
        below 1, or a range this process has not mapped readable and writable)."""
        try:
            eng = self._eng
            if eng is None:
                self._c()
            ptr, n = _pointer(buffer_ptr, "buffer_ptr"), _size(size, "size", minimum=1)
            if not _mapped_rw(ptr, n):
                raise E.InvalidArgumentError(
                    f"[{ptr:#x}, +{n}) is not memory this process has mapped readable and "
                    f"writable (/proc/self/maps); pass the address and the real size of a "
                    f"buffer you allocated")
            region = eng.register_address(ptr, n, access="local")
        except E.MooncakeError as e:
            log.error("register_buffer(%r, %r): %s", buffer_ptr, size, e)
            if isinstance(e, E.InvalidArgumentError):
                return INVALID_PARAMS
            return e.status if isinstance(e.status, int) and e.status < 0 else INVALID_PARAMS
        with self._lock:
            self._buffers[int(buffer_ptr)] = region
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            region = self._buffers.pop(int(buffer_ptr), None)
        if region is None:
            log.error("unregister_buffer: %#x was not registered with register_buffer",
                      buffer_ptr)
            return INVALID_PARAMS
        try:
            self._eng.unregister(region)
        except E.MooncakeError as e:
            log.error("unregister_buffer(%#x): %s", buffer_ptr, e)
            return INTERNAL_ERROR
        return OK

    def _pieces(self, key, ptrs, lens, what: str) -> "list | None":
        """``[(address, size, device), ...]`` of one key's buffers, each checked: a
        non-NULL integer pointer, a size of 0 or more, the range inside one buffer
        registered with register_buffer (or a region of the engine), or else inside one
        CUDA allocation (:meth:`_where`). None, logged, when one is not. Copy each piece
        with :func:`_copy` and its ``device``."""
        try:
            if len(ptrs) != len(lens):
                raise E.InvalidArgumentError(f"{len(ptrs)} buffers but {len(lens)} sizes")
            out = []
            for p, n in zip(ptrs, lens):
                p, n = _pointer(p, "buffer pointer"), _size(n, "size", minimum=0)
                out.append((p, n, self._where(p, n) if n else HOST))
            return out
        except (E.MooncakeError, TypeError, ValueError, OverflowError) as e:
            log.error("%s %r: %s", what, key, e)
            return None

    def _where(self, p: int, n: int) -> int:
        """Where ``[p, p + n)`` is: :data:`HOST` inside a buffer registered with
        register_buffer or a host region of the engine, else the ordinal of the CUDA
        device whose allocation holds it whole (an engine region on a GPU, or device
        memory the driver knows: a tensor's ``data_ptr()`` needs no registering, as
        Mooncake copies with ``cudaMemcpy`` there). CUDA is asked only about pointers
        in no registered buffer, and only in a process that loaded it
        (:func:`_cuda_usable`). InvalidArgumentError, saying why, for anything else."""
        r = self._region_of(p, n)
        if r is not None:
            dev = _region_device(r)
            if dev is None:
                raise E.InvalidArgumentError(
                    f"[{p:#x}, +{n}) lies in an engine region on {r.location}, which this "
                    f"store cannot copy to or from")
            return dev
        dev = _cuda_device(p, n)
        if dev == HOST:
            raise E.InvalidArgumentError(
                f"[{p:#x}, +{n}) is not inside a buffer registered with "
                f"register_buffer() nor in CUDA device memory; register the buffer "
                f"first, and pass sizes that fit in it")
        return dev

    def _regions(self) -> list:
        """The buffers registered with register_buffer and the engine's regions."""
        with self._lock:
            regions: list = list(self._buffers.values())
        eng = self._eng
        if eng is not None:
            regions += list(getattr(eng, "regions", ()))
        return regions

    def _region_of(self, ptr: int, n: int):
        """The registered buffer or engine region holding ``[ptr, ptr + n)``, or None."""
        return next((r for r in self._regions() if r.contains(ptr, n)), None)

    def _registered(self, ptr: int, n: int) -> bool:
        """``[ptr, ptr + n)`` lies in a registered buffer (or engine region) of host
        memory: bytes this process may read and write in place."""
        r = self._region_of(ptr, n)
        return r is not None and _region_device(r) == HOST

    # --- the core: put and get of gathered / scattered objects ---------------------------
    def _check_config(self, config) -> None:
        seg = getattr(config, "preferred_segment", "") if config is not None else ""
        if seg and self._eng is not None and seg != self._eng.name and not self._warned_preferred:
            self._warned_preferred = True
            log.warning("preferred_segment %r is not this process's segment %r; objects "
                        "are stored in this process's pool (Mooncake's fallback when the "
                        "preferred segment cannot take them)", seg, self._eng.name)

    def _put_many(self, keys, datas, config=None, replace: bool = False,
                  forward: bool = True) -> list:
        """Store ``datas[i]`` (bytes-like) under ``keys[i]``; a code per key.

        An object is laid out over pool slots: chunk 0 (under the key itself) holds a
        16-byte object header (magic, total length, a random version nonce) and the first
        bytes; chunks 1.. hold the rest under keys derived from the key, the nonce and the
        chunk number, so a chunk of another version of the object is never mixed in.
        Chunk 0 is placed first, so it is the first of them the LRU evicts: a partly
        evicted object has lost its first chunk and is not found, never half read.
        Returns once every index record is in the metadata store (read-after-write for
        every client). A store without a segment sends the objects to another store's
        segment; ``replica_num`` > 1 sends copies to as many other stores (``forward``
        False: a call from another store, stored here only)."""
        cache = self._c()
        self._check_config(config)
        if config is not None and getattr(config, "soft_pin_ttl_ms", None) is not None and \
                getattr(config, "soft_pin_action", 0) != SoftPinAction.ENABLE:
            log.error("put: soft_pin_ttl_ms is given with soft_pin_action %s; a TTL goes "
                      "only with SoftPinAction.ENABLE (as in Mooncake)",
                      getattr(config, "soft_pin_action", None))
            return [INVALID_PARAMS] * len(keys)
        if replace:
            self._remove_objects(list(keys), forward=forward)
        if self._segmentless and forward:
            return self._put_elsewhere(keys, datas, config, replace)
        chunk = cache.block_bytes
        out: list = [OK] * len(keys)
        ks: list = []
        blocks: list = []
        where: list = []
        if replace:
            pass
        elif self._remote and forward:
            # A key another process holds exists: left as it is (one index query).
            held = cache._index.lookup_many([_key(k) for k in keys])
            there = [i for i, rec in enumerate(held) if rec is not None]
            if there:
                # Only where the holder still serves it: a record a killed process left
                # behind must not stop the object from being stored again.
                for i, h in zip(there, self._heads_of([keys[i] for i in there])):
                    if h is not None:
                        out[i] = None       # marked: skip below
        for i, (k, d) in enumerate(zip(keys, datas)):
            mv = memoryview(d)
            if mv.ndim != 1 or mv.format != "B":
                mv = mv.cast("B")
            n = mv.nbytes
            if n == 0:
                log.error("put %r: an object has at least 1 byte", k)
                out[i] = INVALID_PARAMS
                continue
            nch = n_chunks(n, chunk)
            if nch > cache.dram_slots:
                log.error("put %r: %d bytes do not fit this segment (at most %d bytes: "
                          "global_segment_size %d bytes in slots of %d)", k, n,
                          cache.dram_slots * chunk - _OBJ.size,
                          cache.dram_slots * cache.slot_size, cache.slot_size)
                out[i] = NO_AVAILABLE_HANDLE
                continue
            head = _key(k)
            if out[i] is None or (not replace and cache.size_of(head) is not None):
                out[i] = OK                         # held: left as it is
                continue
            nonce = int.from_bytes(os.urandom(4), "little")
            first = chunk - _OBJ.size
            ks.append(head)
            blocks.append(_OBJ.pack(_OBJ_MAGIC, chunk, n, nonce) + bytes(mv[:first]))
            for j, ck in enumerate(_chunk_keys(k, nonce, nch), start=1):
                ks.append(ck)
                lo = first + (j - 1) * chunk
                blocks.append(mv[lo:lo + chunk])
            where.append(i)
            self._grant(k)
            self._heads[head] = k
        if ks:
            try:
                cache.put(ks, blocks)
                if not cache.flush_index():
                    log.warning("put: the index records of %d objects did not reach the "
                                "metadata store within 10 s", len(where))
            except E.MooncakeError as e:
                log.error("put of %d objects: %s", len(where), e)
                for i in where:
                    out[i] = INTERNAL_ERROR
        nrep = int(getattr(config, "replica_num", 1) or 1) if config is not None else 1
        if forward and nrep > 1 and where:
            self._replicate([keys[i] for i in where if out[i] == OK],
                            [datas[i] for i in where if out[i] == OK], nrep - 1, config,
                            replace)
        return out

    def _targets(self, n: int, config=None) -> dict:
        """``n`` other stores to place objects in: the preferred segments first, then
        the others in turn."""
        peers = self._peers()
        names = sorted(peers)
        if names:
            r = self._rr % len(names)
            self._rr += 1
            names = names[r:] + names[:r]
        pref = []
        if config is not None:
            pref = [p for p in ([getattr(config, "preferred_segment", "")] +
                                list(getattr(config, "preferred_segments", []) or []))
                    if p in peers]
        order = list(dict.fromkeys(pref + names))
        return {seg: peers[seg] for seg in order[:n]}

    def _send_objects(self, targets: dict, keys, datas, replace: bool) -> dict:
        """Send the objects to each target store; ``{segment: [code per key]}``."""
        views = [memoryview(d).cast("B") if memoryview(d).ndim != 1 or
                 memoryview(d).format != "B" else memoryview(d) for d in datas]
        payload = b"".join(views)
        head = {"op": "put", "keys": [str(k) if not isinstance(k, bytes) else
                                      k.decode("utf-8", "surrogateescape") for k in keys],
                "sizes": [v.nbytes for v in views], "replace": replace}
        return {seg: rh.get("codes", [INTERNAL_ERROR] * len(keys))
                for seg, rh in self._call_peers(head, payload, targets)}

    def _put_elsewhere(self, keys, datas, config, replace) -> list:
        """A store without a segment: the objects go to other stores' segments."""
        out = [OK] * len(keys)
        ok_i = []
        for i, d in enumerate(datas):
            n = memoryview(d).nbytes
            if n == 0:
                out[i] = INVALID_PARAMS
            else:
                ok_i.append(i)
        if not ok_i:
            return out
        nrep = max(1, int(getattr(config, "replica_num", 1) or 1)) if config else 1
        targets = self._targets(nrep, config)
        if not targets:
            log.error("put: this store has no segment (global_segment_size = 0) and no "
                      "other store of tenant is running to hold objects")
            for i in ok_i:
                out[i] = NO_AVAILABLE_HANDLE
            return out
        got = self._send_objects(targets, [keys[i] for i in ok_i], [datas[i] for i in ok_i],
                                 replace)
        for j, i in enumerate(ok_i):
            codes = [c[j] for c in got.values()]
            out[i] = OK if OK in codes else (codes[0] if codes else TRANSFER_FAIL)
        return out

    def _replicate(self, keys, datas, n: int, config, replace) -> None:
        """Copies in ``n`` other stores' segments (``replica_num`` - 1). Their index
        records are written after ours, so the index names the last copy made; the
        first holder leaving does not lose the object."""
        targets = self._targets(n, config)
        if len(targets) < n:
            log.warning("replica_num %d: only %d other stores to hold copies", n + 1,
                        len(targets))
        if targets and keys:
            self._send_objects(targets, keys, datas, replace)

    def _heads_of(self, keys, peek: bool = False) -> list:
        """Each object's ``(total bytes, nonce, first chunk array, chunk size)``, or
        None. With
        ``peek``, a first chunk in this process's DRAM tier is read in place, without
        touching it (the chunk array is then None): a first chunk must never become more
        recent than the object's other chunks, or the LRU would evict those first."""
        cache = self._c()
        out: list = [None] * len(keys)
        todo = list(range(len(keys)))
        if peek:
            todo = []
            with cache._lock:
                for i, k in enumerate(keys):
                    ent = cache._dram.get(_key(k))
                    if ent is None:
                        todo.append(i)
                        continue
                    off = ent[0] * cache.slot_size + HEADER_SIZE
                    h = _parse_obj(cache._np[off:off + _OBJ.size])
                    out[i] = None if h is None else (h[0], h[1], None, h[2])
        if todo:
            got = self._fetch([_key(keys[i]) for i in todo])
            for i, g in zip(todo, got):
                h = _parse_obj(g)
                out[i] = None if h is None else (h[0], h[1], g, h[2])
        return out

    def _fetch(self, pool_keys, copy=None) -> list:
        """``KVCache.get`` with the index; what came from another process is not kept
        (its holder stays the one the index names, and a later version of the object
        is never shadowed by a stale copy here)."""
        cache = self._c()
        where: list = []
        got = cache.get(pool_keys, remote=self._remote, copy=copy, where=where)
        fetched = [k for k, w in zip(pool_keys, where) if w is not None and w != "dram"
                   and w != "ssd"]
        if "ssd" in where:
            self._offload_reads += 1
        if fetched:
            cache.remove(fetched, index=False)
        return got

    def _get_many(self, keys, sizes=None) -> list:
        """Each object as a numpy array, or an int code (negative) when it is missing or
        larger than ``sizes[i]``. Two rounds: the first chunks, then every other chunk of
        every object at once."""
        cache = self._c()
        heads = self._heads_of(keys)
        out: list = []
        rest_keys: list = []
        rest_to: list = []            # (index in out, offset)
        for i, h in enumerate(heads):
            if h is None:
                out.append(OBJECT_NOT_FOUND)
                continue
            total, nonce, g, chunk = h
            if sizes is not None and total > sizes[i]:
                log.error("get %r: the object is %d bytes, the buffer %d", keys[i], total,
                          sizes[i])
                out.append(INVALID_PARAMS)
                continue
            first = chunk - _OBJ.size
            buf = np.empty(total, np.uint8)
            n0 = min(total, first)
            buf[:n0] = g[_OBJ.size:_OBJ.size + n0]
            out.append(buf)
            for j, ck in enumerate(_chunk_keys(keys[i], nonce, n_chunks(total, chunk)),
                                   start=1):
                rest_keys.append(ck)
                rest_to.append((i, first + (j - 1) * chunk))
        if rest_keys:
            def land(j, view):
                i, off = rest_to[j]
                dst = out[i]
                if isinstance(dst, np.ndarray):
                    dst[off:off + view.nbytes] = view
            got = self._fetch(rest_keys, copy=land)
            broken = []
            for (i, _), g in zip(rest_to, got):
                if g is None and not isinstance(out[i], int):
                    log.warning("get %r: a chunk of the object was evicted; it is gone",
                                keys[i])
                    out[i] = OBJECT_NOT_FOUND
                    broken.append(keys[i])
            if broken:
                self._remove_objects(broken)     # what is left of them finds no reader
        for k, o in zip(keys, out):
            if not isinstance(o, int):
                self._grant(k)
        return out

    def _remove_objects(self, keys, forward: bool = True) -> list:
        """Remove each object (every chunk, here and from the index; with ``forward``,
        every other store's copies too); True where one was found."""
        cache = self._c()
        heads = self._heads_of(keys, peek=True)
        found = []
        drop: list = []
        for k, h in zip(keys, heads):
            head = _key(k)
            drop.append(head)
            self._heads.pop(head, None)
            if h is not None:
                drop += _chunk_keys(k, h[1], n_chunks(h[0], h[3]))
            found.append(h is not None)
        cache.remove(drop)
        cache.flush_index()
        if forward and self._directory is not None:
            for _, rh in self._call_peers({"op": "remove", "keys": [str(k) for k in keys]}):
                found = [a or bool(b) for a, b in zip(found, rh.get("found", []))]
        return found

    def _remove_regex_here(self, pattern: str) -> int:
        rx = re.compile(pattern)
        names = [n for n in list(self._heads.values())
                 if rx.search(n if isinstance(n, str) else n.decode("utf-8", "replace"))]
        return sum(self._remove_objects(names, forward=False)) if names else 0

    def _remove_all_here(self) -> int:
        cache = self._c()
        held = cache.keys()
        n = sum(1 for k in held if k in self._heads)
        cache.remove(held)
        self._heads.clear()
        cache.flush_index()
        return n

    def _object_size(self, key) -> "int | None":
        """The object's size, from its first chunk (read only when its length does not
        tell: a first chunk shorter than the smallest slot is the whole object)."""
        cache = self._c()
        mine = cache.size_of(_key(key))
        if mine is not None and mine < cache.block_bytes:
            return mine - _OBJ.size          # written here, in one of our slots
        n0 = mine if mine is not None else cache.size_of(_key(key), remote=self._remote)
        if n0 is None:
            return None
        if n0 < 4096 - HEADER_SIZE:
            return n0 - _OBJ.size
        h = self._heads_of([key], peek=True)[0]
        return None if h is None else h[0]

    # --- the everyday API ---------------------------------------------------------------
    def _staged(self, keys, values) -> list:
        """Mooncake's ``put``/``put_batch``/``upsert`` copy the value into the client's
        local buffer (``local_buffer_size``) first; a value that does not fit it fails
        there (-600), with ``local_buffer_size = 0`` every one. A code per key (0: fits)."""
        out = []
        for k, v in zip(keys, values):
            n = memoryview(v).nbytes
            if n > self._local_buffer:
                log.error("put %r: %d bytes do not fit the local buffer (local_buffer_size "
                          "%d); give setup a larger local_buffer_size, or register the "
                          "memory and use put_from", k, n, self._local_buffer)
                out.append(INVALID_PARAMS)
            else:
                out.append(OK)
        return out

    def _put_staged(self, keys, values, config, replace=False) -> list:
        out = self._staged(keys, values)
        ok = [i for i, c in enumerate(out) if c == OK]
        if ok:
            for i, c in zip(ok, self._put_many([keys[i] for i in ok], [values[i] for i in ok],
                                               config, replace=replace)):
                out[i] = c
        return out

    def put(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like) under ``key``. 0, or a negative code; a key that
        exists is left as it is and 0 returned (Mooncake's put semantics)."""
        return self._guard(lambda: self._put_staged([key], [value], config)[0],
                           INTERNAL_ERROR)

    def put_batch(self, keys, values, config: ReplicateConfig | None = None) -> int:
        """Store several objects; 0 when every one was stored, else the first error."""
        def go():
            if len(keys) != len(values):
                raise E.InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
            bad = [c for c in self._put_staged(list(keys), list(values), config) if c]
            return bad[0] if bad else OK
        return self._guard(go, INVALID_PARAMS)

    def upsert(self, key: str, value, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` under ``key``, replacing an object that exists (every copy,
        in every store). 0 or a negative code."""
        return self._guard(lambda: self._put_staged([key], [value], config, True)[0],
                           INTERNAL_ERROR)

    def upsert_batch(self, keys, values, config: ReplicateConfig | None = None) -> int:
        """:meth:`upsert` of several objects; 0, else the first error."""
        def go():
            if len(keys) != len(values):
                raise E.InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
            bad = [c for c in self._put_staged(list(keys), list(values), config, True) if c]
            return bad[0] if bad else OK
        return self._guard(go, INVALID_PARAMS)

    def get(self, key: str) -> bytes:
        """The object's bytes, ``b""`` when it does not exist."""
        def go():
            g = self._get_many([key])[0]
            return b"" if isinstance(g, int) else g.tobytes()
        return self._guard(go, b"")

    def get_batch(self, keys) -> list:
        """Each object's bytes, ``b""`` for a missing one."""
        def go():
            return [b"" if isinstance(g, int) else g.tobytes() for g in self._get_many(keys)]
        return self._guard(go, [b""] * len(keys))

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` under ``key``. 0 or a negative code."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Copy the object into ``buffer_ptr`` (``size`` bytes there); bytes read, or a
        negative code (-704 missing, -600 buffer too small)."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_put_from(self, keys, buffer_ptrs, sizes,
                       config: ReplicateConfig | None = None) -> list:
        """``put_from`` for several keys; a code per key."""
        return self.batch_put_from_multi_buffers(keys, [[p] for p in buffer_ptrs],
                                                 [[s] for s in sizes], config)

    def batch_get_into(self, keys, buffer_ptrs, sizes) -> list:
        """``get_into`` for several keys; bytes read (or a negative code) per key."""
        return self.batch_get_into_multi_buffers(keys, [[p] for p in buffer_ptrs],
                                                 [[s] for s in sizes])

    def get_into_ranges(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets,
                        all_sizes) -> list:
        """Byte ranges of objects into registered buffers, buffer by buffer (Mooncake's
        ``get_into_ranges``): for buffer ``i`` and its ``j``-th key, range ``k`` copies
        ``all_sizes[i][j][k]`` bytes from offset ``all_src_offsets[i][j][k]`` of the
        object to offset ``all_dst_offsets[i][j][k]`` of the buffer.

        Returns ``results[i][j][k]``: the bytes copied, or a negative code: -704 when the
        key does not exist, -600 when the range runs past the object or past the
        registered buffer the pointer lies in, when the key's three lists differ in
        length, or when the pointer is not in a buffer registered with
        ``register_buffer``. The result has one entry per destination offset."""
        def shape():
            return [[[INVALID_PARAMS] * len(d) for d in dsts] for dsts in all_dst_offsets]

        def go():
            res = shape()
            n = len(buffer_ptrs)
            if not (len(all_keys) == len(all_dst_offsets) == len(all_src_offsets)
                    == len(all_sizes) == n):
                log.error("get_into_ranges: %d buffers, %d key lists, %d/%d/%d offset and "
                          "size lists; give one of each per buffer", n, len(all_keys),
                          len(all_dst_offsets), len(all_src_offsets), len(all_sizes))
                return res
            wanted: list = []
            for i in range(n):
                keys = all_keys[i]
                if len(keys) == len(all_dst_offsets[i]) == len(all_src_offsets[i]) == \
                        len(all_sizes[i]):
                    wanted += [k for k in keys if k not in wanted]
            objs = dict(zip(wanted, self._get_many(wanted))) if wanted else {}
            for i in range(n):
                ptr = int(buffer_ptrs[i])
                cap, dev = self._capacity(ptr)
                keys = all_keys[i]
                if not ptr or not cap or not (len(keys) == len(all_dst_offsets[i]) ==
                                              len(all_src_offsets[i]) == len(all_sizes[i])):
                    if not cap:
                        log.error("get_into_ranges: buffer %#x is not inside a buffer "
                                  "registered with register_buffer() nor in CUDA device "
                                  "memory", ptr)
                    continue
                for j, key in enumerate(keys):
                    dsts, srcs, lens = (all_dst_offsets[i][j], all_src_offsets[i][j],
                                        all_sizes[i][j])
                    if not len(dsts) == len(srcs) == len(lens):
                        continue
                    obj = objs.get(key, OBJECT_NOT_FOUND)
                    if isinstance(obj, int):
                        res[i][j] = [obj] * len(dsts)
                        continue
                    for k, (d, sr, ln) in enumerate(zip(dsts, srcs, lens)):
                        d, sr, ln = int(d), int(sr), int(ln)
                        if min(d, sr, ln) < 0 or d + ln > cap or sr + ln > obj.nbytes:
                            continue                      # stays INVALID_PARAMS
                        _copy(ptr + d, obj.ctypes.data + sr, ln, dev)
                        res[i][j][k] = ln
            return res
        return self._guard(go, shape())

    def _grant(self, key) -> None:
        self._leases[key if isinstance(key, str) else str(key)] = (time.monotonic()
                                                                   + self._lease_s)

    def _active_leases(self, keys) -> list:
        now = time.monotonic()
        for k in [k for k, t in list(self._leases.items()) if t <= now]:
            self._leases.pop(k, None)
        return [k for k in keys if self._leases.get(str(k), 0) > now]

    def batch_replica_clear(self, keys, segment_name: str = "") -> list:
        """Remove the replicas of ``keys`` whose lease has ended (Mooncake's
        ``batch_replica_clear``): every replica with ``segment_name`` empty, else only
        the one in that segment (this store's ``get_hostname()`` or another store's).
        Returns the keys cleared. A lease is granted by a put and by every read through
        any store (``MC_STORE_KV_LEASE_TTL`` ms, default 5000 as Mooncake's master); a
        key with a running lease anywhere, or with no replica where asked, is left."""
        def go():
            ks = [str(k) for k in keys]
            if not ks:
                return []
            active = set(self._active_leases(ks))
            if self._directory is not None:
                for _, rh in self._call_peers({"op": "leases", "keys": ks}):
                    active.update(rh.get("active", []))
            cand = [k for k in ks if k not in active]
            if not cand:
                return []
            me = self._eng.name if self._eng is not None else ""
            if not segment_name:
                found = self._remove_objects(cand, forward=True)
            elif segment_name == me and not self._segmentless:
                found = self._remove_objects(cand, forward=False)
            else:
                target = {k: v for k, v in self._peers().items() if k == segment_name}
                found = [False] * len(cand)
                for _, rh in self._call_peers({"op": "remove", "keys": cand}, b"", target):
                    found = [a or bool(b) for a, b in zip(found, rh.get("found", []))]
            return list(dict.fromkeys(k for k, f in zip(cand, found) if f))
        return self._guard(go, [])

    def _capacity(self, ptr: int) -> "tuple[int, int]":
        """Bytes from ``ptr`` to the end of the registered buffer (or engine region) it
        lies in, else of the CUDA allocation it lies in, and where that is (as
        :meth:`_where`); ``(0, HOST)`` if none."""
        best = max((r for r in self._regions() if r.address <= ptr < r.address + r.length),
                   key=lambda r: r.address + r.length, default=None)
        if best is not None:
            dev = _region_device(best)
            return (0, HOST) if dev is None else (best.address + best.length - ptr, dev)
        return _cuda_extent(ptr)

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        """:meth:`put_from` that replaces an object that exists (every copy)."""
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(self, keys, buffer_ptrs, sizes,
                          config: ReplicateConfig | None = None) -> list:
        """:meth:`upsert_from` of several keys; a code per key."""
        return self.batch_put_from_multi_buffers(keys, [[p] for p in buffer_ptrs],
                                                 [[s] for s in sizes], config, _replace=True)

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes,
                                     config: ReplicateConfig | None = None,
                                     _replace: bool = False) -> list:
        """Object ``i`` is the concatenation of ``all_sizes[i][j]`` bytes at
        ``all_buffer_ptrs[i][j]`` (one piece per layer, as vLLM lays it out). A code per
        key: 0 stored (or existed already), negative on error."""
        def go():
            _same_len(keys, all_buffer_ptrs, all_sizes)
            self._c()
            out = [INVALID_PARAMS] * len(keys)
            good, datas = [], []
            for i, (key, ptrs, lens) in enumerate(zip(keys, all_buffer_ptrs, all_sizes)):
                pieces = self._pieces(key, ptrs, lens, "put_from")
                if pieces is None:
                    continue
                buf = np.empty(sum(n for _, n, _ in pieces), np.uint8)
                off = 0
                for p, n, dev in pieces:
                    _copy(buf.ctypes.data + off, p, n, dev)
                    off += n
                good.append(i)
                datas.append(buf)
            codes = (self._put_many([keys[i] for i in good], datas, config, replace=_replace)
                     if good else [])
            for i, code in zip(good, codes):
                out[i] = code
            return out
        return self._guard(go, [INVALID_PARAMS] * len(keys))

    def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes,
                                     prefer_same_node: bool = False,
                                     prefer_alloc_in_same_node: bool = False) -> list:
        """Scatter object ``i`` over ``all_buffer_ptrs[i]`` (``all_sizes[i][j]`` bytes
        each, in order). Bytes read per key, or a negative code (-704 missing)."""
        def go():
            _same_len(keys, all_buffer_ptrs, all_sizes)
            self._c()
            out = [INVALID_PARAMS] * len(keys)
            good, where = [], []
            for i, (key, ptrs, lens) in enumerate(zip(keys, all_buffer_ptrs, all_sizes)):
                pieces = self._pieces(key, ptrs, lens, "get_into")
                if pieces is not None:
                    good.append(i)
                    where.append(pieces)
            got = self._get_many([keys[i] for i in good],
                                 [sum(n for _, n, _ in pieces) for pieces in where]) if good else []
            for i, g, pieces in zip(good, got, where):
                if isinstance(g, int):
                    out[i] = g
                    continue
                src, left = g.ctypes.data, g.nbytes
                for p, n, dev in pieces:
                    k = min(n, left)
                    if k <= 0:
                        break
                    _copy(p, src, k, dev)
                    src += k
                    left -= k
                out[i] = g.nbytes
            return out
        return self._guard(go, [INVALID_PARAMS] * len(keys))

    # --- Mooncake's newer calls -----------------------------------------------------------
    def put_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (bytes-like) under ``key`` (LMCache
        stores a chunk's metadata and its KV bytes this way). 0 or a negative code."""
        return self._parts(key, parts, config, False, "put_parts")

    def upsert_parts(self, key: str, *parts, config: ReplicateConfig | None = None) -> int:
        """:meth:`put_parts`, replacing an object under ``key`` (as :meth:`upsert`)."""
        return self._parts(key, parts, config, True, "upsert_parts")

    def _parts(self, key: str, parts, config, replace: bool, what: str) -> int:
        def go():
            views = [memoryview(p).cast("B") if memoryview(p).ndim != 1 or
                     memoryview(p).format != "B" else memoryview(p) for p in parts]
            if not views:
                raise E.InvalidArgumentError(f"{what} needs at least one part")
            total = sum(v.nbytes for v in views)
            buf = np.empty(total, np.uint8)
            off = 0
            for v in views:
                buf[off:off + v.nbytes] = np.frombuffer(v, np.uint8)
                off += v.nbytes
            return self._put_staged([key], [buf], config, replace)[0]
        return self._guard(go, INTERNAL_ERROR)

    def get_buffer(self, key: str):
        """The object as a :class:`BufferHandle` (``ptr()``, ``size()``, the buffer
        protocol), or None when it does not exist."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys) -> list:
        """:meth:`get_buffer` of several keys, one round of index queries and reads."""
        def go():
            return [None if isinstance(g, int) else g.view(BufferHandle)
                    for g in self._get_many(list(keys))]
        return self._guard(go, [None] * len(keys))

    def health_check(self) -> int:
        """Mooncake's codes: 0 healthy (set up, and every other store in the directory
        answers), 1 not set up or closed, 2 when a store of the directory does not
        answer (Mooncake: the master is unreachable; the stores are what this store
        coordinates with instead)."""
        if self._cache is None:
            return HC_NOT_INITIALIZED
        peers = self._peers()
        answered = self._call_peers({"op": "ping"}, targets=peers)
        return HC_HEALTHY if len(answered) == len(peers) else HC_MASTER_UNREACHABLE

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        """Remove every object, in every store of the tenant, whose key matches the
        regular expression ``pattern`` (``re.search``); how many, or -1."""
        def go():
            re.compile(pattern)
            n = self._remove_regex_here(pattern)
            if self._directory is not None:
                n += sum(int(rh.get("n", 0)) for _, rh in
                         self._call_peers({"op": "remove_regex", "pattern": pattern}))
            return n
        try:
            return go()
        except re.error as e:
            log.error("remove_by_regex: %r is not a regular expression: %s", pattern, e)
            return INVALID_PARAMS
        except E.MooncakeError as e:
            log.error("%s", e)
            return INTERNAL_ERROR

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address: str) -> int:
        """Make this store a dummy client of the real client at ``server_address``
        (``host:port`` of ``mooncake-te compat client`` / ``mooncake_client``): every
        call runs in that process, on its segment; 0, or -1 when it cannot be reached
        (:mod:`mooncake_te.compat.dummy`). The store becomes a :class:`DummyStore`."""
        rc = become_dummy(self, DummyStore, mem_pool_size, local_buffer_size,
                          server_address)
        if rc == OK:
            _LIVE.add(self)
        return rc

    # --- existence, size, removal -------------------------------------------------------
    def is_exist(self, key: str) -> int:
        """1 exists (here or, through the index, in another process), 0 not, -1 error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys) -> list:
        def go():
            cache = self._c()
            return [1 if cache.size_of(_key(k), remote=self._remote) is not None else 0
                    for k in keys]
        return self._guard(go, [-1] * len(keys))

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or -704 when it does not exist."""
        def go():
            n = self._object_size(key)
            return OBJECT_NOT_FOUND if n is None else n
        return self._guard(go, INTERNAL_ERROR)

    def remove(self, key: str, force: bool = False) -> int:
        """Remove the object everywhere: this process's copies, the index records, and
        every other store's copies (through their services). 0, or -704 when nobody
        held it."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys, force: bool = False) -> list:
        def go():
            return [OK if f else OBJECT_NOT_FOUND for f in self._remove_objects(list(keys))]
        return self._guard(go, [INTERNAL_ERROR] * len(keys))

    def remove_all(self, force: bool = False) -> int:
        """Remove every object of the cluster (this tenant's): this process's, and every
        other store's through its service; the number removed, or -1. ``force`` is
        accepted (no leases to skip here)."""
        def go():
            n = self._remove_all_here()
            if self._directory is not None:
                n += sum(int(rh.get("n", 0)) for _, rh in self._call_peers({"op": "remove_all"}))
            return n
        return self._guard(go, -1)

    def batch_get_replica_desc(self, keys) -> dict:
        """``{key: [ReplicaDescriptor, ...]}``: a memory replica where a process's DRAM
        tier holds it, a local-disk replica where this process's SSD tier does; an empty
        list for a missing key."""
        def go():
            cache = self._c()
            out = {}
            for k in keys:
                kk = as_key(_key(k))
                reps = []
                tier = cache.tier(kk)
                if tier == "dram":
                    slot, n = cache._dram[kk]
                    off = slot * cache.slot_size
                    h = _parse_obj(cache._np[off + HEADER_SIZE:off + HEADER_SIZE + _OBJ.size])
                    reps.append(ReplicaDescriptor("memory", self._eng.name, cache.base + off,
                                                  h[0] if h else n))
                elif tier == "ssd":
                    from ..kvcache.ssd import SLAB
                    reps.append(ReplicaDescriptor("local_disk", size=self._object_size(k),
                                                  path=os.path.join(cache.ssd.dir, SLAB)))
                elif self._remote:
                    rec = cache._index.lookup(kk)
                    if rec is not None:
                        reps.append(ReplicaDescriptor("memory", rec[0], rec[1],
                                                      self._object_size(k) or rec[2]))
                out[k] = reps
            return out
        return self._guard(go, {})

    def get_replica_desc(self, key: str) -> list:
        return self.batch_get_replica_desc([key]).get(key, [])

    # --- put_from_with_metadata, the session calls, counters ----------------------------
    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int,
                               config: ReplicateConfig | None = None) -> int:
        """Store ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size``
        bytes at ``buffer_ptr`` as one object (Mooncake's ``put_from_with_metadata``:
        the metadata first). Both ranges must lie in registered buffers (-600
        otherwise); ``size == 0`` stores nothing and returns 0, as Mooncake does."""
        try:
            if int(size) == 0:
                log.warning("put_from_with_metadata %r: size is 0; nothing stored (as in "
                            "Mooncake)", key)
                return OK
            ptrs, lens = [buffer_ptr], [size]
            if int(metadata_size) != 0:
                ptrs, lens = [metadata_buffer_ptr, buffer_ptr], [metadata_size, size]
        except (TypeError, ValueError) as e:
            log.error("put_from_with_metadata %r: %s", key, e)
            return INVALID_PARAMS
        return self.batch_put_from_multi_buffers([key], [ptrs], [lens], config)[0]

    def batch_put_session_start(self, keys, sizes,
                                config: ReplicateConfig | None = None) -> list:
        """Reserve objects of ``sizes[i]`` bytes under ``keys[i]``, to be written by
        :meth:`batch_put_from_multi_buffer_ranges` and made readable by
        :meth:`batch_put_session_end` (or dropped by :meth:`batch_put_session_revoke`).

        A code per key: 0; -600 for unequal lists, a size below 1, a key with a session
        already, or ``config.group_ids`` not one per key; -705 for a key that exists;
        -200 for a size the segment cannot hold beside the sessions open. The reserved
        bytes are staged in this process (zero-filled) until the session ends: nobody
        reads the object before."""
        def go():
            cache = self._c()
            if len(keys) != len(sizes):
                log.error("batch_put_session_start: %d keys but %d sizes", len(keys),
                          len(sizes))
                return [INVALID_PARAMS] * len(keys)
            groups = getattr(config, "group_ids", None) if config is not None else None
            if groups is not None and len(groups) != len(keys):
                log.error("batch_put_session_start: %d group_ids for %d keys; give one "
                          "per key", len(groups), len(keys))
                return [INVALID_PARAMS] * len(keys)
            out = [INVALID_PARAMS] * len(keys)
            exists = self.batch_is_exist(list(keys))
            limit = cache.dram_slots * cache.block_bytes - _OBJ.size
            with self._sessions_lock:
                for i, (k, n) in enumerate(zip(keys, sizes)):
                    n = _size(n, "size", minimum=0)
                    if not isinstance(k, str) or not k or k in self._put_sessions:
                        log.error("batch_put_session_start %r: %s", k,
                                  "a put session for it is open" if k in self._put_sessions
                                  else "a key is a non-empty str")
                    elif n < 1:
                        log.error("batch_put_session_start %r: an object has at least "
                                  "1 byte", k)
                    elif exists[i] == 1:
                        log.error("batch_put_session_start %r: the object exists; "
                                  "remove it first (or upsert it)", k)
                        out[i] = OBJECT_ALREADY_EXISTS
                    elif not self._segmentless and n > limit - sum(
                            p.data.nbytes for p in self._put_sessions.values()):
                        log.error("batch_put_session_start %r: %d bytes do not fit this "
                                  "segment (at most %d, less the put sessions open); end "
                                  "or revoke open sessions, or give a larger "
                                  "global_segment_size", k, n, limit)
                        out[i] = NO_AVAILABLE_HANDLE
                    else:
                        self._put_sessions[k] = _PutSession(np.zeros(n, np.uint8), config)
                        out[i] = OK
            return out
        return self._session_guard(go, "batch_put_session_start", keys)

    def batch_put_from_multi_buffer_ranges(self, keys, all_buffer_ptrs, all_sizes,
                                           all_dst_offsets) -> list:
        """Write ranges of objects reserved by :meth:`batch_put_session_start`: for key
        ``i``, ``all_sizes[i][j]`` bytes at ``all_buffer_ptrs[i][j]`` go to offset
        ``all_dst_offsets[i][j]`` of the object. The bytes written per key, or -600
        (unequal lists, no open session, a range past the object's size, a pointer not
        in a registered buffer); a key with a bad range gets nothing written."""
        def go():
            self._c()
            out = [INVALID_PARAMS] * len(keys)
            if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)
                    == len(all_dst_offsets)):
                log.error("batch_put_from_multi_buffer_ranges: %d keys, %d/%d/%d buffer, "
                          "size and offset lists; give one of each per key", len(keys),
                          len(all_buffer_ptrs), len(all_sizes), len(all_dst_offsets))
                return out
            with self._sessions_lock:
                for i, k in enumerate(keys):
                    sess = self._put_sessions.get(k)
                    if sess is None or not sess.writable:
                        log.error("batch_put_from_multi_buffer_ranges %r: no open put "
                                  "session (batch_put_session_start first)", k)
                        continue
                    ranges = self._ranges(k, all_buffer_ptrs[i], all_sizes[i],
                                          all_dst_offsets[i], sess.data.nbytes)
                    if ranges is None:
                        continue
                    base = sess.data.ctypes.data
                    for p, n, off, dev in ranges:
                        _copy(base + off, p, n, dev)
                    out[i] = sum(n for _, n, _, _ in ranges)
            return out
        return self._session_guard(go, "batch_put_from_multi_buffer_ranges", keys)

    def batch_put_session_end(self, keys) -> list:
        """Store each session's object (the ranges written, zeros elsewhere) and close
        the session. A code per key: 0, -600 with no session, or the put's code (the
        session then stays, for another end or a revoke, as in Mooncake)."""
        def go():
            self._c()
            out = [INVALID_PARAMS] * len(keys)
            todo: dict = {}
            with self._sessions_lock:
                for i, k in enumerate(keys):
                    sess = self._put_sessions.get(k)
                    if sess is None:
                        log.error("batch_put_session_end %r: no put session", k)
                        continue
                    sess.writable = False
                    todo.setdefault(id(sess.config), []).append(i)
            for idx in todo.values():
                sessions = [self._put_sessions[keys[i]] for i in idx]
                codes = self._put_many([keys[i] for i in idx], [s.data for s in sessions],
                                       sessions[0].config)
                with self._sessions_lock:
                    for i, code in zip(idx, codes):
                        out[i] = code
                        if code == OK:
                            self._put_sessions.pop(keys[i], None)
            return out
        return self._session_guard(go, "batch_put_session_end", keys)

    def batch_put_session_revoke(self, keys) -> list:
        """Drop put sessions without storing anything: 0 per key, -600 with none."""
        def go():
            self._c()
            with self._sessions_lock:
                gone = [self._put_sessions.pop(k, None) for k in keys]
            for k, g in zip(keys, gone):
                if g is None:
                    log.error("batch_put_session_revoke %r: no put session", k)
            return [INVALID_PARAMS if g is None else OK for g in gone]
        return self._session_guard(go, "batch_put_session_revoke", keys)

    def batch_get_session_start(self, keys) -> list:
        """Look each object up once (its first chunk: size and layout) and keep that
        for :meth:`batch_get_into_multi_buffer_ranges`, under a lease of
        ``MC_STORE_KV_LEASE_TTL`` ms (Mooncake's master lease). A code per key: 0, or
        -704 when the object does not exist."""
        def go():
            self._c()
            if not keys:
                return []
            heads = self._heads_of(list(keys))
            until = time.monotonic() + self._lease_s
            out = []
            with self._sessions_lock:
                for k, h in zip(keys, heads):
                    self._get_sessions.pop(k, None)
                    if h is None:
                        out.append(OBJECT_NOT_FOUND)
                        continue
                    self._get_sessions[k] = _GetSession(h[0], h[1], h[2], h[3], until)
                    self._grant(k)
                    out.append(OK)
            return out
        return self._session_guard(go, "batch_get_session_start", keys)

    def batch_get_into_multi_buffer_ranges(self, keys, all_buffer_ptrs, all_sizes,
                                           all_src_offsets) -> list:
        """Read ranges of objects looked up by :meth:`batch_get_session_start`: for
        key ``i``, ``all_sizes[i][j]`` bytes from offset ``all_src_offsets[i][j]`` of
        the object into ``all_buffer_ptrs[i][j]``. Only the chunks the ranges touch are
        read. The bytes read per key, or -600 (unequal lists, no session, a range past
        the object, a pointer not in a registered buffer), -707 when the session's
        lease ended (the session is dropped), -704 when the object has gone since."""
        def go():
            self._c()
            out = [INVALID_PARAMS] * len(keys)
            if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)
                    == len(all_src_offsets)):
                log.error("batch_get_into_multi_buffer_ranges: %d keys, %d/%d/%d buffer, "
                          "size and offset lists; give one of each per key", len(keys),
                          len(all_buffer_ptrs), len(all_sizes), len(all_src_offsets))
                return out
            now = time.monotonic()
            plans = []                  # (i, session, ranges)
            with self._sessions_lock:
                for i, k in enumerate(keys):
                    sess = self._get_sessions.get(k)
                    if sess is None:
                        log.error("batch_get_into_multi_buffer_ranges %r: no get session "
                                  "(batch_get_session_start first)", k)
                        continue
                    if now >= sess.until:
                        self._get_sessions.pop(k, None)
                        log.error("batch_get_into_multi_buffer_ranges %r: the session's "
                                  "lease ended; start a new session", k)
                        out[i] = LEASE_EXPIRED
                        continue
                    ranges = self._ranges(k, all_buffer_ptrs[i], all_sizes[i],
                                          all_src_offsets[i], sess.total)
                    if ranges is not None:
                        plans.append((i, sess, ranges))
            cks = [_chunk_keys(keys[i], sess.nonce, n_chunks(sess.total, sess.chunk))
                   for i, sess, _ in plans]
            need: dict = {}             # chunk key -> its bytes (None: gone)
            for (i, sess, ranges), ck in zip(plans, cks):
                first = sess.chunk - _OBJ.size
                for _, n, off, _ in ranges:
                    if n and off + n > first:
                        lo = max(off, first)
                        for j in range((lo - first) // sess.chunk + 1,
                                       (off + n - 1 - first) // sess.chunk + 2):
                            need[ck[j - 1]] = None
            if need:
                need = dict(zip(need, self._fetch(list(need))))
            for (i, sess, ranges), ck in zip(plans, cks):
                first = sess.chunk - _OBJ.size
                # every chunk a range touches is there, whole (its length is the
                # layout's), before a byte is copied
                if any(c in need and (need[c] is None or memoryview(need[c]).nbytes !=
                                      min(sess.chunk, sess.total - first - j * sess.chunk))
                       for j, c in enumerate(ck)):
                    log.warning("batch_get_into_multi_buffer_ranges %r: the object is "
                                "gone (evicted or replaced) since the session started",
                                keys[i])
                    out[i] = OBJECT_NOT_FOUND
                    continue
                for p, n, off, dev in ranges:
                    done = 0
                    while done < n:
                        pos = off + done
                        if pos < first:
                            src = np.asarray(sess.first, np.uint8)[_OBJ.size + pos:
                                                                   _OBJ.size + first]
                        else:
                            j = (pos - first) // sess.chunk + 1
                            lo = first + (j - 1) * sess.chunk
                            src = np.asarray(need[ck[j - 1]], np.uint8)[pos - lo:]
                        k = min(n - done, src.nbytes)
                        _copy(p + done, src.ctypes.data, k, dev)
                        done += k
                out[i] = sum(n for _, n, _, _ in ranges)
            return out
        return self._session_guard(go, "batch_get_into_multi_buffer_ranges", keys)

    def batch_get_session_end(self, keys) -> int:
        """Drop the get sessions of ``keys``; 0 (-1 when the store is not set up)."""
        if self._cache is None:
            log.error("batch_get_session_end: the store is not set up")
            return INTERNAL_ERROR
        with self._sessions_lock:
            for k in keys:
                self._get_sessions.pop(k, None)
        return OK

    def _ranges(self, key, ptrs, lens, offsets, limit: int) -> "list | None":
        """``[(address, size, object offset, device), ...]`` of one key's ranges, each checked
        (as :meth:`_pieces`, and ``offset + size <= limit``); None, logged, if one is
        not."""
        try:
            if not len(ptrs) == len(lens) == len(offsets):
                raise E.InvalidArgumentError(f"{len(ptrs)} buffers, {len(lens)} sizes and "
                                             f"{len(offsets)} offsets must be as many")
            offs = [_size(o, "offset", minimum=0) for o in offsets]
        except (E.MooncakeError, TypeError, ValueError, OverflowError) as e:
            log.error("ranges of %r: %s", key, e)
            return None
        pieces = self._pieces(key, ptrs, lens, "ranges of")
        if pieces is None:
            return None
        for (p, n, _), off in zip(pieces, offs):
            if n > limit or off > limit - n:
                log.error("ranges of %r: [%d, +%d) runs past the object's %d bytes", key,
                          off, n, limit)
                return None
        return [(p, n, off, dev) for (p, n, dev), off in zip(pieces, offs)]

    def _session_guard(self, fn, what: str, keys):
        """Mooncake's session calls answer an empty list when the client is not set
        up; otherwise, as :meth:`_guard`, -600 for every key on a bad argument."""
        if self._cache is None:
            log.error("%s: the store is not set up (setup first)", what)
            return []
        return self._guard(fn, [INVALID_PARAMS] * len(keys))

    def get_offload_rpc_read_count(self) -> int:
        """How many reads went to this store's SSD offload tier (each read call that
        found a chunk there counts once). Mooncake counts its reads of offloaded
        objects, which it fetches by RPC from the client holding them; ours are read
        from this process's own SSD tier (module docstring)."""
        return self._offload_reads

    def alloc_from_mem_pool(self, size) -> int:
        """0, as Mooncake's real client answers: the shared memory pool is a dummy
        client's (after ``setup_dummy``); a real client registers its own buffers."""
        log.error("alloc_from_mem_pool: only a dummy client (setup_dummy) allocates from "
                  "the shared memory pool; register your own buffer with register_buffer")
        return 0

    def init_all(self, protocol: str, device_name: str,
                 mount_segment_size: int = 16 * _MIB) -> int:
        """Mooncake's shorthand for ``setup("localhost:12345", "127.0.0.1:2379",
        mount_segment_size, 1 GiB, protocol, device_name)`` (etcd at 127.0.0.1:2379);
        -600 when the store is set up already."""
        if self._cache is not None:
            log.error("init_all: the store is set up already")
            return INVALID_PARAMS
        return self.setup("localhost:12345", "127.0.0.1:2379", mount_segment_size,
                          1 << 30, protocol, device_name)

    # --- replica tasks: copy and move an object between stores ---------------------------
    def create_copy_task(self, key: str, targets) -> tuple:
        """Copy the object into each store named in ``targets`` (segment names: the
        ``get_hostname()`` of stores of this tenant, this one included). The copy is
        made before this returns (Mooncake's master hands it to a client and
        :meth:`query_task` follows it). ``(task id, 0)``, the id a pair of ints for
        :meth:`query_task`; or ``((0, 0), code)``: -600 for no targets or a name that is
        no store of the tenant, -704 for a missing object."""
        return self._guard(lambda: self._task(TaskType.REPLICA_COPY, key, None,
                                              list(targets)), ((0, 0), INVALID_PARAMS))

    def create_move_task(self, key: str, source: str, target: str) -> tuple:
        """Move the object's replica from store ``source`` to store ``target``: copied
        into ``target``, then dropped from ``source`` (the index then names
        ``target``), before this returns. ``(task id, 0)``, or ``((0, 0), code)``:
        -600 when ``source == target``, either is no store of the tenant, or
        ``source`` holds no replica; -704 for a missing object."""
        return self._guard(lambda: self._task(TaskType.REPLICA_MOVE, key, str(source),
                                              [str(target)]), ((0, 0), INVALID_PARAMS))

    def query_task(self, task_id) -> tuple:
        """``(QueryTaskResponse, 0)`` for a task this store created (``status``
        SUCCESS, or FAILED with ``message`` saying which store did not take the copy),
        ``(None, -1400)`` (``TASK_NOT_FOUND``) for another id."""
        try:
            tid = tuple(int(x) for x in task_id)
        except (TypeError, ValueError):
            tid = ()
        resp = self._tasks.get(tid)
        if resp is None:
            log.error("query_task: no task %r was created by this store", task_id)
            return None, TASK_NOT_FOUND
        return resp, OK

    def _task(self, kind, key: str, source, targets: list) -> tuple:
        self._c()
        none = (0, 0)
        me = self._eng.name if self._eng is not None and not self._segmentless else None
        peers = self._peers()
        known = set(peers) | ({me} if me else set())
        bad = [t for t in targets + ([source] if source is not None else [])
               if t not in known]
        if not targets or bad or source in targets:
            log.error("%s %r: %s", kind.name.lower(), key,
                      f"{bad} are not the segment names of stores of this tenant "
                      f"(their get_hostname()); running: {sorted(known)}" if bad else
                      "source and target are the same store" if targets else
                      "no target segments given")
            return none, INVALID_PARAMS
        obj = self._get_many([key])[0]
        if isinstance(obj, int):
            log.error("%s %r: the object does not exist", kind.name.lower(), key)
            return none, obj
        if source is not None and not self._holds(source, key, peers, me):
            log.error("move %r: store %s holds no replica of it", key, source)
            return none, INVALID_PARAMS
        failed = []
        for t in targets:
            if t == me:
                code = self._put_many([key], [obj], replace=source is not None,
                                      forward=False)[0]
            else:
                code = self._send_objects({t: peers[t]}, [key], [obj],
                                          source is not None).get(t, [TRANSFER_FAIL])[0]
            if code != OK:
                failed.append(f"{t}: {code}")
        if source is not None and not failed:
            if source == me:
                self._drop_here([key])
            else:
                self._call_peers({"op": "drop", "keys": [key]}, b"",
                                 {source: peers[source]})
        now = int(time.time() * 1000)
        resp = QueryTaskResponse()
        resp.id = tuple(int.from_bytes(os.urandom(8), "little") for _ in range(2))
        resp.type, resp.created_at_ms_epoch, resp.last_updated_at_ms_epoch = kind, now, now
        resp.status = TaskStatus.FAILED if failed else TaskStatus.SUCCESS
        resp.message = "; ".join(failed)
        resp.assigned_client = self._client_id
        self._tasks[resp.id] = resp
        return resp.id, OK

    def _holds(self, segment: str, key, peers: dict, me) -> bool:
        """Whether the store ``segment`` holds a copy of the object in its own pool."""
        if segment == me:
            return self._c().size_of(_key(key)) is not None
        got = self._call_peers({"op": "has", "keys": [str(key)]}, b"",
                               {segment: peers[segment]})
        return bool(got and got[0][1].get("found", [False])[0])

    def _drop_here(self, keys) -> None:
        """Drop this store's copies of the objects, keeping the index record of their
        first chunk (another store's copy, which the record names now, serves them)."""
        cache = self._c()
        heads = self._heads_of(list(keys), peek=True)
        for k, h in zip(keys, heads):
            if cache.size_of(_key(k)) is None:
                continue
            self._heads.pop(_key(k), None)
            cache.remove([_key(k)], index=False)
            if h is not None:
                cache.remove(_chunk_keys(k, h[1], n_chunks(h[0], h[3])))
        cache.flush_index()

    # --- refused: calls on Mooncake's master or its C++ objects ---------------------------
    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> dict:
        """Refused (``{"ret": -1012, "segment_ids": []}``): see :func:`_refuse`."""
        _refuse("mount_segment", _NO_MOUNT)
        return {"ret": NOT_SUPPORTED, "segment_ids": []}

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp",
                                   location: str = "") -> dict:
        """Refused (``ret`` -1012, no segment ids, ``allocated_size`` 0)."""
        _refuse("allocate_and_mount_segment", _NO_MOUNT)
        return {"ret": NOT_SUPPORTED, "segment_ids": [], "allocated_size": 0}

    def unmount_segment(self, segment_ids, grace_period_seconds: int = 0) -> int:
        """Refused: -1012."""
        return _refuse("unmount_segment", _NO_MOUNT)

    def unmount_and_free_segment(self, segment_ids, grace_period_seconds: int = 0) -> int:
        """Refused: -1012."""
        return _refuse("unmount_and_free_segment", _NO_MOUNT)

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """Refused: -1012."""
        return _refuse("unmount_local_disk_segment", _NO_MOUNT)

    def _get_pyclient_capsule(self):
        """Refused: None (Mooncake's capsule holds its C++ ``PyClient`` for its
        EngramStore; there is no such object here)."""
        _refuse("_get_pyclient_capsule", _NO_CPP)
        return None

    def _guard(self, fn, failure):
        try:
            return fn()
        except E.MooncakeError as e:
            log.error("%s", e)
            return failure
        except (TypeError, ValueError, OverflowError) as e:
            log.error("%s: %s", type(e).__name__, e)
            return failure


def _key(key) -> bytes:
    """A store key (str) as the pool's 16-byte key (BLAKE2b-128 of its UTF-8 form)."""
    if isinstance(key, bytes):
        key = key.decode("utf-8", "surrogateescape")
    if not isinstance(key, str) or not key:
        raise E.InvalidArgumentError(f"a store key is a non-empty str, got {key!r}")
    return as_key(key.encode())


def _pointer(value, what: str) -> int:
    """A raw pointer argument: a non-NULL integer below 2^64."""
    from ..arguments import U64_MAX, integer
    return integer(value, what, minimum=1, maximum=U64_MAX)


def _size(value, what: str, minimum: int) -> int:
    from ..arguments import integer
    return integer(value, what, minimum=minimum, maximum=1 << 62)


# --- raw pointers in CUDA device memory ------------------------------------------------
#: where a checked piece lies, for :func:`_copy`: host memory (else a CUDA ordinal)
HOST = -1
#: ``"ok"``: whether CUDA may be asked about pointers (cached once CUDA is loaded)
_CUDA_STATE: dict = {}


def _cuda_usable() -> bool:
    """Whether a pointer in no registered buffer may be CUDA device memory worth asking
    the driver about: the driver is loaded in this process already (by PyTorch, CuPy,
    ...; never loaded here: initialising CUDA in a process that never used it would
    break the CUDA of children it forks) and sees a GPU. Cached once CUDA is loaded, so
    a machine without CUDA pays one probe, and only on the path that refuses a pointer."""
    ok = _CUDA_STATE.get("ok")
    if ok is None:
        if not cuda.loaded():
            return False
        ok = _CUDA_STATE["ok"] = cuda.available()[0]
    return ok


def _cuda_extent(p: int) -> "tuple[int, int]":
    """(bytes from ``p`` to the end of its CUDA allocation, device ordinal), or
    ``(0, HOST)`` when ``p`` is not device memory (or CUDA is not in use)."""
    if not _cuda_usable():
        return 0, HOST
    try:
        is_dev, ordinal = cuda.pointer_info(p)
        if not is_dev:
            return 0, HOST
        base, size = cuda.allocation_range(p)
    except E.MooncakeError as e:
        log.debug("CUDA does not know %#x: %s", p, e)
        return 0, HOST
    return base + size - p, ordinal


def _cuda_device(p: int, n: int) -> int:
    """The ordinal of the CUDA device whose allocation holds ``[p, p + n)`` whole;
    :data:`HOST` when ``p`` is not device memory; InvalidArgumentError when it is but
    the range runs past the allocation (-600, as a range past a registered buffer)."""
    left, dev = _cuda_extent(p)
    if dev != HOST and n > left:
        raise E.InvalidArgumentError(
            f"[{p:#x}, +{n}) runs past the end of the CUDA allocation it starts in (cuda:"
            f"{dev}, {left} bytes from {p:#x}); pass sizes that fit in it")
    return dev


def _region_device(region) -> "int | None":
    """Where a registered buffer or engine region is: :data:`HOST`, a CUDA ordinal, or
    None for memory this store cannot copy (another kind of device)."""
    loc = str(getattr(region, "location", "cpu"))
    if loc.startswith("cpu"):
        return HOST
    if loc.startswith("cuda:") and loc[5:].isdigit():
        return int(loc[5:])
    return None


def _torch_sync(ordinal: int) -> None:
    """Wait for PyTorch's current stream on device ``ordinal`` (when this process uses
    PyTorch's CUDA): a tensor's bytes are read, or written, after the work queued before
    the call, as ``tensor.to("cpu")`` waits for it. ``cuMemcpy`` alone orders only with
    the legacy default stream, not with PyTorch's side streams."""
    torch = sys.modules.get("torch")
    cuda_mod = getattr(torch, "cuda", None)
    if cuda_mod is None or not cuda_mod.is_initialized():
        return
    cuda_mod.current_stream(ordinal).synchronize()


def _copy(dst: int, src: int, n: int, device: int) -> None:
    """Copy ``n`` bytes between a checked piece and the store's host memory: ``device``
    is where the piece lies (:meth:`MooncakeDistributedStore._where`). Host memory is
    ``memmove``d; a device pointer never reaches ``memmove`` (it would fault): CUDA
    memory is copied with ``cuMemcpy`` (unified addressing, host <-> device), after
    PyTorch's current stream, and the legacy stream is synchronized before returning,
    so the bytes are in place when the call answers (as Mooncake's ``cudaMemcpy``)."""
    if device == HOST:
        ctypes.memmove(dst, src, n)
        return
    if n <= 0:
        return
    with cuda.device(device):
        _torch_sync(device)
        cuda.memcpy(dst, src, n)
        cuda.synchronize_stream(cuda.LEGACY_STREAM, device)


#: stores set up and not closed: closed at interpreter exit (their finalizers cannot
#: start the closing thread then), so an unclosed store never keeps a process alive.
_LIVE: "weakref.WeakSet[MooncakeDistributedStore]" = weakref.WeakSet()


#: (local_hostname, metadata_server) -> [engine, stores using it]: the engines stores of
#: this process started. A second store set up with the segment name of a live one in
#: this process shares its engine (one engine per name: Mooncake's tests set up stores
#: named host:12345 in several test classes of one process, without closing the first;
#: a second engine under that name would replace, or be refused, the first's record)
_ENGINES: dict = {}
_ENGINES_LOCK = threading.Lock()


def _shared_engine(hostname: str, metadata: str):
    with _ENGINES_LOCK:
        entry = _ENGINES.get((hostname, metadata))
        if entry is None or getattr(entry[0], "get_engine", lambda: None)() is None:
            _ENGINES.pop((hostname, metadata), None)
            return None
        entry[1] += 1
    log.warning("store: segment name %s is in use by another store of this process; this "
                "store shares its transfer engine (the store directory lists the newer "
                "store under that name)", hostname)
    return entry[0]


def _release_engine(key, te) -> bool:
    """One store done with ``te``; True when it was the last (close the engine)."""
    with _ENGINES_LOCK:
        entry = _ENGINES.get(key)
        if entry is None or entry[0] is not te:
            return True
        entry[1] -= 1
        if entry[1] > 0:
            return False
        del _ENGINES[key]
        return True


@atexit.register
def _close_live() -> None:
    for store in list(_LIVE):
        _close_quietly(store)


def _close_quietly(store) -> None:
    try:
        store.close()
    except Exception:
        pass


def _weak_call(obj, name: str):
    """``getattr(obj, name)`` called through a weak reference to ``obj``."""
    ref = weakref.ref(obj)

    def call(*args):
        o = ref()
        if o is None:
            raise E.ClosedError("the store was closed")
        return getattr(o, name)(*args)
    return call


def _keep_listed(ref, stop) -> None:
    """Put a store's directory entry back if a concurrent update dropped it."""
    from .store_service import DIRECTORY_CHECK_S
    while not stop.wait(DIRECTORY_CHECK_S):
        store = ref()
        if store is None:
            return
        svc, d, eng = store._service, store._directory, store._eng
        del store
        if svc is None or d is None or eng is None:
            return
        try:
            if d.services().get(eng.name) != svc.addr:
                d.add(eng.name, svc.addr)
        except Exception as e:            # the metadata store is down: next time
            log.info("store directory: %s", e)
        del svc, d, eng


def _host_of(name: str) -> str:
    """The host of ``host``, ``host:port``, ``[v6]:port`` or a bare IPv6 address."""
    if name.startswith("["):
        return name[1:name.index("]")]
    if name.count(":") == 1:
        return name.split(":")[0] or "127.0.0.1"
    return name or "127.0.0.1"


def _chunk_keys(key, nonce: int, nch: int) -> list:
    """Pool keys of chunks 1 .. nch-1 of version ``nonce`` of object ``key``."""
    if isinstance(key, str):
        key = key.encode("utf-8", "surrogateescape")
    base = b"\0chunk\0" + bytes(key) + nonce.to_bytes(4, "little")
    return [as_key(base + j.to_bytes(4, "little")) for j in range(1, nch)]


def _parse_obj(first) -> "tuple[int, int, int] | None":
    """``(total bytes, nonce, chunk size)`` from an object's first chunk, or None."""
    if first is None or len(first) < _OBJ.size:
        return None
    magic, chunk, total, nonce = _OBJ.unpack_from(bytes(first[:_OBJ.size]))
    return (total, nonce, chunk) if magic == _OBJ_MAGIC and chunk > _OBJ.size else None


class _PutSession:
    """An object reserved by ``batch_put_session_start``: its bytes, staged here until
    ``batch_put_session_end`` stores them, and the put's config."""

    def __init__(self, data, config):
        self.data = data
        self.config = config
        self.writable = True


class _GetSession:
    """An object looked up by ``batch_get_session_start``: its size, version nonce,
    first chunk and chunk size, and when the session's lease ends."""

    def __init__(self, total: int, nonce: int, first, chunk: int, until: float):
        self.total, self.nonce, self.first, self.chunk, self.until = (total, nonce, first,
                                                                     chunk, until)


_NO_MOUNT = ("segments are mounted with Mooncake's master, which keeps the cluster's "
             "segment table; here each store's segment is its KV pool, sized by setup's "
             "global_segment_size (give a larger one, or run another store)")
_NO_CPP = ("it hands out a pointer to Mooncake's C++ client objects, which do not exist "
           "here; use the MooncakeDistributedStore methods")


def _refuse(name: str, why: str) -> int:
    """Log why ``name`` is refused and what to do instead; Mooncake's NOT_SUPPORTED."""
    log.error("%s is not supported by mooncake_te's store: %s", name, why)
    return NOT_SUPPORTED


def bind_to_numa_node(node: int) -> None:
    """Run the calling thread on NUMA node ``node``'s CPUs and prefer that node's memory
    for its allocations (Mooncake's module-level ``bind_to_numa_node``, which uses
    libnuma's ``numa_run_on_node`` and ``numa_set_preferred``). Here: the CPUs from
    ``/sys/devices/system/node/node<N>/cpulist`` through ``os.sched_setaffinity``, and
    ``set_mempolicy(MPOL_PREFERRED)`` for the node. As Mooncake's, it returns None and
    only logs a warning when NUMA is not available, the node does not exist, or a step
    fails."""
    root = "/sys/devices/system/node"
    try:
        nodes = sorted(int(d[4:]) for d in os.listdir(root)
                       if d.startswith("node") and d[4:].isdigit())
    except OSError:
        nodes = []
    if not nodes:
        log.warning("NUMA is not available on this system (no %s); binding skipped", root)
        return
    try:
        node = int(node)
    except (TypeError, ValueError):
        log.warning("Invalid NUMA node: %r", node)
        return
    if node not in nodes:
        log.warning("Invalid NUMA node: %d. Valid nodes: %s", node, nodes)
        return
    try:
        with open(f"{root}/node{node}/cpulist") as f:
            cpus = _cpulist(f.read())
        if not cpus:
            raise OSError(f"node {node} has no CPUs")
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        log.warning("binding to the CPUs of NUMA node %d failed: %s", node, e)
    nr = _SET_MEMPOLICY.get(os.uname().machine)
    if nr is None:
        log.warning("the memory preference for NUMA node %d is not set: no set_mempolicy "
                    "system call number known for %s", node, os.uname().machine)
        return
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(nr), ctypes.c_int(_MPOL_PREFERRED), mask,
                    ctypes.c_ulong(64 * len(mask) + 1)) != 0:
        log.warning("set_mempolicy(MPOL_PREFERRED, node %d) failed: %s", node,
                    os.strerror(ctypes.get_errno()))


_MPOL_PREFERRED = 1
#: set_mempolicy's system call number per machine (Linux)
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 236, "ppc64le": 261, "s390x": 270}


def _cpulist(text: str) -> set:
    """CPUs of a sysfs cpulist (``0-3,8,10-11``)."""
    cpus: set = set()
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.update(range(int(lo), int(hi) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


def _get_pyclient_from_wrapper(wrapper):
    """Refused: None (Mooncake's capsule of its C++ ``PyClient``, for EngramStore)."""
    _refuse("_get_pyclient_from_wrapper", _NO_CPP)
    return None


def get_alloc_func_addr() -> int:
    """Refused: 0 (Mooncake's address of its C hugepage allocator, for a pluggable
    allocator; there is no such C function here)."""
    _refuse("get_alloc_func_addr", _NO_CPP)
    return 0


def get_free_func_addr() -> int:
    """Refused: 0 (see :func:`get_alloc_func_addr`)."""
    _refuse("get_free_func_addr", _NO_CPP)
    return 0


def _same_len(keys, ptrs, sizes) -> None:
    if not (len(keys) == len(ptrs) == len(sizes)):
        raise E.InvalidArgumentError(f"{len(keys)} keys, {len(ptrs)} buffer lists and "
                                     f"{len(sizes)} size lists must be as many")


class DummyStore(DummyClient, MooncakeDistributedStore):
    """A :class:`MooncakeDistributedStore` after ``setup_dummy``: its calls run in the
    real client's process (:mod:`.dummy_client`). Built here, where both classes are
    seen, so that it is one of this module's stores and the dummy side need not import
    this module."""

    def close(self) -> int:
        """Leave the real client and free the shared buffers. 0. Idempotent."""
        _LIVE.discard(self)
        return DummyClient.close(self)


add_forwarders(DummyStore, MooncakeDistributedStore)


__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "ReplicaDescriptor",
           "MemoryDescriptor", "DiskDescriptor", "BufferHandle", "ReplicaStatus",
           "SoftPinAction", "ObjectDataType"]


from .buffer_pool import (BufferLease, BufferLeaseView, BufferPool,  # noqa: E402,F401
                          RegisteredBufferLease, RegisteredBufferLeaseView,
                          RegisteredBufferPool)

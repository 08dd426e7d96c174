# SPDX-License-Identifier: Apache-2.0
"""Mooncake's dummy client and the real client it talks to (issue 39).

In Mooncake a *real client* (the ``mooncake_client`` program) owns a share of the pool
and listens for *dummy clients* (``MooncakeDistributedStore.setup_dummy(mem_pool_size,
local_buffer_size, server_address)``): application processes that keep no memory of
their own in the pool and send every call to the real client. The dummy's buffers for the
zero-copy calls are shared memory the real client maps, so ``get_into`` lands in the
dummy's buffer without a copy through the control connection.

Here:

- :class:`RealClient` is a :class:`~mooncake_te.compat.store.MooncakeDistributedStore`
  set up with a segment plus a listener (:class:`~.store_service.StoreService`, TCP,
  ``127.0.0.1:50052`` by default) that serves dummies; ``mooncake-te compat client``,
  ``python -m mooncake.cli_client`` through the shim, and the ``main()`` here start one
  with Mooncake's ``mooncake_client`` flags.
- :class:`DummyStore` is what ``setup_dummy`` turns a store into: each store call is
  sent to the real client, which runs it on its store and answers. Bytes (``put``'s
  value, ``get``'s result) travel in the call. ``alloc_from_mem_pool(size)`` makes a
  shared-memory buffer (``memfd``), ``register_buffer`` of exactly such a buffer has the
  real client map it (``/proc/<dummy pid>/fd/<fd>``: the two must run on one host as
  one user, as Mooncake's shared memory needs) and register it with its engine; the
  pointer calls (``put_from``, ``get_into``, ``batch_*``, ``get_into_ranges``, the
  multi-buffer forms) then read and write the dummy's buffer in place. A pointer outside
  the dummy's registered buffers is refused by the real client (it never reads or writes
  its own memory for a dummy).

Wire: :mod:`.store_service`'s one call per connection (JSON header, payload). Arguments
are JSON; ``bytes``-like values are carried in the payload (``{"$b": i}``),
``ReplicateConfig`` as its fields. Like Mooncake's real client, the listener takes calls
from anyone who can reach its port: it binds ``127.0.0.1`` unless told otherwise.
"""
from __future__ import annotations

import argparse
import ctypes
import inspect
import logging
import mmap
import os
import sys
import threading
import uuid

import numpy as np

from .. import errors as E
from .store import (_LIVE, INTERNAL_ERROR, INVALID_PARAMS, OK, BufferHandle,
                    MooncakeDistributedStore, ReplicaDescriptor, ReplicateConfig, _parse_size)
from .store_service import call

log = logging.getLogger("mooncake_te.compat.store")

DEFAULT_PORT = 50052

#: store methods a dummy runs locally (the rest are sent to the real client)
_LOCAL = frozenset({"setup", "setup_dummy", "close", "alloc_from_mem_pool",
                    "register_buffer", "unregister_buffer", "get_hostname", "health_check"})
#: argument names that carry pointers into the dummy's memory, and their nesting depth
_POINTER_ARGS = {"buffer_ptr": 0, "buffer_ptrs": 1, "all_buffer_ptrs": 2}


# --- argument and result encoding ------------------------------------------------------
_RC_FIELDS = ("replica_num", "nof_replica_num", "dfs_replica_num", "with_soft_pin",
              "with_hard_pin", "preferred_segment", "preferred_segments",
              "prefer_alloc_in_same_node", "group_ids", "soft_pin_action", "soft_pin_ttl_ms",
              "data_type", "preferred_nof_segments")


def _encode(obj, blobs: list):
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return int(obj) if isinstance(obj, int) and not isinstance(obj, bool) else obj
    if isinstance(obj, ReplicateConfig):
        return {"$rc": {k: _encode(getattr(obj, k), blobs) for k in _RC_FIELDS
                        if hasattr(obj, k)}}
    if isinstance(obj, ReplicaDescriptor):
        if obj._mem is not None:
            b = obj._mem.buffer_descriptor
            return {"$rd": [obj._kind, b.segment_name, b.buffer_address_, b.size_, ""]}
        d = obj._disk
        return {"$rd": [obj._kind, "", 0, d.object_size if d else 0, d.file_path if d else ""]}
    if isinstance(obj, np.ndarray):
        blobs.append(np.ascontiguousarray(obj).view(np.uint8).reshape(-1).tobytes())
        return {"$a": len(blobs) - 1}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        blobs.append(bytes(obj))
        return {"$b": len(blobs) - 1}
    if isinstance(obj, (list, tuple)):
        return [_encode(x, blobs) for x in obj]
    if isinstance(obj, dict):
        return {"$d": [[_encode(k, blobs), _encode(v, blobs)] for k, v in obj.items()]}
    try:
        mv = memoryview(obj)           # any other buffer-protocol value (a put's bytes)
    except TypeError:
        raise E.InvalidArgumentError(
            f"a dummy client cannot send a {type(obj).__name__} to the real client "
            f"(bytes-like values, numbers, strings, lists and ReplicateConfig only)") from None
    blobs.append(mv.tobytes())
    return {"$b": len(blobs) - 1}


def _decode(obj, blobs: list):
    if isinstance(obj, list):
        return [_decode(x, blobs) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "$b" in obj:
        return blobs[int(obj["$b"])]
    if "$a" in obj:
        return np.frombuffer(bytearray(blobs[int(obj["$a"])]), np.uint8).view(BufferHandle)
    if "$rc" in obj:
        rc = ReplicateConfig()
        for k, v in obj["$rc"].items():
            if k in _RC_FIELDS:
                setattr(rc, k, _decode(v, blobs))
        return rc
    if "$rd" in obj:
        kind, seg, addr, size, path = obj["$rd"]
        return ReplicaDescriptor(str(kind), str(seg), int(addr), int(size), str(path))
    if "$d" in obj:
        return {_decode(k, blobs): _decode(v, blobs) for k, v in obj["$d"]}
    raise E.InvalidArgumentError(f"an unknown encoded value {sorted(obj)[:3]}")


def _pack(blobs: list) -> "tuple[list, bytes]":
    return [len(b) for b in blobs], b"".join(blobs)


def _unpack(sizes, payload: bytes) -> list:
    out, off, mv = [], 0, memoryview(payload)
    for n in sizes:
        n = int(n)
        out.append(bytes(mv[off:off + n]))
        off += n
    if off != len(payload):
        raise E.InvalidArgumentError("blob sizes do not add up to the payload")
    return out


# --- the real client ------------------------------------------------------------------
class _Mapping:
    """A dummy's shared-memory buffer mapped here and registered with the store."""

    def __init__(self, path: str, size: int):
        with open(path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), size)
        self._c = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._c)
        self.size = size

    def close(self) -> None:
        del self._c
        self.mm.close()


class RealClient:
    """A store with a segment that serves dummy clients on ``host:port``.

    ``store`` is a set-up :class:`~mooncake_te.compat.store.MooncakeDistributedStore`;
    :meth:`close` stops the listener, drops every dummy's mappings and closes the store.
    """

    def __init__(self, store, host: str = "127.0.0.1", port: int = DEFAULT_PORT):
        from .store_service import StoreService
        self.store = store
        self._lock = threading.Lock()
        #: client id -> {"pid": int, "maps": {dummy address: _Mapping}}
        self._clients: dict = {}
        self._service = StoreService(host, self._serve, port=port)
        self.addr = self._service.addr
        from ..auth import is_loopback
        if not is_loopback(host):
            log.warning("real client %s: dummy clients are served without authentication "
                        "(as Mooncake's real client does); bind an address only your "
                        "cluster reaches", self.addr)

    def close(self) -> None:
        self._service.close()
        with self._lock:
            ids = list(self._clients)
        for cid in ids:
            self._drop(cid)
        self.store.close()

    # -- per-client memory
    def _client(self, cid: str) -> dict:
        with self._lock:
            c = self._clients.get(cid)
        if c is None:
            raise E.InvalidArgumentError(f"dummy client {cid!r} did not say hello first")
        return c

    def _drop(self, cid: str) -> None:
        with self._lock:
            c = self._clients.pop(cid, None)
        if c is None:
            return
        for daddr, m in list(c["maps"].items()):
            self.store.unregister_buffer(m.addr)
            m.close()

    def _sweep(self) -> None:
        """Forget dummies whose process is gone (they ended without ``close``)."""
        with self._lock:
            gone = [cid for cid, c in self._clients.items() if not _alive(c["pid"])]
        for cid in gone:
            log.info("real client: dummy %s (pid %s) is gone; dropping its buffers", cid,
                     self._clients.get(cid, {}).get("pid"))
            self._drop(cid)

    def _translate(self, c: dict, p) -> int:
        try:
            p = int(p)
        except (TypeError, ValueError):
            return 0
        with self._lock:
            maps = list(c["maps"].items())
        for daddr, m in maps:
            if daddr <= p < daddr + m.size:
                return m.addr + (p - daddr)
        return 0                        # not the dummy's: the store refuses it

    def _translated(self, c: dict, value, depth: int):
        if depth == 0:
            return self._translate(c, value)
        return [self._translated(c, v, depth - 1) for v in value]

    # -- calls
    def _serve(self, head: dict, payload: bytes):
        op = head.get("op")
        if op == "hello":
            self._sweep()
            with self._lock:
                self._clients[str(head["client"])] = {"pid": int(head["pid"]), "maps": {}}
            return {"ok": 1, "segment": self.store.get_hostname()}, b""
        if op == "ping":
            self.store._c()
            return {"ok": 1}, b""
        if op == "bye":
            self._drop(str(head["client"]))
            return {"ok": 1}, b""
        c = self._client(str(head.get("client")))
        if op == "map":
            pid, fd, size = int(head["pid"]), int(head["fd"]), int(head["size"])
            daddr = int(head["addr"])
            if pid != c["pid"]:
                raise E.InvalidArgumentError("a buffer of another process")
            try:
                m = _Mapping(f"/proc/{pid}/fd/{fd}", size)
            except (OSError, ValueError) as e:
                raise E.InvalidArgumentError(
                    f"cannot map the dummy's buffer (pid {pid}, fd {fd}, {size} bytes): {e}; "
                    f"the dummy and the real client must run on one host as one user")
            rc = self.store.register_buffer(m.addr, size)
            if rc != 0:
                m.close()
                return {"rc": rc}, b""
            with self._lock:
                old = c["maps"].pop(daddr, None)
                c["maps"][daddr] = m
            if old is not None:
                self.store.unregister_buffer(old.addr)
                old.close()
            return {"rc": 0}, b""
        if op == "unmap":
            with self._lock:
                m = c["maps"].pop(int(head["addr"]), None)
            if m is None:
                return {"rc": -600}, b""
            rc = self.store.unregister_buffer(m.addr)
            m.close()
            return {"rc": rc}, b""
        if op == "call":
            name = str(head["method"])
            if name.startswith("_") or name in _LOCAL or name not in _forwarded():
                raise E.InvalidArgumentError(f"{name!r} is not a store call a dummy sends")
            blobs = _unpack(head.get("blobs", []), payload)
            args = _decode(head.get("args", []), blobs)
            kwargs = _decode(head.get("kwargs", {}), blobs)
            kwargs = kwargs if isinstance(kwargs, dict) else {}
            fn = getattr(self.store, name)
            bound = inspect.signature(fn).bind(*args, **kwargs)
            for arg, depth in _POINTER_ARGS.items():
                if arg in bound.arguments:
                    bound.arguments[arg] = self._translated(c, bound.arguments[arg], depth)
            result = fn(*bound.args, **bound.kwargs)
            out: list = []
            enc = _encode(result, out)
            sizes, data = _pack(out)
            return {"result": enc, "blobs": sizes}, data
        raise E.InvalidArgumentError(f"unknown real-client call {op!r}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _forwarded() -> frozenset:
    global _FORWARDED
    if _FORWARDED is None:
        _FORWARDED = frozenset(
            n for n, v in vars(MooncakeDistributedStore).items()
            if not n.startswith("_") and callable(v) and n not in _LOCAL)
    return _FORWARDED


_FORWARDED: "frozenset | None" = None


# --- the dummy client -----------------------------------------------------------------
class _Shm:
    """A buffer of ``alloc_from_mem_pool``: anonymous shared memory (memfd)."""

    def __init__(self, size: int):
        self.fd = os.memfd_create("mooncake-te-dummy", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self._c = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._c)
        self.size = size
        self.registered = False

    def close(self) -> None:
        del self._c
        try:
            self.mm.close()
        except BufferError:            # a view of it is still alive: the GC frees it
            pass
        os.close(self.fd)


def _failure(name: str, args: tuple, kwargs: dict):
    """What a call returns when the real client cannot be reached or fails."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    n = len(first) if isinstance(first, (list, tuple)) else 1
    if name == "get":
        return b""
    if name == "get_batch":
        return [b""] * n
    if name == "get_buffer":
        return None
    if name == "batch_get_buffer":
        return [None] * n
    if name == "get_into_ranges":
        dst = args[2] if len(args) > 2 else kwargs.get("all_dst_offsets", [])
        return [[[INTERNAL_ERROR] * len(d) for d in dsts] for dsts in dst]
    if name in ("batch_get_replica_desc",):
        return {}
    if name in ("get_replica_desc",):
        return []
    if name.startswith("batch_") or name.endswith("_batch"):
        if name in ("put_batch", "upsert_batch"):
            return INTERNAL_ERROR
        return [INTERNAL_ERROR] * n
    return INTERNAL_ERROR


def _make_forward(name: str):
    def forward(self, *args, **kwargs):
        return self._send(name, args, kwargs)
    forward.__name__ = name
    forward.__qualname__ = f"DummyStore.{name}"
    forward.__doc__ = f"``{name}`` run by the real client (setup_dummy)."
    return forward


def setup_dummy(store, mem_pool_size, local_buffer_size, server_address: str) -> int:
    """Make ``store`` a dummy client of the real client at ``server_address``; 0 or -1
    (logged)."""
    try:
        if store._cache is not None or getattr(store, "_real", None):
            raise E.InvalidArgumentError("this store is set up already; use a new "
                                         "MooncakeDistributedStore for setup_dummy")
        addr = str(server_address or "")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise E.InvalidArgumentError(f"server_address {server_address!r} is not "
                                         f"host:port of a real client (mooncake_client)")
        mem_pool_size, local_buffer_size = (_parse_size(mem_pool_size),
                                            _parse_size(local_buffer_size))
        cid = uuid.uuid4().hex
        rh, _ = call(addr, {"op": "hello", "client": cid, "pid": os.getpid()}, timeout=10.0)
    except (E.MooncakeError, ValueError, TypeError) as e:
        log.error("setup_dummy(%r): %s (is a real client — `mooncake-te compat client` or "
                  "Mooncake's mooncake_client — listening there?)", server_address, e)
        return -1
    store.__class__ = DummyStore
    store._real = addr
    store._cid = cid
    store._shm = {}
    store._mem_pool_size = mem_pool_size
    store._local_buffer = local_buffer_size
    store._real_segment = str(rh.get("segment", ""))
    _LIVE.add(store)
    log.info("dummy client of %s (segment %s)", addr, store._real_segment)
    return 0


class DummyStore(MooncakeDistributedStore):
    """A :class:`MooncakeDistributedStore` after ``setup_dummy``: its calls run in the
    real client's process (module docstring)."""

    _real: str = ""
    _cid: str = ""
    _shm: dict = {}

    def _send(self, name: str, args: tuple, kwargs: dict):
        if not self._real:
            log.error("%s: the dummy client is closed", name)
            return _failure(name, args, kwargs)
        try:
            blobs: list = []
            head = {"op": "call", "client": self._cid, "method": name,
                    "args": _encode(list(args), blobs),
                    "kwargs": _encode(kwargs, blobs)}
            sizes, payload = _pack(blobs)
            head["blobs"] = sizes
            rh, rp = call(self._real, head, payload, timeout=600.0)
            return _decode(rh.get("result"), _unpack(rh.get("blobs", []), rp))
        except E.MooncakeError as e:
            log.error("%s through the real client %s: %s", name, self._real, e)
            return _failure(name, args, kwargs)

    def setup(self, *a, **kw) -> int:
        log.error("setup: this store is a dummy client already (setup_dummy); use a "
                  "new MooncakeDistributedStore")
        return INTERNAL_ERROR

    def setup_dummy(self, *a, **kw) -> int:
        return self.setup()

    def get_hostname(self) -> str:
        """Empty: a dummy client has no segment (as in Mooncake)."""
        return ""

    def health_check(self) -> int:
        """0 while the real client answers, else -1."""
        if not self._real:
            return INTERNAL_ERROR
        try:
            call(self._real, {"op": "ping", "client": self._cid}, timeout=10.0)
            return OK
        except E.MooncakeError as e:
            log.error("health_check: %s", e)
            return INTERNAL_ERROR

    def alloc_from_mem_pool(self, size) -> int:
        """A shared-memory buffer of ``size`` bytes the real client can map when it
        is registered (``register_buffer(ptr, size)`` with exactly this pointer and
        size); its address, or 0."""
        try:
            n = int(size)
            if n <= 0:
                raise E.InvalidArgumentError(f"size {size!r} must be positive")
            shm = _Shm(n)
        except (E.MooncakeError, OSError, ValueError, TypeError) as e:
            log.error("alloc_from_mem_pool(%r): %s", size, e)
            return 0
        self._shm[shm.addr] = shm
        return shm.addr

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        shm = self._shm.get(int(buffer_ptr)) if isinstance(buffer_ptr, int) else None
        if shm is None or int(size) != shm.size:
            log.error("register_buffer(%r, %r): a dummy client registers buffers of "
                      "alloc_from_mem_pool, whole (their pointer and size): the real "
                      "client maps them", buffer_ptr, size)
            return INVALID_PARAMS
        try:
            rh, _ = call(self._real, {"op": "map", "client": self._cid,
                                      "pid": os.getpid(), "fd": shm.fd,
                                      "size": shm.size, "addr": shm.addr})
        except E.MooncakeError as e:
            log.error("register_buffer: %s", e)
            return INTERNAL_ERROR
        rc = int(rh.get("rc", INTERNAL_ERROR))
        shm.registered = rc == 0
        return rc

    def unregister_buffer(self, buffer_ptr: int) -> int:
        shm = self._shm.get(int(buffer_ptr)) if isinstance(buffer_ptr, int) else None
        if shm is None or not shm.registered:
            log.error("unregister_buffer(%r): not a registered buffer of "
                      "alloc_from_mem_pool", buffer_ptr)
            return INVALID_PARAMS
        try:
            rh, _ = call(self._real, {"op": "unmap", "client": self._cid,
                                      "addr": shm.addr})
        except E.MooncakeError as e:
            log.error("unregister_buffer: %s", e)
            return INTERNAL_ERROR
        shm.registered = False
        return int(rh.get("rc", INTERNAL_ERROR))

    def close(self) -> int:
        _LIVE.discard(self)
        real, self._real = self._real, ""
        if real:
            try:
                call(real, {"op": "bye", "client": self._cid}, timeout=10.0)
            except E.MooncakeError as e:
                log.info("close: %s", e)
        shm, self._shm = self._shm, {}
        for s in shm.values():
            s.close()
        return OK

    def __del__(self):
        if self._real and not sys.is_finalizing():
            try:
                threading.Thread(target=self.close, daemon=True).start()
            except RuntimeError:
                pass


for _name in _forwarded():
    setattr(DummyStore, _name, _make_forward(_name))


# --- mooncake_client --------------------------------------------------------------------
def main(argv=None) -> int:
    """``mooncake_client``: a real client for dummy clients (Mooncake's flags)."""
    p = argparse.ArgumentParser(
        prog="mooncake_client",
        description="A Mooncake Store real client on mooncake_te: contributes "
                    "--global_segment_size to the pool and serves dummy clients "
                    "(setup_dummy) on --host:--port.")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind host; host:port also names the store's segment")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="port dummy clients connect to (setup_dummy's server_address)")
    p.add_argument("--global_segment_size", default="4GB")
    p.add_argument("--local_buffer_size", default="16MB")
    p.add_argument("--master_server_address", default="127.0.0.1:50051")
    p.add_argument("--metadata_server", default="http://127.0.0.1:8080/metadata")
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--device_names", default="")
    p.add_argument("--threads", type=int, default=1, help="accepted (one thread per call)")
    p.add_argument("--tenant_id", default="default")
    a, rest = p.parse_known_args(argv)
    for r in rest:
        log.warning("mooncake_client: %s is accepted and not used", r)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    store = MooncakeDistributedStore()
    host = a.host
    rc = store.setup(host, a.metadata_server, a.global_segment_size, a.local_buffer_size,
                     a.protocol, a.device_names, a.master_server_address,
                     tenant_id=a.tenant_id)
    if rc != 0:
        print(f"mooncake_client: the store did not start ({rc}); see the log above",
              flush=True)
        return 1
    bind = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    try:
        real = RealClient(store, bind.strip("[]"), a.port)
    except OSError as e:
        print(f"mooncake_client: cannot listen on {bind}:{a.port}: {e}", flush=True)
        store.close()
        return 1
    print(f"mooncake_client: serving dummy clients on {real.addr} (segment "
          f"{store.get_hostname()})", flush=True)
    stop = threading.Event()
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        stop.wait(1.0)
    real.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

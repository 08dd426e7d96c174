# SPDX-License-Identifier: Apache-2.0
"""Mooncake's dummy client and the real client it talks to (issue 39).

In Mooncake a *real client* (the ``mooncake_client`` program) owns a share of the pool
and listens for *dummy clients* (``MooncakeDistributedStore.setup_dummy(mem_pool_size,
local_buffer_size, server_address)``): application processes that keep no memory of
their own in the pool and send every call to the real client. The dummy's buffers for the
zero-copy calls are shared memory the real client maps, so ``get_into`` lands in the
dummy's buffer without a copy through the control connection.

Here:

- :class:`RealClient` (this module) is a
  :class:`~mooncake_te.compat.store.MooncakeDistributedStore` set up with a segment
  plus a listener (:class:`~.store_service.StoreService`, TCP, ``127.0.0.1:50052`` by
  default) that serves dummies; ``mooncake-te compat client``, ``python -m
  mooncake.cli_client`` through the shim, and the ``main()`` here start one with
  Mooncake's ``mooncake_client`` flags. It maps each dummy's registered buffers and
  runs the dummy's calls on its store, translating the dummy's pointers into the
  mappings: a pointer outside the dummy's registered buffers is refused (the real client
  never reads or writes its own memory for a dummy).
- :class:`DummyStore` is what ``setup_dummy`` turns a store into (built in
  :mod:`.store`, its behaviour and the wire encoding in :mod:`.dummy_client`): each
  store call is sent to the real client, bytes in the call, pointers into shared memory
  the real client maps.

This module imports the store; the store imports only the dummy side
(:mod:`.dummy_client`), so the two do not import each other.

Wire: :mod:`.store_service`'s one call per connection (JSON header, payload;
:mod:`.dummy_client` encodes the arguments and results). Like Mooncake's real client,
the listener takes calls from anyone who can reach its port: it binds ``127.0.0.1``
unless told otherwise.
"""
from __future__ import annotations

import argparse
import ctypes
import inspect
import logging
import mmap
import os
import threading

from .. import errors as E
from .dummy_client import _decode, _encode, _pack, _unpack
from .store import DummyStore, MooncakeDistributedStore

log = logging.getLogger("mooncake_te.compat.store")

DEFAULT_PORT = 50052

__all__ = ["DEFAULT_PORT", "DummyStore", "RealClient", "main", "setup_dummy"]


def setup_dummy(store, mem_pool_size, local_buffer_size, server_address: str) -> int:
    """``store.setup_dummy(mem_pool_size, local_buffer_size, server_address)`` (this
    module's name for it before the dummy side moved to :mod:`.dummy_client`)."""
    return MooncakeDistributedStore.setup_dummy(store, mem_pool_size, local_buffer_size,
                                                server_address)

#: argument names that carry pointers into the dummy's memory, and their nesting depth
_POINTER_ARGS = {"buffer_ptr": 0, "metadata_buffer_ptr": 0, "buffer_ptrs": 1,
                 "all_buffer_ptrs": 2}


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
            if name not in DummyStore.forwarded:
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

# SPDX-License-Identifier: Apache-2.0
"""``mooncake.engine`` on mooncake_te: same class, methods, arguments and return codes.

A program written for Mooncake's Python API changes one line::

    from mooncake.engine import TransferEngine        # before
    from mooncake_te.compat import TransferEngine     # after

Facts about the original come from ``mooncake-integration/transfer_engine/
transfer_engine_py.{h,cpp}`` in kvcache-ai/Mooncake (the pybind11 module, at
``3b5a594``). As there, data-path methods return
status codes instead of raising (0 / -1; a batch id, 0 on failure); the reason for a
failure is logged on the ``mooncake_te.compat`` logger, so a -1 is never silent.
Arguments of the wrong Python type raise ``TypeError``, as pybind11 does.

Where we differ from the original on purpose (``docs/compat.md`` has the full list):
local memory must be registered (Mooncake's TCP transport reads and writes any local
address); calls made before ``initialize`` return an error code instead of crashing;
unknown batch ids and bad frees are refused instead of corrupting memory.
"""
from __future__ import annotations

import ctypes
import enum
import functools
import itertools
import json
import logging
import operator
import os
import threading
import time

import numpy as np

from .. import errors as E
from ..auth import is_loopback
from ..batch import Op
from ..engine import TransferEngine as _Engine
from ..metadata import framing, split_host_port
from ..metadata.url import parse as parse_metadata_url
from .allocator import ManagedAllocator, unmap

log = logging.getLogger("mooncake_te.compat")

# Module attributes of mooncake.engine. This build moves host memory over TCP only.
SUPPORT_CUDA = False
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False
P2PHANDSHAKE = "P2PHANDSHAKE"


class TransferOpcode(enum.IntEnum):
    """Direction of a transfer, numbered as Mooncake's (``enum class TransferOpcode {
    READ = 0, WRITE = 1 }``; note that ``mooncake_te.Op`` numbers them differently)."""
    Read = 0
    Write = 1


# pybind11's export_values() also puts the members at module level.
Read, Write = TransferOpcode.Read, TransferOpcode.Write


class TransferNotify:
    """A notification: ``name`` (chosen by the sender) and ``msg``.

    Parameters
    ----------
    name : str
    msg : str
    """

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def __eq__(self, other) -> bool:
        if not isinstance(other, TransferNotify):
            return NotImplemented
        return (self.name, self.msg) == (other.name, other.msg)

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def _transfer_timeout() -> float:
    """Seconds a transfer may take before the per-byte allowance: ``MC_TRANSFER_TIMEOUT``
    read as C ``atoi`` does, at least 5, default 30 (``TransferEnginePy`` constructor)."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if raw is None:
        return 30.0
    digits = ""
    for i, ch in enumerate(raw.strip()):
        if ch.isdigit() or (i == 0 and ch in "+-"):
            digits += ch
        else:
            break
    try:
        value = int(digits)
    except ValueError:
        value = 0
    return float(max(5, value))


# --- argument conversion: wrong types are TypeError, as pybind11 makes them -------------
class _ArgumentError(TypeError):
    pass


def _uint(value, what: str) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        raise _ArgumentError(f"{what} must be an int, got {type(value).__name__}") from None
    if n < 0:
        raise _ArgumentError(f"{what} must be non-negative, got {n}")
    return n


def _uint_array(values, what: str) -> np.ndarray:
    if isinstance(values, (str, bytes)):
        raise _ArgumentError(f"{what} must be a list of ints, got {type(values).__name__}")
    try:
        a = np.asarray(values)
    except (TypeError, ValueError):
        raise _ArgumentError(f"{what} must be a list of ints") from None
    if a.size == 0:
        return np.empty(0, np.uint64)
    if a.dtype.kind == "O":           # ints above 2**63 or a mix numpy cannot type
        try:
            a = np.array([operator.index(v) for v in a.reshape(-1)], dtype=np.uint64)
        except (TypeError, OverflowError):
            raise _ArgumentError(f"{what} must be a list of non-negative ints") from None
    elif a.dtype.kind not in "iu" or a.ndim != 1:
        raise _ArgumentError(f"{what} must be a flat list of ints, got {a.dtype} "
                             f"values of shape {a.shape}")
    elif a.dtype.kind == "i" and (a < 0).any():
        raise _ArgumentError(f"{what} must be non-negative")
    return np.ascontiguousarray(a, dtype=np.uint64)


def _str(value, what: str) -> str:
    if not isinstance(value, str):
        raise _ArgumentError(f"{what} must be a str, got {type(value).__name__}")
    return value


def _op(opcode) -> Op:
    if isinstance(opcode, Op):          # mooncake_te's own enum, already unambiguous
        return opcode
    try:
        code = TransferOpcode(operator.index(opcode))
    except (TypeError, ValueError):
        raise _ArgumentError(f"opcode must be TransferOpcode.Read or TransferOpcode.Write, "
                             f"got {opcode!r}") from None
    return Op.READ if code == TransferOpcode.Read else Op.WRITE


def _split_hostname(local_hostname: str) -> tuple[str, int]:
    """``"host"``, ``"host:port"``, ``"[v6]:port"`` or a bare IPv6 address -> (host, port);
    port 0 when none is given."""
    s = local_hostname.strip()
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif s.count(":") == 1:
        host, _, port = s.partition(":")
    else:
        host, port = s, ""
    return host, int(port) if port.isdigit() else 0


_STATUS = object()      # guard: return the error's own (negative) Mooncake status code


def _guard(failure):
    """Turn exceptions into Mooncake's return codes and log why.

    ``failure`` is the value returned on error; with ``_STATUS`` the exception's
    ``.status`` (Mooncake's code, e.g. -7 for overlapping registrations) is returned, as
    ``registerLocalMemory`` does. TypeErrors about argument types pass through.
    """
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except _ArgumentError:
                raise
            except E.MooncakeError as e:
                hint = ""
                if isinstance(e, E.AddressNotRegisteredError) and "eng.register" in str(e):
                    hint = " (with this API: register_memory(addr, length), or use " \
                           "allocate_managed_buffer(length), whose memory is registered)"
                log.error("%s: %s%s", fn.__name__, e, hint)
                return e.status if failure is _STATUS else failure
            except Exception as e:        # no exception escapes, as in the original
                log.error("%s: %s: %s", fn.__name__, type(e).__name__, e)
                return -1 if failure is _STATUS else failure
        return wrapper
    return deco


class _Pending:
    """An async batch handed out by id: the batch (None when empty) and our deadline."""

    __slots__ = ("batch", "deadline_ns")

    def __init__(self, batch, deadline_ns: int):
        self.batch = batch
        self.deadline_ns = deadline_ns


class TransferEngine:
    """Drop-in for ``mooncake.engine.TransferEngine``.

    Create it, then call :meth:`initialize` (0 on success). Addresses are plain ints;
    a peer is named by its segment name (``"host:rpc_port"`` with ``P2PHANDSHAKE``).

    Examples
    --------
    >>> te = TransferEngine()                                         # doctest: +SKIP
    >>> te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")         # doctest: +SKIP
    0
    >>> buf = te.allocate_managed_buffer(1 << 20)                     # doctest: +SKIP
    >>> te.transfer_sync_write(peer, buf, peer_addr, 4096)            # doctest: +SKIP
    0
    """

    TransferOpcode = TransferOpcode

    def __init__(self):
        self._eng: _Engine | None = None
        self._alloc: ManagedAllocator | None = None
        self._p2p = False
        self._rpc_port = 0
        self._timeout = _transfer_timeout()
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._pid = os.getpid()

    def __repr__(self) -> str:
        if self._eng is None:
            return "<mooncake_te.compat.TransferEngine (not initialized)>"
        return f"<mooncake_te.compat.TransferEngine {self._eng.name}>"

    # --- lifetime (Mooncake frees everything in the destructor; we add close()) ----------
    def close(self) -> None:
        """Stop the engine and release managed buffers. Idempotent; also run on garbage
        collection, as the original's destructor does."""
        eng, self._eng = self._eng, None
        alloc, self._alloc = self._alloc, None
        with self._lock:
            self._pending.clear()
        if eng is None:
            return
        maps = alloc.release_all() if alloc is not None else []
        # Close first: once the engine stops serving, no peer can touch the mappings.
        eng.close()
        for address, length in maps:
            unmap(address, length)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_pid", None) != os.getpid():
            return          # a forked child must not tear down its parent's engine
        try:
            self.close()
        except Exception:
            pass

    def _engine(self) -> _Engine:
        if self._eng is None:
            raise E.InvalidArgumentError("the engine is not initialized; call "
                                         "initialize(local_hostname, metadata_server, "
                                         "protocol, device_name) first and check it returns 0")
        return self._eng

    # --- setup -------------------------------------------------------------------------
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Start the engine. Returns 0, or -1 (the reason is logged).

        Parameters
        ----------
        local_hostname : str
            ``"host"`` or ``"host:port"``. With ``P2PHANDSHAKE`` the segment is named
            ``"<host>:<rpc port>"`` and the port given here is not used (see
            :meth:`get_rpc_port`); with a metadata server the segment is named
            ``local_hostname`` verbatim.
        metadata_server : str
            ``"P2PHANDSHAKE"`` (no server), ``"scheme://address"`` (etcd, redis, http),
            or a bare ``"host:port"``, which means etcd.
        protocol : str
            ``"tcp"`` uses TCP; anything else lets the engine pick the best transport
            it has (Mooncake's classic build ignores it the same way, reference §0.3).
        device_name : str
            Comma-separated RDMA device allow-list, or ``""``.
        """
        md = _str(metadata_server, "metadata_server")
        url = parse_metadata_url(md)
        mtype, server = ("", P2PHANDSHAKE) if url.is_p2p else (url.scheme, url.address)
        return self.initialize_ext(local_hostname, server, protocol, device_name, mtype)

    @_guard(-1)
    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """:meth:`initialize` with the metadata type given apart: the connection string
        is ``metadata_type://metadata_server`` unless the server is ``P2PHANDSHAKE`` or
        already has a scheme. Returns 0 or -1."""
        local_hostname = _str(local_hostname, "local_hostname")
        metadata_server = _str(metadata_server, "metadata_server")
        protocol = _str(protocol or "", "protocol")
        metadata_type = _str(metadata_type or "", "metadata_type")
        if protocol == "xgmi":
            raise E.InvalidArgumentError("protocol 'xgmi' is not exposed in the Python API "
                                         "(as in Mooncake); use 'tcp'")
        url = parse_metadata_url(metadata_server)
        if url.is_p2p and metadata_server.strip():
            conn = "p2p"
        elif url.explicit:
            conn = metadata_server
        else:
            conn = f"{metadata_type}://{metadata_server}"
        host, port = _split_hostname(local_hostname)
        if conn == "p2p":
            # P2PHANDSHAKE: a random RPC port, and the segment is named after it
            # (TransferEngineImpl::init).
            kwargs = dict(metadata="p2p", host=host or None, port=0)
        elif os.environ.get("MC_LEGACY_RPC_PORT_BINDING"):
            kwargs = dict(metadata=conn, name=local_hostname, host=host or None, port=port)
        else:
            # Mooncake's "new RPC mapping": the RPC address is MC_TCP_BIND_ADDRESS or the
            # first LAN address and the port is random, whatever local_hostname says;
            # the engine's defaults are exactly that. Except for a loopback
            # local_hostname (issue #35): whoever writes 127.0.0.1 means this host only,
            # and listening on the LAN would open the ports to every host there.
            kwargs = dict(metadata=conn, name=local_hostname, port=0)
            if host and is_loopback(host) and not os.environ.get("MC_TCP_BIND_ADDRESS"):
                kwargs["host"] = host
        if protocol not in ("", "tcp", "rdma"):
            log.warning("protocol %r: this engine serves tcp (and rdma where available); "
                        "letting it pick", protocol)
        devices = [d.strip() for d in (device_name or "").split(",") if d.strip()] or None
        eng = _Engine(protocol="tcp" if protocol == "tcp" else None, devices=devices,
                      **kwargs)
        if self._eng is not None:
            log.warning("initialize: replacing the engine %s (as Mooncake does)",
                        self._eng.name)
            self.close()
        self._eng = eng
        self._p2p = conn == "p2p"
        self._rpc_port = eng.descriptor().rpc_port
        self._alloc = ManagedAllocator(
            lambda a, n: eng.internal.register_address(a, n, "auto"),
            lambda a: eng.unregister(a))
        log.info("initialized segment %s (%s, metadata %s)", eng.name, eng.protocol, conn)
        return 0

    def get_rpc_port(self) -> int:
        """The RPC (handshake) port; with ``P2PHANDSHAKE`` the segment name is
        ``"<host>:<this port>"``. -1 before :meth:`initialize`."""
        if self._eng is None:
            log.error("get_rpc_port: the engine is not initialized")
            return -1
        return self._rpc_port

    def get_engine(self):
        """The underlying :class:`mooncake_te.TransferEngine` (None before initialize)."""
        return self._eng

    # --- memory ------------------------------------------------------------------------
    @staticmethod
    def _location(location) -> str:
        location = _str(location, "location")
        return "auto" if location in ("*", "") else location

    @_guard(_STATUS)
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register ``capacity`` bytes at ``buffer_addr`` that you keep alive.

        Returns 0, or Mooncake's negative code: -1 invalid (zero length, null address,
        non-host location), -7 overlaps a registered region.
        """
        addr = _uint(buffer_addr, "buffer_addr")
        cap = _uint(capacity, "capacity")
        self._engine().internal.register_address(addr, cap, self._location(location))
        return 0

    @_guard(_STATUS)
    def unregister_memory(self, buffer_addr: int) -> int:
        """Withdraw a region (waits for I/O on it). 0, or -3 when nothing is registered
        at ``buffer_addr``."""
        self._engine().unregister(_uint(buffer_addr, "buffer_addr"))
        return 0

    @_guard(_STATUS)
    def batch_register_memory(self, buffer_addresses, capacities, location: str = "*") -> int:
        """Register several regions, all or none (as ``registerLocalMemoryBatch``)."""
        addrs = _uint_array(buffer_addresses, "buffer_addresses")
        caps = _uint_array(capacities, "capacities")
        loc = self._location(location)
        eng = self._engine()
        if len(addrs) != len(caps):
            raise E.InvalidArgumentError(f"{len(addrs)} buffer_addresses but {len(caps)} "
                                         f"capacities")
        if len(caps) and not caps.all():
            raise E.InvalidArgumentError(f"capacity of buffer {int(np.argmin(caps))} is 0")
        order = np.argsort(addrs, kind="stable")
        a, c = addrs[order], caps[order]
        clash = np.nonzero(a[1:] - a[:-1] < c[:-1])[0]
        if len(clash):
            i = int(clash[0])
            raise E.AddressOverlappedError(f"buffers at {int(a[i]):#x} (+{int(c[i])}) and "
                                           f"{int(a[i + 1]):#x} overlap")
        done = []
        try:
            for addr, cap in zip(addrs.tolist(), caps.tolist()):
                done.append(eng.internal.register_address(addr, cap, loc))
        except BaseException:
            for r in reversed(done):
                try:
                    eng.unregister(r)
                except E.MooncakeError as e:
                    log.warning("batch_register_memory: rollback of %#x: %s", r.address, e)
            raise
        return 0

    @_guard(_STATUS)
    def batch_unregister_memory(self, buffer_addresses) -> int:
        """Withdraw several regions; tries every one and returns the first error."""
        eng = self._engine()
        first = 0
        for addr in _uint_array(buffer_addresses, "buffer_addresses").tolist():
            try:
                eng.unregister(addr)
            except E.MooncakeError as e:
                log.error("batch_unregister_memory: %s", e)
                first = first or e.status
        return first

    @_guard(0)
    def allocate_managed_buffer(self, length: int) -> int:
        """Address of ``length`` bytes of registered host memory, or 0.

        Served from 16 size classes (8 KiB ... 256 MiB) carved from registered 2 GiB
        chunks; larger requests are mapped and registered on their own.
        """
        n = _uint(length, "length")
        self._engine()
        return self._alloc.allocate(n)

    @_guard(-1)
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Return a block from :meth:`allocate_managed_buffer`. 0, or -1 when the
        address was not allocated there or was freed already."""
        addr = _uint(buffer_addr, "buffer_addr")
        n = _uint(length, "length")
        self._engine()
        try:
            note = self._alloc.free(addr, n)
        except KeyError:
            raise E.InvalidArgumentError(f"{addr:#x} was not returned by "
                                         f"allocate_managed_buffer, or was freed already") \
                from None
        if note:
            log.warning("free_managed_buffer: %s; freed the whole block", note)
        return 0

    @_guard(-1)
    def write_bytes_to_buffer(self, dest_address: int, src_ptr, length: int) -> int:
        """Copy ``length`` bytes of ``src_ptr`` (bytes; a str is UTF-8 encoded) to local
        memory at ``dest_address``. 0, or -1 when ``length`` exceeds the data given."""
        addr = _uint(dest_address, "dest_address")
        n = _uint(length, "length")
        if isinstance(src_ptr, str):
            src_ptr = src_ptr.encode()
        try:
            data = src_ptr if isinstance(src_ptr, bytes) else bytes(memoryview(src_ptr))
        except TypeError:
            raise _ArgumentError(f"src_ptr must be bytes, got {type(src_ptr).__name__}") \
                from None
        if n > len(data):
            raise E.InvalidArgumentError(f"length {n} is more than the {len(data)} bytes given")
        if n and not addr:
            raise E.InvalidArgumentError("dest_address is 0")
        ctypes.memmove(addr, data, n)
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes of local memory at ``source_address``."""
        addr = _uint(source_address, "source_address")
        n = _uint(length, "length")
        if n and not addr:
            log.error("read_bytes_from_buffer: source_address is 0")
            return b""
        return ctypes.string_at(addr, n)

    # --- segments ----------------------------------------------------------------------
    @_guard(0)
    def get_first_buffer_address(self, segment_name: str) -> int:
        """Address of the first buffer ``segment_name`` registered, or 0 (none, or the
        segment cannot be found). Asks the peer afresh each time."""
        name = _str(segment_name, "segment_name").lstrip("/")
        eng = self._engine()
        if name == eng.name:
            buffers = eng.descriptor().buffers
        else:
            buffers = eng.open_segment(name, refresh=True).buffers
        return buffers[0].address if buffers else 0

    def warmup_efa_segment(self, segment_name: str) -> int:
        """No-op (EFA is not built); 0 as in the original's non-EFA builds."""
        _str(segment_name, "segment_name")
        return 0

    @_guard(-1)
    def send_probe(self, peer_server_name: str) -> int:
        """Ask the peer's RPC port whether it is alive. 0 alive, -1 not reachable."""
        name = _str(peer_server_name, "peer_server_name").lstrip("/")
        eng = self._engine()
        if self._p2p:
            host, port = split_host_port(name)
        else:
            desc = eng.open_segment(name, refresh=True).descriptor
            host, port = desc.host, desc.rpc_port
        framing.request(host, port, framing.PROBE, b"{}", min(self._timeout, 5.0))
        return 0

    # --- transfers ---------------------------------------------------------------------
    def _submit(self, target: str, buffers, peers, lengths, op: Op):
        """Start one batch; None for an empty one (it completes at once)."""
        src = _uint_array(buffers, "buffers")
        dst = _uint_array(peers, "peer_buffer_addresses")
        lens = _uint_array(lengths, "lengths")
        eng = self._engine()
        if not (len(src) == len(dst) == len(lens)):
            raise E.InvalidArgumentError(f"buffers ({len(src)}), peer_buffer_addresses "
                                         f"({len(dst)}) and lengths ({len(lens)}) must "
                                         f"have the same size")
        if not len(src):
            return None
        return eng.submit_arrays(op, target, src, dst, lens, timeout=self._timeout)

    def _notify(self, target: str, notify) -> None:
        """Deliver ``notify`` the way Mooncake does: a Notify frame ``{"name",
        "notify_msg"}`` to the peer's RPC port, after the data landed."""
        try:
            name, msg = notify.name, notify.msg
        except AttributeError:
            raise _ArgumentError(f"notify must be a TransferNotify, got "
                                 f"{type(notify).__name__}") from None
        if isinstance(msg, (bytes, bytearray)):
            msg = bytes(msg).decode("utf-8", "surrogateescape")
        # The RPC server (metadata/rpc.py) reads notify_msg as UTF-8 text, as Mooncake's
        # peers send it; test_notify_after_data sends non-ASCII text to keep that true.
        wire = str(msg)
        desc = self._engine().open_segment(target).descriptor
        framing.request(desc.host, desc.rpc_port, framing.NOTIFY,
                        json.dumps({"name": str(name), "notify_msg": wire}).encode(),
                        min(self._timeout, 5.0))

    def transfer_sync_write(self, target_hostname: str, buffer: int,
                            peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        """Write ``length`` local bytes at ``buffer`` to ``peer_buffer_address`` of
        ``target_hostname``; returns 0 once the peer has them, else -1."""
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length,
                                  TransferOpcode.Write, None, transport_hint)

    def transfer_sync_read(self, target_hostname: str, buffer: int,
                           peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        """Read ``length`` bytes at ``peer_buffer_address`` of ``target_hostname`` into
        local ``buffer``. 0 or -1."""
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length,
                                  TransferOpcode.Read, None, transport_hint)

    @_guard(-1)
    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode, notify: TransferNotify | None = None,
                      transport_hint: str = "") -> int:
        """One blocking transfer, then ``notify`` (if given) to the target. 0 or -1.

        ``transport_hint`` is accepted and ignored, as on Mooncake's classic engine.
        """
        target = _str(target_hostname, "target_hostname")
        src = _uint(buffer, "buffer")
        dst = _uint(peer_buffer_address, "peer_buffer_address")
        n = _uint(length, "length")
        op = _op(opcode)
        eng = self._engine()
        if op == Op.WRITE:
            eng.write(target, src, dst, n, timeout=self._timeout)
        else:
            eng.read(target, src, dst, n, timeout=self._timeout)
        if notify is not None:
            self._notify(target, notify)
        return 0

    def batch_transfer_sync_write(self, target_hostname: str, buffers,
                                  peer_buffer_addresses, lengths,
                                  transport_hint: str = "") -> int:
        """Write many blocks to one target and wait for all. 0 or -1."""
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses,
                                        lengths, TransferOpcode.Write, None, transport_hint)

    def batch_transfer_sync_read(self, target_hostname: str, buffers,
                                 peer_buffer_addresses, lengths,
                                 transport_hint: str = "") -> int:
        """Read many blocks from one target and wait for all. 0 or -1."""
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses,
                                        lengths, TransferOpcode.Read, None, transport_hint)

    @_guard(-1)
    def batch_transfer_sync(self, target_hostname: str, buffers, peer_buffer_addresses,
                            lengths, opcode, notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        """One batch of ``len(buffers)`` requests, waited for; then ``notify``. 0 or -1."""
        target = _str(target_hostname, "target_hostname")
        op = _op(opcode)
        batch = self._submit(target, buffers, peer_buffer_addresses, lengths, op)
        if batch is not None:
            batch.wait()
        if notify is not None:
            self._notify(target, notify)
        return 0

    def batch_transfer_async_write(self, target_hostname: str, buffers,
                                   peer_buffer_addresses, lengths,
                                   transport_hint: str = "") -> int:
        """Start writing many blocks; a batch id for :meth:`get_batch_transfer_status`,
        0 on failure."""
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses,
                                         lengths, TransferOpcode.Write, transport_hint)

    def batch_transfer_async_read(self, target_hostname: str, buffers,
                                  peer_buffer_addresses, lengths,
                                  transport_hint: str = "") -> int:
        """Start reading many blocks; a batch id, 0 on failure."""
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses,
                                         lengths, TransferOpcode.Read, transport_hint)

    @_guard(0)
    def batch_transfer_async(self, target_hostname: str, buffers, peer_buffer_addresses,
                             lengths, opcode, transport_hint: str = "") -> int:
        """Start a batch; its id (never 0), or 0 on failure."""
        target = _str(target_hostname, "target_hostname")
        op = _op(opcode)
        return self._track(self._submit(target, buffers, peer_buffer_addresses, lengths, op),
                           lengths)

    def _track(self, batch, lengths) -> int:
        # Our own deadline is taken after the engine's, with the same formula (timeout +
        # 1 ns per byte, as Mooncake's wrapper), so once it passes the engine's has too.
        nbytes = int(np.sum(lengths, dtype=np.uint64)) if len(lengths) else 0
        deadline = time.monotonic_ns() + int(self._timeout * 1e9) + nbytes
        with self._lock:
            bid = next(self._ids)
            self._pending[bid] = _Pending(batch, deadline)
        return bid

    @_guard(-1)
    def get_batch_transfer_status(self, batch_ids) -> int:
        """Wait for every batch in ``batch_ids``: 0 when all completed, -1 when one
        failed or timed out. The ids are released either way (as in the original, the
        rest are given up once one fails)."""
        ids = [_uint(b, "batch id") for b in batch_ids]
        with self._lock:
            entries = [(b, self._pending.pop(b, None)) for b in ids]
        failure = None
        for bid, entry in entries:
            if failure is not None:
                if entry is not None and entry.batch is not None:
                    entry.batch.cancel()
                continue
            if entry is None:
                failure = f"unknown batch id {bid} (0 means the submit failed; an id is " \
                          f"released once its status was reported)"
                continue
            if entry.batch is None:
                continue
            try:
                entry.batch.wait()
            except E.MooncakeError as e:
                failure = f"batch {bid}: {e}"
        if failure is not None:
            log.error("get_batch_transfer_status: %s", failure)
            return -1
        return 0

    @_guard(0)
    def transfer_submit_write(self, target_hostname: str, buffer: int,
                              peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """Start one write; an id for :meth:`transfer_check_status`, or 0 when the
        target cannot be opened or the submit fails (Mooncake PR #2433: ids are
        unsigned, so 0 is the failure value; before it, -1 came back as 2**64-1)."""
        target = _str(target_hostname, "target_hostname")
        lens = [_uint(length, "length")]
        batch = self._submit(target, [_uint(buffer, "buffer")],
                             [_uint(peer_buffer_address, "peer_buffer_address")], lens,
                             Op.WRITE)
        return self._track(batch, lens)

    @_guard(-1)
    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed (id released), 0 in progress, -1 failed (id released) or unknown,
        -2 timed out (id kept, as in the original)."""
        bid = _uint(batch_id, "batch_id")
        with self._lock:
            entry = self._pending.get(bid)
        if entry is None:
            raise E.InvalidArgumentError(f"unknown transfer id {bid} (-1 means the submit "
                                         f"failed; an id is released once it completed or "
                                         f"failed)")
        batch = entry.batch
        if batch is not None:
            if not batch.done() and time.monotonic_ns() < entry.deadline_ns:
                return 0
            # Done, or past the deadline: then wait() returns at once and marks the
            # requests timed out.
            try:
                batch.wait()
            except E.TransferTimeoutError as e:
                log.error("transfer_check_status: transfer %d: %s", bid, e)
                return -2
            except E.MooncakeError as e:
                with self._lock:
                    self._pending.pop(bid, None)
                log.error("transfer_check_status: transfer %d: %s", bid, e)
                return -1
        with self._lock:
            self._pending.pop(bid, None)
        return 1

    # --- notifications and topology ----------------------------------------------------
    def get_notifies(self) -> list:
        """Notifications received since the last call, as :class:`TransferNotify`."""
        if self._eng is None:
            log.error("get_notifies: the engine is not initialized")
            return []
        try:
            got = self._eng.notifications()
        except E.MooncakeError as e:
            log.error("get_notifies: %s", e)
            return []
        return [TransferNotify(n.sender, n.message.decode("utf-8", "replace")) for n in got]

    def get_local_topology(self, device_name: str | None = None) -> str:
        """The NIC priority matrix as JSON: ``{"cpu:0": [[preferred], [available]], ...}``.

        As Mooncake's classic engine (``Topology::discover``/``parse``): a file named by
        ``MC_CUSTOM_TOPO_JSON`` is echoed as written (NICs it names need not exist
        here); otherwise one ``"cpu:N"`` entry per NUMA node, ``[[], []]`` when there are
        no RDMA NICs (or ``device_name`` filters them all out). May be called before
        :meth:`initialize`.
        """
        return json.dumps(local_topology(device_name), indent=3)

    # --- CUDA streams --------------------------------------------------------------------
    def transfer_write_on_cuda(self, target_hostname: str, buffer: int,
                               peer_buffer_address: int, length: int, stream_ptr: int = 0,
                               transport_hint: str = "") -> None:
        """Write ``length`` bytes once the work queued on CUDA stream ``stream_ptr``
        before this call has finished (``buffer`` may be GPU memory registered with
        :meth:`register_memory`). See :meth:`batch_transfer_write_on_cuda`."""
        self._on_cuda(target_hostname, [buffer], [peer_buffer_address], [length],
                      stream_ptr, Op.WRITE)

    def transfer_read_on_cuda(self, target_hostname: str, buffer: int,
                              peer_buffer_address: int, length: int, stream_ptr: int = 0,
                              transport_hint: str = "") -> None:
        """Read ``length`` bytes into ``buffer`` after the work queued on ``stream_ptr``."""
        self._on_cuda(target_hostname, [buffer], [peer_buffer_address], [length],
                      stream_ptr, Op.READ)

    def batch_transfer_write_on_cuda(self, target_hostname: str, buffers,
                                     peer_buffer_addresses, lengths, stream_ptr: int = 0,
                                     transport_hint: str = "") -> None:
        """Write a batch after the work queued on CUDA stream ``stream_ptr``.

        Mooncake enqueues a host function on the stream (``cudaLaunchHostFunc``) that
        submits and waits, and ends the process (``_exit(1)``) when the transfer fails. Here
        the call waits for the stream (``cuStreamSynchronize``), then runs the transfer
        through the engine's GPU paths and returns when it is done; a failure raises
        :class:`mooncake_te.errors.TransferError` instead of ending the process. So the
        data is in place when the call returns, which is at least as strong an
        ordering as Mooncake's for work queued later on the stream.

        Raises
        ------
        CudaUnavailableError
            This machine has no usable CUDA driver (Mooncake's non-CUDA builds do not
            have the method at all).
        """
        self._on_cuda(target_hostname, buffers, peer_buffer_addresses, lengths,
                      stream_ptr, Op.WRITE)

    def batch_transfer_read_on_cuda(self, target_hostname: str, buffers,
                                    peer_buffer_addresses, lengths, stream_ptr: int = 0,
                                    transport_hint: str = "") -> None:
        """Read a batch after the work queued on ``stream_ptr``; see
        :meth:`batch_transfer_write_on_cuda`."""
        self._on_cuda(target_hostname, buffers, peer_buffer_addresses, lengths,
                      stream_ptr, Op.READ)

    def _on_cuda(self, target, buffers, peers, lengths, stream_ptr, op) -> None:
        target = _str(target, "target_hostname")
        stream = _uint(stream_ptr, "stream_ptr")
        from .. import cuda
        ok, why = cuda.available()
        if not ok:
            raise CudaUnavailableError(
                f"transfer_*_on_cuda needs CUDA, and this machine has none ({why}); use transfer_sync_write/read or batch_transfer_sync_write/read for host "
                f"memory")
        # Stream 0 is the legacy default stream, as in cudaLaunchHostFunc(0, ...).
        cuda.synchronize_stream(stream or cuda.LEGACY_STREAM)
        batch = self._submit(target, buffers, peers, lengths, op)
        if batch is not None:
            batch.wait()

    def get_engine_ptr(self) -> int:
        """A handle to this engine that :class:`mooncake_te.compat.store.
        MooncakeDistributedStore` accepts (``setup(..., engine=...)``-style sharing, as
        Mooncake Store reuses the transfer engine whose pointer it is given). Only
        meaningful inside this process; 0 before :meth:`initialize`."""
        if self._eng is None:
            log.error("get_engine_ptr: the engine is not initialized")
            return 0
        return _ENGINES.handle(self._eng)


class CudaUnavailableError(E.DeviceNotFoundError, RuntimeError):
    """A ``*_on_cuda`` method was called on a machine without a usable CUDA driver.
    Also a ``RuntimeError``, which is what Mooncake raises from these methods."""


class _EngineHandles:
    """Integer handles for engines (``get_engine_ptr``): Mooncake returns the C++
    pointer; a Python object has no stable address to hand out that another component
    could dereference safely, so the handle is a key into this table, resolved by
    :func:`engine_from_ptr`. Entries are weak: a closed, collected engine resolves to
    None."""

    def __init__(self):
        import weakref
        self._lock = threading.Lock()
        self._by_handle: "weakref.WeakValueDictionary[int, _Engine]" = weakref.WeakValueDictionary()

    def handle(self, eng) -> int:
        h = id(eng)
        with self._lock:
            self._by_handle[h] = eng
        return h

    def resolve(self, handle: int):
        with self._lock:
            return self._by_handle.get(int(handle))


_ENGINES = _EngineHandles()


def engine_from_ptr(handle: int):
    """The :class:`mooncake_te.TransferEngine` behind a :meth:`TransferEngine.get_engine_ptr`
    handle, or None when it is unknown or was collected."""
    return _ENGINES.resolve(handle)


def local_topology(device_name: str | None = None) -> dict:
    """The matrix :meth:`TransferEngine.get_local_topology` prints, as a dict."""
    from ..topology.matrix import (ENV_CUSTOM_TOPO, build_priority_matrix,
                                   load_priority_matrix)
    from ..topology.discover import discover
    custom = os.environ.get(ENV_CUSTOM_TOPO)
    if custom:
        try:
            # Topology::parse keeps what the file says; only the shape is checked.
            return load_priority_matrix(custom)
        except E.MooncakeError as e:
            log.warning("get_local_topology: %s; discovering instead (as Mooncake falls "
                        "back when the file cannot be loaded)", e)
    try:
        topo = discover()
    except (E.MooncakeError, OSError) as e:
        log.error("get_local_topology: %s", e)
        return {}
    try:
        matrix = build_priority_matrix(topo, device_name or None)
    except E.MooncakeError as e:         # a device_name that names no NIC here
        log.warning("get_local_topology: %s", e)
        matrix = {}
    if not matrix:
        # No RDMA NIC: discoverCpuTopology still lists every NUMA node, with no NICs.
        matrix = {node.location: [[], []] for node in topo.numa_nodes}
    return matrix


# The module's other names, as pybind11 registers them next to TransferEngine.
InnerTransferEngine = _Engine       # what get_engine() returns (Mooncake: the C++ engine)
from .rpc import (  # noqa: E402,F401
    CoroRPCInterface, ReceivedData, ReceivedTensor, RpcInterface, SharedSegment,
    create_rpc_client, create_rpc_server,
)

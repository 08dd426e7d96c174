# SPDX-License-Identifier: Apache-2.0
"""``mooncake.engine``'s RPC names on mooncake_te: ``RpcInterface`` (alias
``CoroRPCInterface``), ``ReceivedData``, ``ReceivedTensor``, ``create_rpc_client``,
``create_rpc_server``, and ``SharedSegment`` (a typed refusal).

Mooncake binds these in ``mooncake-transfer-engine/src/transport/rpc_communicator/
rpc_interface.cpp`` (``bind_rpc_interface``): a message interface where a server calls a
Python callback for every blob of bytes or tensor a client sends. The methods, argument
names, defaults and return values here are Mooncake's; the wire is ours (Mooncake's is
yalantinglibs coro_rpc), so both ends must be mooncake_te. It is a plain TCP protocol:
one connection per message, ``u64 header length | JSON header | payload`` and a one-byte
reply (0 delivered, 1 refused), every wait bounded by ``timeout_seconds``.

What the callbacks get, as in Mooncake: the data callback a dict ``{"source": str,
"data": bytes}``; the tensor callback a :class:`ReceivedTensor` (``shape``, ``dtype`` as a
name such as ``"float32"``, the bytes).
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading

import numpy as np

from .. import errors as E
from ..metadata.framing import _recv_exact

log = logging.getLogger("mooncake_te.compat")

_HDR = struct.Struct("<Q")
_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 1 << 34
# The dtypes Mooncake's tensor header can name (handleIncomingData's switch).
_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
           "bool")


class ReceivedData:
    """Bytes a peer sent: ``source_address``, ``data_size``, :meth:`get_bytes`,
    :meth:`get_memory_view`."""

    def __init__(self, source_address: str = "", data: bytes = b""):
        self.source_address = source_address
        self._data = bytes(data)
        self.data_size = len(self._data)

    def get_bytes(self) -> bytes:
        return self._data

    def get_memory_view(self) -> memoryview:
        return memoryview(self._data)


class ReceivedTensor:
    """A tensor a peer sent: ``source_address``, ``shape``, ``dtype`` (a name such as
    ``"float32"``), ``total_bytes``, and its bytes (:meth:`get_data_as_bytes`)."""

    def __init__(self, source_address: str = "", data: bytes = b"", shape=(),
                 dtype: str = ""):
        self.source_address = source_address
        self._data = bytes(data)
        self.shape = list(shape)
        self.dtype = dtype
        self.total_bytes = len(self._data)

    def get_data_size(self) -> int:
        return len(self._data)

    def get_data_as_bytes(self) -> bytes:
        return self._data

    def get_memory_view(self) -> memoryview:
        return memoryview(self._data)

    def to_numpy(self) -> np.ndarray:
        """The tensor as a numpy array (not in Mooncake; convenient in tests)."""
        return np.frombuffer(self._data, dtype=np.dtype(self.dtype)).reshape(self.shape)


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise E.InvalidArgumentError(f"address {address!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def _tensor_bytes(tensor) -> tuple[bytes, list, str]:
    """(bytes, shape, dtype name) of a torch tensor or numpy array."""
    if hasattr(tensor, "detach"):                    # torch.Tensor
        arr = tensor.detach().cpu().contiguous().numpy()
    else:
        arr = np.ascontiguousarray(tensor)
    name = str(arr.dtype)
    if name not in _DTYPES:
        raise E.InvalidArgumentError(f"tensor dtype {name} cannot be sent (Mooncake's "
                                     f"tensor header names {', '.join(_DTYPES)})")
    if arr.ndim > 4:
        raise E.InvalidArgumentError(f"a tensor of {arr.ndim} dimensions cannot be sent "
                                     f"(Mooncake's tensor header holds at most 4)")
    return arr.tobytes(), list(arr.shape), name


class RpcInterface:
    """Mooncake's ``RpcInterface``: send bytes and tensors to a server that hands them
    to Python callbacks. Both ends must be mooncake_te (see the module docstring).

    Examples
    --------
    >>> srv = RpcInterface()                                          # doctest: +SKIP
    >>> srv.initialize_server("127.0.0.1:8090")
    True
    >>> srv.set_data_receive_callback(lambda d: print(d["data"]))
    >>> srv.start_server_async()
    True
    >>> cli = create_rpc_client()
    >>> cli.send_data("127.0.0.1:8090", b"hi")
    0
    """

    def __init__(self):
        self._listen = ""
        self._timeout = 30.0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._data_cb = None
        self._tensor_cb = None
        self._initialized = False

    # -- set-up -------------------------------------------------------------------------
    def initialize(self, listen_address: str = "", thread_count: int = 0,
                   timeout_seconds: int = 30, pool_size: int = 100) -> bool:
        """Set up a client (``listen_address`` empty) or a server. True on success."""
        self._timeout = float(timeout_seconds) if timeout_seconds > 0 else 30.0
        self._listen = listen_address
        if listen_address:
            try:
                host, port = _split(listen_address)
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
                s.listen(128)
            except (OSError, E.MooncakeError) as e:
                log.error("RpcInterface.initialize: cannot listen on %r: %s",
                          listen_address, e)
                return False
            self._sock = s
        self._initialized = True
        return True

    def initialize_client(self, pool_size: int = 100, timeout_seconds: int = 30) -> bool:
        return self.initialize("", 0, timeout_seconds, pool_size)

    def initialize_server(self, listen_address: str, thread_count: int = 8,
                          timeout_seconds: int = 30) -> bool:
        return self.initialize(listen_address, thread_count, timeout_seconds, 100)

    @property
    def port(self) -> int:
        """The port the server listens on (useful with ``"127.0.0.1:0"``; not in
        Mooncake)."""
        return self._sock.getsockname()[1] if self._sock is not None else 0

    # -- server -------------------------------------------------------------------------
    def start_server(self) -> bool:
        """Serve until :meth:`stop_server` (blocks, as coro_rpc's ``start``)."""
        if not self.start_server_async():
            return False
        while not self._stop.wait(0.5):
            pass
        return True

    def start_server_async(self) -> bool:
        """Serve in a background thread; True when it started."""
        if self._sock is None:
            log.error("RpcInterface: start_server needs initialize(listen_address) first")
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="mte-rpc-interface",
                                            daemon=True)
            self._thread.start()
        return True

    def stop_server(self) -> None:
        self._stop.set()
        s, self._sock = self._sock, None
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def set_data_receive_callback(self, callback) -> None:
        self._data_cb = callback

    def set_tensor_receive_callback(self, callback) -> None:
        self._tensor_cb = callback

    def _serve(self) -> None:
        sock = self._sock
        while not self._stop.is_set() and sock is not None:
            try:
                conn, peer = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn, peer), daemon=True).start()

    def _handle(self, conn: socket.socket, peer) -> None:
        with conn:
            conn.settimeout(self._timeout)
            try:
                (hlen,) = _HDR.unpack(_recv_exact(conn, _HDR.size))
                if hlen > _MAX_HEADER:
                    raise ValueError(f"header of {hlen} bytes")
                head = json.loads(_recv_exact(conn, hlen))
                size = int(head["size"])
                if not 0 <= size <= _MAX_PAYLOAD:
                    raise ValueError(f"payload of {size} bytes")
                data = _recv_exact(conn, size)
            except (OSError, ValueError, KeyError, TypeError, ConnectionError) as e:
                log.warning("RpcInterface: bad message from %s: %s", peer, e)
                return
            source = str(head.get("source") or f"{peer[0]}:{peer[1]}")
            ok = True
            try:
                if head.get("kind") == "tensor":
                    if self._tensor_cb is None:
                        log.warning("RpcInterface: a tensor arrived and no tensor receive "
                                    "callback is set")
                    else:
                        self._tensor_cb(ReceivedTensor(source, data, head.get("shape", []),
                                                       str(head.get("dtype", ""))))
                elif self._data_cb is not None:
                    self._data_cb({"source": source, "data": data})
            except Exception as e:            # a callback's error stays on this side
                log.error("RpcInterface: receive callback raised %s: %s",
                          type(e).__name__, e)
                ok = False
            try:
                conn.sendall(b"\x00" if ok else b"\x01")
            except OSError:
                pass

    # -- client -------------------------------------------------------------------------
    def _send(self, target_address: str, head: dict, payload: bytes) -> int:
        if not self._initialized:
            log.error("RpcInterface: call initialize() or initialize_client() first")
            return -1
        try:
            host, port = _split(target_address)
            head = dict(head, size=len(payload))
            raw = json.dumps(head).encode()
            with socket.create_connection((host, port), timeout=self._timeout) as s:
                s.sendall(_HDR.pack(len(raw)) + raw)
                s.sendall(payload)
                status = _recv_exact(s, 1)
        except (OSError, ConnectionError, E.MooncakeError) as e:
            log.error("RpcInterface: sending to %s failed: %s", target_address, e)
            return -1
        return 0 if status == b"\x00" else -1

    def send_data(self, target_address: str, data) -> int:
        """Send bytes; 0 once the server's callback ran, -1 on failure."""
        return self._send(target_address, {"kind": "data"}, bytes(data))

    def send_tensor(self, target_address: str, tensor) -> int:
        """Send a torch tensor or numpy array (at most 4 dims, a dtype Mooncake's
        header can name); 0 or -1."""
        try:
            payload, shape, dtype = _tensor_bytes(tensor)
        except E.MooncakeError as e:
            log.error("RpcInterface.send_tensor: %s", e)
            return -1
        return self._send(target_address, {"kind": "tensor", "shape": shape,
                                           "dtype": dtype}, payload)

    def send_data_async(self, target_address: str, data, loop):
        """An asyncio future (of ``loop``) that resolves to :meth:`send_data`'s result."""
        return loop.run_in_executor(None, self.send_data, target_address, data)

    def send_tensor_async(self, target_address: str, tensor, loop):
        """An asyncio future that resolves to :meth:`send_tensor`'s result."""
        return loop.run_in_executor(None, self.send_tensor, target_address, tensor)


CoroRPCInterface = RpcInterface


def create_rpc_client(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    """An initialized client (Mooncake's ``createRpcClient``: timeout 30 s)."""
    c = RpcInterface()
    c.initialize("", 0, 30, 10)
    return c


def create_rpc_server(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    """A server initialized on ``0.0.0.0:8080``, as Mooncake's ``createRpcServer``;
    start it with :meth:`RpcInterface.start_server_async`. Raises when the port is
    taken (Mooncake's returns an uninitialized object)."""
    s = RpcInterface()
    if not s.initialize("0.0.0.0:8080", 0, 30, 10):
        raise E.InvalidArgumentError("create_rpc_server: cannot listen on 0.0.0.0:8080 "
                                     "(in use?); use RpcInterface().initialize_server("
                                     "'host:port') with another port")
    return s


class SharedSegmentUnsupportedError(E.MooncakeError, RuntimeError):
    """``SharedSegment`` is not available in mooncake_te (see :class:`SharedSegment`)."""


class SharedSegment:
    """Mooncake's ``SharedSegment`` (``shared_segment_py.cpp``): one memory segment
    shared by the ranks of a job through a two-phase all-gather of opaque blobs.
    mooncake_te has no such object: :meth:`supported` answers False, and
    :meth:`create` raises :class:`SharedSegmentUnsupportedError` (a ``RuntimeError``,
    what Mooncake raises when a build cannot share memory). Share memory between
    processes of one host with ``mooncake_te``'s same-host transport instead
    (register the memory; peers on the host read it with shm/CMA)."""

    @staticmethod
    def supported(mmap: bool = True, host_register: bool = False) -> bool:
        return False

    @staticmethod
    def create(name: str, size: int, world_size: int, rank_id: int, owner_rank: int = 0,
               device_id: int = 0, mmap: bool = True, host_register: bool = False):
        raise SharedSegmentUnsupportedError(
            "SharedSegment is not implemented by mooncake_te (SharedSegment.supported() is "
            "False); register the memory with TransferEngine.register_memory and let the "
            "other processes read it through the engine")

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

The server is a control-plane listener and is guarded like the others (issue #35 item 5):

- it binds ``127.0.0.1`` unless told another address (``create_rpc_server`` too, where
  Mooncake binds ``0.0.0.0``); an address that is not loopback without a token is
  warned about;
- with an auth token (``auth_token=``, else ``MC_AUTH_TOKEN`` / ``config.toml``'s
  ``[transfer_engine] auth_token``) a connection starts with the engine's HMAC
  challenge-response (:func:`~mooncake_te.metadata.framing.client_auth`, labels of its
  own); a peer without the token is refused before its message is read;
- the accept loop is the shared :class:`~mooncake_te.metadata.listener.Listener`
  (survives EMFILE; at most ``MAX_CONNECTIONS`` connections, ``MAX_PER_PEER`` from one
  address, so at most that many threads);
- a message is at most ``max_message_bytes`` (default ``MAX_MESSAGE``), checked before any
  of it is read, and the messages being received together at most ``MAX_INFLIGHT`` bytes;
- a message must arrive whole within ``timeout_seconds`` plus one second per
  ``_MIN_RATE`` bytes (a peer trickling bytes is cut off);
- the ``source`` the callbacks get is the connection's peer address, not what the
  message claims.

What the callbacks get, as in Mooncake: the data callback a dict ``{"source": str,
"data": bytes}``; the tensor callback a :class:`ReceivedTensor` (``shape``, ``dtype`` as a
name such as ``"float32"``, the bytes).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time

import numpy as np

from .. import errors as E
from ..auth import check_token, is_loopback
from ..metadata import framing
from ..metadata.framing import _recv_exact
from ..metadata.listener import Listener

log = logging.getLogger("mooncake_te.compat")

_HDR = struct.Struct("<Q")
_MAX_HEADER = 64 << 10
#: the largest message a server takes by default (``initialize(max_message_bytes=)``)
MAX_MESSAGE = 1 << 30
#: bytes of messages being received at once, all connections together
MAX_INFLIGHT = 2 << 30
MAX_CONNECTIONS = 64        # connections (and threads) served at once
MAX_PER_PEER = 16           # of them from one peer address
_MIN_RATE = 8 << 20         # B/s a message must at least arrive at, after timeout_seconds
#: HMAC labels of this port's authentication (framing.client_auth/server_auth)
LABELS = (b"mte-compat-rpc-server", b"mte-compat-rpc-client")
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
    return host.strip("[]") or "127.0.0.1", int(port)


def _config_token() -> bytes | None:
    """``MC_AUTH_TOKEN``, else ``config.toml``'s ``[transfer_engine] auth_token``."""
    env = os.environ.get("MC_AUTH_TOKEN")
    if env:
        return check_token(env)
    try:
        from ..config import Config
        return check_token(Config.load(None).get("transfer_engine", "auth_token"))
    except E.MooncakeError:
        return None


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
        self._stop = threading.Event()
        self._data_cb = None
        self._tensor_cb = None
        self._initialized = False
        self._token: bytes | None = None
        self._listener: Listener | None = None
        self._max_message = MAX_MESSAGE
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self.refused = 0            # messages refused: authentication, size, deadline

    # -- set-up -------------------------------------------------------------------------
    def initialize(self, listen_address: str = "", thread_count: int = 0,
                   timeout_seconds: int = 30, pool_size: int = 100, *,
                   auth_token=None, max_message_bytes: int = MAX_MESSAGE) -> bool:
        """Set up a client (``listen_address`` empty) or a server. True on success.

        ``auth_token`` (not in Mooncake; default ``MC_AUTH_TOKEN`` or ``config.toml``):
        both ends must have the same one. ``max_message_bytes`` (not in Mooncake): the
        largest message a server accepts. A ``listen_address`` with no host (``":8090"``)
        binds ``127.0.0.1``."""
        self._timeout = float(timeout_seconds) if timeout_seconds > 0 else 30.0
        self._listen = listen_address
        try:
            self._token = check_token(auth_token) if auth_token is not None \
                else _config_token()
        except E.MooncakeError as e:
            log.error("RpcInterface.initialize: %s", e)
            return False
        self._max_message = int(max_message_bytes)
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
            if not self._token and not is_loopback(host):
                log.warning("RpcInterface listens on %s without an auth token: anyone who "
                            "can reach it can call your receive callbacks; set auth_token= "
                            "(or MC_AUTH_TOKEN) on both ends", listen_address)
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
        if self._listener is None:
            self._listener = Listener(self._sock, f"mte-rpc-interface-{self.port}",
                                      self._handle, MAX_CONNECTIONS, MAX_PER_PEER).start()
        return True

    @property
    def shed(self) -> int:
        """Connections closed unserved (limits, descriptors or threads exhausted; not in
        Mooncake)."""
        return self._listener.shed if self._listener is not None else 0

    def stop_server(self) -> None:
        self._stop.set()
        s, self._sock = self._sock, None
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def set_data_receive_callback(self, callback) -> None:
        self._data_cb = callback

    def set_tensor_receive_callback(self, callback) -> None:
        self._tensor_cb = callback

    def _reserve(self, size: int) -> bool:
        with self._inflight_lock:
            if self._inflight + size > MAX_INFLIGHT:
                return False
            self._inflight += size
            return True

    def _release(self, size: int) -> None:
        with self._inflight_lock:
            self._inflight -= size

    def _refuse(self, conn: socket.socket, peer: str, why: str) -> None:
        self.refused += 1
        log.warning("RpcInterface: refused a message from %s: %s", peer, why)
        try:
            conn.sendall(b"\x01")
        except OSError:
            pass

    def _handle(self, conn: socket.socket, peer: str = "") -> None:
        with conn:
            try:
                addr = conn.getpeername()
                source = f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"
            except OSError:
                return
            deadline = time.monotonic() + self._timeout
            conn.settimeout(self._timeout)
            try:
                if self._token is not None:
                    length, kind = framing.recv_header(conn, deadline)
                    payload = b"" if kind != framing.AUTH else framing.recv_payload(
                        conn, length, framing.PRE_AUTH_MAX_FRAME, deadline)
                    why = framing.server_auth(conn, self._token, kind, payload, deadline,
                                              LABELS)
                    if why is not None:
                        self.refused += 1
                        log.warning("RpcInterface: refused %s: %s", source, why)
                        return
                (hlen,) = _HDR.unpack(_recv_exact(conn, _HDR.size, deadline))
                if hlen > _MAX_HEADER:
                    return self._refuse(conn, source, f"a header of {hlen} bytes")
                head = json.loads(_recv_exact(conn, hlen, deadline))
                size = int(head["size"])
            except (OSError, ValueError, KeyError, TypeError, ConnectionError,
                    E.MooncakeError) as e:
                self.refused += 1
                log.warning("RpcInterface: bad message from %s: %s", source, e)
                return
            # Checked before a byte of the payload is read: an announced 16 GiB costs
            # nothing.
            if not 0 <= size <= self._max_message:
                return self._refuse(conn, source, f"a message of {size} bytes (at most "
                                                  f"{self._max_message}: max_message_bytes)")
            if not self._reserve(size):
                return self._refuse(conn, source, f"a message of {size} bytes while "
                                                  f"{self._inflight} are being received")
            try:
                data = _recv_exact(conn, size, deadline + size / _MIN_RATE)
            except (OSError, ConnectionError) as e:
                self.refused += 1
                log.warning("RpcInterface: message from %s not received: %s", source, e)
                return
            finally:
                self._release(size)
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
                if self._token is not None:
                    framing.client_auth(s, self._token, f"RpcInterface {target_address}",
                                        LABELS)
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
    """A server initialized on ``127.0.0.1:8080`` (Mooncake's ``createRpcServer`` binds
    ``0.0.0.0:8080``: to serve other hosts, use ``RpcInterface().initialize_server(
    "0.0.0.0:8080")`` with an auth token); start it with
    :meth:`RpcInterface.start_server_async`. Raises when the port is taken (Mooncake's
    returns an uninitialized object)."""
    s = RpcInterface()
    if not s.initialize("127.0.0.1:8080", 0, 30, 10):
        raise E.InvalidArgumentError("create_rpc_server: cannot listen on 127.0.0.1:8080 "
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

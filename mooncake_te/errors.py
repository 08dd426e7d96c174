# SPDX-License-Identifier: Apache-2.0
"""The exception tree of mooncake_te.

Every error is a :class:`MooncakeError` and carries ``.status``, the numeric code
Mooncake's Transfer Engine uses for the same condition (``include/error.h`` in
kvcache-ai/Mooncake), and ``.errno`` where an OS error caused it. All of them pickle,
because worker processes (vLLM workers, bench targets) send them across processes.

Every status code the native data paths return (src/core/status.h, the only list of them)
has exactly one class here, declared with ``status=`` (or ``status_range=`` for a code
that folds an errno or a device status into a base); :func:`error_class` finds it. A
second class claiming a code is rejected when it is defined, and
tests/unit/test_status_codes.py checks this table against status.h.
"""
from __future__ import annotations

# Mooncake status codes (include/error.h, docs/source/troubleshooting/error-code.md).
ERR_INVALID_ARGUMENT = -1
ERR_TOO_MANY_REQUESTS = -2
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_BATCH_BUSY = -4
ERR_DEVICE_NOT_FOUND = -6
ERR_ADDRESS_OVERLAPPED = -7
ERR_DNS = -101
ERR_SOCKET = -102
ERR_MALFORMED_JSON = -103
ERR_REJECT_HANDSHAKE = -104
ERR_METADATA = -200
ERR_ENDPOINT = -201
ERR_CONTEXT = -202
ERR_NUMA = -300
ERR_CLOCK = -301
ERR_MEMORY = -302
ERR_NOT_IMPLEMENTED = -303
# Codes Mooncake has no number for; ours, kept out of Mooncake's ranges.
ERR_TRANSFER_FAIL = -800          # Mooncake's Python wrapper reports -800 for failed transfers
ERR_TRANSFER_TIMEOUT = -801
ERR_TRANSPORT_UNAVAILABLE = -802
ERR_AUTHENTICATION = -803
ERR_CONFIG = -804
ERR_CANCELED = -805
# The native data paths' own codes (src/core/status.h).
ERR_LOCAL_NOT_REGISTERED = -1003
ERR_REMOTE_ACCESS = -1004
ERR_PEER_RESTARTED = -1006
ERR_PROTOCOL = -1007
ERR_CLOSED = -1008
ERR_CROSS_MEMORY = -1009
ERR_CUDA = -1010
ERR_WRONG_PEER = -1011
ERR_NOTIFY_FULL = -1012
ERR_OUT_OF_RANGE = -1021
ERR_RDMA_WC_BASE = -1100          # -1100 - ibv_wc_status
ERR_RDMA_NO_RAIL = -1150
ERR_RDMA_POST = -1151
ERR_RDMA_LOCAL_KEY = -1152
ERR_RDMA_PORT_DOWN = -1153
ERR_STORAGE_BASE = -1400          # -1400 - errno

_BY_STATUS: dict = {}             # status -> the class that owns it
_RANGES: list = []                # (lo, hi, class): codes lo..hi inclusive


class MooncakeError(Exception):
    """Root of every mooncake_te error.

    Parameters
    ----------
    message : str
        What failed, with which value, and what to do.
    status : int, optional
        Mooncake's numeric status code; the class default when omitted.
    errno : int, optional
        The OS errno behind the failure, if any.
    """

    default_status = ERR_INVALID_ARGUMENT

    def __init_subclass__(cls, status: int | None = None, status_range: tuple | None = None,
                          **kw):
        # One class per status code (asyncpg's registry of SQLSTATE classes works so).
        super().__init_subclass__(**kw)
        if status is not None:
            owner = _BY_STATUS.get(status)
            if owner is not None:
                raise TypeError(f"status {status} already belongs to {owner.__name__}; "
                                f"{cls.__name__} cannot claim it too")
            _BY_STATUS[status] = cls
            cls.default_status = status
        if status_range is not None:
            lo, hi = sorted(status_range)
            for a, b, owner in _RANGES:
                if a <= hi and lo <= b:
                    raise TypeError(f"statuses {lo}..{hi} overlap {owner.__name__}'s {a}..{b}")
            _RANGES.append((lo, hi, cls))
            cls.default_status = status_range[0]

    def __init__(self, message: str = "", status: int | None = None, errno: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = self.default_status if status is None else int(status)
        self.errno = errno

    def __reduce__(self):
        # Keep status and errno across pickling (the default only keeps args).
        return (_rebuild, (type(self), self.message, self.status, self.errno))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls, message, status, errno):
    return cls(message, status=status, errno=errno)


# The classes the package exports at its top level (mooncake_te.__all__): the names users
# catch. describe() names an error by the nearest of them.
_TOP_LEVEL = ("TransferTimeoutError", "TransferCanceledError", "AddressOverlappedError",
              "AddressNotRegisteredError", "SegmentNotFoundError", "MetadataError",
              "DeviceNotFoundError", "TransportUnavailableError", "AuthenticationError",
              "ConfigError", "InvalidArgumentError", "TransferError", "MooncakeError")


def describe(e: BaseException) -> str:
    """The error's kind for a one-line message: its class when that is one of the
    top-level classes, else "<nearest top-level class> (<its class>)", e.g.
    "TransferError (PeerRestartedError)"."""
    name = type(e).__name__
    if name in _TOP_LEVEL or not isinstance(e, MooncakeError):
        return name
    base = next(c.__name__ for c in type(e).__mro__ if c.__name__ in _TOP_LEVEL)
    return f"{base} ({name})"


def error_class(status: int) -> type:
    """The exception class of a status code; TransferError for a code nobody owns."""
    cls = _BY_STATUS.get(status)
    if cls is not None:
        return cls
    for lo, hi, owner in _RANGES:
        if lo <= status <= hi:
            return owner
    return TransferError


class InvalidArgumentError(MooncakeError, ValueError, status=ERR_INVALID_ARGUMENT):
    """A value passed in is wrong (type, range, unknown name); the message names it and what is accepted."""


class AddressNotRegisteredError(MooncakeError, status=ERR_ADDRESS_NOT_REGISTERED):
    """An address is outside the regions registered with the engine that was asked."""


class AddressOverlappedError(InvalidArgumentError, status=ERR_ADDRESS_OVERLAPPED):
    """A region to register overlaps one already registered; unregister it first or register the union once."""


class MetadataError(MooncakeError, status=ERR_METADATA):
    """The metadata store or a peer's RPC port failed or answered something unexpected; ``.errno`` holds the socket error where there was one."""


class SegmentNotFoundError(MooncakeError):
    """No segment of that name in the metadata store (Mooncake reports it as a metadata
    error, -200, which MetadataError owns)."""

    default_status = ERR_METADATA


class DeviceNotFoundError(MooncakeError, status=ERR_DEVICE_NOT_FOUND):
    """A named device (RDMA NIC, GPU, NVMe namespace) does not exist on this host."""


class TransportUnavailableError(MooncakeError, status=ERR_TRANSPORT_UNAVAILABLE):
    """A transport (or CUDA) is unavailable on this machine or build; the message says why (``mooncake-te version`` lists them)."""


class AuthenticationError(MooncakeError, status=ERR_AUTHENTICATION):
    """The peers' ``auth_token`` settings differ: one has none, or the HMAC proofs do not match."""


class ConfigError(MooncakeError, ValueError, status=ERR_CONFIG):
    """A configuration file, section, key or ``MC_*`` variable is invalid; the message names the file and key."""


# --- transfers: one class per code the native data paths return ------------------------

class TransferError(MooncakeError, status=ERR_TRANSFER_FAIL):
    """A transfer failed; subclasses say how."""


class TransferTimeoutError(TransferError, TimeoutError, status=ERR_TRANSFER_TIMEOUT):
    """A transfer or wait ran past its deadline (``timeout=``, ``[transfer_engine] timeout_ms`` or ``MC_TRANSFER_TIMEOUT``)."""


class TransferCanceledError(TransferError, status=ERR_CANCELED):
    """A request was dropped by :meth:`Batch.cancel` before it reached the wire."""


class ConnectionLostError(TransferError, status=ERR_SOCKET):
    """A data connection failed or was lost (peer dead, restarted or unreachable)."""


class OutOfMemoryError(TransferError, status=ERR_MEMORY):
    """Memory, or pinned staging memory, ran out on one side."""


class LocalAddressNotRegisteredError(AddressNotRegisteredError, status=ERR_LOCAL_NOT_REGISTERED):
    """The local side of a request is outside this engine's registered regions."""


class RemoteAccessError(AddressNotRegisteredError, status=ERR_REMOTE_ACCESS):
    """The peer's region does not allow this direction (registered read-only or local)."""


class PeerRestartedError(TransferError, status=ERR_PEER_RESTARTED):
    """The peer restarted (its instance id changed); re-resolve its addresses."""


class ProtocolError(TransferError, status=ERR_PROTOCOL):
    """The peer broke the data path's wire protocol."""


class ClosedError(TransferError, InvalidArgumentError, RuntimeError, status=ERR_CLOSED):
    """The object, connection or transport was closed.

    Every closed object raises it; it stays catchable as what such objects raised before
    it existed (ValueError, RuntimeError, InvalidArgumentError), and a request failed by a
    closing transport is a TransferError."""


class CrossMemoryAttachError(TransferError, status=ERR_CROSS_MEMORY):
    """Same host: the peer could not copy to or from this process's memory."""


class CudaCopyError(TransferError, status=ERR_CUDA):
    """A CUDA copy of GPU memory failed (staging or IPC mapping)."""


class WrongPeerError(AuthenticationError, status=ERR_WRONG_PEER):
    """The engine that answered for a segment could not prove it is that segment: its
    descriptor in the metadata store is stale or forged (another engine's ports under
    this name), or the tokens differ. Nothing was sent."""


class NotificationQueueFullError(TransferError, status=ERR_NOTIFY_FULL):
    """The receiver's notification queue is full (64 MiB or 65,536 messages unread); the
    notification was not queued. The receiver must drain ``notifications()`` more often."""


class OutOfRangeError(TransferError, status=ERR_OUT_OF_RANGE):
    """A request reaches past the end of a storage segment."""


class RdmaCompletionError(TransferError, status_range=(ERR_RDMA_WC_BASE - 1,
                                                       ERR_RDMA_WC_BASE - 49)):
    """An RDMA work completion failed: ``status`` is -1100 - ibv_wc_status."""


class RdmaRemoteAccessError(RdmaCompletionError, AddressNotRegisteredError,
                            status=ERR_RDMA_WC_BASE - 10):
    """IBV_WC_REM_ACCESS_ERR: the peer's NIC refused the address or the direction."""


class RdmaNoRailError(TransferError, status=ERR_RDMA_NO_RAIL):
    """No rail to the peer can carry the request."""


class RdmaPostError(TransferError, status=ERR_RDMA_POST):
    """ibv_post_send refused the work request."""


class RdmaLocalKeyError(AddressNotRegisteredError, status=ERR_RDMA_LOCAL_KEY):
    """The local buffer is not registered with the RDMA NICs."""


class RdmaPortDownError(TransferError, status=ERR_RDMA_PORT_DOWN):
    """The local RDMA NIC's port went down and no other rail could take over."""


class StorageError(TransferError, status_range=(ERR_STORAGE_BASE, ERR_STORAGE_BASE - 199)):
    """Storage I/O failed: ``status`` is -1400 - errno."""


class NativeOSError(MooncakeError, OSError):
    """A system call of the native tier failed (``errno`` says which error); also an
    OSError, as these always were. Raised by the compiled tier's one checker
    (``mooncake_te.core._core.check_errno``)."""

    def __init__(self, message: str = "", status: int | None = None, errno: int | None = None):
        if isinstance(message, int) and isinstance(status, str):    # OSError's (errno, text)
            message, status, errno = status, None, message
        super().__init__(message, status=status, errno=errno)
        self.strerror = message


class VerbsError(NativeOSError):
    """A libibverbs call failed; ``errno`` and the call are in the message."""

    default_status = ERR_CONTEXT


__all__ = [name for name in dir() if name.endswith("Error") or name.startswith("ERR_")]
__all__ += ["describe", "error_class"]

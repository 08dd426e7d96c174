# SPDX-License-Identifier: Apache-2.0
"""The exception tree of mooncake_te.

Every error is a :class:`MooncakeError` and carries ``.status``, the numeric code
Mooncake's Transfer Engine uses for the same condition (``include/error.h`` in
kvcache-ai/Mooncake), and ``.errno`` where an OS error caused it. All of them pickle,
because worker processes (vLLM workers, bench targets) send them across processes.
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


class InvalidArgumentError(MooncakeError, ValueError):
    """A value passed in is wrong (type, range, unknown name); the message names it and what is accepted."""

    default_status = ERR_INVALID_ARGUMENT


class AddressNotRegisteredError(MooncakeError):
    """An address range is not inside a region registered on the side that owns it (locally, or by the peer for the target side)."""

    default_status = ERR_ADDRESS_NOT_REGISTERED


class AddressOverlappedError(InvalidArgumentError):
    """A region to register overlaps one already registered; unregister it first or register the union once."""

    default_status = ERR_ADDRESS_OVERLAPPED


class SegmentNotFoundError(MooncakeError):
    """No peer segment of that name could be resolved (not published, or its RPC port did not answer as an engine)."""

    default_status = ERR_METADATA


class TransferError(MooncakeError):
    """A transfer failed (peer refused or died, connection lost); ``.status`` holds the Mooncake status code."""

    default_status = ERR_TRANSFER_FAIL


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer or wait ran past its deadline (``timeout=``, ``[transfer_engine] timeout_ms`` or ``MC_TRANSFER_TIMEOUT``)."""

    default_status = ERR_TRANSFER_TIMEOUT


class TransferCanceledError(TransferError):
    """A request was dropped by :meth:`Batch.cancel` before it reached the wire."""

    default_status = ERR_CANCELED


class MetadataError(MooncakeError):
    """The metadata store or a peer's RPC port failed or answered something unexpected; ``.errno`` holds the socket error where there was one."""

    default_status = ERR_METADATA


class DeviceNotFoundError(MooncakeError):
    """A named device (RDMA NIC, GPU, NVMe namespace) does not exist on this host."""

    default_status = ERR_DEVICE_NOT_FOUND


class TransportUnavailableError(MooncakeError):
    """A transport (or CUDA) is unavailable on this machine or build; the message says why (``mooncake-te version`` lists them)."""

    default_status = ERR_TRANSPORT_UNAVAILABLE


class AuthenticationError(MooncakeError):
    """The peers' ``auth_token`` settings differ: one has none, or the HMAC proofs do not match."""

    default_status = ERR_AUTHENTICATION


class ConfigError(MooncakeError, ValueError):
    """A configuration file, section, key or ``MC_*`` variable is invalid; the message names the file and key."""

    default_status = ERR_CONFIG


__all__ = [name for name in dir() if name.endswith("Error") or name.startswith("ERR_")]

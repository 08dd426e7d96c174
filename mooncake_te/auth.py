# SPDX-License-Identifier: Apache-2.0
"""The shared-secret token: validation, keys derived from it for MACs above the core
(KV index records, P/D parameters), and the warning for an engine without one."""
from __future__ import annotations

import hmac
import ipaddress
import logging

from . import errors as E

log = logging.getLogger("mooncake_te")

_warned_hosts: set = set()


def check_token(token, empty_ok: bool = True) -> bytes | None:
    """The auth token as bytes (None: no authentication), validated. An empty one means
    none where it comes from the configuration (its default is ``""``); given to the
    engine itself (``empty_ok=False``) it is refused, so a token that came out empty (an
    unset variable, a blank file) cannot silently turn authentication off."""
    if token is None:
        return None
    if token == "" or token == b"":
        if empty_ok:
            return None
        raise E.InvalidArgumentError(
            "auth_token is empty; a token is 1 to 256 bytes (the same on every engine), or "
            "pass auth_token=None (the default) for no authentication")
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, (bytes, bytearray)):
        raise E.InvalidArgumentError(f"auth_token must be str or bytes, got "
                                     f"{type(token).__name__}")
    if not 1 <= len(token) <= 256:
        raise E.InvalidArgumentError("auth_token must be 1 to 256 bytes long")
    return bytes(token)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def warn_unauthenticated(host: str) -> None:
    """Once per address: anyone who reaches it can read and write registered memory."""
    if host in _warned_hosts or is_loopback(host):
        return
    _warned_hosts.add(host)
    log.warning("listening on %s without an auth_token: anyone who can reach this address can "
                "read and write registered memory; set auth_token (or MC_AUTH_TOKEN) on every "
                "engine", host)


def derive_key(token: "bytes | None", label: str) -> "bytes | None":
    """A key for one use of the cluster token (``HMAC-SHA256(token, "mte-derive " + label)``,
    RFC 2104 as a PRF), so a MAC made for one purpose (a KV index record, P/D parameters)
    is never valid for another and the token itself never keys two protocols. None
    without a token."""
    if not token:
        return None
    return hmac.digest(token, b"mte-derive " + label.encode(), "sha256")


def mac(key: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 of ``parts``, each length-prefixed (no two part lists give the same
    input), as hex."""
    msg = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    return hmac.digest(key, msg, "sha256").hex()


def mac_ok(key: bytes, expected, *parts: bytes) -> bool:
    """Whether ``expected`` (a str from the wire, of any type) is :func:`mac` of
    ``parts``; compared in constant time."""
    if not isinstance(expected, str) or not expected.isascii():
        return False
    return hmac.compare_digest(mac(key, *parts), expected)

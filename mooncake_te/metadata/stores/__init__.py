# SPDX-License-Identifier: Apache-2.0
"""Metadata stores: etcd, redis and HTTP, each in its own module.

:func:`open_store` is what :func:`mooncake_te.metadata.open_backend` calls for
``etcd://``, ``redis://`` and ``http(s)://`` specs. Every store may take
``?ttl=SECONDS`` (default 10, or ``MC_METADATA_TTL``): how long a published segment
outlives its engine. Client libraries are imported lazily, so a missing one only
matters to those who pick that store; the error names the extra to install.
"""
from __future__ import annotations

from ...errors import MetadataError
from ..base import MetadataBackend

__all__ = ["open_store", "spec_from_config"]


def open_store(scheme: str, rest: str, spec: str, token: bytes | None = None) -> MetadataBackend:
    """Open the store ``scheme`` at ``rest`` (``spec`` is the whole string, for errors).

    Parameters
    ----------
    scheme : str
        ``"etcd"``, ``"redis"``, ``"http"`` or ``"https"``.
    rest : str
        Everything after ``scheme://``.
    spec : str
        The user's ``metadata=`` string.
    token : bytes, optional
        The engines' ``auth_token``: signs HTTP requests (see :mod:`.http`).
    """
    scheme = scheme.lower()
    if not rest.strip():
        raise MetadataError(f"metadata={spec!r} names no server address; e.g. "
                            f"'{scheme}://127.0.0.1:{_EXAMPLE_PORT.get(scheme, 2379)}'")
    if scheme == "etcd":
        from .etcd import EtcdStore
        return EtcdStore(rest)
    if scheme == "redis":
        from .redis import RedisStore
        return RedisStore(rest)
    if scheme in ("http", "https"):
        from .http import HttpStore
        return HttpStore(scheme, rest, token=token)
    raise MetadataError(f"unknown metadata store {scheme!r} in {spec!r}; use etcd://, redis:// "
                        f"or http://")


_EXAMPLE_PORT = {"etcd": 2379, "redis": 6379, "http": "8080/metadata",
                 "https": "8443/metadata"}


def spec_from_config(server_type: str, server_address: str) -> str:
    """The ``metadata=`` string for config.toml's ``[metadata] server_type/server_address``.

    Mooncake's deployment skeleton gives an address without a scheme
    (``server_address = "127.0.0.1:2379"``); a full URL is accepted as well, and an
    address whose scheme contradicts ``server_type`` is an error naming both.

    Examples
    --------
    >>> spec_from_config("redis", "10.0.0.1:6379")
    'redis://10.0.0.1:6379'
    >>> spec_from_config("http", "10.0.0.1:8080")
    'http://10.0.0.1:8080/metadata'
    """
    kind = (server_type or "p2p").strip().lower()
    addr = (server_address or "").strip()
    if kind in ("p2p", "p2phandshake"):
        return "p2p"
    if kind not in ("etcd", "redis", "http"):
        raise MetadataError(f"[metadata] server_type = {server_type!r} is not one of "
                            f"'p2p', 'etcd', 'redis', 'http'")
    if not addr:
        raise MetadataError(f"[metadata] server_type = {kind!r} needs server_address, e.g. "
                            f"\"127.0.0.1:{_EXAMPLE_PORT[kind]}\"")
    if "://" in addr:
        given = addr.split("://", 1)[0].lower()
        if given != kind and not (kind == "http" and given == "https"):
            raise MetadataError(f"[metadata] server_type = {kind!r} but server_address "
                                f"{addr!r} is a {given}:// address; make them agree")
        return addr
    if kind == "http":
        host_port, sep, path = addr.partition("/")
        return f"http://{host_port}/{path if sep and path else 'metadata'}"
    return f"{kind}://{addr}"

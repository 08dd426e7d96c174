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
from ..url import example, from_config

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
                            f"'{example(scheme)}'")
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


# The [metadata] server_type/server_address pair is parsed with every other form of
# the connection string, in ..url.
spec_from_config = from_config

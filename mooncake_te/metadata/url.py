# SPDX-License-Identifier: Apache-2.0
"""The metadata connection string, parsed in one place.

Every caller that reads a ``metadata=`` string (the engine, ``config.py`` for
``MC_METADATA_SERVER``, :func:`mooncake_te.metadata.open_backend`, the P2P store, the
Mooncake-compatible engine) goes through :func:`parse`; ``config.toml``'s
``[metadata] server_type / server_address`` pair goes through :func:`from_config`.

Mooncake's forms (``src/transfer_metadata_plugin.cpp``): ``"P2PHANDSHAKE"`` (no
server; ``"p2p"`` here too), ``"etcd://h:2379[,h2:2379]"``, ``"redis://h:6379[/db]"``,
``"http://h:8080/metadata"``, and a bare ``"h:2379"``, which means etcd.
"""
from __future__ import annotations

from typing import NamedTuple

from ..errors import MetadataError

P2P_NAMES = ("p2p", "p2phandshake")
STORE_SCHEMES = ("etcd", "redis", "http", "https")
_EXAMPLE_PORT = {"etcd": 2379, "redis": 6379, "http": "8080/metadata",
                 "https": "8443/metadata"}


class MetadataUrl(NamedTuple):
    """A parsed ``metadata=`` string.

    Attributes
    ----------
    scheme : str
        ``"p2p"``, ``"etcd"``, ``"redis"``, ``"http"``, ``"https"``, or whatever unknown
        scheme was given (:attr:`known` is then False).
    address : str
        Everything after ``scheme://`` (``""`` for p2p).
    spec : str
        The string as given (stripped), for error messages.
    explicit : bool
        Whether the string named its scheme as ``scheme://`` (a bare ``host:port`` and
        ``"P2PHANDSHAKE"`` do not).
    """
    scheme: str
    address: str
    spec: str
    explicit: bool

    @property
    def is_p2p(self) -> bool:
        return self.scheme == "p2p"

    @property
    def known(self) -> bool:
        return self.is_p2p or self.scheme in STORE_SCHEMES

    @property
    def url(self) -> str:
        """The canonical form: ``"p2p"`` or ``"scheme://address"``."""
        return "p2p" if self.is_p2p else f"{self.scheme}://{self.address}"

    def config_pair(self) -> "tuple[str, str]":
        """``(server_type, server_address)`` as config.toml's ``[metadata]`` keeps them:
        the skeleton's ``server_address`` has no scheme, except ``https`` (TLS is not the
        default, so the scheme stays)."""
        if self.is_p2p:
            return "p2p", ""
        if self.scheme == "https":
            return "http", self.url
        return self.scheme, self.address


def parse(spec) -> MetadataUrl:
    """Parse a metadata connection string (never raises; see :attr:`MetadataUrl.known`).

    Examples
    --------
    >>> parse("10.0.0.1:2379").url
    'etcd://10.0.0.1:2379'
    >>> parse("P2PHANDSHAKE").is_p2p
    True
    """
    s = str(spec if spec is not None else "").strip()
    if s.lower() in P2P_NAMES or not s:
        return MetadataUrl("p2p", "", s, False)
    scheme, sep, rest = s.partition("://")
    if not sep:
        return MetadataUrl("etcd", s, s, False)
    return MetadataUrl(scheme.lower(), rest, s, True)


def from_config(server_type: str, server_address: str) -> str:
    """The ``metadata=`` string for config.toml's ``[metadata] server_type/server_address``.

    Mooncake's deployment skeleton gives an address without a scheme
    (``server_address = "127.0.0.1:2379"``); a full URL is accepted as well, and an
    address whose scheme contradicts ``server_type`` is an error naming both.

    Examples
    --------
    >>> from_config("redis", "10.0.0.1:6379")
    'redis://10.0.0.1:6379'
    >>> from_config("http", "10.0.0.1:8080")
    'http://10.0.0.1:8080/metadata'
    """
    kind = (server_type or "p2p").strip().lower()
    addr = (server_address or "").strip()
    if kind in P2P_NAMES:
        return "p2p"
    if kind not in ("etcd", "redis", "http"):
        raise MetadataError(f"[metadata] server_type = {server_type!r} is not one of "
                            f"'p2p', 'etcd', 'redis', 'http'")
    if not addr:
        raise MetadataError(f"[metadata] server_type = {kind!r} needs server_address, e.g. "
                            f"\"127.0.0.1:{_EXAMPLE_PORT[kind]}\"")
    given = parse(addr)
    if given.explicit:
        if given.scheme != kind and not (kind == "http" and given.scheme == "https"):
            raise MetadataError(f"[metadata] server_type = {kind!r} but server_address "
                                f"{addr!r} is a {given.scheme}:// address; make them agree")
        return addr
    if kind == "http":
        host_port, sep, path = addr.partition("/")
        return f"http://{host_port}/{path if sep and path else 'metadata'}"
    return f"{kind}://{addr}"


def example(scheme: str) -> str:
    """An example address for ``scheme``, for error messages."""
    return f"{scheme}://127.0.0.1:{_EXAMPLE_PORT.get(scheme, 2379)}"

# SPDX-License-Identifier: Apache-2.0
"""``redis://[user:password@]host:6379[/db]``: segment descriptors in redis.

Client: redis-py (with hiredis for parsing, the ``[redis]`` extra).
Credentials and the database come from the URL, else from Mooncake's
``MC_REDIS_USERNAME`` / ``MC_REDIS_PASSWORD`` / ``MC_REDIS_DB_INDEX`` (reference §5,
``transfer_metadata_plugin.cpp``). Keys are plain strings set with ``EX ttl`` and
re-set every ``ttl / 3`` (``SET`` rather than ``EXPIRE``, so a redis that restarted
empty gets the keys back).
"""
from __future__ import annotations

import os
from urllib.parse import urlsplit, unquote

from ...errors import MetadataError, ERR_SOCKET
from ._leased import is_rpc_meta, LeasedStore, identify_http, port_hint, split_options, ttl_from

try:
    import redis as _redis
except ImportError:     # pragma: no cover - depends on the installed extras
    _redis = None


class RedisStore(LeasedStore):
    """Segment descriptors in a redis server.

    Parameters
    ----------
    rest : str
        ``[user:password@]host[:port][/db][?ttl=seconds]``.
    """

    kind = "redis"

    def __init__(self, rest: str, cluster_id: str | None = None, timeout: float = 3.0):
        if _redis is None:
            raise MetadataError("metadata='redis://...' needs the redis client library: "
                                "pip install 'redis[hiredis]>=5' (or '.[redis]' in a mooncake_te clone)")
        base, options = split_options(rest)
        ttl = ttl_from(options)
        u = urlsplit("redis://" + base)
        try:
            self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        except ValueError:
            raise MetadataError(f"redis metadata address {base!r} has an invalid port; "
                                f"use redis://host:6379[/db]") from None
        db_text = u.path.strip("/") or os.environ.get("MC_REDIS_DB_INDEX", "") or "0"
        if not db_text.isdigit():
            raise MetadataError(f"redis database {db_text!r} in {rest!r} is not a number; "
                                f"use redis://host:6379/0")
        super().__init__(f"redis://{self.host}:{self.port}/{db_text}", ttl, cluster_id)
        self.db = int(db_text)
        username = unquote(u.username) if u.username else os.environ.get("MC_REDIS_USERNAME")
        password = unquote(u.password) if u.password else os.environ.get("MC_REDIS_PASSWORD")
        # Mooncake's libcurl HTTP client allows 1.5 s to connect and 3 s per request;
        # the same bounds keep a dead redis from stalling an engine for long.
        self._client = _redis.Redis(host=self.host, port=self.port, db=self.db,
                                    username=username or None, password=password or None,
                                    socket_connect_timeout=min(1.5, timeout),
                                    socket_timeout=timeout, health_check_interval=0,
                                    retry=_one_quick_retry())
        self._ex = max(1, int(round(self.ttl)))

    # -- errors ------------------------------------------------------------------------
    def _error(self, what: str, e: Exception) -> MetadataError:
        msg = f"redis metadata store {self.address}: {what} failed: {str(e).rstrip('.')}."
        if isinstance(e, _redis.exceptions.AuthenticationError) or "AUTH" in str(e) \
                or "NOAUTH" in str(e) or "WRONGPASS" in str(e):
            msg += (" Check the username/password in the URL or MC_REDIS_USERNAME / "
                    "MC_REDIS_PASSWORD.")
        elif isinstance(e, _redis.exceptions.InvalidResponse):
            # An HTTP server answers "HTTP/1.1 400": redis-py reads reply type byte "H".
            msg += (identify_http(self.host, self.port) or
                    " The server does not speak the redis protocol; is this the redis port?")
        elif isinstance(e, _redis.exceptions.ResponseError) and "WRONGTYPE" in str(e):
            msg += (" The key holds a redis type other than a string: something other than "
                    "a mooncake engine wrote it; delete the key.")
        elif isinstance(e, _redis.exceptions.ConnectionError) and "refused" in str(e).lower():
            msg += f" Is redis-server running at {self.host}:{self.port}?"
        elif isinstance(e, _redis.exceptions.ConnectionError):
            # Connected, then cut off: something that is not redis (etcd closes a
            # connection whose first bytes are not HTTP or gRPC). Ask it what it is.
            msg += (identify_http(self.host, self.port) or
                    f" Is redis-server running and reachable at {self.host}:{self.port}?")
        elif isinstance(e, _redis.exceptions.TimeoutError):
            msg += f" Is {self.host}:{self.port} reachable from here (firewall, wrong host)?"
        msg += port_hint("redis", self.port)
        return MetadataError(msg, status=ERR_SOCKET, errno=getattr(e, "errno", None))

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            with self._lock:
                return fn(*args, **kwargs)
        except _redis.exceptions.RedisError as e:
            raise self._error(what, e) from None

    # -- KeyValueBackend ---------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        return self._call(f"GET {key!r}", self._client.get, key)

    def put(self, key: str, value: bytes) -> None:
        self._call(f"SET {key!r}", self._client.set, key, value)

    def delete(self, key: str) -> None:
        self._call(f"DEL {key!r}", self._client.delete, key)

    def keys(self, prefix: str) -> list[str]:
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        found = self._call(f"SCAN {pattern!r}",
                           lambda: list(self._client.scan_iter(match=pattern, count=1000)))
        return sorted(k.decode() if isinstance(k, bytes) else k for k in found)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return self._call(f"MGET of {len(keys)} keys", self._client.mget, keys)

    def put_many(self, items: dict[str, bytes]) -> None:
        if items:
            self._call(f"MSET of {len(items)} keys", self._client.mset, items)

    def delete_many(self, keys: list[str]) -> None:
        if keys:
            self._call(f"DEL of {len(keys)} keys", self._client.delete, *keys)

    def _put_leased(self, key: str, value: bytes) -> None:
        self._call(f"SET {key!r} EX {self._ex}", self._client.set, key, value, ex=self._ex)

    def _renew(self, records: dict[str, bytes]) -> None:
        def go():
            pipe = self._client.pipeline(transaction=False)
            rpc = [k for k in records if is_rpc_meta(k)]
            for key in rpc:
                # rpc_meta is written once (LeasedStore._publish_rpc_meta): renewing
                # extends its lifetime; it is SET again only when the store lost it.
                pipe.expire(key, self._ex)
            for key, value in records.items():
                if not is_rpc_meta(key):
                    pipe.set(key, value, ex=self._ex)
            kept = pipe.execute()[:len(rpc)]
            lost = [k for k, ok in zip(rpc, kept) if not ok]
            if lost:
                pipe = self._client.pipeline(transaction=False)
                for key in lost:
                    pipe.set(key, records[key], ex=self._ex)
                pipe.execute()
        self._call("renewing keys", go)

    def _close_client(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass


def _one_quick_retry():
    """redis-py retries a failed connect 3 times with exponential backoff by default
    (about 9 s against a closed port, where etcd and http fail at once); one immediate
    retry still replaces a pooled connection that a redis restart cut."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    return Retry(NoBackoff(), 1)

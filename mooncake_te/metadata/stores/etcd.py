# SPDX-License-Identifier: Apache-2.0
"""``etcd://h1:2379[,h2:2379]`` (or a bare ``h:2379``): segment descriptors in etcd v3.

Client choice, on evidence (tried 2026-12 with grpcio 1.85 and protobuf 7.36):

* ``etcd3`` 0.12.0 (last release 2020) fails at import: its generated ``*_pb2`` modules
  predate protobuf 4 ("Descriptors cannot be created directly ... downgrade the protobuf
  package to 3.20.x"), so it cannot live beside any current grpc/protobuf user.
* ``etcd-sdk-python`` (a regenerated fork of etcd3) imports and works, but drags grpcio
  and protobuf in, and a gRPC channel does not survive ``fork()`` (grpc's fork support
  is opt-in, ``GRPC_ENABLE_FORK_SUPPORT``), which serving frameworks do to workers.
* ``etcd3gw`` 2.7 (OpenStack, released 2026) speaks etcd's own gRPC-gateway JSON API
  (``/v3/kv/put``, ``/v3/lease/keepalive``; https://etcd.io/docs/v3.5/dev-guide/api_grpc_gateway/)
  over ``requests``: no protobuf at all, fork-safe, picks ``/v3``, ``/v3beta`` or
  ``/v3alpha`` from the server's ``/version``; put/get/lease/keepalive all worked
  against Debian's etcd 3.4. We use it: the ``[etcd]`` extra.

Keys are attached to one lease of ``ttl`` seconds per engine, kept alive every
``ttl / 3``; when etcd reports the lease gone (TTL -1 after an outage) a new one is
granted and the keys are put again. ``close()`` deletes the keys and revokes the lease.
"""
from __future__ import annotations

import base64
import logging

from ...errors import MetadataError, ERR_SOCKET
from ._leased import LeasedStore, port_hint, split_options, ttl_from

try:
    import etcd3gw as _etcd3gw
    from etcd3gw import exceptions as _etcd_exc
except ImportError:     # pragma: no cover - depends on the installed extras
    _etcd3gw = None

log = logging.getLogger("mooncake_te.metadata")


def _parse_endpoints(base: str) -> list[tuple[str, int]]:
    out = []
    for item in base.split(","):
        item = item.strip().rstrip("/")
        if not item:
            continue
        if "://" in item:        # etcd://h1:2379,http://h2:2379 is accepted too
            item = item.split("://", 1)[1]
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "2379"
        if not port.isdigit():
            raise MetadataError(f"etcd endpoint {item!r} is not host:port; "
                                f"use etcd://host:2379[,host2:2379]")
        out.append((host.strip("[]") or "127.0.0.1", int(port)))
    if not out:
        raise MetadataError("etcd metadata address is empty; use etcd://host:2379")
    return out


class EtcdStore(LeasedStore):
    """Segment descriptors in an etcd v3 cluster (any member answers).

    Parameters
    ----------
    rest : str
        ``host:port[,host:port...][?ttl=seconds]``.
    """

    kind = "etcd"

    def __init__(self, rest: str, cluster_id: str | None = None, timeout: float = 3.0):
        if _etcd3gw is None:
            raise MetadataError("metadata='etcd://...' needs the etcd client library: "
                                "pip install 'etcd3gw>=2.4' (or '.[etcd]' in a mooncake_te clone)")
        base, options = split_options(rest)
        ttl = ttl_from(options)
        self.endpoints = _parse_endpoints(base)
        super().__init__("etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints),
                         ttl, cluster_id)
        self._timeout = timeout
        self._clients = [_etcd3gw.client(host=h, port=p, timeout=timeout)
                         for h, p in self.endpoints]
        self._current = 0           # the member that answered last
        self._lease = None

    # -- transport & errors --------------------------------------------------------------
    def _error(self, what: str, errors: list) -> MetadataError:
        parts = []
        hint = ""
        for (host, port), e in errors:
            detail = getattr(e, "detail_text", None) or str(e) or type(e).__name__
            detail = " ".join(str(detail).split())
            if isinstance(e, _etcd_exc.ConnectionFailedError) and "refused" in detail.lower():
                parts.append(f"{host}:{port}: connection refused")
                hint = hint or " Nothing listens there: is etcd running?"
            elif isinstance(e, _etcd_exc.ConnectionFailedError) and any(
                    w in detail for w in ("BadStatusLine", "RemoteDisconnected", "aborted")):
                parts.append(f"{host}:{port}: the answer is not HTTP ({detail[:160]})")
                hint = hint or (" The server answered, but not as etcd's HTTP gateway "
                                "(a redis port? use redis://HOST:PORT).")
            elif isinstance(e, _etcd_exc.ConnectionTimeoutError):
                parts.append(f"{host}:{port}: timed out")
                hint = hint or " Is the address reachable from here (firewall, wrong host)?"
            else:
                parts.append(f"{host}:{port}: {type(e).__name__} {detail[:200]}")
                if '"code"' not in detail and ("404" in detail or "not found" in detail.lower()):
                    # A gateway error is JSON with a gRPC "code"; a bare 404 page is
                    # another kind of HTTP server on this port.
                    hint = hint or (" The server has no etcd v3 API there: an HTTP metadata "
                                    "server? use http://HOST:PORT/metadata.")
            if port_hint("etcd", port) not in hint:
                hint += port_hint("etcd", port)
        return MetadataError(f"etcd metadata store {self.address}: {what} failed "
                             f"({'; '.join(parts)}).{hint}", status=ERR_SOCKET)

    def _call(self, what: str, op):
        """Run ``op(client)`` on the member that answered last, failing over in turn."""
        errors = []
        with self._lock:
            n = len(self._clients)
            for i in range(n):
                idx = (self._current + i) % n
                try:
                    result = op(self._clients[idx])
                except (_etcd_exc.ConnectionFailedError, _etcd_exc.ConnectionTimeoutError,
                        _etcd_exc.InternalServerError, _etcd_exc.ApiVersionDiscoveryFailedError,
                        ) as e:
                    errors.append((self.endpoints[idx], e))
                    continue
                except _etcd_exc.Etcd3Exception as e:
                    raise self._error(what, [(self.endpoints[idx], e)]) from None
                except ValueError as e:     # a non-JSON answer: not etcd's gateway
                    raise self._error(what, [(self.endpoints[idx],
                                              _etcd_exc.Etcd3Exception(f"not JSON: {e}"))]) from None
                self._current = idx
                return result
        raise self._error(what, errors)

    # -- KeyValueBackend ---------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        values = self._call(f"get {key!r}", lambda c: c.get(key))
        return values[0] if values else None

    def put(self, key: str, value: bytes) -> None:
        self._call(f"put {key!r}", lambda c: c.put(key, value))

    def delete(self, key: str) -> None:
        self._call(f"delete {key!r}", lambda c: c.delete(key))

    def keys(self, prefix: str) -> list[str]:
        raw = prefix.encode()
        end = raw[:-1] + bytes([raw[-1] + 1]) if raw and raw[-1] < 255 else b"\0"
        body = {"key": base64.b64encode(raw).decode(), "range_end":
                base64.b64encode(end).decode(), "keys_only": True}
        resp = self._call(f"list {prefix!r}*", lambda c: c.post(c.get_url("/kv/range"),
                                                                json=body))
        return sorted(base64.b64decode(kv["key"]).decode() for kv in resp.get("kvs", ()))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        # One transaction of range requests per 128 keys (etcd's default --max-txn-ops),
        # so watching many peers costs one round trip per renewal period, not one each.
        out: list[bytes | None] = []
        for i in range(0, len(keys), 128):
            chunk = keys[i:i + 128]
            txn = {"success": [{"request_range": {"key": _b64(k)}} for k in chunk]}
            resp = self._call(f"read {len(chunk)} keys",
                              lambda c: c.post(c.get_url("/kv/txn"), json=txn))
            for r in resp.get("responses", ()):
                kvs = (r.get("response_range") or {}).get("kvs") or ()
                out.append(base64.b64decode(kvs[0]["value"]) if kvs and "value" in kvs[0]
                           else (b"" if kvs else None))
        if len(out) != len(keys):
            raise MetadataError(f"etcd metadata store {self.address}: a transaction of "
                                f"{len(keys)} reads answered {len(out)} results")
        return out

    def _txn(self, what: str, ops: list) -> None:
        for i in range(0, len(ops), 128):           # etcd's default --max-txn-ops
            chunk = ops[i:i + 128]
            self._call(f"{what} ({len(chunk)} keys)",
                       lambda c: c.post(c.get_url("/kv/txn"), json={"success": chunk}))

    def put_many(self, items: dict[str, bytes]) -> None:
        self._txn("put", [{"request_put": {"key": _b64(k), "value": base64.b64encode(
            v).decode()}} for k, v in items.items()])

    def delete_many(self, keys: list[str]) -> None:
        self._txn("delete", [{"request_delete_range": {"key": _b64(k)}}
                             for k in dict.fromkeys(keys)])

    # -- leases ------------------------------------------------------------------------
    def _grant(self):
        # The lease ID is cluster-wide, so any member can keep it alive later.
        ttl = max(1, int(round(self.ttl)))
        self._lease = self._call(f"grant a {ttl} s lease", lambda c: c.lease(ttl))
        return self._lease

    def _put_leased(self, key: str, value: bytes) -> None:
        with self._lock:
            lease = self._lease or self._grant()
            try:
                self._call(f"put {key!r}", lambda c: c.put(key, value, lease=lease))
            except MetadataError as e:
                if "lease not found" not in str(e):
                    raise
                # The lease expired (etcd unreachable for longer than the TTL) before the
                # renewer noticed: take a new one and put again; the renewer re-attaches
                # the other keys at its next pass (their keepalive reports TTL -1).
                lease = self._grant()
                self._call(f"put {key!r}", lambda c: c.put(key, value, lease=lease))

    def _renew(self, records: dict[str, bytes]) -> None:
        with self._lock:
            lease = self._lease
            ttl = -1
            if lease is not None:
                ttl = self._call("keep the lease alive",
                                 lambda c: _keepalive(c, lease.id))
            if ttl <= 0:
                # Expired (etcd unreachable for longer than the TTL) or never granted:
                # a new lease and the keys again, so the engine reappears.
                log.info("etcd lease of %s expired; granting a new one", self.address)
                self._lease = None
                for key, value in records.items():
                    self._put_leased(key, value)

    def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            self._call("revoke the lease", lambda c: c.post(c.get_url("/kv/lease/revoke"),
                                                            json={"ID": lease.id}))
        except MetadataError as e:
            if "lease not found" not in str(e):     # already expired: nothing to end
                raise

    def _close_client(self) -> None:
        for c in self._clients:
            try:
                c.session.close()
            except Exception:
                pass


def _b64(key: str) -> str:
    # The gateway carries bytes fields as base64 (proto3 JSON mapping).
    return base64.b64encode(key.encode()).decode()


def _keepalive(client, lease_id: int) -> int:
    # The gateway's keepalive answers {"result": {"TTL": n}}, TTL absent once the lease is
    # gone (rpc.swagger.json LeaseKeepAliveResponse); etcd3gw's Lease.refresh does the same
    # request but is bound to the client that granted the lease.
    result = client.post(client.get_url("/lease/keepalive"), json={"ID": lease_id})
    return int((result.get("result") or {}).get("TTL", -1))


__all__ = ["EtcdStore"]

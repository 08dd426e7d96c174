# SPDX-License-Identifier: Apache-2.0
"""The etcd, redis and HTTP metadata stores against real servers (tests/servers.py).

Backend level: publish/fetch/unpublish under Mooncake's keys, keys that expire once
their owner stops renewing (including a SIGKILLed owner process), server restarts,
wrong scheme or port, garbage under a key.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from servers import (HttpMetadataServer, RedisServer, etcd_server,  # noqa: F401
                     free_port, http_metadata_server, redis_server, require_client,
                     store_server)

from mooncake_te.errors import MetadataError, SegmentNotFoundError
from mooncake_te.metadata import BufferInfo, SegmentDescriptor, open_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TTL = 2


def with_ttl(url: str, ttl: float = TTL) -> str:
    return f"{url}?ttl={ttl:g}"


def descriptor(name: str, instance: str = "i-1", addr: int = 0x10000) -> SegmentDescriptor:
    return SegmentDescriptor(name=name, protocol="tcp", host="127.0.0.1", rpc_port=15003,
                             instance_id=instance, tcp_data_port=15004,
                             buffers=[BufferInfo(addr, 4096), BufferInfo(addr + 8192, 1 << 20)])


def wait_until(pred, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def exists(backend, name: str) -> bool:
    try:
        backend.fetch(name, 2.0)
        return True
    except SegmentNotFoundError:
        return False


# A separate owner process: publishes, says READY, then lives until killed.
OWNER = r"""
import sys, time
from mooncake_te.metadata import open_backend, SegmentDescriptor, BufferInfo
b = open_backend(sys.argv[1])
b.publish(SegmentDescriptor(name=sys.argv[2], protocol="tcp", host="127.0.0.1",
                            rpc_port=1, instance_id="owner", buffers=[BufferInfo(4096, 64)]))
print("READY", flush=True)
time.sleep(600)
"""


def spawn_owner(spec: str, name: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", OWNER, spec, name], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    line = p.stdout.readline()
    if line.strip() != b"READY":
        p.kill()
        raise AssertionError(f"owner did not start: {line!r} {p.stderr.read()[-2000:]!r}")
    return p


# -- basic round trips ----------------------------------------------------------------------
def test_publish_fetch_unpublish(store_server):
    w = open_backend(with_ttl(store_server.url))
    r = open_backend(store_server.url)
    try:
        d = descriptor("10.0.0.2:15003")
        w.publish(d)
        got = r.fetch(d.name, 2.0)
        assert got.instance_id == "i-1"
        assert [(b.address, b.length) for b in got.buffers] == [(0x10000, 4096),
                                                                (0x10000 + 8192, 1 << 20)]
        # Mooncake's layout, readable by operators' tooling
        meta = json.loads(r.get("mooncake/rpc_meta/10.0.0.2:15003"))
        assert meta == {"ip_or_host_name": "127.0.0.1", "rpc_port": 15003}
        ram = json.loads(r.get("mooncake/ram/10.0.0.2:15003"))
        assert ram["name"] == d.name and ram["protocol"] == "tcp"
        assert ram["buffers"][0]["addr"] == 0x10000 and ram["buffers"][0]["name"] == "cpu:0"
        # a re-publish (new registration) replaces the descriptor
        d.buffers.append(BufferInfo(0x900000, 16))
        w.publish(d)
        assert len(r.fetch(d.name, 2.0).buffers) == 3
        w.unpublish(d.name)
        assert not exists(r, d.name)
        assert r.get("mooncake/rpc_meta/10.0.0.2:15003") is None
    finally:
        w.close()
        r.close()


def test_cluster_id_prefixes_keys(store_server, monkeypatch):
    monkeypatch.setenv("MC_METADATA_CLUSTER_ID", "blue")
    w = open_backend(with_ttl(store_server.url))
    try:
        w.publish(descriptor("seg"))
        assert w.get("mooncake/blue/ram/seg") is not None
        assert w.get("mooncake/ram/seg") is None
        monkeypatch.setenv("MC_METADATA_CLUSTER_ID", "green")
        other = open_backend(store_server.url)
        with pytest.raises(SegmentNotFoundError):
            other.fetch("seg", 2.0)
        other.close()
    finally:
        w.close()


def test_close_removes_keys_at_once(store_server):
    w = open_backend(with_ttl(store_server.url, 30))
    r = open_backend(store_server.url)
    w.publish(descriptor("closing"))
    assert exists(r, "closing")
    w.close()
    w.close()       # idempotent
    assert not exists(r, "closing")
    with pytest.raises(MetadataError, match="closed"):
        w.publish(descriptor("closing"))
    r.close()


# -- liveness --------------------------------------------------------------------------------
def test_live_owner_outlives_ttl(store_server):
    w = open_backend(with_ttl(store_server.url))
    r = open_backend(store_server.url)
    try:
        w.publish(descriptor("alive"))
        time.sleep(TTL * 2.5)           # several TTLs: only renewal keeps it
        assert exists(r, "alive")
    finally:
        w.close()
        r.close()


def test_sigkilled_owner_disappears_within_ttl(store_server):
    r = open_backend(store_server.url)
    owner = spawn_owner(with_ttl(store_server.url), "doomed")
    try:
        assert exists(r, "doomed")
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        killed = time.monotonic()
        # etcd checks lease expiry every 500 ms; our server sweeps every 500 ms: generous
        # bound of TTL + 3 s for a loaded CI machine.
        assert wait_until(lambda: not exists(r, "doomed"), TTL + 3.0), \
            f"{store_server.name}: killed owner still listed after {TTL + 3.0} s"
        assert time.monotonic() - killed >= 0.0
        if store_server.name == "http-metadata":
            # HTTP: rpc_meta is written once without a TTL, as Mooncake's engine writes
            # it (Mooncake's server refuses to re-PUT it, so it cannot be renewed); the
            # ram key's TTL is the liveness, and a new engine under the name replaces
            # the leftover (test_compat_metadata.py).
            assert r.get("mooncake/rpc_meta/doomed") is not None
        else:
            # Both keys have the same TTL but were renewed one request apart: the second
            # may outlive the first by that much (seen under load).
            assert wait_until(lambda: r.get("mooncake/rpc_meta/doomed") is None, 1.0)
    finally:
        if owner.poll() is None:
            owner.kill()
        r.close()


def test_restarted_owner_replaces_descriptor(store_server):
    """A new instance under the same name (before the old one's TTL ran out) wins."""
    r = open_backend(store_server.url)
    owner = spawn_owner(with_ttl(store_server.url, 30), "phoenix")
    try:
        assert r.fetch("phoenix", 2.0).instance_id == "owner"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        w = open_backend(with_ttl(store_server.url))
        d = descriptor("phoenix", instance="reborn", addr=0x777000)
        d.rpc_port = 16000      # a new port: Mooncake's duplicate-rpc_meta rule must not bite
        w.publish(d)
        got = r.fetch("phoenix", 2.0)
        assert got.instance_id == "reborn" and got.buffers[0].address == 0x777000
        w.close()
    finally:
        if owner.poll() is None:
            owner.kill()
        r.close()


# -- the store going away and coming back ----------------------------------------------------
def test_store_down_is_metadata_error_then_recovers(store_server):
    w = open_backend(with_ttl(store_server.url))
    w.publish(descriptor("survivor"))
    store_server.kill()
    r = open_backend(store_server.url)
    with pytest.raises(MetadataError) as ei:
        r.fetch("survivor", 2.0)
    msg = str(ei.value)
    assert store_server.kind_word() in msg and str(store_server.port) in msg
    assert not isinstance(ei.value, SegmentNotFoundError)
    newcomer = open_backend(with_ttl(store_server.url))
    with pytest.raises(MetadataError):
        newcomer.publish(descriptor("newcomer"))
    newcomer.close()
    store_server.start()
    # etcd and the HTTP server keep their data; redis comes back empty and the owner's
    # renewer puts the keys back within one period (TTL / 3).
    assert wait_until(lambda: exists(r, "survivor"), TTL * 2), store_server.log_tail()
    w.close()
    assert not exists(r, "survivor")
    r.close()


def test_http_server_persistence_across_sigkill(tmp_path):
    with HttpMetadataServer(str(tmp_path)) as srv:
        w = open_backend(srv.url)
        w.put("mooncake/ram/plain", descriptor("plain").encode())   # no TTL: Mooncake-style
        srv.kill()
        srv.start()
        assert w.fetch("plain", 2.0).instance_id == "i-1"
        health = json.loads(w._session.get(srv.url.rsplit("/", 1)[0] + "/health").text)
        assert health["status"] == "ok" and health["keys"] == 1
        assert health["persist"] == str(tmp_path / "metadata.json")
        w.close()


def test_http_server_without_persistence_loses_keys(tmp_path):
    with HttpMetadataServer(str(tmp_path), persist=False) as srv:
        w = open_backend(srv.url)
        w.put("mooncake/ram/plain", descriptor("plain").encode())
        srv.kill()
        srv.start()
        assert w.get("mooncake/ram/plain") is None
        w.close()


# -- wrong addresses --------------------------------------------------------------------------
@pytest.mark.parametrize("scheme, spec, word", [
    ("etcd", "etcd://127.0.0.1:{}", "etcd"), ("redis", "redis://127.0.0.1:{}", "redis"),
    ("http", "http://127.0.0.1:{}/metadata", "HTTP")])
def test_connection_refused_names_backend_and_address(scheme, spec, word):
    require_client(scheme)
    port = free_port()
    b = open_backend(spec.format(port))
    with pytest.raises(MetadataError) as ei:
        b.fetch("x", 1.0)
    msg = str(ei.value)
    assert word in msg and f"127.0.0.1:{port}" in msg and "running" in msg, msg
    b.close()


def test_http_backend_given_the_etcd_port(etcd_server):
    b = open_backend(f"http://127.0.0.1:{etcd_server.port}/metadata")
    with pytest.raises(MetadataError) as ei:
        b.fetch("x", 1.0)
    msg = str(ei.value)
    assert "404" in msg and "etcd server" in msg and f"etcd://127.0.0.1:{etcd_server.port}" in msg
    b.close()


def test_redis_backend_given_the_etcd_port(etcd_server):
    b = open_backend(f"redis://127.0.0.1:{etcd_server.port}")
    with pytest.raises(MetadataError) as ei:
        b.fetch("x", 1.0)
    msg = str(ei.value)
    assert "redis" in msg and "is an etcd server" in msg and \
        f"etcd://127.0.0.1:{etcd_server.port}" in msg, msg
    b.close()


def test_etcd_backend_given_the_redis_port(redis_server):
    b = open_backend(f"etcd://127.0.0.1:{redis_server.port}")
    with pytest.raises(MetadataError) as ei:
        b.fetch("x", 1.0)
    msg = str(ei.value)
    assert "etcd" in msg and "redis://" in msg, msg
    b.close()


def test_etcd_backend_given_the_http_server(http_metadata_server):
    b = open_backend(f"etcd://127.0.0.1:{http_metadata_server.port}")
    with pytest.raises(MetadataError) as ei:
        b.fetch("x", 1.0)
    assert "http://HOST:PORT/metadata" in str(ei.value), str(ei.value)
    b.close()


def test_default_port_hint():
    require_client("redis")
    b = open_backend("redis://127.0.0.1:2379")     # nothing listens on 2379 here
    with pytest.raises(MetadataError, match="2379 is etcd's default port"):
        b.fetch("x", 1.0)
    b.close()


def test_etcd_failover_to_a_live_member(etcd_server):
    dead = free_port()
    b = open_backend(f"etcd://127.0.0.1:{dead},127.0.0.1:{etcd_server.port}?ttl=2")
    try:
        b.publish(descriptor("multi"))
        assert b.fetch("multi", 2.0).instance_id == "i-1"
    finally:
        b.close()


@pytest.mark.parametrize("spec, match, client", [
    ("zookeeper://h:2181", "unknown metadata backend", None),
    ("etcd://", "names no server address", None),
    ("redis://127.0.0.1:6379/zero", "not a number", "redis"),
    ("redis://127.0.0.1:6379?ttl=soon", "not a number of seconds", "redis"),
    ("http://127.0.0.1:8080/metadata?ttl=0.1", "too short", "http"),
    ("etcd://127.0.0.1:abc", "not host:port", "etcd"),
])
def test_bad_specs(spec, match, client):
    if client:          # checked by the backend, after it found its client library
        require_client(client)
    with pytest.raises(MetadataError, match=match):
        open_backend(spec)


def test_missing_client_library_names_the_extra(monkeypatch):
    from mooncake_te.metadata.stores import etcd, redis, http
    # Both forms that work (mooncake-te is not on PyPI: never `pip install mooncake-te[x]`,
    # issue 41, item 1): the client library itself, or the extra from a clone.
    for mod, attr, spec, lib, extra in (
            (etcd, "_etcd3gw", "etcd://h:2379", "'etcd3gw>=2.4'", "'.[etcd]'"),
            (redis, "_redis", "redis://h:6379", "'redis[hiredis]>=5'", "'.[redis]'"),
            (http, "_requests", "http://h:8080/metadata", "'requests>=2.28'", "'.[http]'")):
        monkeypatch.setattr(mod, attr, None)
        with pytest.raises(MetadataError) as ei:
            open_backend(spec)
        msg = str(ei.value)
        assert f"pip install {lib}" in msg and f"{extra} in a mooncake_te clone" in msg, msg
        assert "mooncake-te[" not in msg


# -- garbage -----------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [b"\xff\xfe not json", b"[1, 2, 3]", b'{"name": "g"}',
                                 b'{"name":"g","protocol":"tcp","buffers":[{"addr":"x"}]}'])
def test_garbage_under_a_key_is_a_clear_error(store_server, raw):
    b = open_backend(store_server.url)
    try:
        b.put("mooncake/ram/g", raw)
        with pytest.raises(MetadataError) as ei:
            b.fetch("g", 2.0)
        msg = str(ei.value)
        assert "'mooncake/ram/g'" in msg and "not a segment descriptor" in msg, msg
        assert not isinstance(ei.value, SegmentNotFoundError)
    finally:
        b.delete("mooncake/ram/g")
        b.close()


# -- config.toml mapping -----------------------------------------------------------------------
@pytest.mark.parametrize("kind, addr, spec", [
    ("etcd", "10.0.0.1:2379", "etcd://10.0.0.1:2379"),
    ("etcd", "10.0.0.1:2379,10.0.0.2:2379", "etcd://10.0.0.1:2379,10.0.0.2:2379"),
    ("redis", "10.0.0.1:6379/2", "redis://10.0.0.1:6379/2"),
    ("http", "10.0.0.1:8080", "http://10.0.0.1:8080/metadata"),
    ("http", "http://10.0.0.1:8080/meta", "http://10.0.0.1:8080/meta"),
    ("p2p", "", "p2p"),
])
def test_spec_from_config(kind, addr, spec):
    from mooncake_te.metadata.stores import spec_from_config
    assert spec_from_config(kind, addr) == spec


def test_spec_from_config_contradiction():
    from mooncake_te.metadata.stores import spec_from_config
    with pytest.raises(MetadataError, match="make them agree"):
        spec_from_config("redis", "etcd://10.0.0.1:2379")
    with pytest.raises(MetadataError, match="needs server_address"):
        spec_from_config("etcd", "")


# -- noticing a restarted or vanished peer ---------------------------------------------------
def test_on_change_reports_restart_and_disappearance(store_server):
    events = []
    r = open_backend(with_ttl(store_server.url))
    r.on_change = lambda name, inst: events.append((name, inst))
    owner = spawn_owner(with_ttl(store_server.url), "watched")
    w = None
    try:
        assert r.fetch("watched", 2.0).instance_id == "owner"
        time.sleep(TTL)
        assert events == []                 # renewals are not changes
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        w = open_backend(with_ttl(store_server.url))
        w.publish(descriptor("watched", instance="second"))
        assert wait_until(lambda: ("watched", "second") in events, TTL * 2), events
        w.close()                           # a clean close: the peer is gone
        assert wait_until(lambda: ("watched", None) in events, TTL * 2), events
    finally:
        if owner.poll() is None:
            owner.kill()
        r.close()


def test_etcd_publish_after_the_lease_expired(etcd_server):
    """An etcd outage longer than the TTL ends the lease; the next publish takes a new one."""
    w = open_backend(with_ttl(etcd_server.url, 30))
    r = open_backend(etcd_server.url)
    try:
        w.publish(descriptor("lapsed"))
        w._release()                    # as if etcd had let the lease expire: keys go too
        assert not exists(r, "lapsed")
        w._lease = type("Gone", (), {"id": 1234567})()      # the engine still holds its id
        w.publish(descriptor("lapsed", instance="again"))
        assert r.fetch("lapsed", 2.0).instance_id == "again"
    finally:
        w.close()
        r.close()


def test_redis_credentials_from_url_and_environment(tmp_path, monkeypatch):
    with RedisServer(str(tmp_path), password="s3cret") as srv:
        base = f"127.0.0.1:{srv.port}"
        # in the URL, with a database index
        w = open_backend(f"redis://:s3cret@{base}/3?ttl=2")
        try:
            w.publish(descriptor("authed"))
            assert w.db == 3
            # Mooncake's variables, when the URL carries none
            monkeypatch.setenv("MC_REDIS_PASSWORD", "s3cret")
            monkeypatch.setenv("MC_REDIS_DB_INDEX", "3")
            r = open_backend(f"redis://{base}")
            assert r.fetch("authed", 2.0).instance_id == "i-1"
            r.close()
            monkeypatch.setenv("MC_REDIS_DB_INDEX", "4")         # another database: not there
            r = open_backend(f"redis://{base}")
            with pytest.raises(SegmentNotFoundError):
                r.fetch("authed", 2.0)
            r.close()
            monkeypatch.setenv("MC_REDIS_PASSWORD", "wrong")
            r = open_backend(f"redis://{base}")
            with pytest.raises(MetadataError, match="MC_REDIS_PASSWORD"):
                r.fetch("authed", 2.0)
            r.close()
        finally:
            w.close()


def test_engine_takes_the_store_from_config_toml(tmp_path, store_server):
    import mooncake_te as mte
    kind = {"etcd": "etcd", "redis": "redis", "http-metadata": "http"}[store_server.name]
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[metadata]\nserver_type = "{kind}"\n'
                   f'server_address = "127.0.0.1:{store_server.port}"\n')
    r = open_backend(store_server.url)
    try:
        with mte.TransferEngine(name="from-config", config=str(cfg), host="127.0.0.1") as eng:
            got = r.fetch("from-config", 2.0)
            assert got.instance_id == eng.descriptor().instance_id and got.host == "127.0.0.1"
        assert not exists(r, "from-config")
    finally:
        r.close()


def test_get_many_in_one_pass(store_server):
    """The peer watch and the KV cache's owner index read many keys at once (etcd:
    transactions of 128, redis: MGET, our HTTP server: POST /metadata/batch)."""
    b = open_backend(store_server.url)
    try:
        keys = [f"many/{i}" for i in range(300)]
        for i in range(0, 300, 7):
            b.put(keys[i], str(i).encode())
        got = b.get_many(keys)
        assert got == [str(i).encode() if i % 7 == 0 else None for i in range(300)]
    finally:
        for i in range(0, 300, 7):
            b.delete(keys[i])
        b.close()

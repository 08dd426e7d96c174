# SPDX-License-Identifier: Apache-2.0
"""Engines in separate processes finding each other through etcd, redis and the HTTP
metadata server (real servers from tests/servers.py), and what happens when an engine
or the metadata server dies.
"""
from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from peers import PeerProcess
from servers import EtcdServer, HttpMetadataServer, RedisServer, _serve

import mooncake_te as mte
from mooncake_te.errors import MetadataError, SegmentNotFoundError

TTL = 2
KINDS = {"etcd": EtcdServer, "redis": RedisServer, "http": HttpMetadataServer}


@pytest.fixture(scope="module", params=list(KINDS))
def store(request):
    """One server of each kind, shared by the tests that leave it running."""
    yield from _serve(KINDS[request.param])


@pytest.fixture(params=list(KINDS))
def fresh_store(request):
    """A server of each kind that the test may kill and restart."""
    yield from _serve(KINDS[request.param])


def spec(server) -> str:
    return f"{server.url}?ttl={TTL}"


def sha(data) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def wait_until(pred, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def listed(eng, name: str) -> bool:
    try:
        eng.open_segment(name, refresh=True)
        return True
    except SegmentNotFoundError:
        return False


def test_three_engines_find_each_other_and_move_data(store):
    url = spec(store)
    peers = [PeerProcess(1 << 20, metadata=url, name=f"{store.name}-{i}") for i in range(3)]
    try:
        with mte.TransferEngine(name=f"{store.name}-driver", metadata=url, host="127.0.0.1") as eng:
            # by name, not address: the store resolves them
            for p in peers:
                seg = eng.open_segment(p.name)
                assert seg.name == p.name
                assert any(b.address == p.address and b.length == p.size for b in seg.buffers)
            # a ring of writes between the peers, checksummed at the targets
            n = 300_000
            for i, src in enumerate(peers):
                dst = peers[(i + 1) % 3]
                digest = src.call("write_pattern", dst.name, dst.address, n, 100 + i, 65536)
                assert dst.call("sha", dst.address, n) == digest
            # and from this process: write, then read back
            buf = np.random.default_rng(7).integers(0, 256, 2 * n, dtype=np.uint8)
            r = eng.register(buf)
            eng.write(peers[0].name, r.address, peers[0].address, n)
            assert peers[0].call("sha", peers[0].address, n) == sha(buf[:n])
            eng.read(peers[2].name, r.address + n, peers[2].address, n)
            assert sha(buf[n:]) == peers[2].call("sha", peers[2].address, n)
    finally:
        for p in peers:
            p.close()


def test_closed_engine_is_withdrawn_at_once(store):
    url = spec(store)
    with mte.TransferEngine(name=f"{store.name}-watcher", metadata=url, host="127.0.0.1") as eng:
        p = PeerProcess(4096, metadata=url, name=f"{store.name}-leaving")
        assert listed(eng, p.name)
        p.close()           # a clean close deletes its keys; no TTL wait
        assert not listed(eng, p.name)


def test_sigkilled_engine_disappears_within_ttl(store):
    url = spec(store)
    with mte.TransferEngine(name=f"{store.name}-observer", metadata=url, host="127.0.0.1") as eng:
        p = PeerProcess(4096, metadata=url, name=f"{store.name}-victim")
        try:
            assert listed(eng, p.name)
            p.kill()
            assert wait_until(lambda: not listed(eng, p.name), TTL + 3.0), \
                f"SIGKILLed engine still listed in {store.name} after {TTL + 3.0} s"
            with pytest.raises(SegmentNotFoundError, match=p.name):
                eng.open_segment(p.name, refresh=True)
        finally:
            p.kill()


def test_restarted_peer_with_same_name_and_new_buffers(store):
    url = spec(store)
    name = f"{store.name}-phoenix"
    n = 65536
    with mte.TransferEngine(name=f"{store.name}-writer", metadata=url, host="127.0.0.1") as eng:
        src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        r = eng.register(src)
        old = PeerProcess(1 << 20, metadata=url, name=name)
        try:
            eng.write(name, r.address, old.address, n)          # caches old's descriptor
            assert old.call("sha", old.address, n) == sha(src)
            old_instance = eng.open_segment(name).instance_id
        finally:
            old.kill()          # SIGKILL: its keys are still in the store for up to TTL
        new = PeerProcess(3 << 20, metadata=url, name=name)     # same name, new buffers
        try:
            src[:] = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
            # No refresh asked for: the engine must notice the new instance by itself.
            # The first transfer may fail (it was aimed at the dead instance's data port;
            # retrying it blindly could write old addresses into new memory), but it drops
            # the stale descriptor, so the next one reaches the new instance.
            try:
                eng.write(name, r.address, new.address + 4096, n)
            except mte.TransferError as e:
                assert name in str(e) and ("restarted" in str(e) or "lost" in str(e)), str(e)
                eng.write(name, r.address, new.address + 4096, n)
            assert new.call("sha", new.address + 4096, n) == sha(src)
            seg = eng.open_segment(name)
            assert seg.instance_id != old_instance
            assert any(b.address == new.address and b.length == 3 << 20 for b in seg.buffers)
        finally:
            new.close()


def test_metadata_server_killed_and_restarted(fresh_store):
    url = spec(fresh_store)
    kind = fresh_store.name
    a = PeerProcess(1 << 20, metadata=url, name=f"{kind}-a")
    b = PeerProcess(1 << 20, metadata=url, name=f"{kind}-b")
    try:
        n = 100_000
        digest = a.call("write_pattern", b.name, b.address, n, 1, 8192)
        assert b.call("sha", b.address, n) == digest        # a now knows b

        fresh_store.kill()
        # peers that already know each other keep working
        digest = a.call("write_pattern", b.name, b.address, n, 2, 8192)
        assert b.call("sha", b.address, n) == digest
        # a new engine cannot publish itself: a clear MetadataError naming the store
        with pytest.raises(MetadataError) as ei:
            mte.TransferEngine(name=f"{kind}-late", metadata=url, host="127.0.0.1")
        assert fresh_store.kind_word() in str(ei.value) and str(fresh_store.port) in str(ei.value)

        fresh_store.start()
        # etcd and the HTTP server (persisted) keep the keys; redis restarts empty and
        # the peers' renewers put theirs back within TTL / 3.
        with mte.TransferEngine(name=f"{kind}-late", metadata=url, host="127.0.0.1") as late:
            assert wait_until(lambda: listed(late, a.name) and listed(late, b.name), TTL * 3), \
                fresh_store.log_tail()
            buf = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
            r = late.register(buf)
            late.write(b.name, r.address, b.address, n)
            assert b.call("sha", b.address, n) == sha(buf)
            digest = b.call("write_pattern", late.name, r.address, n, 4, 8192)
            assert sha(buf) == digest
    finally:
        a.close()
        b.close()


def test_restarted_peer_noticed_before_the_next_transfer(store):
    """The store's change reports reach the engine's cache: a peer restarted some time ago
    is re-resolved before the next transfer, which succeeds at the first try."""
    url = spec(store)
    name = f"{store.name}-lazarus"
    n = 32768
    with mte.TransferEngine(name=f"{store.name}-early", metadata=url, host="127.0.0.1") as eng:
        assert getattr(eng._backend, "on_change", None) is not None, \
            "the engine must wire backend.on_change to its descriptor cache"
        src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        r = eng.register(src)
        old = PeerProcess(1 << 20, metadata=url, name=name)
        try:
            eng.write(name, r.address, old.address, n)
            old_instance = eng.open_segment(name).instance_id
        finally:
            old.kill()
        new = PeerProcess(2 << 20, metadata=url, name=name)
        try:
            # the cached descriptor (no refresh asked) turns over within a renewal period
            assert wait_until(lambda: eng.open_segment(name).instance_id != old_instance,
                              TTL * 2)
            eng.write(name, r.address, new.address, n)
            assert new.call("sha", new.address, n) == sha(src)
        finally:
            new.close()

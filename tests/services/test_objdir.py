# SPDX-License-Identifier: Apache-2.0
"""The object directory (issue 40): owner records with MACs, published and looked up in
batches on every metadata store the index lives in (etcd, redis, our HTTP server), and
the verified READ: a checksum that does not match is a miss, and nothing lands outside
the destination."""
from __future__ import annotations

import json

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.auth import derive_key, mac
from mooncake_te.metadata import open_backend
from mooncake_te.objdir import (ObjectDirectory, OwnerDirectory, area_prefix,
                                crc32_held, crc32_released, parse_tier, read_verified,
                                record_key, record_mac, record_mac_ok)
from store_fixtures import _loopback, index_url  # noqa: F401

KEY = derive_key(b"objdir-test-token", "objdir-test")


@pytest.fixture
def store(index_url):  # noqa: F811
    s = open_backend(index_url)
    yield s
    s.close()


def keys(n: int, tag: int = 0) -> list:
    return [(tag << 64 | i).to_bytes(16, "big") for i in range(n)]


def test_batch_publish_and_lookup_on_each_store(store):
    ks = keys(40, 1)
    a = OwnerDirectory(store, "objdir-test/batch", "eng-a", mac_key=KEY)
    b = OwnerDirectory(store, "objdir-test/batch", "eng-b", mac_key=KEY)
    try:
        for i, k in enumerate(ks):
            a.publish(k, 4096 * (i + 1), 100 + i, i * 7)
        assert a.flush()
        got = b.lookup_many(ks + keys(3, 2))            # 40 records and 3 never published
        assert got[:40] == [("eng-a", 4096 * (i + 1), 100 + i, i * 7) for i in range(40)]
        assert got[40:] == [None] * 3
        assert b.lookup_prefix(ks) == 40 and a.lookup_many(ks[:2]) == [None, None]  # ours
        assert b.rejected == 0
        # A demotion keeps the record, as SSD: a router sees it, a reader does not.
        a.demote(ks[0], 100, 0)
        a.withdraw(ks[1])
        b.withdraw(ks[2])                               # not b's: stays
        assert a.flush() and b.flush()
        assert b.lookup_tiers(ks[:3]) == [("eng-a", "ssd"), None, ("eng-a", "dram")]
        assert b.lookup_many(ks[:3]) == [None, None, ("eng-a", 4096 * 3, 102, 14)]
        assert b.lookup_prefix(ks) == 0
        b.drop(ks[2])                                   # removed: whoever owns it
        assert b.flush() and b.lookup_many([ks[2]]) == [None]
        assert [parse_tier(r) for r in store.get_many([a._key(ks[0]), a._key(ks[1])])] == \
            [("eng-a", "ssd"), None]
    finally:
        a.close(withdraw_all=ks)
        b.close()
    assert store.get_many([a._key(k) for k in ks]) == [None] * 40


def test_a_tampered_record_is_refused(store):
    k = keys(1, 3)[0]
    a = OwnerDirectory(store, "objdir-test/mac", "eng-a", mac_key=KEY)
    b = OwnerDirectory(store, "objdir-test/mac", "eng-b", mac_key=KEY)
    other = OwnerDirectory(store, "objdir-test/mac", "eng-b",
                           mac_key=derive_key(b"another token", "objdir-test"))
    try:
        a.publish(k, 8192, 64, 0x1234)
        assert a.flush()
        good = json.loads(store.get(a._key(k)))
        assert b.lookup(k) == ("eng-a", 8192, 64, 0x1234)
        assert other.lookup(k) is None and other.rejected == 1     # another token's key
        for field, value in [("addr", 4096), ("length", 63), ("crc", 0x1235),
                             ("owner", "eng-x"), ("tier", "ssd"), ("mac", "0" * 64)]:
            store.put(a._key(k), json.dumps(dict(good, **{field: value})).encode())
            before = b.rejected
            assert b.lookup(k) is None and b.lookup_tiers([k]) == [None], field
            assert b.rejected == before + 2, field
        for bad in (b"not json", b'{"owner": "eng-a"}', json.dumps(
                dict(good, addr=(1 << 64) - 10)).encode()):
            store.put(a._key(k), bad)
            assert b.lookup(k) is None
        # Without a MAC key records are read unauthenticated, malformed ones still refused.
        store.put(a._key(k), json.dumps(dict(good, mac="forged")).encode())
        plain = OwnerDirectory(store, "objdir-test/mac", "eng-c")
        assert plain.lookup(k) == ("eng-a", 8192, 64, 0x1234)
        plain.close()
    finally:
        store.delete(a._key(k))
        for d in (a, b, other):
            d.close()


def test_the_record_is_the_one_older_engines_wrote(store):
    """Issue 40 moved the KV cache's owner index here: a DRAM record is byte for byte
    what it was (``{"owner", "addr", "length", "crc", "mac"}``, MAC over the
    length-prefixed key, owner, address, length and CRC), so mixed versions share."""
    k = keys(1, 4)[0]
    d = OwnerDirectory(store, "kvcache/compat", "eng-a", mac_key=KEY)
    try:
        parts = (k, b"eng-a", (4096).to_bytes(8, "little"), (10).to_bytes(8, "little"),
                 (7).to_bytes(4, "little"))
        legacy = json.dumps({"owner": "eng-a", "addr": 4096, "length": 10, "crc": 7,
                             "mac": mac(KEY, *parts)}).encode()
        assert d.encode(k, 4096, 10, 7) == legacy
        assert d._key(k) == area_prefix(store, "kvcache/compat") + k.hex()
        store.put(d._key(k), legacy)
        reader = OwnerDirectory(store, "kvcache/compat", "eng-b", mac_key=KEY)
        assert reader.lookup(k) == ("eng-a", 4096, 10, 7)
        reader.close()
    finally:
        store.delete(d._key(k))
        d.close()


def test_one_record_mac_for_every_kind_of_record():
    """The record MAC (issue 40) that owner records and the P2P store's holder entries
    share: a key per kind of record, fields length-prefixed, any tampering refused."""
    assert record_key(None, "kind-a") is None and record_key(b"", "kind-a") is None
    ka, kb = record_key(b"tok", "kind-a"), record_key(b"tok", "kind-b")
    assert ka is not None and kb is not None
    assert ka == derive_key(b"tok", "kind-a") != kb
    tag = record_mac(ka, b"x", "y")                  # a str field is its UTF-8
    assert tag == mac(ka, b"x", b"y") and len(tag) == 64
    assert record_mac_ok(ka, tag, "x", b"y")
    assert not record_mac_ok(kb, tag, b"x", b"y")                 # another kind's key
    assert not record_mac_ok(record_key(b"other", "kind-a"), tag, b"x", b"y")
    assert not record_mac_ok(ka, tag, b"xy", b"")                 # length-prefixed
    assert not record_mac_ok(ka, tag, b"x", b"y", b"")
    assert not record_mac_ok(ka, tag, b"x", b"z")
    for bad in (None, 5, b"x", tag.upper(), tag[:32], "\u00e9" * 64, ""):
        assert not record_mac_ok(ka, bad, b"x", b"y"), bad


def test_directory_batches_and_read_modify_write(store):
    d = ObjectDirectory(store, "objdir-test/area/")
    assert d.prefix.endswith("objdir-test/area/") and d.key("x") == d.prefix + "x"
    d.put_many({f"n{i}": str(i).encode() for i in range(5)})
    assert d.get_many([f"n{i}" for i in range(6)]) == [b"0", b"1", b"2", b"3", b"4", None]
    assert d.update("list", lambda v: {"names": sorted(set(v["names"]) | {"a"})},
                    {"names": []})
    assert d.get_json("list", None) == {"names": ["a"]}
    d.put("bad", b"{")
    assert d.get_json("bad", "dflt") == "dflt"
    d.delete_many([f"n{i}" for i in range(5)] + ["list", "bad"])
    assert d.get_many(["n0", "list"]) == [None, None] and d.errors == 0


def test_an_outage_is_a_miss_not_an_error():
    from mooncake_te.metadata.base import KeyValueBackend

    class Down(KeyValueBackend):
        kind = "down"

        def get(self, key):
            raise ConnectionError("store down")

        def put(self, key, value):
            raise ConnectionError("store down")

        def delete(self, key):
            raise ConnectionError("store down")

    d = OwnerDirectory(Down(""), "objdir-test/down", "eng-a")
    try:
        assert d.lookup_many(keys(3)) == [None] * 3 and d.dir.errors == 1
        d.publish(keys(1)[0], 4096, 1, 1)
        assert d.flush() and d.errors == 1      # the writer thread survives
    finally:
        d.close()


# --- the verified READ ----------------------------------------------------------------
GUARD = 0xAB


def test_a_checksum_mismatch_is_a_miss_and_nothing_lands_beyond_the_destination():
    src = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.full(3 << 16, GUARD, np.uint8)            # the destination is the middle third
    with mte.TransferEngine(host="127.0.0.1", name="objdir-owner") as owner, \
            mte.TransferEngine(host="127.0.0.1", name="objdir-reader") as reader:
        owner.register(src, access="r")
        seg = owner.name
        reader.register(dst)
        local, n = dst.ctypes.data + (1 << 16), 1 << 16
        mid = dst[1 << 16:2 << 16]
        want = crc32_held(src)
        item = (seg, local, src.ctypes.data, n)
        ok = read_verified(reader, [item], lambda i: crc32_held(mid) == want ^ 1)
        assert ok == [False]                            # wrong checksum: a miss
        assert (dst[:1 << 16] == GUARD).all() and (dst[2 << 16:] == GUARD).all()
        mid[:] = 0
        # Two pieces of one item (a chunk split over regions), checked as one.
        half = n // 2
        split = [(seg, local, src.ctypes.data, half),
                 (seg, local + half, src.ctypes.data + half, n - half)]
        errors: dict = {}
        ok = read_verified(reader, [split, ("no-such-engine", dst.ctypes.data,
                                            src.ctypes.data, 16)],
                           lambda i: crc32_released(mid) == want, errors=errors)
        assert ok == [True, False] and list(errors) == [1]      # the unknown owner: a miss
        assert (mid == src).all()
        assert (dst[:1 << 16] == GUARD).all() and (dst[2 << 16:] == GUARD).all()
        # A READ past the owner's registered memory fails (a miss), it is never served.
        bad = (seg, local, src.ctypes.data + n - 8, 64)
        assert read_verified(reader, [bad], lambda i: True) == [False]
        # A record naming more bytes than the destination holds: refused before any READ,
        # although the bytes past it are registered memory the engine would write.
        mid[:] = 0
        long = (seg, local + 64, src.ctypes.data, n)      # ends 64 bytes past the slot
        assert read_verified(reader, [long], lambda i: True, bounds=[(local, n)]) == [False]
        assert (mid == 0).all() and (dst[2 << 16:] == GUARD).all()
        assert read_verified(reader, [item], lambda i: True, bounds=[(local, n)]) == [True]
        # A destination outside the reader's registered memory is refused, not written.
        outside = np.full(64, GUARD, np.uint8)
        assert read_verified(reader, [(seg, outside.ctypes.data,
                                       src.ctypes.data, 64)], lambda i: True) == [False]
        assert (outside == GUARD).all()


def test_p2p_store_lists_what_it_does_not_hold_with_one_batch_lookup(index_url,  # noqa: F811
                                                                     monkeypatch):
    """The P2P store's manifests are records of the object directory: ``list()`` reads
    those of objects it does not hold in one ``get_many``, not one ``get`` each."""
    from mooncake_te.p2p_store import P2PStore
    with mte.TransferEngine(host="127.0.0.1", metadata=index_url) as ea, \
            mte.TransferEngine(host="127.0.0.1", metadata=index_url) as eb:
        pub, other = P2PStore(ea), P2PStore(eb)
        try:
            for i in range(3):
                pub.register(f"objdir-list-{i}", np.full(1 << 12, i, np.uint8))
            backend = other.directory.backend
            calls = {"get": 0, "get_many": 0}
            for name in calls:
                real = getattr(backend, name)

                def counted(*a, _real=real, _name=name):
                    calls[_name] += 1
                    return _real(*a)
                monkeypatch.setattr(backend, name, counted)
            got = [(o.name, o.held, o.size) for o in other.list()]
            assert got == [(f"objdir-list-{i}", None, 1 << 12) for i in range(3)]
            assert calls == {"get": 1, "get_many": 1}       # the name list, the manifests
        finally:
            other.close()
            pub.close()

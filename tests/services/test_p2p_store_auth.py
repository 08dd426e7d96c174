# SPDX-License-Identifier: Apache-2.0
"""The P2P store's control port is guarded like the engine's RPC port (issue #20 item 9):
with the engine's auth_token a peer proves the token before its first request; without
it, nothing is answered. Its accept loop sheds floods and keeps serving."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import time

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.errors import AuthenticationError
from mooncake_te.metadata import framing, open_backend
from mooncake_te.objdir import record_key, record_mac
from mooncake_te.p2p_store import P2PStore
from mooncake_te.p2p_store.control import FRAME, ControlClient
from mooncake_te.p2p_store.directory import HOLDER_LABEL, StoreDirectory
from mooncake_te.p2p_store.manifest import HolderRef, Manifest
from servers import redis_server  # noqa: F401

TOKEN = b"p2p-cluster-secret"


@pytest.fixture
def seed_store():
    eng = mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN)
    store = P2PStore(eng, metadata="p2p")
    yield eng, store
    store.close()
    eng.close()


def _raw_request(address: str, request: dict) -> tuple[int, dict]:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        framing.send_frame(s, FRAME, json.dumps(request).encode())
        kind, raw = framing.recv_frame(s)
        return kind, json.loads(raw)


def test_control_port_refuses_unauthenticated_requests(seed_store):
    eng, store = seed_store
    data = np.arange(1 << 16, dtype=np.uint8)
    store.register("obj", data)
    kind, reply = _raw_request(store.address, {"op": "list"})
    assert kind == framing.AUTH_FAILED and "auth_token" in reply["reply_msg"]
    deadline = time.monotonic() + 5         # counted just after the refusal is sent
    while store._server.auth_failures < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store._server.auth_failures == 1
    with pytest.raises(AuthenticationError, match="does not authenticate|differ"):
        ControlClient(store.address, 2.0, b"wrong-token").call({"op": "list"})
    reply = ControlClient(store.address, 2.0, TOKEN).call({"op": "list"})
    assert reply["ok"]


def test_stores_with_a_token_share_objects(seed_store):
    eng, store = seed_store
    data = np.random.default_rng(3).integers(0, 256, 1 << 18, dtype=np.uint8)
    store.register("obj", data)
    with mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN) as eng2:
        getter = P2PStore(eng2, metadata="p2p", seeds=[store.address])
        try:
            got = getter.get("obj")
            assert bytes(got) == data.tobytes()
        finally:
            getter.close()


def test_getter_without_the_token_is_refused(seed_store):
    eng, store = seed_store
    store.register("obj", np.zeros(1 << 16, np.uint8))
    with mte.TransferEngine(host="127.0.0.1") as eng2:
        getter = P2PStore(eng2, metadata="p2p", seeds=[store.address])
        try:
            with pytest.raises(mte.errors.MooncakeError):
                getter.get("obj")
        finally:
            getter.close()


def test_control_port_sheds_a_flood_and_keeps_serving(seed_store):
    from mooncake_te.p2p_store import control
    eng, store = seed_store
    host, port = store.address.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=5)
             for _ in range(control.MAX_PER_PEER + 10)]
    time.sleep(0.5)
    assert store._server.shed >= 10
    for s in socks:
        s.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert ControlClient(store.address, 2.0, TOKEN).call({"op": "list"})["ok"]
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# --- issue #35 item 8: bounded holder lists and statistics, authenticated chunks ----------
@pytest.fixture
def open_store():
    """A store without a token (the attacks below need none)."""
    eng = mte.TransferEngine(host="127.0.0.1")
    store = P2PStore(eng, metadata="p2p")
    yield eng, store
    store.close()
    eng.close()


def _holder(i: int, name_len: int = 16) -> dict:
    return {"name": f"fake{i}".ljust(name_len, "x"), "address": f"127.0.0.9:{1000 + i}",
            "segment": f"fake{i}", "instance": f"{i:012x}"}


def test_fake_holder_announcements_cannot_break_getters(open_store):
    eng, store = open_store
    data = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
    m = store.register("obj", data)
    oid = store._objects["obj"].manifest.object_id
    attacker = ControlClient(store.address, 5.0, None)
    for i in range(12):                  # 12 names of 100 KB: a holder list past 1 MiB
        try:
            attacker.call({"op": "announce", "name": "obj", "object_id": oid,
                           "holder": _holder(i, 100_000)})
        except Exception:
            pass
    for i in range(300):                 # and many ordinary-looking ones
        attacker.call({"op": "announce", "name": "obj", "object_id": oid,
                       "holder": _holder(1000 + i)})
    attacker.close()
    assert len(store._objects["obj"].known) <= 128                  # store.MAX_KNOWN
    with mte.TransferEngine(host="127.0.0.1") as eng2:
        getter = P2PStore(eng2, metadata="p2p", seeds=[store.address])
        try:
            assert bytes(getter.get("obj")) == data.tobytes()
        finally:
            getter.close()
    del m


def test_done_statistics_are_bounded(open_store):
    eng, store = open_store
    store.register("obj", np.zeros(1 << 16, np.uint8))
    oid = store._objects["obj"].manifest.object_id
    c = ControlClient(store.address, 5.0, None)
    for i in range(600):
        c.send({"op": "done", "name": "obj", "object_id": oid, "chunk": 0, "result": "ok",
                "bytes": 1 << 40, "by": f"getter-{i}-" + "y" * 200})
    assert c.call({"op": "hello"})["ok"]          # the sends before it were handled
    c.close()
    assert len(store._chunks_to) <= 256 + 1                # store.MAX_STATS_PEERS, others
    assert len(store._objects["obj"].uploads_to) <= 256 + 1
    assert all(len(k) <= 300 for k in store._chunks_to)
    assert store.stats()["bytes_uploaded"] <= 600 * (1 << 16)     # no 2^40 per report


def _crc32_forge(chunk: bytes, change: bytes) -> bytes:
    """``chunk`` with ``change`` written at its start and bytes 4..8 chosen so that its
    CRC-32 is unchanged (CRC is linear over GF(2): a lying holder can do this)."""
    import zlib
    n = len(chunk)
    zero = zlib.crc32(bytes(n))

    def lin(delta: bytes) -> int:        # the linear part of crc32 of a difference
        return zlib.crc32(delta) ^ zero
    head = bytes(a ^ b for a, b in zip(chunk[:4], change)) + bytes(n - 4)
    target = lin(head)                   # what bytes 4..8 must cancel
    cols = []
    for bit in range(32):
        d = bytearray(n)
        d[4 + bit // 8] = 1 << (bit % 8)
        cols.append(lin(bytes(d)))
    # Solve sum(x_bit * cols[bit]) == target over GF(2).
    rows = [(cols[b], 1 << b) for b in range(32)]
    basis: dict = {}
    for v, combo in rows:
        for hb in range(31, -1, -1):
            if not v >> hb & 1:
                continue
            if hb in basis:
                v ^= basis[hb][0]
                combo ^= basis[hb][1]
            else:
                basis[hb] = (v, combo)
                break
    x, t = 0, target
    for hb in range(31, -1, -1):
        if t >> hb & 1:
            t ^= basis[hb][0]
            x ^= basis[hb][1]
    assert t == 0
    fix = bytes((x >> (8 * i)) & 0xFF for i in range(4))
    delta = head[:4] + fix + bytes(n - 8)
    out = bytes(a ^ b for a, b in zip(chunk, delta))
    assert zlib.crc32(out) == zlib.crc32(chunk) and out[:4] == change
    return out


def test_with_a_token_a_lying_replica_cannot_pass_a_forged_chunk():
    """A replica's copy changed so that its CRC still matches: with the token, the getter
    checks each chunk's keyed tag and refuses it (before, it returned the forged bytes)."""
    data = np.random.default_rng(9).integers(0, 256, 1 << 16, dtype=np.uint8)
    e1 = mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN)
    e2 = mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN)
    e3 = mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN)
    origin = P2PStore(e1, metadata="p2p", chunk_size=16 << 10)
    replica = P2PStore(e2, metadata="p2p", seeds=[origin.address])
    getter = None
    try:
        origin.register("obj", data)
        copy = replica.get("obj")
        assert bytes(copy) == data.tobytes()
        origin.close()                     # the replica is now the only holder
        chunk = bytes(copy[:16 << 10])
        copy[:16 << 10] = np.frombuffer(_crc32_forge(chunk, b"EVIL"), np.uint8)
        getter = P2PStore(e3, metadata="p2p", seeds=[replica.address])
        try:
            got = getter.get("obj", timeout=20)
        except mte.errors.MooncakeError:
            got = None                     # refused: no honest holder of chunk 0 left
        assert got is None or bytes(got) == data.tobytes(), "forged chunk accepted"
        assert getter.stats()["corrupt_chunks"] >= 1
    finally:
        if getter is not None:
            getter.close()
        replica.close()
        origin.close()
        for e in (e1, e2, e3):
            e.close()


def test_with_a_token_an_unsealed_manifest_is_refused(seed_store):
    """A manifest from a store without the token (or written into the metadata store by
    anyone) is not used by a store that has one."""
    eng, store = seed_store
    with mte.TransferEngine(host="127.0.0.1") as e0:
        plain = P2PStore(e0, metadata="p2p")
        try:
            plain.register("obj", np.zeros(1 << 16, np.uint8))
            manifest = plain._objects["obj"].manifest
            assert not manifest.seal
            with pytest.raises(AuthenticationError, match="not sealed"):
                manifest.check_sealed(TOKEN)
        finally:
            plain.close()
    store.register("obj2", np.ones(1 << 16, np.uint8))
    sealed = store._objects["obj2"].manifest
    assert sealed.check_sealed(TOKEN) is sealed
    forged = type(sealed).from_json(dict(sealed.to_json(), size=sealed.size))
    forged.checksums = [c ^ 1 for c in forged.checksums]
    with pytest.raises(AuthenticationError):
        forged.check_sealed(TOKEN)


def test_with_a_token_holder_entries_written_without_it_are_ignored(redis_server):
    """Anyone who can write to redis could add holders to an object's list; with a token,
    an entry counts only with its tag."""
    url = f"{redis_server.url}?ttl=2"
    eng = mte.TransferEngine(host="127.0.0.1", metadata=url, auth_token=TOKEN)
    store = P2PStore(eng)
    try:
        store.register("tagged", np.ones(1 << 16, np.uint8))
        d = store.directory
        oid = store._objects["tagged"].manifest.object_id
        key = d._hkey("tagged")
        raw = json.loads(d.backend.get(key))
        raw["holders"] += [_holder(i) for i in range(5)]          # no tags
        raw["holders"].append(dict(_holder(9), mac="0" * 32))       # a wrong tag
        d.backend.put(key, json.dumps(raw).encode())
        assert [h.name for h in d.holders("tagged", oid)] == [store.name]
        for i in range(300):                     # the list stays bounded
            d.add_holder(store._objects["tagged"].manifest,
                         type(store.ref).from_json(_holder(100 + i)))
        assert len(json.loads(d.backend.get(key))["holders"]) <= 256
        assert store.name in {h.name for h in d.holders("tagged", oid)}
    finally:
        store.close()
        eng.close()


def test_with_a_token_a_forged_or_altered_holder_entry_is_refused(redis_server, caplog):
    """Holder entries carry the object directory's record MAC (issue 40): an entry
    altered in any field, forged under another token or another kind of record's key,
    moved from another object, or written with the P2P store's former MAC is skipped
    and counted; the genuine entries are listed."""
    d = StoreDirectory(open_backend(redis_server.url), owned=True)
    d.token = TOKEN
    pub = HolderRef("pub", "127.0.0.1:7001", "127.0.0.1:17001", "a" * 12)
    getter = HolderRef("getter", "127.0.0.1:7002", "127.0.0.1:17002", "b" * 12)
    m = Manifest("holder-mac", "0123456789abcdef", 10, 10, [0], pub)
    key = record_key(TOKEN, HOLDER_LABEL)
    fields = (m.name, m.object_id, "getter", getter.address, getter.segment,
              getter.instance)
    try:
        d.publish(m)
        d.add_holder(m, getter)
        assert [h.name for h in d.holders(m.name, m.object_id)] == ["pub", "getter"]
        assert d.rejected == 0
        raw = json.loads(d.backend.get(d._hkey(m.name)))
        entry = raw["holders"][1]
        assert entry["mac"] == record_mac(key, *fields)       # the shared scheme
        former = hmac.new(TOKEN, "\0".join(("mte-p2p-holder", m.object_id) + fields[2:])
                          .encode(), hashlib.sha256).hexdigest()[:32]
        bad = {                       # the first refusal is logged (then the 10th...)
            "the former MAC": dict(entry, mac=former),
            "name": dict(entry, name="pub"),
            "address": dict(entry, address="127.0.0.9:7002"),
            "segment": dict(entry, segment="127.0.0.9:17002"),
            "instance": dict(entry, instance="c" * 12),
            "no mac": {k: v for k, v in entry.items() if k != "mac"},
            "not a str": dict(entry, mac=1),
            "another token": dict(entry, mac=record_mac(
                record_key(b"another token", HOLDER_LABEL), *fields)),
            "another kind's key": dict(entry, mac=record_mac(
                record_key(TOKEN, "kvcache-index/default"), *fields)),
            "another object": dict(entry, mac=record_mac(
                key, "other", "fedcba9876543210", *fields[2:])),
        }
        for why, forged in bad.items():
            d.backend.put(d._hkey(m.name), json.dumps(
                dict(raw, holders=[raw["holders"][0], forged])).encode())
            before = d.rejected
            with caplog.at_level(logging.WARNING, "mooncake_te.p2p_store"):
                caplog.clear()
                assert [h.name for h in d.holders(m.name, m.object_id)] == ["pub"], why
            assert d.rejected == before + 1, why
            if why == "the former MAC":
                assert "older version" in caplog.text
        # Without the token entries carry no MAC and none is checked.
        plain = StoreDirectory(d.backend)
        assert [h.name for h in plain.holders(m.name, m.object_id)] == ["pub", "getter"]
        plain.add_holder(m, getter)
        assert "mac" not in json.loads(d.backend.get(d._hkey(m.name)))["holders"][-1]
    finally:
        d.withdraw(m)
        d.close()

# SPDX-License-Identifier: Apache-2.0
"""Issue 35, item 1 and the Low items of the same code: who the KV cache trusts.

Attacks tried with real engines and a real redis on loopback: a process without the
cluster's token writes owner-index records and serves blocks with valid CRCs; index
records with bogus fields; SSD records and cache directories planted by someone else."""
from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.errors import ConfigError, InvalidArgumentError
from mooncake_te.kvcache import KVCache, prefix_hashes
from mooncake_te.kvcache.record import HEADER_SIZE, crc32_held, pack_header
from mooncake_te.kvcache.ssd import MANIFEST, SLAB
from servers import redis_server  # noqa: F401  (fixture)

BB = 8192 - HEADER_SIZE
SLOT = 8192
TOKEN = "kv-auth-test-token"


def block(i: int, n: int = BB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def cache(engine=None, dram=4, ssd=0, cache_dir=None, **kw) -> KVCache:
    kw.setdefault("log_interval_s", 0)
    return KVCache(BB, dram * SLOT, ssd * SLOT, cache_dir, engine=engine, **kw)


def index_key(c: KVCache, key: bytes) -> str:
    return c._index._key(key)


class Forger:
    """A process without the token: an engine serving a forged block (valid header and
    CRC) from its own registered memory, and a record naming it, written straight into
    the metadata store."""

    def __init__(self, url: str, key: bytes, payload: np.ndarray):
        self.engine = mte.TransferEngine(name="kv-forger", metadata=url, host="127.0.0.1")
        self.buf = np.zeros(SLOT, np.uint8)
        self.buf[HEADER_SIZE:HEADER_SIZE + payload.size] = payload
        self.crc = crc32_held(self.buf[HEADER_SIZE:HEADER_SIZE + payload.size])
        self.buf[:HEADER_SIZE] = np.frombuffer(pack_header(key, payload.size, 1, self.crc),
                                               np.uint8)
        self.engine.register(self.buf, access="r")
        self.addr = int(self.buf.ctypes.data)

    def record(self, **over) -> bytes:
        d = {"owner": self.engine.name, "addr": self.addr, "length": BB, "crc": self.crc}
        d.update(over)
        return json.dumps(d).encode()

    def close(self):
        self.engine.close()


def test_without_a_token_sharing_is_off_and_says_why(redis_server, caplog):  # noqa: F811
    """The issue's attack: on main the victim served the forger's block and re-published
    it. Without a token (and without share_without_token) nothing is shared."""
    url = redis_server.url
    keys = prefix_hashes(np.arange(32), 16)
    forged = block(666)
    fg = Forger(url, keys[0], forged)
    try:
        with mte.TransferEngine(name="kv-victim", metadata=url, host="127.0.0.1") as ev, \
                cache(ev, namespace="t-noshare") as v:
            assert not v.can_remote
            assert "auth_token" in (v.sharing_off or "")
            assert "sharing blocks with other instances is off" in caplog.text
            fg.engine.metadata.put(f"mooncake/kvcache/t-noshare/{keys[0].hex()}", fg.record())
            with pytest.raises(InvalidArgumentError, match="share_without_token"):
                v.get(keys[:1], remote=True)
            v.put(keys[1:2], [block(1)])       # nothing published either
            assert v.flush_index()
            assert ev.metadata.get(f"mooncake/kvcache/t-noshare/{keys[1].hex()}") is None
    finally:
        fg.close()


def test_with_a_token_records_are_authenticated(redis_server):  # noqa: F811
    url = redis_server.url
    keys = prefix_hashes(np.arange(64), 16)
    with mte.TransferEngine(name="kv-ta", metadata=url, host="127.0.0.1",
                            auth_token=TOKEN) as ea, \
            mte.TransferEngine(name="kv-tb", metadata=url, host="127.0.0.1",
                               auth_token=TOKEN) as eb, \
            cache(ea, namespace="t-auth") as a, cache(eb, namespace="t-auth") as b:
        a.put(keys[:2], [block(0), block(1)])
        assert a.flush_index()
        store = eb.metadata
        raw = json.loads(store.get(index_key(a, keys[0])))
        assert set(raw) == {"owner", "addr", "length", "crc", "mac"}
        # The honest path: verified, served, kept and re-published as b's own.
        got = b.get(keys[:1], remote=True)
        assert np.array_equal(got[0], block(0))
        assert b.stats()["served_remote"] == 1

        # A forger without the token: its record has no valid MAC, whatever it names.
        fg = Forger(url, keys[2], block(666))
        try:
            store.put(index_key(a, keys[2]), fg.record())
            assert b.lookup(keys[2:3], remote=True) == 0          # not a hit
            assert b.get(keys[2:3], remote=True) == [None]        # not served
            assert b.stats()["remote_rejected_records"] >= 2
            # Copying a valid MAC onto another record does not help.
            good = json.loads(store.get(index_key(a, keys[1])))
            store.put(index_key(a, keys[2]), fg.record(mac=good["mac"]))
            assert b.get(keys[2:3], remote=True) == [None]
            # Nor does moving a valid record to another address, length or CRC.
            for field, value in (("addr", good["addr"] + SLOT), ("crc", good["crc"] ^ 1),
                                 ("length", good["length"] - 1), ("owner", "kv-forger")):
                store.put(index_key(a, keys[1]), json.dumps(dict(good, **{field: value})))
                before = b.stats()["remote_rejected_records"]
                assert b.lookup(keys[1:2], remote=True) == 0, field
                assert b.stats()["remote_rejected_records"] == before + 1, field
        finally:
            fg.close()
        assert b.get(keys[2:3]) == [None] and keys[2] not in b


def test_no_token_sharing_enabled_explicitly_never_republishes(redis_server):  # noqa: F811
    """share_without_token=True: blocks from peers are served, but the reader never
    publishes them as its own, so a forged block cannot spread to a third instance."""
    url = redis_server.url
    keys = prefix_hashes(np.arange(64), 16)
    with mte.TransferEngine(name="kv-na", metadata=url, host="127.0.0.1") as ea, \
            mte.TransferEngine(name="kv-nb", metadata=url, host="127.0.0.1") as eb, \
            cache(ea, namespace="t-open", share_without_token=True) as a, \
            cache(eb, namespace="t-open", share_without_token=True) as b:
        a.put(keys[:2], [block(0), block(1)])
        assert a.flush_index()
        got = b.get(keys[:2], remote=True)
        assert all(np.array_equal(g, block(i)) for i, g in enumerate(got))
        assert b.flush_index()
        for k in keys[:2]:
            assert json.loads(eb.metadata.get(index_key(b, k)))["owner"] == "kv-na"
        # b's own blocks are published as before.
        b.put(keys[2:3], [block(2)])
        assert b.flush_index()
        assert json.loads(eb.metadata.get(index_key(b, keys[2])))["owner"] == "kv-nb"


def test_bogus_index_records_are_counted_misses(redis_server):  # noqa: F811
    """An address past 2^64 raised an untyped OverflowError for the whole get on main,
    and malformed records counted as remote hits."""
    url = redis_server.url
    keys = prefix_hashes(np.arange(160), 16)
    with mte.TransferEngine(name="kv-ba", metadata=url, host="127.0.0.1") as ea, \
            mte.TransferEngine(name="kv-bb", metadata=url, host="127.0.0.1") as eb, \
            cache(ea, namespace="t-bogus", share_without_token=True) as a, \
            cache(eb, namespace="t-bogus", share_without_token=True) as b:
        a.put(keys[:1], [block(0)])
        assert a.flush_index()
        bogus = [{"owner": "kv-ba", "addr": 1 << 70, "length": 100},
                 {"owner": "kv-ba", "addr": -4096, "length": 100},
                 {"owner": "kv-ba", "addr": 4096, "length": 1 << 40},
                 {"owner": "kv-ba", "addr": "4096", "length": 100},
                 {"owner": "", "addr": 4096, "length": 100},
                 {"owner": "kv-ba", "addr": 4096},
                 [1, 2, 3]]
        for i, rec in enumerate(bogus, start=1):
            eb.metadata.put(index_key(b, keys[i]), json.dumps(rec).encode())
        n = len(bogus)
        got = b.get(keys[:n + 1], remote=True)
        assert np.array_equal(got[0], block(0)) and got[1:] == [None] * n
        assert b.stats()["remote_rejected_records"] == n
        assert b.lookup(keys[1:n + 1], remote=True) == 0
        assert b.stats()["hit_blocks_remote"] == 0


def _ssd_cache(d, **kw):
    return KVCache(BB, 2 * SLOT, 8 * SLOT, str(d), log_interval_s=0, **kw)


def test_ssd_record_with_the_largest_seq_does_not_break_puts(tmp_path):
    d = tmp_path / "kv"
    keys = prefix_hashes(np.arange(64), 16)
    with _ssd_cache(d) as c:
        c.put(keys[:1], [block(0)])
        c.persist()
    # Rewrite the record's header with seq = 2^64 - 1 (valid header CRC: a planted one).
    with open(d / SLAB, "r+b") as f:
        head = f.read(HEADER_SIZE)
        crc = int.from_bytes(head[40:44], "little")
        f.seek(0)
        f.write(pack_header(keys[0], BB, (1 << 64) - 1, crc))
    with _ssd_cache(d) as c:
        assert c.put(keys[1:3], [block(1), block(2)]) == 2
        assert all(np.array_equal(g, block(i + 1)) for i, g in enumerate(c.get(keys[1:3])))
        assert c.stats()["ssd_corrupt_records"] == 1


def test_a_deleted_manifest_does_not_make_old_blocks_servable(tmp_path):
    d = tmp_path / "kv"
    keys = prefix_hashes(np.arange(64), 16)
    with _ssd_cache(d, namespace="tenant-a") as c:
        c.put(keys[:2], [block(0), block(1)])
        c.persist()
    os.unlink(d / MANIFEST)
    with _ssd_cache(d, namespace="tenant-b") as c:
        assert len(c) == 0 and c.get(keys[:2]) == [None, None]
    with open(d / MANIFEST) as f:
        assert json.load(f)["namespace"] == "tenant-b"


def test_world_writable_cache_dir_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)
    with pytest.raises(ConfigError, match="writable by every user"):
        _ssd_cache(d)
    assert not (d / SLAB).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory of another uid")
def test_cache_dir_of_another_uid_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 65534, 65534)
    os.chmod(d, 0o777 & ~0o002 | stat.S_IRWXU)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        _ssd_cache(d)
    # A slab planted by another uid in our own directory is refused too.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / SLAB).write_bytes(b"")
    os.chown(mine / SLAB, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        _ssd_cache(mine)


def test_share_without_token_from_the_environment(redis_server, monkeypatch):  # noqa: F811
    """The documented switch: MC_KVCACHE_SHARE_WITHOUT_TOKEN=1 ([kvcache]
    share_without_token) read from the engine's config."""
    monkeypatch.setenv("MC_KVCACHE_SHARE_WITHOUT_TOKEN", "1")
    with mte.TransferEngine(name="kv-env", metadata=redis_server.url, host="127.0.0.1") as e, \
            cache(e, namespace="t-env") as c:
        assert c.can_remote and c.sharing_off is None
    monkeypatch.setenv("MC_KVCACHE_SHARE_WITHOUT_TOKEN", "0")
    with mte.TransferEngine(name="kv-env", metadata=redis_server.url, host="127.0.0.1") as e, \
            cache(e, namespace="t-env") as c:
        assert not c.can_remote


def test_a_signed_record_is_read_only_from_the_engine_it_names(redis_server,  # noqa: F811
                                                               caplog):
    """The handshake's identity binding: a valid record names engine A, but the store's
    descriptor for A is replaced by one pointing at a process without the token. The
    reader's connection fails the proof (the process cannot prove the token, let alone
    that it is A): a counted miss, never its bytes."""
    import dataclasses
    url = redis_server.url
    keys = prefix_hashes(np.arange(32), 16)
    with mte.TransferEngine(name="kv-ia", metadata=url, host="127.0.0.1",
                            auth_token=TOKEN) as ea, \
            mte.TransferEngine(name="kv-ib", metadata=url, host="127.0.0.1",
                               auth_token=TOKEN) as eb, \
            cache(ea, namespace="t-ident") as a, cache(eb, namespace="t-ident") as b:
        a.put(keys[:1], [block(0)])
        assert a.flush_index()
        fg = Forger(url, keys[0], block(666))
        try:
            # The forger's memory at the address the record names: same layout as A's.
            rec = json.loads(eb.metadata.get(index_key(a, keys[0])))
            fake = dataclasses.replace(fg.engine.descriptor(), name="kv-ia")
            fg.engine.metadata.publish(fake)
            with caplog.at_level("INFO", logger="mooncake_te.kvcache"):
                got = b.get(keys[:1], remote=True)
            assert got == [None] and b.stats()["remote_failed"] == 1
            assert "could not prove the token" in caplog.text
            assert rec["owner"] == "kv-ia"
        finally:
            fg.close()

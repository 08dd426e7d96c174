# SPDX-License-Identifier: Apache-2.0
"""The tiered KV cache: policies against a brute-force model, tier movement, restart,
torn and corrupt SSD records, configuration errors, accounting, remote get between two
engines through a real redis, and the real cache against the simulator."""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mooncake_te as mte
from mooncake_te.errors import ConfigError, InvalidArgumentError
from mooncake_te.kvcache import KVCache, LFU, LRU, as_key, prefix_hashes
from mooncake_te.kvcache.record import HEADER_SIZE
from mooncake_te.kvcache.ssd import SLAB
from servers import redis_server  # noqa: F401  (fixture)

BB = 8192 - HEADER_SIZE           # block bytes that fill an 8 KiB slot exactly
SLOT = 8192


def block(i: int, n: int = BB) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, n, dtype=np.uint8)


def cache(tmp_path=None, dram=4, ssd=0, **kw) -> KVCache:
    kw.setdefault("log_interval_s", 0)
    return KVCache(BB, dram * SLOT, ssd * SLOT, str(tmp_path / "kv") if tmp_path else None,
                   **kw)


# --- policies ----------------------------------------------------------------------------
ops = st.lists(st.tuples(st.sampled_from(["insert", "touch", "remove", "pop"]),
                         st.integers(0, 7)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from(["lru", "lfu"]))
def test_policies_match_a_brute_force_model(seq, name):
    pol = LRU() if name == "lru" else LFU()
    model = {}                       # key -> [freq, last use]
    for clock, (op, key) in enumerate(seq):
        if op == "insert" and key not in model:
            pol.insert(key)
            model[key] = [1, clock]
        elif op == "touch" and key in model:
            pol.touch(key)
            model[key][0] += 1
            model[key][1] = clock
        elif op == "remove":
            pol.remove(key)
            model.pop(key, None)
        elif op == "pop" and model:
            rank = (lambda k: model[k][1]) if name == "lru" else (lambda k: tuple(model[k]))
            want = min(model, key=rank)
            assert pol.victim() == want
            assert pol.pop() == want
            del model[want]
        assert len(pol) == len(model) and all(k in pol for k in model)
    if model:
        rank = (lambda k: model[k][1]) if name == "lru" else (lambda k: tuple(model[k]))
        order = sorted(model, key=rank)
        assert list(pol) == order
        assert pol.victim(skip={order[0]}) == (order[1] if len(order) > 1 else None)


# --- keys --------------------------------------------------------------------------------
def test_prefix_hashes_are_prefix_keys_and_stable():
    a = prefix_hashes(list(range(48)), 16)
    b = prefix_hashes(list(range(32)) + [7] * 16, 16)
    assert a[:2] == b[:2] and a[2] != b[2]                # same prefix, then they diverge
    assert prefix_hashes([1, 2, 3], 2) == prefix_hashes([1, 2], 2)
    assert len(prefix_hashes([1, 2, 3], 2, include_partial=True)) == 2
    # Stable across processes and versions: a fixed digest (BLAKE2b-128, person "mooncake-kv").
    assert a[0].hex() == prefix_hashes(np.arange(16), 16)[0].hex()
    assert as_key(5) == bytes(15) + b"\x05" and as_key(a[0]) is a[0]
    assert as_key("x") == as_key(b"x") and len(as_key(b"long key")) == 16
    with pytest.raises(InvalidArgumentError):
        as_key(-1)


# --- DRAM tier ---------------------------------------------------------------------------
def test_put_get_lookup_dram_only():
    with cache(dram=8) as c:
        assert c.put([1, 2, 3], [block(1), block(2), block(3, 100)]) == 3
        assert c.put([1], [block(9)]) == 0                # held already: touched, not rewritten
        got = c.get([1, 3, 4])
        assert np.array_equal(got[0], block(1)) and np.array_equal(got[1], block(3, 100))
        assert got[2] is None
        assert c.lookup([1, 2, 4, 3]) == 2 and c.lookup([4, 1]) == 0
        out = [bytearray(BB), np.zeros(BB, np.uint8)]
        assert c.get([2, 1], out=out) == [BB, BB]
        assert bytes(out[0]) == block(2).tobytes() and np.array_equal(out[1], block(1))
        with pytest.raises(InvalidArgumentError, match="1 to block_bytes"):
            c.put([7], [bytes(BB + 1)])
        s = c.stats()
        assert (s["lookups"], s["lookup_blocks"], s["hit_blocks"]) == (2, 6, 2)
        assert s["served_dram"] == 4 and s["get_misses"] == 1 and s["dram_blocks"] == 3
        for i in range(10, 20):                          # DRAM only: evictions drop blocks
            c.put([i], [block(i)])
        assert c.stats()["dropped"] == 5 and 1 not in c and 19 in c


def test_dram_pool_is_one_registered_buffer(engine):
    with cache(dram=4, engine=engine) as c:
        assert c.region is not None and c.region.address == c.base
        assert c.region.length == 4 * SLOT and c.region.access == "r"
        assert any(b.address == c.base for b in engine.descriptor().buffers)
    assert all(r.address != c.base for r in engine.regions)     # closed: unregistered


# --- tier movement -----------------------------------------------------------------------
def test_demotion_promotion_and_du_growth(tmp_path):
    with cache(tmp_path, dram=4, ssd=16) as c:
        slab = tmp_path / "kv" / SLAB
        assert c.stats()["ssd_io"] in ("o_direct", "buffered+fdatasync")
        c.put(range(4), [block(i) for i in range(4)])
        assert [c.tier(i) for i in range(4)] == ["dram"] * 4
        du0 = os.stat(slab).st_blocks
        c.put(range(4, 7), [block(i) for i in range(4, 7)])
        # LRU: 0, 1, 2 were the least recent, so they went down to SSD.
        assert [c.tier(i) for i in range(7)] == ["ssd"] * 3 + ["dram"] * 4
        s = c.stats()
        assert (s["evictions_dram"], s["demotions"], s["ssd_blocks"]) == (3, 3, 3)
        assert os.stat(slab).st_blocks * 512 >= du0 * 512 + 3 * SLOT     # du -sh grows
        assert c.lookup([0, 1, 5]) == 3 and c.stats()["hit_blocks_ssd"] == 2
        got = c.get([1])                                  # an SSD hit: promoted
        assert np.array_equal(got[0], block(1)) and c.tier(1) == "dram"
        s = c.stats()
        assert (s["promotions"], s["served_ssd"], s["demotions"]) == (1, 1, 4)
        assert c.tier(3) == "ssd"                         # made room for it
        # The SSD copy of a promoted block stays, so its next demotion writes nothing.
        for i in range(10, 14):
            c.put([i], [block(i)])
        assert c.tier(1) == "ssd" and c.stats()["demotions_skipped"] == 1
        assert all(np.array_equal(c.get([i])[0], block(i)) for i in range(7))


def test_lfu_keeps_the_frequently_used(tmp_path):
    with cache(dram=3, policy="lfu") as c:
        c.put([1, 2, 3], [block(i) for i in (1, 2, 3)])
        c.get([1]); c.get([1]); c.get([2])
        c.put([4], [block(4)])                            # evicts 3 (count 1)
        assert 3 not in c and 1 in c and 2 in c
        c.put([5], [block(5)])                            # 4 (count 1, newest) goes: LFU
        assert 4 not in c and 5 in c


@pytest.mark.parametrize("dram,ssd,ops", [
    # A DRAM block of the call demoted by the promotions before it, then evicted from SSD
    # by a later demotion of the same call before it was read: KeyError, the get failed.
    (3, 4, [("put", [0, 3, 4, 6]), ("put", [1, 7]), ("get", [3, 0, 1]), ("put", [1, 6, 0]),
            ("put", [2, 4]), ("put", [2]), ("get", [1, 0, 6])]),
    # A DRAM block of the call demoted and evicted from SSD before its turn: a miss.
    (2, 3, [("put", [3, 0, 1, 6]), ("put", [6]), ("get", [1, 3, 0, 6])]),
])
def test_get_never_loses_a_block_to_its_own_promotions(tmp_path, dram, ssd, ops):
    """A get of more blocks than the DRAM tier holds promotes and demotes inside the call;
    every block the lookup found is still returned, with its bytes."""
    with cache(tmp_path, dram=dram, ssd=ssd, o_direct=False) as c:
        for op, ids in ops:
            keys = [as_key(f"k{i}") for i in ids]
            if op == "put":
                c.put(keys, [block(i) for i in ids])
                continue
            assert c.lookup(keys) == len(keys)
            got = c.get(keys)
            assert [g is not None for g in got] == [True] * len(keys)
            for i, g in zip(ids, got):
                assert np.array_equal(g, block(i))


def test_lfu_block_evicted_in_the_put_that_brought_it_goes_to_ssd(tmp_path):
    # DRAM full of hot blocks: each new block is the coldest, so the next new block of the
    # same put evicts it before its bytes ever reached the pool (the "bounce" path).
    with cache(tmp_path, dram=2, ssd=8, policy="lfu") as c:
        c.put([1, 2], [block(1), block(2)])
        c.get([1, 2]); c.get([1, 2])
        c.put([10, 11, 12], [block(i) for i in (10, 11, 12)])
        # 10 evicts 1 (counts tie at 3; 1 is less recent), 11 evicts 10, 12 evicts 11.
        assert [c.tier(i) for i in (1, 2, 10, 11, 12)] == ["ssd", "dram", "ssd", "ssd", "dram"]
        s = c.stats()
        assert s["demotions"] == 3 and s["demoted_bytes"] == 3 * BB
        assert all(np.array_equal(g, block(i)) for i, g in zip((10, 11, 1), c.get([10, 11, 1])))
    with cache(dram=2, policy="lfu") as c:                # DRAM only: the block is dropped
        c.put([1, 2], [block(1), block(2)])
        c.get([1, 2])
        c.put([10, 11, 12], [block(i) for i in (10, 11, 12)])
        assert [i for i in (1, 2, 10, 11, 12) if i in c] == [2, 12]
        assert np.array_equal(c.get([12])[0], block(12))


def test_an_io_error_drops_what_was_in_flight(tmp_path, caplog):
    with cache(tmp_path, dram=2, ssd=8) as c:
        c.put([0, 1], [block(0), block(1)])
        real = c.ssd.write_many

        def failing(items):
            raise OSError(5, "Input/output error")
        c.ssd.write_many = failing
        with pytest.raises(OSError), caplog.at_level(logging.ERROR):
            c.put([2], [block(2)])                        # demotes 0: the write fails
        c.ssd.write_many = real
        assert "failed" in caplog.text
        assert 0 not in c and 2 not in c                  # neither half-moved block is kept
        assert np.array_equal(c.get([1])[0], block(1))
        c.put([2, 3], [block(2), block(3)])               # and the cache goes on working
        assert all(np.array_equal(g, block(i)) for i, g in zip((1, 2, 3), c.get([1, 2, 3])))


def test_threads_share_one_cache(tmp_path):
    import threading
    errors = []
    blocks = {i: block(i, 512 + 7 * i) for i in range(40)}

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                ks = [int(x) for x in rng.choice(40, size=3, replace=False)]
                if rng.random() < 0.5:
                    c.put(ks, [blocks[k] for k in ks])
                else:
                    for k, g in zip(ks, c.get(ks)):
                        if g is not None and not np.array_equal(g, blocks[k]):
                            errors.append(k)
        except Exception as e:          # pragma: no cover - reported below
            errors.append(e)

    with cache(tmp_path, dram=4, ssd=12) as c:
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
        assert errors == []
        s = c.stats()
        assert s["demotions"] > 0 and s["promotions"] > 0 and s["evictions_ssd"] > 0


# --- restart and corruption --------------------------------------------------------------
def test_restart_finds_ssd_blocks_in_lru_order(tmp_path):
    with cache(tmp_path, dram=2, ssd=8) as c:
        c.put(range(6), [block(i) for i in range(6)])     # 0..3 demoted in that order
    with cache(tmp_path, dram=2, ssd=8) as c:
        s = c.stats()
        assert s["ssd_recovered_blocks"] == 4 and s["ssd_blocks"] == 4
        assert [c.tier(i) for i in range(6)] == ["ssd"] * 4 + [None] * 2
        assert list(c.ssd.policy) == [as_key(i) for i in range(4)]
        assert all(np.array_equal(g, block(i)) for i, g in enumerate(c.get(range(4))))


def test_close_persist_keeps_dram_blocks_too(tmp_path):
    with cache(tmp_path, dram=3, ssd=8) as c:
        c.put(range(5), [block(i) for i in range(5)])     # 0, 1 on SSD; 2, 3, 4 in DRAM
        c.get([2])                                        # 2 becomes the most recent
        c.close(persist=True)
    with cache(tmp_path, dram=3, ssd=8) as c:
        assert c.stats()["ssd_recovered_blocks"] == 5
        assert list(c.ssd.policy) == [as_key(i) for i in (0, 1, 3, 4, 2)]
        assert all(np.array_equal(g, block(i)) for i, g in enumerate(c.get(range(5))))


def _slab_offset_of(tmp_path, key):
    with cache(tmp_path, dram=1, ssd=8) as c:
        return c.ssd.index[as_key(key)][0] * SLOT


def test_torn_block_is_dropped_never_served(tmp_path, caplog):
    with cache(tmp_path, dram=1, ssd=8) as c:
        c.put([1, 2, 3], [block(i) for i in (1, 2, 3)])  # 1 and 2 on SSD
    off = _slab_offset_of(tmp_path, 2)
    with open(tmp_path / "kv" / SLAB, "r+b") as f:       # a torn write: half the data lost
        f.seek(off + HEADER_SIZE + BB // 2)
        f.write(bytes(BB // 2))
    with cache(tmp_path, dram=1, ssd=8) as c, caplog.at_level(logging.WARNING):
        assert c.lookup([1, 2]) == 2                     # the header still looks fine...
        got = c.get([1, 2])
        assert np.array_equal(got[0], block(1)) and got[1] is None   # ...the data does not
        assert c.stats()["corrupt_dropped"] == 1 and 2 not in c
        assert "corrupt or torn" in caplog.text


def test_corrupt_header_and_truncated_file(tmp_path):
    with cache(tmp_path, dram=1, ssd=8) as c:
        c.put([1, 2, 3, 4], [block(i) for i in (1, 2, 3, 4)])   # 1, 2, 3 on SSD
    off1 = _slab_offset_of(tmp_path, 1)
    slab = tmp_path / "kv" / SLAB
    with open(slab, "r+b") as f:
        f.seek(off1 + 20)                                # a flipped byte in the key
        f.write(b"\xff")
    last = max(_slab_offset_of(tmp_path, k) for k in (2, 3))
    os.truncate(slab, last + HEADER_SIZE + 10)           # the last record cut short
    with cache(tmp_path, dram=1, ssd=8) as c:
        s = c.stats()
        assert s["ssd_corrupt_records"] == 1 and s["ssd_recovered_blocks"] == 2
        assert 1 not in c
        got = c.get([2, 3])
        assert sum(g is None for g in got) == 1         # the truncated one
        assert all(np.array_equal(g, block(k)) for k, g in zip((2, 3), got) if g is not None)


# --- coalesced SSD I/O, held-GIL checksums, get(copy=) ----------------------------------
def _count_calls(monkeypatch, name):
    calls = []
    real = getattr(os, name)

    def counting(fd, bufs, offset):
        calls.append(len(bufs))
        return real(fd, bufs, offset)
    monkeypatch.setattr(os, name, counting)
    return calls


def _on_ssd(tmp_path, n):
    """Blocks 0..n-1 written to SSD slots 0..n-1 (a clean close persists them)."""
    with cache(tmp_path, dram=n, ssd=n + 4) as c:
        c.put(range(n), [block(i) for i in range(n)])
        c.close(persist=True)
    with cache(tmp_path, dram=1, ssd=n + 4) as c:
        return {k: c.ssd.index[as_key(k)][0] for k in range(n)}


def test_adjacent_ssd_slots_are_one_read_and_one_write(tmp_path, monkeypatch):
    slots = _on_ssd(tmp_path, 6)
    assert sorted(slots.values()) == list(range(6))
    order = sorted(range(6), key=slots.get)
    with cache(tmp_path, dram=8, ssd=10) as c:
        reads = _count_calls(monkeypatch, "preadv")
        got = c.get(order[::-1])                          # any key order: sorted by slot
        assert reads == [6]
        assert all(np.array_equal(g, block(k)) for k, g in zip(order[::-1], got))
    with cache(tmp_path, dram=8, ssd=10) as c:
        c.remove([order[2]])                              # a hole between two runs
        reads = _count_calls(monkeypatch, "preadv")
        keep = [k for k in order if k != order[2]]
        got = c.get(keep)
        assert reads == [2, 3]
        assert all(np.array_equal(g, block(k)) for k, g in zip(keep, got))
    (tmp_path / "w").mkdir()          # the cache creates only the last level (issue 41)
    with cache(tmp_path / "w", dram=4, ssd=8) as c:
        c.put(range(4), [block(i) for i in range(4)])
        writes = _count_calls(monkeypatch, "pwritev")
        c.close(persist=True)                             # 4 new SSD slots side by side
        assert writes == [4]


def test_corrupt_block_inside_a_run_is_dropped_the_rest_served(tmp_path, monkeypatch, caplog):
    slots = _on_ssd(tmp_path, 5)
    bad = next(k for k, s in slots.items() if s == 2)     # the middle of slots 0..4
    with open(tmp_path / "kv" / SLAB, "r+b") as f:
        f.seek(2 * SLOT + HEADER_SIZE + 100)
        f.write(b"\xff\x00\xff")
    with cache(tmp_path, dram=8, ssd=9) as c, caplog.at_level(logging.WARNING):
        reads = _count_calls(monkeypatch, "preadv")
        got = c.get(range(5))
        assert reads == [5]                               # still one read
        assert got[bad] is None and bad not in c
        assert all(np.array_equal(g, block(k)) for k, g in enumerate(got) if k != bad)
        assert c.stats()["corrupt_dropped"] == 1 and "corrupt or torn" in caplog.text


def test_short_reads_and_writes_are_finished():
    from mooncake_te.kvcache.ssd import _rw_full
    src = bytes(range(256)) * 64                         # 16 KiB
    dst = [memoryview(bytearray(4096)) for _ in range(4)]

    def dribble(fd, bufs, offset):                        # at most 3000 bytes a call
        n = 0
        for mv in bufs:
            k = min(mv.nbytes, 3000 - n, len(src) - offset - n)
            mv[:k] = src[offset + n:offset + n + k]
            n += k
            if n == 3000 or k < mv.nbytes:
                break
        return n
    assert _rw_full(dribble, -1, dst, 0) == len(src)
    assert b"".join(bytes(d) for d in dst) == src
    dst = [memoryview(bytearray(4096)) for _ in range(5)]   # the "file" ends first
    assert _rw_full(dribble, -1, dst, 0) == len(src)


@pytest.mark.parametrize("n", [0, 1, 63, 4096, 8128, (1 << 20) + 3])
def test_held_gil_crc_equals_zlib(n):
    import zlib
    from mooncake_te.kvcache import record
    data = np.random.default_rng(n).integers(0, 256, n + 5, dtype=np.uint8)
    want = zlib.crc32(data[5:])
    impls = [f for f in (record._crc_isal, record._crc_libz) if f is not None]
    assert impls, "neither ISA-L nor libz could be loaded"
    for f in impls:
        assert f(data[5:]) == want                       # an unaligned numpy view
        assert f(memoryview(data)[5:]) == want
        assert f(data[5:].tobytes()) == want             # read-only bytes
        assert f(data[5:], 12345) == zlib.crc32(data[5:], 12345)
    assert record.crc32_held(data[5:]) == want


def test_isal_is_used_where_installed():
    from mooncake_te.kvcache import record
    try:
        import isal  # noqa: F401
    except ImportError:
        pytest.skip("the isal package (extra [kvcache]) is not installed")
    assert record.CRC32_IMPL == "isal"


def test_get_copy_hands_each_block_over(tmp_path):
    with cache(tmp_path, dram=2, ssd=8) as c:
        c.put(range(4), [block(i) for i in range(4)])     # 0, 1 on SSD; 2, 3 in DRAM
        seen = {}

        def copy(i, blk):
            assert not blk.flags.writeable and blk.dtype == np.uint8
            seen[i] = blk.copy()
        assert c.get([3, 0, 9, 1], copy=copy) == [BB, BB, None, BB]
        assert sorted(seen) == [0, 1, 3]
        assert all(np.array_equal(seen[i], block(k)) for i, k in ((0, 3), (1, 0), (3, 1)))
        s = c.stats()
        assert s["served_ssd"] == 2 and s["served_dram"] == 1 and s["get_misses"] == 1
        with pytest.raises(InvalidArgumentError, match="not both"):
            c.get([3], out=[bytearray(BB)], copy=copy)
        with pytest.raises(ZeroDivisionError):
            c.get([3], copy=lambda i, b: 1 / 0)
        assert np.array_equal(c.get([3])[0], block(3))     # the cache goes on working


class _QueuedSink:
    """A get(copy=) sink that only queues in __call__ and copies in flush(), the way a
    GPU copier batches its DMA: a view must still hold its block at flush time."""

    def __init__(self):
        self.queued, self.seen, self.flushes = [], {}, 0

    def __call__(self, i, blk):
        self.queued.append((i, blk))

    def flush(self):
        self.flushes += 1
        for i, blk in self.queued:
            self.seen[i] = blk.copy()
        self.queued = []


@pytest.mark.parametrize("dram,ssd", [(8, 0), (2, 8), (3, 8)])
def test_get_copy_sink_flushes_while_the_blocks_are_still_there(tmp_path, dram, ssd):
    # With a DRAM tier smaller than the call, promotions evict blocks served earlier in
    # the same call: flush() must run before that happens.
    with cache(tmp_path, dram=dram, ssd=ssd) as c:
        c.put(range(6), [block(i) for i in range(6)])
        sink = _QueuedSink()
        want = [k for k in (5, 0, 3, 1, 4) if k in c]
        got = c.get(want, copy=sink)
        assert sink.queued == [] and sink.flushes >= 1
        assert got == [BB] * len(want)
        assert all(np.array_equal(sink.seen[i], block(k)) for i, k in enumerate(want))


@pytest.mark.parametrize("dram,ssd", [(8, 0), (2, 8)])
def test_put_fill_writes_straight_into_the_slots(tmp_path, dram, ssd):
    with cache(tmp_path, dram=dram, ssd=ssd) as c:
        calls = []

        def fill(items):
            calls.append(len(items))
            for i, view in items:
                assert view.flags.writeable and view.nbytes == BB
                view[:] = block(10 + i)
        assert c.put(range(10, 15), fill=fill) == 5
        assert sum(calls) == 5 and len(calls) <= 5
        got = c.get(range(10, 15))
        assert all(g is not None and np.array_equal(g, block(k)) for k, g in
                   zip(range(10, 15), got))
        # Held keys are touched, not filled again; lengths pick the block sizes.
        assert c.put([10, 20], fill=lambda items: [v.fill(7) for _, v in items],
                     lengths=[BB, 100]) == 1
        assert np.array_equal(c.get([20])[0], np.full(100, 7, np.uint8))
        with pytest.raises(InvalidArgumentError, match="not both"):
            c.put([1], [block(1)], fill=lambda items: None)
        with pytest.raises(ZeroDivisionError):
            c.put([30, 31], fill=lambda items: 1 / 0)
        assert 30 not in c and 31 not in c                # nothing half-written served


def test_put_fill_in_a_full_lfu_pool(tmp_path):
    # LFU evicts blocks placed in the same put once the pool is full of hotter ones: the
    # round's fills land first, then the eviction demotes them as usual.
    with cache(tmp_path, dram=2, ssd=8, policy="lfu") as c:
        c.put([0, 1], [block(0), block(1)])
        c.get([0, 1])
        c.get([0, 1])
        c.put(range(2, 6), fill=lambda items: [v.__setitem__(slice(None), block(2 + i))
                                               for i, v in items])
        for k in range(6):
            g = c.get([k])[0]
            assert g is not None and np.array_equal(g, block(k)), k


def test_prefault_thread_after_a_restart(tmp_path):
    with cache(tmp_path, dram=2, ssd=8) as c:
        assert c._prefaulter is None                      # nothing on SSD yet
        c.put(range(4), [block(i) for i in range(4)])
    with cache(tmp_path, dram=2, ssd=8) as c:
        t = c._prefaulter
        assert t is not None and t.name == "kvcache-prefault" and t.daemon
        t.join(10)
        assert not t.is_alive()
        assert all(np.array_equal(g, block(i)) for i, g in enumerate(c.get(range(2))))
    with cache(tmp_path, dram=2, ssd=8, prefault_restart=False) as c:
        assert c._prefaulter is None


# --- configuration errors ----------------------------------------------------------------
def test_cache_dir_not_writable(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"cache_dir = .*a-file/kv.* cannot be a directory: "
                                          r".*a-file' is a file"):
        KVCache(BB, SLOT, SLOT, str(f / "kv"))
    with pytest.raises(ConfigError, match="is not writable: .* on a proc file system"):
        KVCache(BB, SLOT, SLOT, "/proc/mooncake-kvcache")
    if os.geteuid() != 0:            # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="is not writable"):
            KVCache(BB, SLOT, SLOT, str(ro))
    with pytest.raises(ConfigError, match="needs cache_dir"):
        KVCache(BB, SLOT, SLOT, None)
    with pytest.raises(ConfigError, match="holds no block"):
        KVCache(BB, SLOT - 1)


def test_cache_dir_in_use_or_of_another_layout(tmp_path):
    with cache(tmp_path, dram=1, ssd=4):
        with pytest.raises(ConfigError, match="in use by another process"):
            cache(tmp_path, dram=1, ssd=4)
    with pytest.raises(ConfigError, match="holds a cache written with"):
        KVCache(2 * BB, 4 * SLOT, 8 * SLOT, str(tmp_path / "kv"))
    with pytest.raises(ConfigError, match="holds a cache written with"):
        cache(tmp_path, dram=1, ssd=4, namespace="another-model")


def test_buffered_fallback_and_config_file(tmp_path):
    cfg = tmp_path / "c.toml"
    d = tmp_path / "kvb"
    cfg.write_text(f'[kvcache]\ncache_dir = "{d}"\ndram_cache_gb = {2 * SLOT / 2**30!r}\n'
                   f'ssd_cache_gb = {4 * SLOT / 2**30!r}\neviction_policy = "lfu"\n'
                   f'block_size = 32\n')
    with KVCache.from_config(str(cfg), block_bytes=BB, o_direct=False, log_interval_s=0) as c:
        assert (c.dram_slots, c.ssd.nslots, c.policy_name, c.block_tokens) == (2, 4, "lfu", 32)
        assert c.stats()["ssd_io"] == "buffered+fdatasync"
        c.put(range(4), [block(i) for i in range(4)])
        assert c.tier(0) == "ssd" and np.array_equal(c.get([0])[0], block(0))
    with pytest.raises(ConfigError, match="dram_cache_gb = 0 holds no block"):
        KVCache.from_config(None, block_bytes=BB)


# --- accounting --------------------------------------------------------------------------
def test_hit_rate_line_is_logged_periodically(caplog):
    with caplog.at_level(logging.INFO, logger="mooncake_te.kvcache"):
        with cache(dram=4, log_interval_s=0.05, block_tokens=16) as c:
            c.put([1, 2], [block(1), block(2)])
            assert c.lookup([1, 2, 3, 4], num_tokens=60) == 2
            deadline = time.monotonic() + 5
            while "kv cache hit rate" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            s = c.stats()
    assert "kv cache hit rate 50.0% of blocks, 53.3% of tokens" in caplog.text
    assert s["token_hit_rate"] == pytest.approx(32 / 60)
    assert s["dram_bytes"] == 2 * BB and s["dram_capacity_bytes"] == 4 * SLOT


# --- the real cache against the simulator ------------------------------------------------
# The sample trace ships with the repository (data/traces/README.md).
TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "data",
                     "traces", "synthetic_trace.jsonl")


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_real_dram_cache_equals_the_simulation(policy):
    from mooncake_te.kvcache import load_trace, simulate
    from mooncake_te.kvcache.replay import replay_real
    tr = load_trace(TRACE).head(800)
    with KVCache(512 * 4, 400 * 4096, policy=policy, log_interval_s=0) as c:
        s = replay_real(tr, c, 4, verify=True)
    sim = simulate(tr, policy, 400)
    assert (s["hit_blocks"], s["hit_tokens"]) == (sim.hit_blocks, sim.hit_tokens)
    assert s["evictions_dram"] == sim.evictions and s["verify_mismatches"] == 0


@pytest.mark.skipif(not os.path.exists(TRACE), reason="sample trace not found")
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_real_tiered_cache_serves_right_bytes(tmp_path, policy):
    from mooncake_te.kvcache import load_trace, simulate
    from mooncake_te.kvcache.replay import replay_real
    tr = load_trace(TRACE).head(800)
    with KVCache(512 * 4, 100 * 4096, 600 * 4096, str(tmp_path / "kv"), policy=policy,
                 log_interval_s=0) as c:
        s = replay_real(tr, c, 4, verify=True)
    assert s["verify_mismatches"] == 0 and s["get_misses"] == 0
    assert s["hit_blocks_ssd"] > 0 and s["promotions"] == s["served_ssd"] > 0
    if policy == "lru":
        # Inclusive tiers: between an LRU of the SSD size and one of both sizes together.
        assert simulate(tr, "lru", 600).hit_blocks <= s["hit_blocks"] \
            <= simulate(tr, "lru", 700).hit_blocks


# --- remote get between two engines ------------------------------------------------------
def test_remote_get_between_two_engines(redis_server):  # noqa: F811
    url = redis_server.url
    # Sharing needs the cluster token (or share_without_token: test_kvcache_auth.py).
    with mte.TransferEngine(name="kv-a", metadata=url, host="127.0.0.1",
                            auth_token="kv-test") as ea, \
            mte.TransferEngine(name="kv-b", metadata=url, host="127.0.0.1",
                               auth_token="kv-test") as eb, \
            cache(dram=4, engine=ea, namespace="t-remote") as a, \
            cache(dram=4, engine=eb, namespace="t-remote") as b:
        keys = prefix_hashes(np.arange(64), 16)
        a.put(keys, [block(i) for i in range(4)])
        assert a.flush_index()
        assert b.lookup(keys) == 0 and b.lookup(keys, remote=True) == 4
        got = b.get(keys[:3], remote=True)
        assert all(np.array_equal(g, block(i)) for i, g in enumerate(got))
        s = b.stats()
        assert s["served_remote"] == 3 and s["hit_blocks_remote"] == 4
        assert b.tier(keys[0]) == "dram"                  # kept locally, zero-copy into the pool
        # A stale index record (A reused the slot) is a miss, never wrong bytes.
        crc = b._index.lookup(keys[3])[3]
        a.put(range(100, 104), [block(i) for i in range(100, 104)])
        assert keys[3] not in a
        b._index.flush()
        rec = (a.engine.name, a.base, BB, crc)            # what a stale record would say
        b._index.lookup_many = lambda ks: [rec] * len(ks)
        assert b.get([keys[3]], remote=True) == [None]
        assert b.stats()["remote_failed"] == 1


def test_remote_prefix_costs_one_index_query(redis_server):  # noqa: F811
    """A prompt's remote blocks are found with one query to the metadata store, not one
    per block (the scheduler asks for every new request)."""
    url = redis_server.url
    with mte.TransferEngine(name="kv-q1", metadata=url, host="127.0.0.1") as ea, \
            mte.TransferEngine(name="kv-q2", metadata=url, host="127.0.0.1") as eb, \
            cache(dram=8, engine=ea, namespace="t-query", share_without_token=True) as a, \
            cache(dram=8, engine=eb, namespace="t-query", share_without_token=True) as b:
        keys = prefix_hashes(np.arange(128), 16)
        a.put(keys[:6], [block(i) for i in range(6)])
        assert a.flush_index()
        store = b._index.store
        calls = []
        real_get, real_many = store.get, store.get_many
        # Index queries only (the owner's segment descriptor is fetched once, apart).
        store.get = lambda k: ("kvcache/" in k and calls.append(("get", k))) or real_get(k)
        store.get_many = lambda ks: calls.append(("many", len(ks))) or real_many(ks)
        try:
            assert b.lookup(keys, remote=True) == 6
            assert calls == [("many", 8)]
            calls.clear()
            got = b.get(keys[:6], remote=True)
            assert calls == [("many", 6)]
            assert all(np.array_equal(g, block(i)) for i, g in enumerate(got))
        finally:
            store.get, store.get_many = real_get, real_many


def test_remote_get_needs_an_index(engine):
    with cache(dram=2, engine=engine) as c:              # p2p metadata: no store
        with pytest.raises(InvalidArgumentError, match="owner index"):
            c.get([1], remote=True)


def test_shared_cache_dir_across_processes(tmp_path):
    """share=True (the vLLM pool's SSD tier): a cache_dir another *process* holds is not
    an error; this one takes cache_dir/instance-1 (issue 35, item 9). Without share the
    refusal stays."""
    import subprocess
    import sys
    d = tmp_path / "kv"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from mooncake_te.kvcache import KVCache\n"
         f"c = KVCache({BB}, {SLOT}, {4 * SLOT}, {str(d)!r}, tiers={{'ssd': {{'share': True}}}})\n"
         "print(c.ssd.dir, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        assert holder.stdout.readline().strip() == str(d)
        with pytest.raises(ConfigError, match="in use by another process"):
            KVCache(BB, SLOT, 4 * SLOT, str(d))
        with KVCache(BB, SLOT, 4 * SLOT, str(d), tiers={"ssd": {"share": True}}) as c:
            assert c.ssd.dir == str(d / "instance-1")
            c.put([b"k" * 16], [b"\x01" * BB])
    finally:
        holder.stdin.close()
        holder.wait(30)

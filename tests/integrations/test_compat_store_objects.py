# SPDX-License-Identifier: Apache-2.0
"""Mooncake Store semantics beyond one pool slot (issue 39): objects of any size up to
the segment, spread over as many slots as they need (items 1), and a put that returned
is visible to every client through the index (item 4 of the issue, "read-after-write"),
under etcd, redis and our HTTP metadata server."""
from __future__ import annotations

import os

import numpy as np
import pytest

from mooncake_te.compat.store import (NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND,
                                      MooncakeDistributedStore)

pytestmark = pytest.mark.timeout(180)
MIB = 1 << 20


from store_fixtures import _loopback, index_url  # noqa: F401  (fixtures)


def _store(url="P2PHANDSHAKE", segment=64 * MIB, local=128 * MIB, **kw):
    s = MooncakeDistributedStore()
    assert s.setup(dict(local_hostname="127.0.0.1", metadata_server=url,
                        global_segment_size=segment, local_buffer_size=local,
                        protocol="tcp", master_server_address="127.0.0.1:50051", **kw)) == 0
    return s


def test_object_larger_than_a_slot_and_a_segment_full_of_objects():
    s = _store()
    try:
        big = os.urandom(4 * MIB)
        assert s.put("big", big) == 0                     # was -200 (one 4 MiB slot)
        assert s.get("big") == big and s.get_size("big") == 4 * MIB
        dst = np.zeros(4 * MIB, np.uint8)
        assert s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        assert s.get_into("big", dst.ctypes.data, dst.nbytes) == 4 * MIB
        assert dst.tobytes() == big
        assert s.remove("big") == 0 and s.get("big") == b""
        # 1 MiB objects fill the segment with no live one evicted: 17 slots of 64 KiB
        # each (a 4 MiB slot per object held 15 of them).
        room = s._c().dram_slots // 17
        assert room >= 60
        objs = {f"o{i}": os.urandom(MIB) for i in range(room)}
        for k, v in objs.items():
            assert s.put(k, v) == 0
        assert s.batch_is_exist(list(objs)) == [1] * room
        for k, v in objs.items():
            assert s.get(k) == v, k
        # One more evicts the least recently used object whole, never a part of one.
        assert s.put("extra", os.urandom(MIB)) == 0
        gone = [k for k in objs if s.is_exist(k) == 0]
        assert gone == ["o0"], gone
        assert s.get("o0") == b"" and s.get_size("o0") == OBJECT_NOT_FOUND
        for k in list(objs)[1:]:
            assert s.get(k) == objs[k]
        assert s.put("too-big", b"x" * (65 * MIB)) == NO_AVAILABLE_HANDLE
        assert s.remove_all() == room
    finally:
        s.close()


def test_upsert_free_versions_never_mix():
    """A removed and re-put object of another size reads back as the new bytes: chunks
    of the old version are keyed by its version and never read for the new one."""
    s = _store(segment=8 * MIB)
    try:
        a, b = os.urandom(300 << 10), os.urandom(200 << 10)
        assert s.put("k", a) == 0 and s.get("k") == a
        assert s.remove("k") == 0
        assert s.put("k", b) == 0 and s.get("k") == b and s.get_size("k") == len(b)
    finally:
        s.close()


def test_read_after_write_across_clients(index_url):
    """A put that returned is seen by another client's get at once, 20 times in a row,
    large objects included (read one-sided, chunk by chunk, from the holder's pool)."""
    a = _store(index_url, segment=32 * MIB)
    b = _store(index_url, segment=32 * MIB)
    try:
        vals = []
        for i in range(20):
            v = os.urandom(1000 + 37 * i)
            vals.append(v)
            assert a.put(f"raw{i}", v) == 0
            assert b.get(f"raw{i}") == v, i
        # b's reads left the index naming a, the holder: a third client reads them too
        c = _store(index_url, segment=8 * MIB)
        try:
            assert [c.get(f"raw{i}") for i in range(20)] == vals
        finally:
            c.close()
        big = os.urandom(3 * MIB + 5)
        assert a.put("big", big) == 0
        assert b.is_exist("big") == 1 and b.get_size("big") == len(big)
        assert b.get("big") == big
        assert b.remove("big") == 0
        assert b.get("big") == b"" and b.is_exist("big") == 0
    finally:
        a.close()
        b.close()


def test_concurrent_puts_and_gets_keep_every_object(index_url):
    """Threads putting and reading at once (Mooncake's concurrency test, scaled down):
    while the segment has room, no object is evicted and every read is whole."""
    import threading
    s = _store(index_url, segment=64 * MIB)
    errors: list = []
    blobs = {f"t{t}/{i}": os.urandom(256 << 10) for t in range(4) for i in range(40)}

    def worker(t):
        try:
            mine = [k for k in blobs if k.startswith(f"t{t}/")]
            for k in mine:
                if s.put(k, blobs[k]) != 0:
                    errors.append(("put", k))
            for k in mine:
                if s.get(k) != blobs[k]:
                    errors.append(("get", k))
        except Exception as e:           # surfaced below
            errors.append(repr(e))
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors[:5]
        assert s.batch_is_exist(list(blobs)) == [1] * len(blobs)
    finally:
        s.close()

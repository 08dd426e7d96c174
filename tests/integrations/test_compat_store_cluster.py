# SPDX-License-Identifier: Apache-2.0
"""Mooncake Store across processes without a master (issue 39): clients with
``global_segment_size = 0`` that put into and read from other processes' segments,
``replica_num > 1`` copies that outlive their first holder, cluster-wide ``remove`` /
``remove_all`` and ``upsert``, and ``local_buffer_size`` bounding ``put`` as in
Mooncake; under etcd, redis and our HTTP metadata server. The other stores run in child
processes (their own engines and pools)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from servers import ROOT
from mooncake_te.compat.store import (INVALID_PARAMS, NO_AVAILABLE_HANDLE,
                                      MooncakeDistributedStore, ReplicateConfig)

pytestmark = pytest.mark.timeout(240)
MIB = 1 << 20

HOLDER = r"""
import json, sys
from mooncake_te.compat.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup(json.loads(sys.argv[1])) == 0
print(json.dumps({"name": s.get_hostname()}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "held":        # what this process's own pool holds
        print(json.dumps([1 if s._c().size_of(__import__("mooncake_te.compat.store",
              fromlist=["_key"])._key(k)) is not None else 0 for k in cmd["keys"]]),
              flush=True)
    elif cmd["op"] == "close":
        break
s.close()
print(json.dumps("closed"), flush=True)
"""


from store_fixtures import _loopback, index_url  # noqa: F401  (fixtures)


def _cfg(url, segment=16 * MIB, local=16 * MIB):
    return dict(local_hostname="127.0.0.1", metadata_server=url, global_segment_size=segment,
                local_buffer_size=local, protocol="tcp",
                master_server_address="127.0.0.1:50051")


class Holder:
    def __init__(self, url, tenant="default"):
        cfg = dict(_cfg(url), tenant_id=tenant)
        self.p = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(cfg)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=dict(os.environ, PYTHONPATH=ROOT))
        self.name = self._read()["name"]

    def _read(self):
        line = self.p.stdout.readline()
        assert line, "the holder process died"
        return json.loads(line)

    def held(self, keys):
        self.p.stdin.write(json.dumps({"op": "held", "keys": keys}) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.write(json.dumps({"op": "close"}) + "\n")
            self.p.stdin.flush()
            assert self._read() == "closed"
        self.p.wait(30)
        self.p.stdin.close()
        self.p.stdout.close()


def _store(cfg):
    s = MooncakeDistributedStore()
    assert s.setup(cfg) == 0
    return s


def test_segmentless_client_puts_into_and_reads_from_other_segments(index_url):
    tenant = "zero-" + os.urandom(4).hex()
    alone = MooncakeDistributedStore()
    assert alone.setup(dict(_cfg(index_url, segment=0), tenant_id=tenant)) == 0   # was -1
    try:
        assert alone.put("k", b"v") == NO_AVAILABLE_HANDLE       # nobody holds a segment
    finally:
        alone.close()
    h = Holder(index_url, tenant)
    try:
        c = _store(dict(_cfg(index_url, segment=0), tenant_id=tenant))
        try:
            big = os.urandom(2 * MIB + 3)
            assert c.put("small", b"hello") == 0
            assert c.put("big", big) == 0
            assert h.held(["small", "big"]) == [1, 1]          # in the holder's segment
            assert c.get("small") == b"hello" and c.get("big") == big
            assert c.get_size("big") == len(big) and c.is_exist("big") == 1
            d = c.get_replica_desc("big")[0]
            assert d.get_memory_descriptor().buffer_descriptor.segment_name == h.name
            assert c.remove("small") == 0 and h.held(["small"]) == [0]
        finally:
            c.close()
    finally:
        h.close()


def test_replica_survives_first_holder_and_remove_all_is_cluster_wide(index_url):
    tenant = "rep-" + os.urandom(4).hex()
    h = Holder(index_url, tenant)
    a = _store(dict(_cfg(index_url), tenant_id=tenant))
    reader = None
    try:
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        v = os.urandom(700 << 10)
        assert a.put("rep", v, cfg) == 0                        # a, and a copy in h
        assert a.put("one", b"single") == 0                     # replica_num 1: a only
        assert h.held(["rep", "one"]) == [1, 0]
        a.close()                                               # the first holder leaves
        reader = _store(dict(_cfg(index_url), tenant_id=tenant))
        assert reader.get("rep") == v
        assert reader.get("one") == b""
        # upsert replaces every copy; remove_all clears every store of the tenant
        assert reader.upsert("rep", b"new") == 0
        assert reader.get("rep") == b"new" and h.held(["rep"]) == [0]
        assert reader.remove_all(force=True) >= 1
        assert reader.is_exist("rep") == 0 and h.held(["rep"]) == [0]
    finally:
        a.close()
        if reader is not None:
            reader.close()
        h.close()


def test_local_buffer_bounds_put_as_in_mooncake(index_url):
    s = _store(_cfg(index_url, local=0))
    try:
        assert s.put("k", b"v") == INVALID_PARAMS                # nothing to stage it in
        assert s.put_batch(["a"], [b"1"]) == INVALID_PARAMS
        import numpy as np
        buf = np.frombuffer(b"zero-copy", np.uint8).copy()
        assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        assert s.put_from("k", buf.ctypes.data, buf.nbytes) == 0   # no staging needed
        assert s.get("k") == b"zero-copy"
    finally:
        s.close()
    s = _store(_cfg(index_url, local=MIB))
    try:
        assert s.put("big", b"x" * (MIB + 1)) == INVALID_PARAMS
        assert s.put("fits", b"x" * MIB) == 0
    finally:
        s.close()


def test_put_after_the_holder_was_killed_stores_again(index_url):
    """A holder killed without closing leaves its index records; a put of the same key
    elsewhere must not take them for an existing object (the put would be a no-op and
    every get a miss)."""
    tenant = "kill-" + os.urandom(4).hex()
    h = Holder(index_url, tenant)
    a = _store(dict(_cfg(index_url), tenant_id=tenant))
    try:
        c = _store(dict(_cfg(index_url, segment=0), tenant_id=tenant))
        cfg = ReplicateConfig()
        cfg.preferred_segment = h.name
        assert c.put("k", b"first", cfg) == 0 and h.held(["k"]) == [1]
        c.close()
        h.p.kill()
        h.p.wait(10)
        assert a.put("k", b"second") == 0
        assert a.get("k") == b"second"
        assert a.health_check() == 2          # h does not answer ...
        assert a.health_check() == 0          # ... and left the directory with that
    finally:
        a.close()
        h.close()


def test_unclosed_store_is_collected_and_leaves_the_directory(index_url):
    """The store service and directory threads hold the store weakly: a store its user
    dropped without close() is still collected, and its finalizer closes it."""
    import gc
    import weakref
    tenant = "gc-" + os.urandom(4).hex()
    b = _store(dict(_cfg(index_url), tenant_id=tenant))
    try:
        s = _store(dict(_cfg(index_url), tenant_id=tenant))
        name = s.get_hostname()
        assert name in b._directory.services()
        ref = weakref.ref(s)
        del s
        gc.collect()
        import time
        deadline = time.monotonic() + 15       # its finalizer closes it on a thread
        while (ref() is not None or name in b._directory.services()) and \
                time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.1)
        assert ref() is None
        assert name not in b._directory.services()
    finally:
        b.close()

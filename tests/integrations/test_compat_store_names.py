# SPDX-License-Identifier: Apache-2.0
"""Two stores of one process set up with the same ``host:port`` name (issue 39).

Mooncake's ``test_batch_replica_clear.py`` sets up a store as ``localhost:12345`` in one
test class and, without closing it, two more as ``localhost:12345`` / ``:12346`` in the
next. With our HTTP metadata server the second engine under a live engine's name was
refused (its rpc_meta record is not replaced while the first is alive), so ``setup``
returned -1. Stores of one process now share the engine of a name; each keeps its own
pool, and the engine closes with the last of them.
"""
from __future__ import annotations

import socket

import pytest

from mooncake_te.compat.store import MooncakeDistributedStore, ReplicateConfig

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20


from store_fixtures import _loopback, index_url  # noqa: F401  (fixtures)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(s, name, url) -> int:
    return s.setup(name, url, 16 * MIB, 16 * MIB, "tcp", "", "127.0.0.1:50051")


def test_same_name_twice_in_one_process(index_url):
    p1, p2 = _port(), _port()
    old = MooncakeDistributedStore()
    assert _setup(old, f"127.0.0.1:{p1}", index_url) == 0
    assert old.put("n-old", b"old") == 0
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    try:
        assert _setup(a, f"127.0.0.1:{p1}", index_url) == 0      # the name of a live one
        assert _setup(b, f"127.0.0.1:{p2}", index_url) == 0
        assert a.get_hostname() == old.get_hostname() == f"127.0.0.1:{p1}"
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        assert a.put("n-rep", b"replicated", cfg) == 0
        assert b.get("n-rep") == b"replicated"
        assert b.get("n-old") == b"old"                       # through the index
        old.close()                                           # the engine stays for a
        assert a.put("n-after", b"after") == 0
        assert b.get("n-after") == b"after"
        assert a.get("n-rep") == b"replicated"
    finally:
        old.close()
        a.close()
        b.close()
    c = MooncakeDistributedStore()                            # closed with the last user
    try:
        assert _setup(c, f"127.0.0.1:{p1}", index_url) == 0
        assert c.put("n-new", b"new") == 0 and c.get("n-new") == b"new"
    finally:
        c.close()

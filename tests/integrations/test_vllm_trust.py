# SPDX-License-Identifier: Apache-2.0
"""Issue 35, items 2 and 3: what a decode instance trusts in ``kv_transfer_params`` (which
any client of its API can set), and who may release a producer's lease. vLLM-free: the
scheduler and worker sides of the connector, with real engines for the notifications."""
from __future__ import annotations

import hmac
import time

import numpy as np

import mooncake_te as mte
from mooncake_te.integrations.vllm import leases
from mooncake_te.integrations.vllm.leases import LeaseTable
from mooncake_te.integrations.vllm.scheduler import SchedulerSide, Work
from mooncake_te.integrations.vllm.settings import parse_extra_config
from mooncake_te.integrations.vllm.worker import READ_DONE, WorkerSide

def derive_key(token: bytes, label: str) -> bytes:
    """mooncake_te.auth.derive_key, spelled out: the key the connector MACs with."""
    return hmac.digest(token, b"mte-derive " + label.encode(), "sha256")


KEY = derive_key(b"pd-test-token", "vllm-pd-params")
PRODUCER = "10.0.0.1:14579"


class Req:
    def __init__(self, rid, n, params, status="FINISHED_LENGTH_CAPPED", first=0):
        self.request_id, self.prompt_token_ids = rid, list(range(first, first + n))
        self.kv_transfer_params, self.status = params, status
        self.num_computed_tokens = n


class Blocks:
    def __init__(self, ids, cached=0):
        self.ids, self.cached = ids, cached

    def get_block_ids(self):
        return (list(self.ids),)

    def get_unhashed_block_ids(self):
        return list(self.ids[self.cached:])


class PoolLookup:
    """The scheduler's view of the pool (pool/lookup.py's reply): holds nothing."""

    def lookup(self, keys, remote=True):
        return [0, 0, 0]


def producer(key=KEY):
    return SchedulerSide(block_size=32, is_producer=True, is_consumer=False,
                         engine_name=PRODUCER, host="10.0.0.1", port=14579, lease_s=60,
                         clock=lambda: 1000.0, params_key=key)


def consumer(key=KEY, pool=None):
    return SchedulerSide(block_size=32, is_producer=False, is_consumer=True,
                         engine_name="10.0.0.2:14579", host="10.0.0.2", port=14579,
                         params_key=key, pool=pool)


def produced(key=KEY, first=0):
    _, params = producer(key).request_finished(Req("p1", 75, {"do_remote_decode": True},
                                                   first=first), [7, 8, 9, 10])
    return params


def test_signed_params_are_accepted():
    params = produced()
    assert len(params["remote_mac"]) == 64
    cons = consumer()
    d = Req("d1", 75, dict(params))
    assert cons.get_num_new_matched_tokens(d, 0) == (75, True)
    cons.update_state_after_alloc(d, Blocks([40, 41, 42]), 75)
    (spec,) = cons.take_work().loads
    assert spec.remote_engine == PRODUCER and spec.lease_key == params["remote_lease_key"]
    assert cons.refused_params == 0


def test_params_a_client_made_or_changed_are_refused():
    """The issue's attack: a client names its own engine (or other blocks, or replays
    another prompt's parameters); the decode instance must not connect there, load,
    or tell anyone to release anything."""
    good = produced()
    forged = [dict(good, remote_engine="127.0.0.1:6666"),           # an attacker's engine
              dict(good, remote_block_ids=[1, 2, 3]),               # other blocks
              dict(good, remote_num_tokens=64),
              dict(good, remote_lease_key="00" * 16),
              {k: v for k, v in good.items() if k != "remote_mac"},  # unsigned
              dict(good, remote_mac="zz"), dict(good, remote_mac=None),
              dict(good, remote_block_ids="7,8,9"),
              produced(key=derive_key(b"another-cluster", "vllm-pd-params"))]
    cons = consumer()
    for i, p in enumerate(forged):
        d = Req(f"d{i}", 75, dict(p))
        assert cons.get_num_new_matched_tokens(d, 0) == (0, False), p
        cons.update_state_after_alloc(d, Blocks([40, 41, 42]), 0)
        assert cons.request_finished(d, [40, 41, 42]) == (False, None)
        w = cons.take_work()
        assert w.loads == [] and w.releases == [], p
    # Valid parameters for another prompt (replayed onto this request).
    d = Req("dx", 75, dict(produced(first=1000)))
    assert cons.get_num_new_matched_tokens(d, 0) == (0, False)
    assert cons.refused_params == len(forged) + 1


def test_kv_from_an_unverified_producer_is_never_saved_into_the_pool():
    """Without a token nothing can be checked: the load runs, its KV stays out of the
    pool (on main it was saved, and served to the next request with that prefix)."""
    params = produced(key=None)
    assert "remote_mac" not in params
    cons = consumer(key=None, pool=PoolLookup())
    d = Req("d1", 75, dict(params))
    assert cons.get_num_new_matched_tokens(d, 0) == (75, True)
    cons.update_state_after_alloc(d, Blocks([40, 41, 42]), 75)
    assert len(cons.take_work().loads) == 1
    assert cons.request_finished(d, [40, 41, 42]) == (False, None)
    assert cons.take_work().saves == []
    # A request computed here is saved as before.
    local = Req("l1", 75, None)
    assert cons.request_finished(local, [50, 51, 52])[0] is True
    assert len(cons.take_work().saves) == 1


def test_read_done_releases_only_with_the_lease_key():
    now = [100.0]
    t = LeaseTable(10, clock=lambda: now[0])
    t.add("a", "k1")
    t.read_done("a", None)                  # an older message, or a guess: refused
    t.read_done("a", "k2")
    assert t.collect() == set() and t.refused == 2
    t.read_done("a", "k1")
    assert t.collect() == {"a"}
    t.read_done("b", "bad")                 # early, with the wrong key
    t.add("b", "kb")
    assert t.collect() == set()
    t.read_done("c", "kc")                  # early, right key
    t.add("c", "kc")
    assert t.collect() == {"c"}


def test_early_read_dones_are_bounded():
    """Main kept every unknown id for lease_s: 300 notifications held 300 MiB."""
    MAX_EARLY, MAX_ID = getattr(leases, "MAX_EARLY", 1024), getattr(leases, "MAX_ID", 256)
    t = LeaseTable(120)
    for i in range(3 * MAX_EARLY):
        t.read_done(f"ghost-{i}", "00")
    assert len(t._early) == MAX_EARLY and t.early_dropped == 2 * MAX_EARLY
    t.read_done("x" * (1 << 20), "00")      # a 1 MiB id is not kept at all
    assert len(t._early) == MAX_EARLY and t.refused == 1
    assert max(len(k) for k in t._early) <= MAX_ID


def test_a_producer_frees_a_lease_only_for_the_reader_it_was_given_to():
    """Real engines: the producer's worker side holds p1's lease; another sender's
    read-done for p1 (without, or with a wrong, key) does not free it, the reader's does."""
    s = parse_extra_config({"protocol": "tcp"})
    w = WorkerSide(s, {}, "127.0.0.1", 0, is_producer=True, is_consumer=False)
    w.engine = mte.TransferEngine(host="127.0.0.1", protocol="tcp")
    try:
        with mte.TransferEngine(host="127.0.0.1", protocol="tcp") as other:
            w.start(Work(leases=[("p1", "ab" * 16)]))

            def sent(msg, want):
                other.send_notification(w.engine.name, msg)
                end = time.monotonic() + 5
                got: set = set()
                while time.monotonic() < end and w.stats.get("read_done_refused", 0) < want:
                    got |= w.collect()[0]
                    time.sleep(0.01)
                return got | w.collect()[0]

            assert sent(READ_DONE + b"p1", 1) == set()
            assert sent(READ_DONE + b"p1 " + b"cd" * 16, 2) == set()
            other.send_notification(w.engine.name, READ_DONE + b"p1 " + b"ab" * 16)
            end, freed = time.monotonic() + 5, set()
            while time.monotonic() < end and "p1" not in freed:
                freed |= w.collect()[0]
                time.sleep(0.01)
            assert "p1" in freed
            assert np.isfinite(w.stats["read_done_refused"])
    finally:
        w.engine.close()

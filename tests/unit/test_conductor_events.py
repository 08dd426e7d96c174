# SPDX-License-Identifier: Apache-2.0
"""vLLM's KV events in the conductor: batches applied to an instance's GPU cache view
(data: event maps as vLLM's msgpack decodes to), routing with that view, and the ZeroMQ
side (a real PUB and ROUTER pair speaking vLLM's wire format: sequence gaps filled from
the replay endpoint, a publisher restart, a late subscriber). The same against a real
vLLM: tests/integrations/test_conductor_e2e.py::test_kv_events_match_vllm."""
from __future__ import annotations

import asyncio
import time

import pytest

from mooncake_te.conductor import Cluster, InstanceRecord, Priors
from mooncake_te.conductor.events import (GpuBlocks, connect_endpoint, parse_kv_events)
from mooncake_te.integrations.vllm.pool.keys import block_keys, namespace_root

BS = 4
ROOT = namespace_root("m|torch.float32|auto", BS)


def stored(hashes, parent, toks, **kw):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": toks, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, **kw}


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def batch(*events):
    return [time.time(), list(events)]


def test_stored_blocks_chain_into_pool_keys():
    v = GpuBlocks(ROOT, BS)
    toks = list(range(100, 124))                     # 6 blocks
    keys = block_keys(toks, BS, ROOT)
    # vLLM stores a prompt's blocks in two steps (chunked prefill): the second chains
    # from the first's last hash.
    v.apply(0, batch(stored([b"h0", b"h1", b"h2"], None, toks[:12])))
    v.apply(1, batch(stored([b"h3", b"h4", b"h5"], b"h2", toks[12:])))
    assert v.keys == set(keys) and v.complete
    # an integer-hash publisher (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) works the same
    w = GpuBlocks(ROOT, BS)
    w.apply(0, batch(stored([11, 12], None, toks[:8]), stored([13], 12, toks[8:12])))
    assert w.keys == set(keys[:3])


def test_removed_cleared_and_skipped():
    v = GpuBlocks(ROOT, BS)
    toks = list(range(200, 216))
    keys = block_keys(toks, BS, ROOT)
    v.apply(0, batch(stored([b"a", b"b", b"c", b"d"], None, toks)))
    v.apply(1, batch(removed([b"d", b"c"])))
    assert v.keys == set(keys[:2])
    v.apply(2, batch({"type": "AllBlocksCleared"}))
    assert len(v) == 0 and not v.by_hash
    # blocks whose KV depends on more than their tokens, or not in the GPU, or another
    # block size: not counted
    for kw in ({"lora_name": "adapter"}, {"extra_keys": [("salt",)]}, {"medium": "CPU"},
               {"block_size": 8}, {"group_idx": 1}):
        v.apply(v.last_seq + 1, batch(stored([b"x"], None, toks[:BS], **kw)))
    assert len(v) == 0 and v.skipped == 5
    # extra_keys of None per block (the usual case) is no extra input
    v.apply(v.last_seq + 1, batch(stored([b"y"], None, toks[:BS], extra_keys=[None])))
    assert v.keys == {keys[0]}
    # a parent never seen cannot be chained: not counted (no false hit)
    v.apply(v.last_seq + 1, batch(stored([b"z"], b"unknown", toks[4:8])))
    assert v.orphans == 1 and v.keys == {keys[0]}


def test_sequence_numbers():
    v = GpuBlocks(ROOT, BS)
    toks = list(range(300, 308))
    v.apply(5, batch(stored([b"a"], None, toks[:4])))     # history before 5 unknown
    assert not v.complete and len(v) == 1
    v.apply(0, batch())                                  # a publisher's first batch
    assert v.complete and len(v) == 0
    v.apply(1, batch(stored([b"a"], None, toks[:4])))
    v.apply(3, batch())                                  # 2 missing
    assert not v.complete


def cluster(n=2):
    c = Cluster(Priors(), default_root=ROOT, default_namespace="ns", gpu_blocks=1000)
    for i in range(n):
        c.add(InstanceRecord(url=f"http://127.0.0.1:81{i:02d}", role="plain",
                             engine=f"e{i}", block_size=BS), static=True)
    return c


def test_events_decide_the_gpu_tier():
    c = cluster(2)
    toks = list(range(400, 440))                      # 10 blocks
    keys = block_keys(toks, BS, c.default_root)
    hashes = [bytes([i]) for i in range(10)]
    # e0 was sent this prompt (the shadow says cached) but its events say vLLM evicted
    # it; e1's events say it holds the first 6 blocks.
    c.shadows["e0"].add(keys)
    for n in ("e0", "e1"):
        c.events_view(n).apply(0, batch(stored(hashes, None, toks)))
    c.events_view("e0").apply(1, batch(removed(hashes)))
    c.events_view("e1").apply(1, batch(removed(hashes[6:])))
    est, _, hits = c.rank_prefill(toks, ("plain",))
    assert hits["e0"]["gpu"] == 0 and hits["e1"]["gpu"] == 6
    assert est[0].name == "e1"
    # A hole in e0's history: what the conductor sent there counts again.
    c.events_view("e0").apply(5, batch())
    assert c.rank_prefill(toks, ("plain",))[2]["e0"]["gpu"] == 10
    # Routed and not answered (vLLM has not reported the blocks yet): counted while in
    # flight and for the grace after the answer.
    c2 = cluster(2)
    for n in ("e0", "e1"):
        c2.events_view(n).apply(0, batch())
    c2.pending["e1"].add(keys)
    assert c2.rank_prefill(toks, ("plain",), now=100.0)[2]["e1"]["gpu"] == 10
    c2.pending["e1"].done(keys, now=100.0)
    assert c2.rank_prefill(toks, ("plain",), now=101.0)[2]["e1"]["gpu"] == 10
    assert c2.rank_prefill(toks, ("plain",), now=103.0)[2]["e1"]["gpu"] == 0


def test_endpoints_and_config():
    assert connect_endpoint("tcp://*:5557", "http://10.1.2.3:8100") == "tcp://10.1.2.3:5557"
    assert connect_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert connect_endpoint("tcp://*:5557", "http://[::1]:8100") == "tcp://[::1]:5557"
    for bad, msg in (("127.0.0.1:5557", "expected tcp://"), ("tcp://*:0", "fixed port"),
                     ("tcp://*:5557", "instance's URL")):
        with pytest.raises(ValueError, match=msg):
            connect_endpoint(bad)
    assert parse_kv_events("http://h:1=tcp://h:2,tcp://h:3") == ("http://h:1", "tcp://h:2",
                                                                 "tcp://h:3")
    with pytest.raises(ValueError, match="INSTANCE_URL=ENDPOINT"):
        parse_kv_events("tcp://h:2")
    from mooncake_te.conductor.config import build
    from mooncake_te.config import Config
    from mooncake_te.errors import ConfigError
    base = Config.load(None, env={})
    cfg = base.with_overrides({"conductor": {
        "plain": ["http://127.0.0.1:8100"], "model": "m",
        "kv_events": ["http://127.0.0.1:8100=tcp://127.0.0.1:5557"]}})
    rec = next(iter(build(cfg, tokenizer=object()).cluster.records.values()))
    assert (rec.kv_events, rec.kv_events_replay) == ("tcp://127.0.0.1:5557", "")
    with pytest.raises(ConfigError, match="no instance http://127.0.0.1:9"):
        build(base.with_overrides({"conductor": {
            "plain": ["http://127.0.0.1:8100"],
            "kv_events": ["http://127.0.0.1:9=tcp://127.0.0.1:5557"]}}), tokenizer=object())
    # A record announced by a connector round-trips its endpoints.
    r = InstanceRecord(url="http://h:1", kv_events="tcp://*:5557",
                       kv_events_replay="tcp://*:5558")
    assert InstanceRecord.decode(r.encode()) == r


def test_connector_announces_its_endpoints():
    from types import SimpleNamespace as NS
    from mooncake_te.conductor.registry import kv_events_of
    on = NS(kv_events_config=NS(enable_kv_cache_events=True, publisher="zmq",
                                endpoint="tcp://*:5557", replay_endpoint=None))
    assert kv_events_of(on) == {"kv_events": "tcp://*:5557", "kv_events_replay": ""}
    assert kv_events_of(NS(kv_events_config=None)) == {}
    off = NS(kv_events_config=NS(enable_kv_cache_events=False, publisher="null",
                                 endpoint="tcp://*:5557", replay_endpoint=None))
    assert kv_events_of(off) == {}


def test_missing_pyzmq_is_a_clear_error(monkeypatch):
    import sys
    from mooncake_te.conductor.events import Subscriber
    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(RuntimeError, match=r"pip install 'mooncake-te\[conductor\]'"):
        Subscriber("e0", GpuBlocks(ROOT, BS), "tcp://127.0.0.1:1")


# -- over ZeroMQ ---------------------------------------------------------------------------
zmq = pytest.importorskip("zmq", reason="pyzmq not installed (pip install pyzmq)")
msgpack = pytest.importorskip("msgpack", reason="msgpack not installed")


class Publisher:
    """vLLM's wire format on real sockets: PUB frames (topic, seq, payload) and a ROUTER
    that replays its buffer from a sequence number, then an end marker."""

    def __init__(self, port=0, rport=0, seq0=0):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.rep = self.ctx.socket(zmq.ROUTER)
        self.rep.setsockopt(zmq.LINGER, 0)
        if port:
            self.pub.bind(f"tcp://127.0.0.1:{port}")
            self.rep.bind(f"tcp://127.0.0.1:{rport}")
        else:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            rport = self.rep.bind_to_random_port("tcp://127.0.0.1")
        self.port, self.rport = port, rport
        self.seq = seq0
        self.buf: list = []

    def send(self, events, drop=False):
        payload = msgpack.packb([time.time(), events])
        seq = self.seq.to_bytes(8, "big")
        self.buf.append((seq, payload))
        if not drop:
            self.pub.send_multipart([b"", seq, payload])
        self.seq += 1

    def serve_replay(self):
        while self.rep.poll(0):
            client, _, start = self.rep.recv_multipart()
            s = int.from_bytes(start, "big")
            for seq, p in self.buf:
                if int.from_bytes(seq, "big") >= s:
                    self.rep.send_multipart([client, b"", b"", seq, p])
            self.rep.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                     b""])

    def close(self):
        self.pub.close()
        self.rep.close()
        self.ctx.term()


async def until(cond, pub=None, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        if pub is not None:
            pub.serve_replay()
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


@pytest.mark.timeout(60)
def test_subscriber_gaps_restart_and_late_join():
    from mooncake_te.conductor.events import Subscriber
    toks = list(range(500, 532))
    keys = block_keys(toks, BS, ROOT)
    h = [bytes([i]) for i in range(8)]

    async def main():
        pub = Publisher()
        # Published before anyone subscribed: only the replay endpoint has it.
        pub.send([stored(h[:2], None, toks[:8])])
        v = GpuBlocks(ROOT, BS)
        sub = Subscriber("e0", v, f"tcp://127.0.0.1:{pub.port}",
                         f"tcp://127.0.0.1:{pub.rport}")
        task = asyncio.ensure_future(sub.run())
        try:
            await until(lambda: v.keys == set(keys[:2]) and v.complete, pub)
            # PUB/SUB needs a moment to connect before messages are delivered
            t0 = time.monotonic()
            while sub.last_sub_seq < 0 and time.monotonic() - t0 < 10:
                pub.send([])
                await until(lambda: True, pub)
                await asyncio.sleep(0.05)
            # a batch the SUB socket never sees, then the next: the gap is replayed
            pub.send([stored(h[2:4], h[1], toks[8:16])], drop=True)
            pub.send([stored(h[4:6], h[3], toks[16:24])])
            await until(lambda: v.keys == set(keys[:6]), pub)
            assert v.complete and v.gaps == 1
            for _ in range(20):                  # a longer life than the next one's start
                pub.send([])
            await until(lambda: sub.last_sub_seq == pub.seq - 1, pub)
            # the instance restarts: a new publisher on the same ports, numbers from 0
            port, rport = pub.port, pub.rport
            pub.close()
            pub = Publisher(port, rport)
            pub.send([stored(h[6:7], None, toks[:4])])
            t0 = time.monotonic()
            while v.restarts == 0 and time.monotonic() - t0 < 10:
                pub.send([])
                await until(lambda: True, pub)
                await asyncio.sleep(0.1)
            assert v.restarts == 1
            await until(lambda: v.keys == {keys[0]}, pub)
            assert v.by_hash == {h[6]: keys[0]}
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            pub.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_subscriber_without_replay_is_incomplete():
    from mooncake_te.conductor.events import Subscriber
    toks = list(range(600, 608))

    async def main():
        pub = Publisher()
        pub.send([stored([b"a"], None, toks[:4])])        # missed: no replay endpoint
        v = GpuBlocks(ROOT, BS)
        sub = Subscriber("e0", v, f"tcp://127.0.0.1:{pub.port}")
        task = asyncio.ensure_future(sub.run())
        try:
            t0 = time.monotonic()
            while v.batches == 0 and time.monotonic() - t0 < 10:
                pub.send([stored([b"b"], b"a", toks[4:8])])
                await asyncio.sleep(0.1)
            assert v.batches >= 1 and not v.complete
            assert v.orphans >= 1 and len(v) == 0       # b's parent was never seen
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            pub.close()

    asyncio.run(main())

# SPDX-License-Identifier: Apache-2.0
"""P2P store: engines in separate processes on 127.0.0.1 distributing objects through a
real etcd (tests/servers.py), redis and HTTP metadata server, and with no server at all.

Each store process (``StoreProcess``, on tests/child.py) runs its own TransferEngine and
P2PStore and is driven over a pipe; a get runs in a thread of that process so the test can watch its
progress and kill or corrupt other holders meanwhile. A getter is slowed only through
the public ``progress`` hook (a slow consumer), never by patching the store.
"""
from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from child import Child
from servers import EtcdServer, HttpMetadataServer, RedisServer, _serve

import mooncake_te as mte
from mooncake_te.p2p_store import ObjectExistsError, ObjectNotFoundError, P2PStore

CALL_TIMEOUT = 60.0
CHUNK = 64 << 10


def _data(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _sha(a) -> str:
    return hashlib.sha256(memoryview(a).cast("B")).hexdigest()


class _StoreState:
    """The child's side: an engine and its P2PStore; gets run in threads so the test can
    watch their progress."""

    def __init__(self, metadata, kwargs):
        import logging
        logging.basicConfig(level=logging.WARNING)
        self.eng = mte.TransferEngine(host="127.0.0.1",
                                      metadata=metadata if metadata != "p2p" else "p2p")
        self.store = P2PStore(self.eng, metadata=metadata, **kwargs)
        self.arrays = {}
        self.gets = {}

    def hello(self):
        return self.store.name, self.store.address

    def close(self):
        self.store.close()
        self.eng.close()

    def _run_get(self, name, delay, decentralized):
        def progress(done, total):
            self.gets[name]["done"] = done
            if delay:
                time.sleep(delay)       # a slow consumer, through the public hook
        try:
            self.arrays[name] = self.store.get(name, progress=progress,
                                               decentralized=decentralized)
            self.gets[name]["result"] = ("ok", _sha(self.arrays[name]))
        except BaseException as e:
            self.gets[name]["result"] = ("error", (type(e).__name__, str(e)))

    def do_register(self, name, size, seed):            # -> sha
        self.arrays[name] = _data(size, seed)
        self.store.register(name, self.arrays[name])
        return _sha(self.arrays[name])

    def do_start_get(self, name, delay, decentralized):  # delay per chunk
        self.gets[name] = {"done": 0}
        threading.Thread(target=self._run_get, args=(name, delay, decentralized),
                         daemon=True).start()

    def do_progress(self, name):                         # -> bytes verified so far
        return self.gets[name]["done"]

    def do_wait_get(self, name, timeout):   # -> ("ok", sha) | ("error", (type, msg))
        deadline = time.monotonic() + timeout
        while "result" not in self.gets[name] and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.gets[name].get("result", ("error", ("Timeout", "get did not end")))

    def do_sha(self, name):                              # -> sha256 of our copy
        return _sha(self.arrays[name])

    def do_corrupt(self, name):                          # flip every byte of our copy
        self.arrays[name] ^= 0xFF

    def do_unregister(self, name):
        self.store.unregister(name)

    def do_stats(self):
        return self.store.stats()


class StoreProcess(Child):
    """An engine + P2PStore in another process; ``name`` and ``address`` once ready."""

    def __init__(self, metadata: str, **kwargs):
        self.name = self.address = None
        super().__init__(_StoreState, metadata, kwargs, what="store process",
                         timeout=CALL_TIMEOUT, wait=False)

    def on_ready(self, hello) -> None:
        self.name, self.address = hello

    def wait_progress(self, name: str, at_least: int, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.call("progress", name)
            if done >= at_least:
                return done
            time.sleep(0.01)
        raise TimeoutError(f"{self.name}: get of {name!r} stuck below {at_least} bytes")


def start(n: int, metadata: str, **kwargs) -> list[StoreProcess]:
    """``n`` store processes started together (spawning is the slow part)."""
    procs = [StoreProcess(metadata, **kwargs) for _ in range(n)]
    for p in procs:
        p.ready()
    return procs


@pytest.fixture(scope="module")
def etcd():
    yield from _serve(EtcdServer)


@pytest.fixture
def procs():
    """Collects the test's store processes and closes them however the test ends."""
    made: list[StoreProcess] = []
    yield made
    for p in made:
        p.close()


def wait_until(pred, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def spec(server) -> str:
    return f"{server.url}?ttl=2"


def get_ok(p: StoreProcess, name: str, timeout: float = 30.0) -> str:
    kind, value = p.call("wait_get", name, timeout, timeout=timeout + 10)
    assert kind == "ok", f"{p.name}: get of {name!r} failed: {value}"
    return value


# --- chunk arithmetic --------------------------------------------------------------------------
def test_transfer_plan_maps_every_byte_between_differently_split_copies():
    from mooncake_te.p2p_store.manifest import transfer_plan
    rng = np.random.default_rng(12)
    for _ in range(200):
        size = int(rng.integers(1, 5000))
        memory = np.zeros(4 * size + 1000, np.uint8)          # addresses are indices here
        obj = rng.integers(0, 256, size, dtype=np.uint8)

        def split(base):
            cuts = np.sort(rng.choice(np.arange(1, size), min(size - 1, int(rng.integers(0, 6))),
                                      replace=False)) if size > 1 else []
            bounds = [0, *cuts, size]
            pieces, addr = [], base
            for lo, hi in zip(bounds, bounds[1:]):
                pieces.append((addr, hi - lo))
                addr += hi - lo + int(rng.integers(0, 7))    # gaps between buffers
            return pieces
        src, dst = split(0), split(2 * size + 100)
        for (a, n), lo in zip(src, np.cumsum([0] + [n for _, n in src])):
            memory[a:a + n] = obj[lo:lo + n]
        chunk = int(rng.integers(1, size + 1))
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            local, remote, lens = transfer_plan(dst, src, off, n)
            assert sum(lens) == n
            for la, ra, k in zip(local, remote, lens):
                memory[la:la + k] = memory[ra:ra + k]
        got = np.concatenate([memory[a:a + n] for a, n in dst])
        assert (got == obj).all()


# --- distribution ---------------------------------------------------------------------------
def test_fan_out_later_getters_fetch_from_earlier_ones(etcd, procs):
    size, name = 8 << 20, "fanout"
    procs += start(5, spec(etcd), chunk_size=CHUNK)
    seed, first, *later = procs
    digest = seed.call("register", name, size, 1)

    first.call("start_get", name, 0, True)
    assert get_ok(first, name) == digest
    for p in later:                                 # three getters at once
        p.call("start_get", name, 0, True)
    for p in later:
        assert get_ok(p, name) == digest

    chunks = size // CHUNK
    from_peers = 0
    for p in later:
        got = p.call("stats")["gets"][name]["chunks_from"]
        assert sum(got.values()) == chunks
        from_peers += sum(n for holder, n in got.items() if holder != seed.name)
    # Later getters took a measurable share from earlier getters, not all from the seed.
    assert from_peers >= 0.25 * chunks * len(later), from_peers
    getters = 1 + len(later)
    # Every chunk a getter verified, its holder counted as uploaded (the outcome report
    # is sent without waiting for an answer, hence the wait).
    assert wait_until(lambda: sum(p.call("stats")["bytes_uploaded"] for p in procs)
                      == getters * size, 5)
    seed_stats = seed.call("stats")
    assert seed_stats["bytes_uploaded"] < getters * size
    assert seed_stats["chunks_uploaded"] == sum(seed_stats["chunks_to"].values())


def test_centralized_fetches_everything_from_the_publisher(etcd, procs):
    size, name = 2 << 20, "central"
    procs += start(3, spec(etcd), chunk_size=CHUNK, decentralized=False)
    seed, a, b = procs
    digest = seed.call("register", name, size, 2)
    for p in (a, b):
        p.call("start_get", name, 0, None)
    for p in (a, b):
        assert get_ok(p, name) == digest
        assert p.call("stats")["gets"][name]["chunks_from"] == {seed.name: size // CHUNK}
    assert wait_until(lambda: seed.call("stats")["bytes_uploaded"] == 2 * size, 5)


def test_holder_killed_mid_get_the_others_finish_it(etcd, procs):
    size, name = 8 << 20, "victim"
    procs += start(5, spec(etcd), chunk_size=CHUNK)
    seed, r1, r2, *getters = procs
    digest = seed.call("register", name, size, 3)
    for r in (r1, r2):
        r.call("start_get", name, 0, True)
        assert get_ok(r, name) == digest
    for g in getters:
        g.call("start_get", name, 0.004, True)     # ~4 ms per chunk: time to kill
    for g in getters:
        g.wait_progress(name, size // 4)
    r1.kill()
    for g in getters:
        assert get_ok(g, name) == digest
        got = g.call("stats")["gets"][name]
        assert got["chunks_from"].get(r1.name, 0) > 0     # it was used before
        assert r1.name in got["failed_holders"]           # and then avoided
        assert sum(got["chunks_from"].values()) == size // CHUNK


def test_corrupt_chunk_detected_and_fetched_elsewhere(etcd, procs):
    size, name = 4 << 20, "corrupt"
    procs += start(3, spec(etcd), chunk_size=CHUNK)
    seed, bad, getter = procs
    digest = seed.call("register", name, size, 4)
    bad.call("start_get", name, 0, True)
    assert get_ok(bad, name) == digest
    bad.call("corrupt", name)             # its memory changes after it verified the chunks
    getter.call("start_get", name, 0, True)
    assert get_ok(getter, name) == digest
    g = getter.call("stats")["gets"][name]
    assert g["corrupt_from"].get(bad.name, 0) >= 1
    assert g["chunks_from"].get(bad.name, 0) == 0
    assert g["chunks_from"][seed.name] == size // CHUNK
    # The holder checked its own copy when told, stopped serving what is damaged, and
    # fetched it again from the others.
    assert wait_until(lambda: bad.call("sha", name) == digest, 15), bad.call("stats")
    st = bad.call("stats")
    assert st["corrupt_local"] == st["repaired_chunks"] == size // CHUNK
    assert getter.call("stats")["corrupt_chunks"] == g["corrupt_chunks"]


def test_missing_and_unregistered_mid_get_are_clear_errors(etcd, procs):
    size, name = 4 << 20, "withdrawn"
    procs += start(2, spec(etcd), chunk_size=CHUNK)
    seed, getter = procs
    getter.call("start_get", "no-such-object", 0, True)
    kind, (etype, msg) = getter.call("wait_get", "no-such-object", 10)
    assert (kind, etype) == ("error", "ObjectNotFoundError")
    assert "no-such-object" in msg and "etcd" in msg

    seed.call("register", name, size, 5)
    getter.call("start_get", name, 0.01, True)
    getter.wait_progress(name, CHUNK * 4)
    seed.call("unregister", name)
    kind, (etype, msg) = getter.call("wait_get", name, 20)
    assert (kind, etype) == ("error", "ObjectUnregisteredError"), msg
    assert name in msg and "unregistered" in msg


# --- other metadata backends, in one process (the API, not the fan-out) -----------------------
@pytest.fixture(params=["redis", "http"])
def other_store(request):
    yield from _serve({"redis": RedisServer, "http": HttpMetadataServer}[request.param])


def test_holder_lists_live_in_redis_and_http(other_store):
    url = spec(other_store)
    engines = [mte.TransferEngine(host="127.0.0.1", metadata=url) for _ in range(3)]
    # The first shares its engine's store client (metadata=None), the others open theirs.
    stores = [P2PStore(e, metadata=url if i else None, chunk_size=CHUNK)
              for i, e in enumerate(engines)]
    assert stores[0].directory.backend is engines[0]._backend
    try:
        data = _data(1 << 20, 6)
        stores[0].register("kv", data)
        with pytest.raises(ObjectExistsError, match="already published"):
            stores[1].register("kv", _data(CHUNK, 7))
        out1 = stores[1].get("kv")
        out2 = stores[2].get("kv")
        assert _sha(out1) == _sha(out2) == _sha(data)
        names = {h.name for h in stores[0].directory.holders("kv", stores[0].list()[0].object_id)}
        assert names == {s.name for s in stores}
        assert [(o.name, o.held) for o in stores[2].list()] == [("kv", "replica")]
        stores[1].unregister("kv")          # a replica leaves; the object stays
        oid = stores[0].list()[0].object_id
        # Eventually: without compare-and-swap another holder's concurrent update of the
        # list can write the entry back, and the leaver removes it again.
        assert wait_until(lambda: stores[1].name not in {
            h.name for h in stores[0].directory.holders("kv", oid)}, 5)
        stores[0].unregister("kv")          # the publisher withdraws it
        with pytest.raises(ObjectNotFoundError, match="kv"):
            stores[1].get("kv")
    finally:
        for s in stores:
            s.close()
        for e in engines:
            e.close()


def test_p2p_metadata_with_a_seed_and_errors():
    engines = [mte.TransferEngine(host="127.0.0.1") for _ in range(3)]
    seed = P2PStore(engines[0], metadata="p2p", chunk_size=CHUNK)
    a = P2PStore(engines[1], metadata="p2p", seeds=[seed.address], chunk_size=CHUNK)
    lonely = P2PStore(engines[2], metadata="p2p")
    try:
        data = _data(3 * CHUNK + 17, 8)                 # a short last chunk
        parts = [data[:100_000].copy(), data[100_000:].copy()]   # two buffers, odd split
        regions = [engines[0].register(p, access="r") for p in parts]
        seed.register("two-parts", regions)
        dst = [np.zeros(CHUNK + 5, np.uint8), np.zeros(len(data), np.uint8)]
        a.get("two-parts", into=dst)
        assert _sha(np.concatenate(dst)[:len(data)]) == _sha(data)
        assert [o.held for o in a.list()] == ["replica"]
        with pytest.raises(ObjectExistsError, match="already holds"):
            a.get("two-parts")
        small = P2PStore(engines[2], metadata="p2p", seeds=[seed.address])
        with pytest.raises(mte.InvalidArgumentError, match="hold 10 bytes"):
            small.get("two-parts", into=np.zeros(10, np.uint8))
        small.close()
        with pytest.raises(ObjectNotFoundError, match="seeds="):
            lonely.get("two-parts")
        bad_seed = P2PStore(engines[2], metadata="p2p", seeds=[engines[0].name])
        with pytest.raises(mte.MetadataError, match="not a P2P store port"):
            bad_seed.get("two-parts")
        bad_seed.close()
    finally:
        for s in (a, seed, lonely):
            s.close()
        for e in engines:
            e.close()


def test_config_decentralized_false(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('[p2p_store]\nmetadata_server = "p2p"\ndecentralized = false\n')
    pub_eng = mte.TransferEngine(host="127.0.0.1")
    eng = mte.TransferEngine(host="127.0.0.1", config=str(cfg))
    pub = P2PStore(pub_eng, chunk_size=CHUNK)
    store = P2PStore(eng, seeds=[pub.address])
    try:
        assert store.decentralized is False and store.directory.kind == "p2p"
        data = _data(5 * CHUNK, 9)
        pub.register("cfg", data)
        out = store.get("cfg")
        assert _sha(out) == _sha(data)
        assert store.stats()["gets"]["cfg"]["chunks_from"] == {pub.name: 5}
        assert store.list()[0].held is None         # a plain copy: not served onward
        assert wait_until(lambda: pub.stats()["chunks_to"] == {store.name: 5}, 5)
    finally:
        store.close()
        pub.close()
        eng.close()
        pub_eng.close()


def test_cli_publish_fetch_list(tmp_path):
    import json
    import subprocess
    import sys
    src = tmp_path / "model.bin"
    src.write_bytes(_data(3 * CHUNK + 1000, 10).tobytes())
    cli = [sys.executable, "-m", "mooncake_te", "p2p"]
    pub = subprocess.Popen(cli + ["publish", str(src), "--host", "127.0.0.1", "--chunk-size",
                                  "64K", "--duration", "20", "--json"],
                           stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(pub.stdout.readline())
        assert info["name"] == "model.bin" and info["chunks"] == 4
        out = tmp_path / "copy.bin"
        seed = ["--seed", info["store"], "--host", "127.0.0.1"]
        r = subprocess.run(cli + ["fetch", "model.bin", "-o", str(out), "--json"] + seed,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["chunks_from"] == {info["segment"]: 4}
        assert out.read_bytes() == src.read_bytes()
        r = subprocess.run(cli + ["list", "--json"] + seed, capture_output=True, text=True,
                           timeout=60)
        assert [o["name"] for o in json.loads(r.stdout)] == ["model.bin"]
        r = subprocess.run(cli + ["fetch", "nothing-here"] + seed, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and "no object named 'nothing-here'" in r.stderr
        assert "model.bin" in r.stderr                  # the published names are listed
    finally:
        pub.terminate()
        pub.wait(10)


def test_every_holder_gone_is_a_clear_error(etcd, procs):
    procs += start(2, spec(etcd), chunk_size=CHUNK, stall_timeout=1.0)
    seed, getter = procs
    seed.call("register", "orphan", 1 << 20, 11)
    seed.kill()                 # its manifest stays in etcd; nobody can serve it
    getter.call("start_get", "orphan", 0, True)
    kind, (etype, msg) = getter.call("wait_get", "orphan", 20)
    assert (kind, etype) == ("error", "NoHolderError"), msg
    assert seed.name in msg and "unreachable" in msg and "orphan" in msg

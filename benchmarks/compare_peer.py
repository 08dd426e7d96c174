# SPDX-License-Identifier: Apache-2.0
"""One side (target or initiator) of a ``benchmarks/compare.py`` run, for one engine.

``compare.py`` starts two of these per engine, each under that engine's interpreter
(mooncake_te: the interpreter running compare.py; Mooncake and NIXL: their own
virtualenvs), so this file imports nothing but the standard library, numpy, the engine
under test and ``mooncake_te/bench/pattern.py`` loaded by path (pure numpy), which is
what makes the verification identical for all engines.

Protocol: one JSON object per line on stdin (commands) and on the original stdout
(replies). Engines log to stdout (NIXL) or stderr (Mooncake's glog), so fd 1 is pointed
at stderr before any engine is imported and replies go to a private copy of the
original stdout.

Commands (both roles unless marked):
  {"cmd": "info"}                        -> what a peer needs to reach this side
  {"cmd": "connect", "info": {...}}      -> (initiator) open the target
  {"cmd": "fill", "seed": s}             -> pattern ``s`` into the whole buffer
  {"cmd": "check", "seed": s, "block": b, "count": k}
                                         -> every byte of the first ``k`` blocks of the walk
  {"cmd": "point", "op": "write", "block": b, "batch": n, "inflight": d,
   "warmup": w, "duration": t}           -> (initiator) one throughput point
  {"cmd": "sync", "op": "write", "size": b, "duration": t}
                                         -> (initiator) synchronous single requests
  {"cmd": "quit"}
"""
from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_PATTERN = os.path.join(_HERE, os.pardir, "mooncake_te", "bench", "pattern.py")


def _load_pattern():
    """``mooncake_te.bench.pattern`` without importing ``mooncake_te`` (absent in the
    other engines' virtualenvs): the same bytes, so the same verification."""
    spec = importlib.util.spec_from_file_location("_mte_bench_pattern", _PATTERN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pattern = _load_pattern()


def walk(nblocks: int) -> np.ndarray:
    """Block indices in the order every engine visits them.

    A fixed odd stride (coprime with the power-of-two block count) instead of 0, 1, 2...:
    a batch's blocks are then not adjacent in memory, as the pages of a paged KV cache are
    not, and no engine can coalesce a batch of 64 x 4 KiB into one 256 KiB request (NIXL
    merges contiguous descriptors by default).
    """
    if nblocks <= 2:
        return np.arange(nblocks, dtype=np.int64)
    step = int(nblocks * 0.618) | 1
    while np.gcd(step, nblocks) != 1:
        step += 2
    return (np.arange(nblocks, dtype=np.int64) * step) % nblocks


def percentiles(samples_us) -> dict:
    a = np.asarray(samples_us, dtype=np.float64)
    if a.size == 0:
        return {"count": 0}
    p50, p90, p99, p999 = np.percentile(a, [50, 90, 99, 99.9])
    return {"count": int(a.size), "avg": float(a.mean()), "p50": float(p50),
            "p90": float(p90), "p99": float(p99), "p999": float(p999),
            "max": float(a.max())}


# --- engines: each exposes buffer, info(), connect(info), post(), wait(), sync() ----------

class MooncakeTE:
    """This repository's engine (``import mooncake_te``) over TCP: ``protocol="tcp"``
    keeps a peer on this host off the same-host transport."""

    name = "mooncake_te"
    protocol = "tcp"

    def __init__(self, buffer: np.ndarray, role: str = "initiator"):
        import mooncake_te as mte
        self.mte = mte
        self.buffer = buffer
        self.eng = mte.TransferEngine(host="127.0.0.1", metadata="p2p", protocol=self.protocol)
        self.checked = False
        self.region = self.eng.register(buffer)
        self.base = self.region.address

    def version(self) -> str:
        return getattr(self.mte, "__version__", "?")

    def info(self) -> dict:
        return {"segment": self.eng.name, "address": self.base}

    def connect(self, info: dict) -> None:
        self.seg = info["segment"]
        self.remote = int(info["address"])
        self.eng.open_segment(self.seg)

    def prepare(self, op: str, block: int, batches) -> None:
        pass                       # nothing to prepare: submit_arrays takes the arrays

    def post(self, op: str, idx: np.ndarray, block: int, key=None):
        offs = idx.astype(np.uint64) * np.uint64(block)
        return self.eng.submit_arrays(self.mte.WRITE if op == "write" else self.mte.READ,
                                      self.seg, offs + np.uint64(self.base),
                                      offs + np.uint64(self.remote), block)

    def wait(self, handle) -> None:
        handle.wait()
        if not self.checked:
            # A figure must carry the name of the transport that produced it.
            want = "tcp" if self.protocol == "tcp" else "shm"
            if handle.transport != want:
                raise RuntimeError(f"{self.name}: batches went over {handle.transport!r}, "
                                   f"not {want!r}")
            self.checked = True

    def sync(self, op: str, size: int) -> None:
        (self.eng.write if op == "write" else self.eng.read)(self.seg, self.base, self.remote,
                                                             size)

    def close(self) -> None:
        self.eng.close()


class MooncakeTEShm(MooncakeTE):
    """This repository's engine on its same-host transport (unix socket + cross-memory
    attach), which ``protocol="auto"`` picks for a peer on this host: not TCP, so shown
    beside the TCP figures, not in the ratios."""

    name = "mooncake_te_shm"
    protocol = "auto"


class Mooncake:
    """Mooncake's Transfer Engine from PyPI: TCP transport, P2PHANDSHAKE metadata."""

    name = "mooncake"

    def __init__(self, buffer: np.ndarray, role: str = "initiator"):
        # No RDMA here, but say it: the transport is chosen by hardware discovery, not by
        # the protocol argument (reference §0.3), and the figures must be TCP's.
        os.environ.setdefault("MC_FORCE_TCP", "1")
        from mooncake.engine import TransferEngine
        self.buffer = buffer
        self.te = TransferEngine()
        rc = self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"mooncake TransferEngine.initialize returned {rc}")
        self.base = buffer.ctypes.data
        rc = self.te.register_memory(self.base, buffer.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory returned {rc}")

    def version(self) -> str:
        from importlib.metadata import version
        for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
            try:
                return version(dist)
            except Exception:
                pass
        return "?"

    def info(self) -> dict:
        return {"segment": f"127.0.0.1:{self.te.get_rpc_port()}", "address": self.base}

    def connect(self, info: dict) -> None:
        self.seg = info["segment"]
        self.remote = int(info["address"])

    def prepare(self, op: str, block: int, batches) -> None:
        pass                       # the binding has no preparation step

    def post(self, op: str, idx: np.ndarray, block: int, key=None):
        # The binding takes Python lists of ints: building them is part of its submit cost.
        offs = idx * block
        src = (offs + self.base).tolist()
        dst = (offs + self.remote).tolist()
        lens = [block] * len(src)
        f = (self.te.batch_transfer_async_write if op == "write"
             else self.te.batch_transfer_async_read)
        bid = f(self.seg, src, dst, lens)
        if bid == 0:
            raise RuntimeError(f"mooncake batch_transfer_async_{op} failed (batch id 0)")
        return bid

    def wait(self, handle) -> None:
        rc = self.te.get_batch_transfer_status([handle])
        if rc != 0:
            raise RuntimeError(f"mooncake get_batch_transfer_status returned {rc}")

    def sync(self, op: str, size: int) -> None:
        f = self.te.transfer_sync_write if op == "write" else self.te.transfer_sync_read
        rc = f(self.seg, self.base, self.remote, size)
        if rc != 0:
            raise RuntimeError(f"mooncake transfer_sync_{op} returned {rc}")

    def close(self) -> None:
        try:
            self.te.unregister_memory(self.base)
        except Exception:
            pass


class Nixl:
    """NIXL from PyPI, UCX backend restricted to TCP over ``lo``.

    Descriptor lists and transfer handles are prepared once per (op, block size) and
    reposted, outside the timed part: NIXL's intended hot path (create once, post many;
    nixlbench does the same). The other two engines have no preparation step, so their
    whole submission cost is timed.
    """

    name = "nixl"

    def __init__(self, buffer: np.ndarray, role: str = "initiator"):
        # UCX over TCP only, and only on loopback: without these it would pick shared
        # memory for a same-host peer (not the TCP comparison) and could reach the peer
        # through a non-loopback interface.
        os.environ.setdefault("UCX_TLS", "tcp")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        self.buffer = buffer
        self.base = buffer.ctypes.data
        # The Python API's defaults, progress thread included: over TCP, UCX emulates
        # one-sided operations with messages the *target* must progress, so without that
        # thread the target never answers (with it off on both sides, the first transfer
        # never completed here).
        self.agent = nixl_agent(f"cmp-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        self.reg = self.agent.register_memory([(self.base, buffer.nbytes, 0, "")], "DRAM")
        self.prepped: dict = {}

    def version(self) -> str:
        from importlib.metadata import version
        for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
            try:
                return version(dist)
            except Exception:
                pass
        return "?"

    def info(self) -> dict:
        return {"metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "address": self.base}

    def connect(self, info: dict) -> None:
        self.peer = self.agent.add_remote_agent(base64.b64decode(info["metadata"]))
        self.remote = int(info["address"])

    def _dlists(self, block: int):
        key = ("dl", block)
        if key not in self.prepped:
            n = self.buffer.nbytes // block
            offs = np.arange(n, dtype=np.uint64) * np.uint64(block)
            loc = np.stack([offs + np.uint64(self.base), np.full(n, block, np.uint64),
                            np.zeros(n, np.uint64)], axis=1)
            rem = loc.copy()
            rem[:, 0] = offs + np.uint64(self.remote)
            self.prepped[key] = (self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, "DRAM"),
                                 self.agent.prep_xfer_dlist(self.peer, rem, "DRAM"))
        return self.prepped[key]

    def prepare(self, op: str, block: int, batches) -> None:
        """One transfer handle per distinct batch of the walk, made before timing."""
        lh, rh = self._dlists(block)
        for key, idx in batches:
            hk = (op, block, key)
            if hk not in self.prepped:
                ii = idx.astype(np.int32)
                self.prepped[hk] = self.agent.make_prepped_xfer(op.upper(), lh, ii, rh, ii)

    def post(self, op: str, idx: np.ndarray, block: int, key=None):
        h = self.prepped[(op, block, key)]
        st = self.agent.transfer(h)
        if st == "ERR":
            raise RuntimeError(f"nixl transfer({op}) returned ERR")
        return h

    def wait(self, handle) -> None:
        while True:
            st = self.agent.check_xfer_state(handle)
            if st == "DONE":
                return
            if st == "ERR":
                raise RuntimeError("nixl check_xfer_state returned ERR")
            # Poll, as NIXL expects, but give the CPU away between checks: the progress
            # thread does the work, and on 2 CPUs a pure spin starves it.
            os.sched_yield()

    def sync(self, op: str, size: int) -> None:
        h = self.prepped[(op, size, "sync")]
        self.post(op, None, size, "sync")
        self.wait(h)

    def close(self) -> None:
        pass


ENGINES = {"mooncake_te": MooncakeTE, "mooncake_te_shm": MooncakeTEShm, "mooncake": Mooncake,
           "nixl": Nixl}


# --- the measured loops ------------------------------------------------------------------

def run_point(eng, op: str, block: int, batch: int, inflight: int, warmup: float,
              duration: float) -> dict:
    """Keep ``inflight`` batches of ``batch`` requests outstanding for ``duration`` s."""
    nblocks = eng.buffer.nbytes // block
    order = walk(nblocks)
    batch = max(1, min(batch, nblocks))
    nbatch = nblocks // batch
    # The walk in batch-sized pieces; the last partial piece is dropped so that every
    # batch has the same size (block counts are powers of two here, so none is).
    pieces = [(k, order[k * batch:(k + 1) * batch]) for k in range(nbatch)]
    eng.prepare(op, block, pieces)
    posted = 0                     # requests handed to the engine, warm-up included
    pending = []                   # (handle, t_post, key)
    lat, post_us = [], []
    timed_bytes = 0
    k = 0
    t0 = time.perf_counter()
    t_start = t0 + warmup
    t_end = t_start + duration
    timing = False
    t_first = None
    while True:
        now = time.perf_counter()
        if not timing and now >= t_start:
            # Start the clock with the pipeline full: drain the warm-up batches first.
            for h, _, _ in pending:
                eng.wait(h)
            pending.clear()
            timing = True
            t_first = time.perf_counter()
            now = t_first
        if timing and now >= t_end:
            break
        while len(pending) < inflight:
            key, idx = pieces[k % nbatch]
            k += 1
            tp = time.perf_counter()
            h = eng.post(op, idx, block, key)
            td = time.perf_counter()
            pending.append((h, tp, timing))
            posted += len(idx)
            if timing:
                post_us.append((td - tp) * 1e6)
                timed_bytes += len(idx) * block
        h, tp, was_timed = pending.pop(0)
        eng.wait(h)
        if was_timed:
            lat.append((time.perf_counter() - tp) * 1e6)
    for h, tp, was_timed in pending:
        eng.wait(h)
        if was_timed:
            lat.append((time.perf_counter() - tp) * 1e6)
    seconds = time.perf_counter() - t_first
    return {"op": op, "block": block, "batch": batch, "inflight": inflight,
            "bytes": timed_bytes, "seconds": seconds, "gbps": timed_bytes / seconds / 1e9,
            "requests": timed_bytes // block, "posted": posted,
            "lat_us": percentiles(lat), "post_us": percentiles(post_us)}


def run_sync(eng, op: str, size: int, duration: float, warmup: float = 0.2) -> dict:
    """Synchronous single requests of ``size`` bytes at offset 0, one at a time."""
    if isinstance(eng, Nixl) and (op, size, "sync") not in eng.prepped:
        lh, rh = eng._dlists(size)
        eng.prepped[(op, size, "sync")] = eng.agent.make_prepped_xfer(
            op.upper(), lh, np.zeros(1, np.int32), rh, np.zeros(1, np.int32))
    t_end = time.perf_counter() + warmup
    while time.perf_counter() < t_end:
        eng.sync(op, size)
    samples = []
    t_end = time.perf_counter() + duration
    clock = time.perf_counter
    while True:
        t = clock()
        if t >= t_end:
            break
        eng.sync(op, size)
        samples.append((clock() - t) * 1e6)
    return {"op": op, "size": size, "lat_us": percentiles(samples)}


def check(buf: np.ndarray, seed: int, block: int, count: int) -> dict:
    """Compare every byte of the first ``count`` blocks of the walk with pattern ``seed``."""
    nblocks = buf.nbytes // block
    want = np.empty_like(buf)
    pattern.fill(want, seed)
    touched = walk(nblocks)[:min(count, nblocks)]
    bad = (buf[:nblocks * block].reshape(nblocks, block)[touched]
           != want[:nblocks * block].reshape(nblocks, block)[touched])
    rows = np.flatnonzero(bad.any(axis=1))
    if rows.size == 0:
        return {"ok": True, "checked_bytes": int(touched.size) * block}
    r = int(rows[0])
    col = int(np.flatnonzero(bad[r])[0])
    off = int(touched[r]) * block + col
    return {"ok": False, "offset": off, "got": int(buf[off]), "want": int(want[off]),
            "bad_blocks": int(rows.size)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=sorted(ENGINES), required=True)
    ap.add_argument("--buffer-size", type=int, required=True)
    ap.add_argument("--role", choices=["target", "initiator"], required=True)
    ap.add_argument("--cpu", type=int, default=None,
                    help="pin this process (and the engine threads it starts) to one CPU")
    args = ap.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})     # before any engine thread exists
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                  # engine chatter on stdout must not break the protocol

    def reply(obj) -> None:
        proto.write(json.dumps(obj) + "\n")

    buf = np.empty(args.buffer_size, dtype=np.uint8)
    buf.fill(0x5A)                 # touch every page before registering and timing
    try:
        eng = ENGINES[args.engine](buf, args.role)
    except Exception as e:          # the orchestrator prints this as the engine's reason
        reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    reply({"ok": True, "pid": os.getpid(), "version": eng.version()})
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        try:
            if cmd == "quit":
                break
            if cmd == "info":
                out = eng.info()
            elif cmd == "connect":
                eng.connect(req["info"])
                out = {}
            elif cmd == "fill":
                pattern.fill(buf, int(req["seed"]))
                out = {}
            elif cmd == "check":
                out = check(buf, int(req["seed"]), int(req["block"]), int(req["count"]))
            elif cmd == "point":
                out = run_point(eng, req["op"], int(req["block"]), int(req["batch"]),
                                int(req["inflight"]), float(req["warmup"]),
                                float(req["duration"]))
            elif cmd == "sync":
                out = run_sync(eng, req["op"], int(req["size"]), float(req["duration"]))
            else:
                raise ValueError(f"unknown command {cmd!r}")
            out.setdefault("ok", True)
        except Exception as e:
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        reply(out)
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""Engines in separate processes, driven over a pipe, for integration tests.

Each PeerProcess is a real OS process (multiprocessing, spawn) running its own
TransferEngine on 127.0.0.1 with one registered numpy buffer; the test asks it to fill,
hash, read back, register, transfer or exit. Every call has a timeout so a wedged peer
fails the test instead of hanging it.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import traceback

CALL_TIMEOUT = 60.0


def _serve(conn, size, kwargs):
    import numpy as np
    import mooncake_te as mte

    eng = mte.TransferEngine(host="127.0.0.1", **kwargs)
    buf = np.zeros(size, dtype=np.uint8)
    region = eng.register(buf)
    extra = {}
    retired = []           # unregistered arrays kept alive (a stale peer may aim at them)
    conn.send(("ready", (eng.name, region.address, os.getpid())))

    def view(addr, n):
        for arr in [buf, *extra.values(), *retired]:
            base = arr.ctypes.data
            if base <= addr and addr + n <= base + arr.nbytes:
                return arr[addr - base: addr - base + n]
        raise ValueError(f"{addr:#x}+{n} is not in this peer's buffers")

    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "exit":
                eng.close()
                conn.send(("ok", None))
                break
            elif cmd == "fill":           # (addr, bytes)
                addr, data = args
                view(addr, len(data))[:] = np.frombuffer(data, np.uint8)
                out = None
            elif cmd == "get":            # (addr, n) -> bytes
                out = view(*args).tobytes()
            elif cmd == "sha":            # (addr, n) -> hex digest
                out = hashlib.sha256(view(*args)).hexdigest()
            elif cmd == "alloc":          # (size, access) -> addr
                arr = np.zeros(args[0], dtype=np.uint8)
                r = eng.register(arr, access=args[1])
                extra[r.address] = arr
                out = r.address
            elif cmd == "unregister":     # (addr)
                eng.unregister(args[0])
                arr = extra.pop(args[0], None)
                if arr is not None:
                    retired.append(arr)
                out = None
            elif cmd == "rdma_stats":     # per-device counters of the RDMA transport
                t = eng._transports.get("rdma")
                out = t.stats() if t is not None else None
            elif cmd == "notifications":
                out = [(n.sender, n.message) for n in eng.notifications()]
            elif cmd == "write_pattern":  # (target, remote_addr, n, seed, block) WRITE as initiator
                target, raddr, n, seed, block = args
                data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
                buf[:n] = data
                offs = np.arange(0, n, block, dtype=np.uint64)
                lens = np.minimum(block, n - offs).astype(np.uint64)
                eng.submit_arrays(mte.WRITE, target, region.address + offs, raddr + offs,
                                  lens).wait()
                out = hashlib.sha256(data).hexdigest()
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", out))
        except BaseException as e:  # report, keep serving
            conn.send(("error", (repr(e), traceback.format_exc())))


class PeerProcess:
    """A TransferEngine in another process. ``name``, ``address`` (its buffer), ``pid``."""

    def __init__(self, size: int = 1 << 20, **engine_kwargs):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, size, engine_kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.size = size
        self.name, self.address, self.pid = self._reply(CALL_TIMEOUT)

    def _reply(self, timeout):
        if not self._conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"peer process {self.proc.pid} did not answer in {timeout} s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"peer failed: {value[0]}\n{value[1]}")
        return value

    def call(self, cmd, *args, timeout: float = CALL_TIMEOUT):
        self._conn.send((cmd, args))
        return self._reply(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except Exception:
                pass
        self.proc.join(5)
        self.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sigstop(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads has stopped.

    kill() only queues the signal: a thread that is running (our receivers poll for a
    few microseconds before they block) can still serve one more request before it
    stops, which would make a "hung peer" test race with its own set-up."""
    import glob
    import signal
    import time
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(stat) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not stop within {timeout} s")

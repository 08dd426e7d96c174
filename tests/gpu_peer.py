# SPDX-License-Identifier: Apache-2.0
"""GPU buffers in tests: patterns and checksums computed on the GPU, and an engine with
GPU buffers in another process (spawned, driven over a pipe; every call has a timeout).

Buffers are made by CuPy or PyTorch (``lib``), and may be a slice at a non-zero offset
of a bigger allocation (as a KV-cache layer inside PyTorch's caching allocator is)."""
from __future__ import annotations

import gc
import multiprocessing as mp
import traceback

CALL_TIMEOUT = 120.0


def _cp_view(address: int, n: int):
    """A CuPy uint8 array over device memory we do not own (for kernels only)."""
    import cupy as cp
    mem = cp.cuda.UnownedMemory(address, n, None)
    return cp.ndarray((n,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))


def pattern(n: int, seed: int, xp):
    """n bytes that depend on every index and the seed (xp: numpy or cupy)."""
    i = xp.arange(n, dtype=xp.uint32)
    return ((i * xp.uint32(2654435761) + xp.uint32(seed * 97 + 13)) >> xp.uint32(13)).astype(
        xp.uint8)


def checksum(address: int, n: int, on_gpu: bool) -> int:
    """Position-weighted sum of [address, +n): a byte in the wrong place changes it.
    Computed on the GPU for device memory."""
    if on_gpu:
        import cupy as cp
        x = _cp_view(address, n).astype(cp.uint64)
        w = (cp.arange(n, dtype=cp.uint64) % cp.uint64(65521)) + cp.uint64(1)
        return int((x * w).sum())
    import ctypes

    import numpy as np
    x = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address)).astype(np.uint64)
    w = (np.arange(n, dtype=np.uint64) % np.uint64(65521)) + np.uint64(1)
    return int((x * w).sum())


def fill(address: int, n: int, seed: int, on_gpu: bool) -> None:
    if on_gpu:
        import cupy as cp
        _cp_view(address, n)[:] = pattern(n, seed, cp)
        cp.cuda.runtime.deviceSynchronize()
    else:
        import ctypes

        import numpy as np
        np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address))[:] = pattern(n, seed,
                                                                                       np)


def expected(n: int, seed: int) -> int:
    """The checksum of pattern(n, seed), computed on the CPU."""
    import numpy as np
    x = pattern(n, seed, np).astype(np.uint64)
    w = (np.arange(n, dtype=np.uint64) % np.uint64(65521)) + np.uint64(1)
    return int((x * w).sum())


def gpu_buffer(lib: str, size: int, offset: int = 0, device: int = 0):
    """(exported object, base object) of ``size`` bytes on ``device``, ``offset`` bytes
    into a bigger allocation."""
    if lib == "torch":
        import torch
        base = torch.zeros(size + offset, dtype=torch.uint8, device=f"cuda:{device}")
        return base[offset:], base
    import cupy as cp
    with cp.cuda.Device(device):
        base = cp.zeros(size + offset, dtype=cp.uint8)
    return base[offset:], base


def free_caches(lib: str) -> None:
    gc.collect()
    if lib == "torch":
        import torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    else:
        import cupy as cp
        cp.get_default_memory_pool().free_all_blocks()


def _serve(conn, kwargs):
    import numpy as np

    import mooncake_te as mte

    eng = mte.TransferEngine(host="127.0.0.1", **kwargs)
    keep = {}        # address -> (lib, exported, base, region)
    conn.send(("ready", eng.name))
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
            if cmd == "alloc":            # (lib, size, offset, device, access) -> address
                lib, size, offset, device, access = args
                if lib == "cpu":
                    obj = base = np.zeros(size, np.uint8)
                else:
                    obj, base = gpu_buffer(lib, size, offset, device)
                r = eng.register(obj, access=access)
                keep[r.address] = (lib, obj, base, r)
                out = (r.address, r.location)
            elif cmd == "fill":           # (address, n, seed)
                a, n, seed = args
                fill(a, n, seed, _on_gpu(keep, a))
                out = None
            elif cmd == "checksum":       # (address, n) -> int
                a, n = args
                out = checksum(a, n, _on_gpu(keep, a))
            elif cmd == "unregister_free":   # (address): unregister, then free the memory
                lib, obj, base, r = keep.pop(args[0])
                eng.unregister(r)
                del obj, base, r
                if lib != "cpu":
                    free_caches(lib)
                out = None
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", out))
        except BaseException as e:  # report, keep serving
            conn.send(("error", (repr(e), traceback.format_exc())))


def _on_gpu(keep, address) -> bool:
    for a, (lib, obj, _, r) in keep.items():
        if a <= address < a + r.length:
            return lib != "cpu"
    raise ValueError(f"{address:#x} is not in this peer's buffers")


class GpuPeer:
    """A TransferEngine with GPU buffers in another process; ``name``."""

    def __init__(self, **engine_kwargs):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, engine_kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.name = self._reply(CALL_TIMEOUT)

    def _reply(self, timeout):
        if not self._conn.poll(timeout):
            self.proc.kill()
            raise TimeoutError(f"GPU peer {self.proc.pid} did not answer in {timeout} s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"GPU peer failed: {value[0]}\n{value[1]}")
        return value

    def call(self, cmd, *args, timeout: float = CALL_TIMEOUT):
        self._conn.send((cmd, args))
        return self._reply(timeout)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=20)
            except Exception:
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

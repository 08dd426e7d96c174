# SPDX-License-Identifier: Apache-2.0
"""GPU buffers in tests: patterns and checksums computed on the GPU, and an engine with
GPU buffers in another process (tests/child.py: spawned, driven over a pipe; every call
has a timeout).

Buffers are made by CuPy or PyTorch (``lib``), and may be a slice at a non-zero offset
of a bigger allocation (as a KV-cache layer inside PyTorch's caching allocator is)."""
from __future__ import annotations

import gc

from child import Child

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


class _GpuState:
    """The child's side: an engine and the buffers it allocated and registered."""

    def __init__(self, kwargs):
        import mooncake_te as mte
        self.eng = mte.TransferEngine(host="127.0.0.1", **kwargs)
        self.keep = {}        # address -> (lib, exported, base, region)

    def hello(self):
        return self.eng.name

    def close(self):
        self.eng.close()

    def do_alloc(self, lib, size, offset, device, access):    # -> (address, location)
        import numpy as np
        if lib == "cpu":
            obj = base = np.zeros(size, np.uint8)
        else:
            obj, base = gpu_buffer(lib, size, offset, device)
        r = self.eng.register(obj, access=access)
        self.keep[r.address] = (lib, obj, base, r)
        return r.address, r.location

    def do_fill(self, a, n, seed):
        fill(a, n, seed, self._on_gpu(a))

    def do_checksum(self, a, n):                                # -> int
        return checksum(a, n, self._on_gpu(a))

    def do_notifications(self):
        return [(m.sender, m.message) for m in self.eng.notifications()]

    def do_get(self, a, n):                                     # -> bytes
        if not self._on_gpu(a):
            import ctypes
            return ctypes.string_at(a, n)
        import cupy as cp
        return cp.asnumpy(_cp_view(a, n)).tobytes()

    def do_put(self, a, data):                                  # bytes at a
        import numpy as np
        if not self._on_gpu(a):
            import ctypes
            ctypes.memmove(a, data, len(data))
            return
        import cupy as cp
        _cp_view(a, len(data)).set(np.frombuffer(data, np.uint8))
        cp.cuda.runtime.deviceSynchronize()

    def do_unregister_free(self, address):     # unregister, then free the memory
        lib, obj, base, r = self.keep.pop(address)
        self.eng.unregister(r)
        del obj, base, r
        if lib != "cpu":
            free_caches(lib)

    def _on_gpu(self, address) -> bool:
        for a, (lib, obj, _, r) in self.keep.items():
            if a <= address < a + r.length:
                return lib != "cpu"
        raise ValueError(f"{address:#x} is not in this peer's buffers")


class GpuPeer(Child):
    """A TransferEngine with GPU buffers in another process; ``name``."""

    exit_timeout = 20.0

    def __init__(self, **engine_kwargs):
        super().__init__(_GpuState, engine_kwargs, what="GPU peer", timeout=CALL_TIMEOUT)

    def on_ready(self, hello) -> None:
        self.name = hello

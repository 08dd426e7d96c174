# SPDX-License-Identifier: Apache-2.0
"""One P/D KV load between two processes of this host, on 4 KiB pages and on 2 MiB pages,
with and without a busy thread in the producer.

The shape is ``benchmarks/vllm_ttft.py``'s P/D load: the consumer READs 8 requests of
3968 KiB (one per layer: 62 blocks of 64 KiB, coalesced) from the producer's KV cache in
one batch, timed by ``Batch.elapsed``. Both sides hold one 64 MiB buffer per layer and per
variant (all allocated up front, interleaved load by load, so the machine's drift lands on
every variant alike):

* ``small pages``: a private anonymous mapping written at allocation, as ``torch.zeros``
  leaves vLLM's CPU KV cache (4 KiB pages);
* ``huge pages``: the same, then ``mooncake_te.hugepages.back_with_hugepages`` and a
  prefault, as the vLLM connector does at registration.

``--busy`` runs that many busy threads in the producer while the loads run: the stand-in
for vLLM's OpenMP worker, which spin-waits ~9 ms after each forward pass (libgomp's
default), right when a consumer reads the prompt it just prefilled. On the 2-core VM one
busy thread takes about a third of the two cores from the copy. Same host only (the shm
route: the producer copies with ``process_vm_writev``).

    .venv/bin/python benchmarks/pd_load.py [--loads 30] [--busy 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import statistics
import threading
import time

LAYERS, REQ, SIZE = 8, 3968 << 10, 64 << 20
VARIANTS = ("small pages", "huge pages")


def _alloc(variant: str, size: int = SIZE):
    import numpy as np

    from mooncake_te.hugepages import back_with_hugepages
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    if variant == "huge pages":
        back_with_hugepages(a)
    a[:] = 1                                   # written: faulted in, 4 KiB or 2 MiB
    return m, a


def _huge(bufs) -> "list[int]":
    """Bytes in huge pages, per variant."""
    from mooncake_te.hugepages import anon_huge_bytes
    return [anon_huge_bytes([(int(a.ctypes.data), a.nbytes)
                             for _, a in bufs[k * LAYERS:(k + 1) * LAYERS]])
            for k in range(len(VARIANTS))]


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def _producer(conn, busy: int, size: int = SIZE) -> None:
    import mooncake_te as mte
    eng = mte.TransferEngine(metadata="p2p", host="127.0.0.1", protocol="shm")
    bufs = [_alloc(v, size) for v in VARIANTS for _ in range(LAYERS)]
    regions = [eng.register(a) for _, a in bufs]
    conn.send((eng.name, [r.address for r in regions], _huge(bufs)))
    stop = threading.Event()
    conn.recv()                                # the consumer is ready: start the busy threads
    for _ in range(busy):
        threading.Thread(target=_spin, args=(stop,), daemon=True).start()
    conn.send("busy")
    conn.recv()
    stop.set()
    eng.close()


def main() -> None:
    import numpy as np

    import mooncake_te as mte
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", type=int, default=30, help="loads per variant")
    ap.add_argument("--busy", type=int, default=1, help="busy threads in the producer")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two, smallest sizes: does it still run (CI)")
    a = ap.parse_args()
    size, req = SIZE, REQ
    if a.smoke:                        # 4 MiB buffers, 1 MiB requests, 2 loads
        a.loads, size, req = 2, 4 << 20, 1 << 20
    here, there = mp.Pipe()
    p = mp.get_context("spawn").Process(target=_producer, args=(there, a.busy, size))
    p.start()
    name, remote, remote_huge = here.recv()
    eng = mte.TransferEngine(metadata="p2p", host="127.0.0.1", protocol="shm")
    bufs = [_alloc(v, size) for v in VARIANTS for _ in range(LAYERS)]
    local = [eng.register(x).address for _, x in bufs]
    seg = eng.open_segment(name)
    here.send("go")
    here.recv()
    rates: dict = {v: [] for v in VARIANTS}
    for i in range(a.loads + 1):
        for k, v in enumerate(VARIANTS):
            time.sleep(0.02)
            sl = slice(k * LAYERS, (k + 1) * LAYERS)
            b = eng.submit_arrays(mte.READ, seg, np.array(local[sl], np.uint64),
                                  np.array(remote[sl], np.uint64), req)
            while not b.poll(timeout=0.01):
                pass
            b.raise_for_status()
            if i:                              # the first round warms the lanes
                rates[v].append(LAYERS * req / b.elapsed / 1e9)
    here.send("stop")
    p.join(30)
    eng.close()
    out = {"busy_threads": a.busy, "loads": a.loads, "request_bytes": req,
           "huge_bytes_consumer": dict(zip(VARIANTS, _huge(bufs))),
           "huge_bytes_producer": dict(zip(VARIANTS, remote_huge))}
    print(f"P/D load, 8 x {req >> 10} KiB READ (shm), {a.busy} busy thread(s) in the "
          f"producer, {a.loads} loads per variant:")
    for v in VARIANTS:
        r = sorted(rates[v])
        out[v] = {"median_gbps": statistics.median(r), "min_gbps": r[0], "max_gbps": r[-1]}
        print(f"  {v:12} median {out[v]['median_gbps']:5.2f} GB/s  (min {r[0]:.2f}, max "
              f"{r[-1]:.2f})")
    ratio = out["huge pages"]["median_gbps"] / out["small pages"]["median_gbps"]
    out["huge_over_small"] = ratio
    mib = lambda d: ", ".join(f"{v} {n >> 20}" for v, n in d.items())  # noqa: E731
    print(f"  huge / small pages: {ratio:.2f}x. MiB in 2 MiB pages of {LAYERS * size >> 20} "
          f"per variant: consumer {mib(out['huge_bytes_consumer'])}; producer "
          f"{mib(out['huge_bytes_producer'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

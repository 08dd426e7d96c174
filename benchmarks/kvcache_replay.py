# SPDX-License-Identifier: Apache-2.0
"""Benchmark: ``trace replay --real`` on the synthetic trace with a DRAM tier smaller than
its working set, beside the disk's own O_DIRECT figures (fio, else dd) and the transfer
engine's same-host figure (``mooncake-te bench``, loopback over TCP).

Usage::

    python benchmarks/kvcache_replay.py [--trace FILE] [--bytes-per-token 512]
        [--dram-gb 1] [--ssd-gb 16] [--cache-dir DIR] [--requests N] [--json]

Prints one table and, with ``--json``, one JSON object. Takes a minute or two with the
defaults (about 11 GiB of blocks written through the cache, 256 KiB per block).

``--restart-get [--busy-thread]`` instead times one full-prefix ``get`` (``--blocks``
blocks of ``--block-kib``, default 61 of 512 KiB: the longest prompt of
benchmarks/vllm_ttft.py) from the SSD tier of a cache just reopened on the same
``cache_dir`` (once right after the open, once after the ``kvcache-prefault`` thread
populated the pool), and the same ``get`` again from DRAM, each block copied to its
destination by ``get(copy=...)``; with ``--busy-thread`` a pure-Python loop runs beside
it, as vLLM's engine loop does. Seconds, no disk ceiling or trace.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.join(HERE, os.pardir, "data", "traces", "synthetic_trace.jsonl")


def fio_or_dd(directory: str, block: int, size_mb: int = 1024) -> dict:
    """O_DIRECT write and read GB/s of ``directory``'s disk: fio (4 jobs in flight, like
    the cache's I/O threads) if installed, else dd (one I/O at a time)."""
    path = os.path.join(directory, "odirect.bench")
    out = {}
    try:
        if shutil.which("fio"):
            for rw in ("write", "read"):
                r = subprocess.run(
                    ["fio", "--name=kv", f"--filename={path}", f"--rw={rw}", f"--bs={block}",
                     f"--size={size_mb}M", "--direct=1", "--ioengine=psync", "--numjobs=4",
                     "--group_reporting", "--output-format=json"],
                    capture_output=True, text=True, timeout=300)
                j = json.loads(r.stdout)["jobs"][0][rw]
                out[f"fio_{rw}_gbps"] = j["bw_bytes"] / 1e9
            out["tool"] = f"fio psync, 4 jobs, bs={block}, direct=1"
        else:
            cnt = size_mb * (1 << 20) // block
            for rw, cmd in (("write", ["dd", "if=/dev/zero", f"of={path}", f"bs={block}",
                                       f"count={cnt}", "oflag=direct"]),
                            ("read", ["dd", f"if={path}", "of=/dev/null", f"bs={block}",
                                      "iflag=direct"])):
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                m = re.search(r"copied, ([\d.]+) s", r.stderr)
                out[f"dd_{rw}_gbps"] = size_mb * (1 << 20) / float(m.group(1)) / 1e9
            out["tool"] = f"dd bs={block} O_DIRECT, one I/O at a time"
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out


def engine_loopback(block: int, seconds: float = 1.0) -> dict:
    """``mooncake-te bench`` READ GB/s at the cache's block size, same host, TCP."""
    r = subprocess.run([sys.executable, "-m", "mooncake_te", "bench", "--host", "127.0.0.1",
                        "--op", "read", "--block-sizes", str(block), "--duration",
                        str(seconds), "--json",
                        "--no-progress"], capture_output=True, text=True, timeout=300)
    try:
        d = json.loads(r.stdout)
        p = d["points"][0]
        return {"engine_read_gbps": p.get("gbps", p.get("GBps")), "engine_point": p}
    except (ValueError, KeyError, IndexError):
        return {"engine_error": (r.stderr or r.stdout)[-300:]}


def remote_get(block: int, nblocks: int = 2048, batch: int = 32, token: "str | None" = "bench",
               ) -> dict:
    """GB/s of ``KVCache.get(remote=True)`` between two engines on 127.0.0.1: cache B
    reads blocks that cache A holds, straight into B's pool, checking each record.
    The owner index lives in an in-process key-value store, so only the data path is
    timed (with a real store each lookup is also one round trip to it). With ``token``
    the engines authenticate and records are MAC'd (docs/kvcache.md, "Sharing between
    instances"); ``token=None`` shares without one (``share_without_token``)."""
    import numpy as np

    import mooncake_te as mte
    from mooncake_te.kvcache import KVCache
    from mooncake_te.metadata.base import KeyValueBackend

    class DictStore(KeyValueBackend):
        kind = "dict"

        def __init__(self):
            super().__init__("")
            self.d = {}

        def get(self, key):
            return self.d.get(key)

        def put(self, key, value):
            self.d[key] = value

        def delete(self, key):
            self.d.pop(key, None)

    store = DictStore()
    size = nblocks * (block + 4096) + (1 << 20)
    data = np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8)
    kw = dict(index=store, log_interval_s=0, prefault=True, share_without_token=token is None)
    with mte.TransferEngine(host="127.0.0.1", auth_token=token) as ea, \
            mte.TransferEngine(host="127.0.0.1", auth_token=token) as eb, \
            KVCache(block, size, engine=ea, **kw) as a, KVCache(block, size, engine=eb, **kw) as b:
        keys = list(range(nblocks))
        for i in range(0, nblocks, batch):
            a.put(keys[i:i + batch], [data] * len(keys[i:i + batch]))
        a.flush_index()
        out = [np.empty(block, np.uint8) for _ in range(batch)]
        for i in range(0, nblocks, batch):
            got = b.get(keys[i:i + batch], out=out[:len(keys[i:i + batch])], remote=True)
            assert all(n == block for n in got), "a remote block was not served"
        s = b.stats()
        return {"remote_get_gbps": s["remote_read_gbps"], "remote_blocks": s["served_remote"],
                "transport": ea.protocol}


def restart_get(cache_dir: str, block: int, nblocks: int, reps: int, busy: bool) -> dict:
    """Median seconds of a full-prefix ``get`` from SSD after a restart and from DRAM."""
    import statistics
    import threading
    import time

    import numpy as np

    from mooncake_te.kvcache import KVCache
    try:
        from mooncake_te.kvcache.record import CRC32_IMPL
    except ImportError:                        # a tree from before crc32_held: zlib's
        CRC32_IMPL = "zlib"

    kv = os.path.join(cache_dir, "kv")
    keys = list(range(nblocks))
    data = [np.random.default_rng(i).integers(0, 256, block, dtype=np.uint8)
            for i in range(nblocks)]
    dram = (nblocks + 4) * (block + 4096)
    with KVCache(block, dram, 2 * dram, kv, log_interval_s=0) as c:
        c.put(keys, data)
        c.close(persist=True)                  # every block on SSD, as after a clean exit
    dst = [memoryview(np.empty(block, np.uint8)) for _ in keys]

    def copy(i, blk):
        dst[i][:] = memoryview(blk)            # a memcpy with the GIL held

    def get(c):
        try:
            return c.get(keys, copy=copy)
        except TypeError:                      # a tree from before get(copy=): out=
            return c.get(keys, out=dst)

    stop = threading.Event()
    spin = None
    if busy:
        def loop():
            n = 0
            while not stop.is_set():
                n += 1
        spin = threading.Thread(target=loop, name="busy", daemon=True)
        spin.start()
    ssd, hot, cold = [], [], []
    try:
        for _ in range(reps):
            with KVCache(block, dram, 2 * dram, kv, log_interval_s=0) as c:   # a restart
                # Right away, the kvcache-prefault thread just started beside the get.
                t = time.perf_counter()
                got = get(c)
                cold.append(time.perf_counter() - t)
                assert got == [block] * nblocks, "an SSD block was not served"
                c.close(persist=True)
            with KVCache(block, dram, 2 * dram, kv, log_interval_s=0) as c:
                # A server takes seconds to start: the pool's slots are populated by then.
                if getattr(c, "_prefaulter", None) is not None:
                    c._prefaulter.join()
                t = time.perf_counter()
                got = get(c)
                ssd.append(time.perf_counter() - t)
                assert got == [block] * nblocks, "an SSD block was not served"
                t = time.perf_counter()
                got = get(c)
                hot.append(time.perf_counter() - t)
                assert got == [block] * nblocks and c.stats()["served_dram"] == nblocks
                c.close(persist=True)
    finally:
        stop.set()
        if spin is not None:
            spin.join()
    assert all(bytes(d) == bytes(x) for d, x in zip(dst, data)), "wrong bytes served"
    s, d, k = statistics.median(ssd), statistics.median(hot), statistics.median(cold)
    return {"blocks": nblocks, "block_bytes": block, "busy_thread": busy, "reps": reps,
            "ssd_s": s, "ssd_cold_s": k, "dram_s": d, "ssd_over_dram": s / d,
            "crc32": CRC32_IMPL, "ssd_all_s": ssd, "ssd_cold_all_s": cold, "dram_all_s": hot}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--bytes-per-token", type=int, default=512)
    ap.add_argument("--dram-gb", type=float, default=1.0)
    ap.add_argument("--ssd-gb", type=float, default=16.0)
    ap.add_argument("--cache-dir")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--policy", default="lru", choices=("lru", "lfu"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--restart-get", action="store_true",
                    help="time a full-prefix get from SSD after a restart vs from DRAM")
    ap.add_argument("--busy-thread", action="store_true",
                    help="with --restart-get: a busy Python thread beside (vLLM's engine)")
    ap.add_argument("--blocks", type=int, default=61)
    ap.add_argument("--block-kib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two: 50 requests, 8 MiB of fio, 64 remote blocks "
                         "(does it still run: CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.dram_gb, args.ssd_gb = 50, 1 / 64, 1 / 16
        args.blocks, args.reps = 4, 1
    if args.restart_get:
        tmp = cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvcache-bench-",
                                                            dir="/var/tmp")
        try:
            r = restart_get(cache_dir, args.block_kib << 10, args.blocks, args.reps,
                            args.busy_thread)
        finally:
            if not args.cache_dir:
                shutil.rmtree(tmp, ignore_errors=True)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"full-prefix get of {r['blocks']} blocks of {r['block_bytes'] >> 10} KiB"
                  f"{' beside a busy Python thread' if r['busy_thread'] else ''} "
                  f"(CRC-32: {r['crc32']}), median of {r['reps']}: SSD after a restart "
                  f"{r['ssd_s'] * 1e3:.1f} ms (pool populated; {r['ssd_cold_s'] * 1e3:.1f} ms "
                  f"right after the open), DRAM {r['dram_s'] * 1e3:.1f} ms, SSD/DRAM "
                  f"{r['ssd_over_dram']:.2f}x")
        return 0

    from mooncake_te.kvcache import KVCache, load_trace, simulate
    from mooncake_te.kvcache.replay import replay_real

    trace = load_trace(args.trace)
    if args.requests:
        trace = trace.head(args.requests)
    block = trace.block_tokens * args.bytes_per_token
    tmp = None
    cache_dir = args.cache_dir
    if cache_dir is None:
        tmp = cache_dir = tempfile.mkdtemp(prefix="kvcache-bench-", dir="/var/tmp")
    try:
        disk = fio_or_dd(cache_dir, block, 8 if args.smoke else 1024)
        eng = engine_loopback(block, 0.2 if args.smoke else 1.0)
        eng.update(remote_get(block, 64 if args.smoke else 2048))
        with KVCache(block, int(args.dram_gb * (1 << 30)), int(args.ssd_gb * (1 << 30)),
                     os.path.join(cache_dir, "kv"), args.policy, log_interval_s=0) as c:
            s = replay_real(trace, c, args.bytes_per_token)
        uniq = len({h for ids in trace.hash_ids for h in ids})
        sim_dram = simulate(trace, args.policy, s["dram_capacity_blocks"])
        sim_ssd = simulate(trace, args.policy, s["ssd_capacity_blocks"])
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    res = {"trace": os.path.abspath(args.trace), "requests": len(trace), "block_bytes": block,
           "working_set_blocks": uniq, "working_set_gib": uniq * block / (1 << 30),
           "replay": {k: s[k] for k in (
               "dram_capacity_blocks", "ssd_capacity_blocks", "ssd_io", "block_hit_rate",
               "token_hit_rate", "block_hit_rate_dram", "block_hit_rate_ssd",
               "served_dram_bytes", "dram_read_gbps", "served_ssd_bytes", "ssd_read_gbps",
               "demoted_bytes", "ssd_write_gbps", "promotions", "demotions", "evictions_ssd",
               "wall_s")},
           "sim_lru_at_dram_size": sim_dram.block_hit_rate,
           "sim_lru_at_ssd_size": sim_ssd.block_hit_rate, "disk": disk, "engine": eng}
    if args.json:
        print(json.dumps(res, indent=2, default=str))
        return 0
    r = res["replay"]
    print(f"trace {res['trace']}: {res['requests']:,} requests, working set "
          f"{uniq:,} blocks = {res['working_set_gib']:.1f} GiB of {block // 1024} KiB blocks")
    print(f"cache: DRAM {r['dram_capacity_blocks']:,} blocks, SSD {r['ssd_capacity_blocks']:,} "
          f"blocks ({r['ssd_io']}), {args.policy.upper()}; replay took {r['wall_s']:.1f} s")
    print(f"hit rate (blocks): {r['block_hit_rate']:.4f} = DRAM {r['block_hit_rate_dram']:.4f}"
          f" + SSD {r['block_hit_rate_ssd']:.4f}; tokens {r['token_hit_rate']:.4f}")
    print(f"  simulator, one {args.policy.upper()} of the DRAM size: "
          f"{res['sim_lru_at_dram_size']:.4f}; of the SSD size: {res['sim_lru_at_ssd_size']:.4f}")
    print(f"served from DRAM : {r['served_dram_bytes'] / 1e9:8.2f} GB at "
          f"{r['dram_read_gbps']:.2f} GB/s (copy out of the pool)")
    print(f"served from SSD  : {r['served_ssd_bytes'] / 1e9:8.2f} GB at "
          f"{r['ssd_read_gbps']:.2f} GB/s (O_DIRECT read + CRC, {r['promotions']:,} promotions)")
    print(f"demoted to SSD   : {r['demoted_bytes'] / 1e9:8.2f} GB at "
          f"{r['ssd_write_gbps']:.2f} GB/s ({r['demotions']:,} demotions)")
    print(f"disk ({disk.get('tool')}): " + ", ".join(
        f"{k} {v:.2f}" for k, v in disk.items() if k.endswith("gbps")))
    print(f"remote get (cache B reads cache A's pool, {eng['remote_blocks']:,} blocks of "
          f"{block // 1024} KiB, batches of 32, {eng['transport']}): "
          f"{eng['remote_get_gbps']:.2f} GB/s")
    if "engine_read_gbps" in eng:
        print(f"transfer engine same-host READ at {block // 1024} KiB: "
              f"{eng['engine_read_gbps']:.2f} GB/s")
    else:
        print(f"transfer engine bench failed: {eng.get('engine_error')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

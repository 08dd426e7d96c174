# SPDX-License-Identifier: Apache-2.0
"""mooncake_te against Mooncake's Transfer Engine (and NIXL) on one workload, in one run.

    python benchmarks/compare.py                      # mooncake_te and Mooncake, ~2 min
    python benchmarks/compare.py --with-nixl          # and NIXL (UCX over TCP on lo)
    python benchmarks/compare.py --json out.json

For every engine: a target process and an initiator process on 127.0.0.1, each
registering a buffer of ``--buffer-size`` bytes. For WRITE then READ and block sizes
4 KiB, 64 KiB, 1 MiB, 16 MiB, the initiator keeps ``--inflight`` batches outstanding
(batch = 64 requests, at most 16 MiB a batch) for ``--duration`` seconds after a warm-up,
walking the whole buffer in a fixed non-contiguous block order. Then synchronous 4 KiB
single requests. Every point is verified: the data side is filled with a pattern first
and every byte of every block the point touched is compared afterwards (the pattern of
``mooncake-te bench --verify``).

Each engine runs under its own interpreter: mooncake_te under this one; Mooncake
(``mooncake-transfer-engine-non-cuda`` from PyPI, TCP, P2PHANDSHAKE) and NIXL (the
``nixl-cu12`` binary distribution from PyPI, UCX restricted to TCP on ``lo``) in
virtualenvs created on first use under ``--cache`` (default
``~/.cache/mooncake_te/compare``). An engine that cannot run here is reported with its
error, never given a figure.

Noise: this machine class is shared. Around every point the CPU time used by *other*
processes is measured from /proc (all busy time minus this run's processes). A point
during which others used more than ``--noise-limit`` CPUs is run again (up to
``--retries`` times); if every attempt was noisy the quietest is kept and marked ``~``.
Only ratios between engines within one run mean anything.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import selectors
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "compare_peer.py")
BLOCKS = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
MAX_BATCH_BYTES = 16 << 20

# pip requirement per engine. NIXL: ``pip install nixl`` drags torch and the CUDA wheels
# (~6 GB) in, but torch is imported lazily and only for tensors; numpy buffers need just
# the binary distribution, so it is installed without its dependencies (plus numpy).
PIP_SPECS = {
    "mooncake": (["mooncake-transfer-engine-non-cuda", "numpy"], []),
    "nixl": (["numpy"], ["--no-deps", "nixl-cu12"]),
}
IMPORT_PROBE = {
    "mooncake": "import mooncake.engine as m; m.TransferEngine()",
    "nixl": "from nixl_cu12._api import nixl_agent",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def size_str(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


# --- environments ----------------------------------------------------------------------

class EngineUnavailable(Exception):
    """The engine cannot run on this machine; the message says why."""


def ensure_env(engine: str, cache: str, log) -> str:
    """The interpreter that runs ``engine``, creating its virtualenv on first use."""
    if engine.startswith("mooncake_te"):
        probe = subprocess.run([sys.executable, "-c", "import mooncake_te"],
                               capture_output=True, text=True)
        if probe.returncode:
            raise EngineUnavailable(f"import mooncake_te failed under {sys.executable}: "
                                    f"{probe.stderr.strip().splitlines()[-1]}")
        return sys.executable
    venv = os.path.join(cache, engine)
    py = os.path.join(venv, "bin", "python")
    first, second = PIP_SPECS[engine]
    stamp = os.path.join(venv, ".compare-ready")
    want = json.dumps([first, second])
    if not (os.path.exists(stamp) and open(stamp).read() == want):
        log(f"creating {venv} (pip install {' '.join(first)}; {' '.join(second) or '-'})")
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
        for spec in (first, second):
            if not spec:
                continue
            r = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                *spec], capture_output=True, text=True)
            if r.returncode:
                tail = "\n".join(r.stderr.strip().splitlines()[-3:])
                raise EngineUnavailable(f"pip install {' '.join(spec)} failed:\n{tail}")
        with open(stamp, "w") as f:
            f.write(want)
    probe = subprocess.run([py, "-c", IMPORT_PROBE[engine]], capture_output=True, text=True,
                           timeout=120)
    if probe.returncode:
        lines = [ln for ln in probe.stderr.strip().splitlines() if ln.strip()]
        raise EngineUnavailable(f"{IMPORT_PROBE[engine]!r} fails under {py}: "
                                f"{lines[-1] if lines else 'exit ' + str(probe.returncode)}")
    return py


# --- CPU noise ---------------------------------------------------------------------------

def _proc_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])       # utime + stime, all threads
    except (OSError, IndexError, ValueError):
        return 0


def _softirqd_ticks() -> int:
    # Loopback packets are partly processed by ksoftirqd on behalf of our sockets: that
    # kernel thread is not another user's job, so it does not count as noise.
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().startswith("ksoftirqd"):
                        total += _proc_ticks(int(pid))
            except OSError:
                pass
    return total


class CpuMeter:
    """CPU seconds used by processes other than ``pids`` (and this one) between
    ``start()`` and ``stop()``, from /proc/stat and /proc/<pid>/stat."""

    def __init__(self, pids):
        self.pids = [os.getpid(), *pids]

    @staticmethod
    def _busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user + nice + system: softirq is left out (our own loopback traffic lands
        # there), and steal is reported apart (the hypervisor's other guests).
        return v[0] + v[1] + v[2], v[7] if len(v) > 7 else 0

    def _snap(self):
        busy, steal = self._busy()
        return (time.monotonic(), busy, steal, sum(_proc_ticks(p) for p in self.pids),
                _softirqd_ticks())

    def start(self) -> None:
        self.a = self._snap()

    def stop(self) -> dict:
        b = self._snap()
        wall = max(b[0] - self.a[0], 1e-9)
        foreign = (b[1] - self.a[1]) - (b[3] - self.a[3]) - (b[4] - self.a[4])
        return {"others_cpus": max(foreign, 0) / CLK_TCK / wall,
                "ours_cpus": (b[3] - self.a[3]) / CLK_TCK / wall,
                "steal_cpus": (b[2] - self.a[2]) / CLK_TCK / wall}


# --- one engine pair ---------------------------------------------------------------------

class Peer:
    """A ``compare_peer.py`` child speaking JSON lines."""

    def __init__(self, python: str, engine: str, role: str, buffer_size: int, logdir: str,
                 cpu: int | None = None):
        self.label = f"{engine} {role}"
        self.log_path = os.path.join(logdir, f"{engine}-{role}.log")
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        pin = ["--cpu", str(cpu)] if cpu is not None else []
        self.proc = subprocess.Popen([python, PEER, "--engine", engine, "--role", role,
                                      "--buffer-size", str(buffer_size), *pin],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        hello = self._read(120)
        if not hello.get("ok"):
            raise EngineUnavailable(f"{self.label} failed to start: {hello.get('error')}")
        self.pid = hello["pid"]
        self.version = hello.get("version", "?")

    def _read(self, timeout: float) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise EngineUnavailable(f"{self.label}: no answer within {timeout:.0f} s "
                                        f"(log: {self.log_path})")
        finally:
            sel.close()
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            with open(self.log_path) as f:
                tail = " | ".join(f.read().strip().splitlines()[-3:])
            raise EngineUnavailable(f"{self.label} exited with status {rc}: {tail}")
        return json.loads(line)

    def call(self, timeout: float = 300, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        out = self._read(timeout)
        if not out.get("ok", False) and "error" in out:
            raise RuntimeError(f"{self.label} {req['cmd']}: {out['error']}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def batch_for(block: int) -> int:
    return max(1, min(64, MAX_BATCH_BYTES // block))


def run_engine(engine: str, python: str, args, log) -> dict:
    """Every point of the workload through one engine; raises EngineUnavailable."""
    logdir = os.path.join(args.cache, "logs")
    os.makedirs(logdir, exist_ok=True)
    cpus = {"none": (None, None), "same": (0, 0), "split": (1, 0)}[args.pin]
    target = Peer(python, engine, "target", args.buffer_size, logdir, cpus[0])
    init = None
    try:
        init = Peer(python, engine, "initiator", args.buffer_size, logdir, cpus[1])
        init.call(cmd="connect", info=target.call(cmd="info"))
        meter = CpuMeter([target.pid, init.pid])
        points, syncs = [], []
        seed = 1
        for op in args.ops:
            for block in ([] if args.sync_only else args.block_sizes):
                attempts = []
                for attempt in range(args.retries + 1):
                    seed += 2
                    data, other = (init, target) if op == "write" else (target, init)
                    data.call(cmd="fill", seed=seed)
                    other.call(cmd="fill", seed=seed + 1)
                    meter.start()
                    p = init.call(cmd="point", op=op, block=block, batch=batch_for(block),
                                  inflight=args.inflight, warmup=args.warmup,
                                  duration=args.duration)
                    p["noise"] = meter.stop()
                    v = other.call(cmd="check", seed=seed, block=block, count=p["posted"])
                    if not v.get("ok"):
                        raise RuntimeError(f"{engine} {op} {size_str(block)}: verification "
                                           f"failed at offset {v['offset']} (got {v['got']}, "
                                           f"want {v['want']}; {v['bad_blocks']} bad blocks)")
                    p["verified_bytes"] = v["checked_bytes"]
                    p["attempt"] = attempt + 1
                    attempts.append(p)
                    if p["noise"]["others_cpus"] <= args.noise_limit:
                        break
                best = min(attempts, key=lambda q: q["noise"]["others_cpus"])
                best["noisy"] = best["noise"]["others_cpus"] > args.noise_limit
                best["discarded"] = len(attempts) - 1
                points.append(best)
                log(f"  {engine:12} {op:5} {size_str(block):>7}  {best['gbps']:6.2f} GB/s  "
                    f"others {best['noise']['others_cpus']:.2f} CPU"
                    + (f"  ({best['discarded']} noisy run(s) discarded)"
                       if best["discarded"] else "")
                    + ("  NOISY" if best["noisy"] else ""))
        if args.sync_size:
            for op in args.ops:
                meter.start()
                s = init.call(cmd="sync", op=op, size=args.sync_size, duration=args.duration)
                s["noise"] = meter.stop()
                syncs.append(s)
                log(f"  {engine:12} sync {op:5} {size_str(args.sync_size)}: median "
                    f"{s['lat_us']['p50']:.1f} µs, p99 {s['lat_us']['p99']:.1f} µs")
        return {"engine": engine, "version": target.version, "python": python,
                "points": points, "sync": syncs}
    finally:
        if init is not None:
            init.close()
        target.close()


def merge(old: dict | None, new: dict) -> dict:
    """Per point (and per synchronous op), the attempt during which others used the least
    CPU, over all rounds; the others count as discarded."""
    if old is None:
        return new
    def quieter(a, b):
        return a if a["noise"]["others_cpus"] <= b["noise"]["others_cpus"] else b
    pts = {(p["op"], p["block"]): p for p in old["points"]}
    for p in new["points"]:
        k = (p["op"], p["block"])
        if k in pts:
            keep = quieter(pts[k], p)
            keep["discarded"] = pts[k]["discarded"] + p["discarded"] + 1
            pts[k] = keep
        else:
            pts[k] = p
    syncs = {s["op"]: s for s in old["sync"]}
    for s in new["sync"]:
        syncs[s["op"]] = quieter(syncs[s["op"]], s) if s["op"] in syncs else s
    return dict(old, points=list(pts.values()), sync=list(syncs.values()))


# --- report ------------------------------------------------------------------------------

def machine() -> dict:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg": os.getloadavg()}


def print_table(report: dict, noise_limit: float) -> None:
    ok = [r for r in report["engines"] if "points" in r]
    names = [r["engine"] for r in ok]
    by = {r["engine"]: {(p["op"], p["block"]): p for p in r["points"]} for r in ok}
    # Ratios compare TCP with TCP: mooncake_te over TCP against each other engine.
    others = [n for n in names if not n.startswith("mooncake_te")]
    m = report["machine"]
    print(f"\nmachine: {m['cpus']} CPUs ({m['cpu_model']}), Linux {m['kernel']}; load average "
          f"{report['loadavg_before'][0]:.2f} before, {report['loadavg_after'][0]:.2f} after")
    print("versions: " + ", ".join(f"{r['engine']} {r['version']}" for r in ok))
    for op in report["ops"]:
        print(f"\n{op.upper()}  GB/s (10^9 B/s), batch of min(64, 16 MiB/block), "
              f"{report['inflight']} batches in flight, {report['duration']:g} s/point")
        w = max(14, *(len(n) + 2 for n in names))
        head = f"{'block':>8} {'batch':>6}" + "".join(f"{n:>{w}}" for n in names)
        head += "".join(f"{'te/' + n:>{w}}" for n in others)
        print(head)
        print("─" * len(head))
        for block in report["block_sizes"]:
            row = f"{size_str(block):>8} {batch_for(block):>6}"
            for n in names:
                p = by[n].get((op, block))
                row += (f"{p['gbps']:>{w - 1}.2f}{'~' if p['noisy'] else ' '}" if p
                        else f"{'-':>{w}}")
            te = by.get("mooncake_te", {}).get((op, block))
            for n in others:
                p = by[n].get((op, block))
                row += (f"{te['gbps'] / p['gbps']:>{w - 1}.2f}x" if te and p and p["gbps"]
                        else f"{'-':>{w}}")
            print(row)
    syncs = {(r["engine"], s["op"]): s for r in ok for s in r["sync"]}
    if syncs:
        print(f"\nsynchronous {size_str(report['sync_size'])} single requests, one at a time "
              f"(µs); CPU placement: {report.get('pin', 'none')}")
        print(f"{'engine':>16} {'op':>6} {'count':>8} {'median':>8} {'p90':>8} {'p99':>8} "
              f"{'max':>8}")
        for (n, op), s in syncs.items():
            lat = s["lat_us"]
            print(f"{n:>16} {op:>6} {lat['count']:>8} {lat['p50']:>8.1f} {lat['p90']:>8.1f} "
                  f"{lat['p99']:>8.1f} {lat['max']:>8.0f}"
                  + ("  ~" if s["noise"]["others_cpus"] > noise_limit else ""))
    for r in report["engines"]:
        if "error" in r:
            print(f"\n{r['engine']}: NOT MEASURED: {r['error']}")
    noisy = sum(p["noisy"] for r in ok for p in r["points"])
    discarded = sum(p["discarded"] for r in ok for p in r["points"])
    print(f"\nnoise: {discarded} run(s) discarded because other processes used more than "
          f"{noise_limit:g} CPU; {noisy} point(s) marked ~ stayed noisy after "
          f"{report['retries']} retries and {report.get('rounds', 1)} round(s) (the quietest "
          f"attempt is shown).")
    print("This machine is shared with other users' jobs: figures move ±20-30 % between "
          "runs; compare ratios within one run only.")


def plot(report: dict, path: str) -> None:
    """GB/s against block size, one line per engine and op (matplotlib, optional)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(report["ops"]), figsize=(5.5 * len(report["ops"]), 4),
                             squeeze=False)
    for ax, op in zip(axes[0], report["ops"]):
        for r in report["engines"]:
            pts = sorted((p["block"], p["gbps"], p["noisy"]) for p in r.get("points", [])
                         if p["op"] == op)
            if not pts:
                continue
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            line, = ax.plot(xs, ys, marker="o", label=r["engine"])
            noisy = [(x, y) for x, y, n in pts if n]
            if noisy:
                ax.plot(*zip(*noisy), linestyle="none", marker="o", markersize=11,
                        markerfacecolor="none", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["block_sizes"], [size_str(b) for b in report["block_sizes"]])
        ax.set_xlabel("block size")
        ax.set_ylabel("GB/s (10^9 B/s)")
        ax.set_title(f"{op.upper()}, loopback, {report['inflight']} batches in flight")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    m = report["machine"]
    fig.suptitle(f"benchmarks/compare.py: {m['cpus']} shared CPUs, load average "
                 f"{report['loadavg_before'][0]:.1f}-{report['loadavg_after'][0]:.1f} "
                 f"(circled: other processes busy during the point)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--with-nixl", action="store_true",
                    help="also measure NIXL (installs nixl-cu12 into its own virtualenv)")
    ap.add_argument("--with-shm", action="store_true",
                    help="also measure mooncake_te's same-host transport (not TCP; shown, "
                         "not in the ratios)")
    ap.add_argument("--engines", default=None,
                    help="comma list to run instead (mooncake_te,mooncake_te_shm,mooncake,"
                         "nixl)")
    ap.add_argument("--buffer-size", type=parse_size, default=parse_size("128M"))
    ap.add_argument("--block-sizes", default="4K,64K,1M,16M")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--duration", type=float, default=2.0, help="timed seconds per point")
    ap.add_argument("--warmup", type=float, default=0.25)
    ap.add_argument("--sync-size", type=parse_size, default=4096,
                    help="synchronous single-request size; 0 skips")
    ap.add_argument("--noise-limit", type=float, default=0.25,
                    help="CPUs other processes may use during a point before it is rerun")
    ap.add_argument("--retries", type=int, default=2,
                    help="reruns of a noisy point within a round")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine this many times, alternating the order; each "
                         "point keeps its quietest attempt")
    ap.add_argument("--pin", choices=["none", "same", "split"], default="none",
                    help="CPU placement of each engine's two processes: free (default), "
                         "both on CPU 0, or on CPUs 1 and 0. Synchronous latency depends "
                         "on it: a wake-up across vCPUs costs tens of µs on a VM")
    ap.add_argument("--sync-only", action="store_true",
                    help="only the synchronous single-request points")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/mooncake_te/compare"))
    ap.add_argument("--json", metavar="FILE", help="also write the full report here")
    ap.add_argument("--plot", metavar="FILE.png",
                    help="GB/s against block size (needs matplotlib: "
                         "pip install 'mooncake-te[bench]')")
    ap.add_argument("--from-json", metavar="FILE",
                    help="measure nothing: print (and --plot) a report saved with --json")
    ap.add_argument("--smoke", action="store_true",
                    help="a second or two: mooncake_te (tcp, shm) only, 4 KiB, 0.1 s points; "
                         "does it still run (CI; the peers' wheels are not installed there)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.engines, args.buffer_size, args.block_sizes = "mooncake_te,mooncake_te_shm", 8 << 20, "4K"
        args.duration, args.warmup, args.retries, args.rounds = 0.1, 0.02, 0, 1
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib, which is not installed: "
                     "pip install 'mooncake-te[bench]' (or matplotlib)")
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        print_table(report, report["noise_limit"])
        if args.plot:
            plot(report, args.plot)
        return 0
    args.block_sizes = [parse_size(b) for b in args.block_sizes.split(",")]
    args.ops = [o.strip() for o in args.ops.split(",")]
    engines = (args.engines.split(",") if args.engines else
               ["mooncake_te"] + (["mooncake_te_shm"] if args.with_shm else []) + ["mooncake"]
               + (["nixl"] if args.with_nixl else []))
    os.makedirs(args.cache, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    report = {"machine": machine(), "loadavg_before": os.getloadavg(),
              "buffer_size": args.buffer_size, "block_sizes": args.block_sizes,
              "ops": args.ops, "inflight": args.inflight, "duration": args.duration,
              "sync_size": args.sync_size, "noise_limit": args.noise_limit,
              "retries": args.retries, "rounds": args.rounds, "pin": args.pin,
              "engines": []}
    log(f"compare: {', '.join(engines)}; buffer {size_str(args.buffer_size)} per side; "
        f"load average {report['loadavg_before'][0]:.2f} on {os.cpu_count()} CPUs "
        f"(shared machine: expect noise)")
    results: dict = {}
    for rnd in range(args.rounds):
        # Noise comes and goes over minutes: alternating the order between rounds gives
        # every engine a turn early and late, and each point keeps its quietest attempt.
        for engine in (engines if rnd % 2 == 0 else engines[::-1]):
            if "error" in results.get(engine, {}):
                continue
            if args.rounds > 1:
                log(f"round {rnd + 1}/{args.rounds}: {engine}")
            try:
                python = ensure_env(engine, args.cache, log)
                results[engine] = merge(results.get(engine), run_engine(engine, python, args, log))
            except EngineUnavailable as e:
                log(f"  {engine}: cannot run here: {e}")
                results[engine] = {"engine": engine, "error": str(e)}
            except RuntimeError as e:       # a failed transfer or verification: no figure
                log(f"  {engine}: failed: {e}")
                results[engine] = {"engine": engine, "error": f"failed: {e}"}
    report["engines"] = [results[e] for e in engines]
    report["loadavg_after"] = os.getloadavg()
    print_table(report, args.noise_limit)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    return 0 if all("points" in r for r in report["engines"]) else 1


if __name__ == "__main__":
    sys.exit(main())

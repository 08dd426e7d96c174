# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te bench`` and ``mooncake-te version``: behaviour, not speed.

Every run is tiny (0.1-0.2 s per point, few block sizes) because the machines that run
the suite are shared; all traffic stays on 127.0.0.1.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.bench import BenchConfig, BenchTarget, Runner, TargetControl, VerifyError
from mooncake_te.bench import auto_batch, pattern
from mooncake_te.bench.stats import summarize_ns
from mooncake_te.units import format_size, parse_size, parse_sizes

HOST = "127.0.0.1"


def cli(*args, timeout=120, check=True):
    """Run ``python -m mooncake_te ARGS`` and return the CompletedProcess."""
    p = subprocess.run([sys.executable, "-m", "mooncake_te", *args], capture_output=True,
                       text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def _children(pid: int) -> list:
    """Pids whose parent is ``pid`` (from /proc, no psutil needed)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Field 4 is the ppid; the command name in field 2 may contain spaces.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- units --------------------------------------------------------------------------------
def test_sizes_parse_and_format():
    assert parse_size("4K") == parse_size("4KiB") == parse_size("4kb") == 4096
    assert parse_size("16M") == 16 << 20 and parse_size(512) == 512
    assert parse_sizes("4K, 64K,1M") == [4096, 65536, 1 << 20]
    assert format_size(4096) == "4 KiB" and format_size(16 << 20) == "16 MiB"
    for bad in ("", "4Q", "-1", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_auto_batch_bounds_bytes_per_batch():
    assert auto_batch(4096) == 64
    assert auto_batch(1 << 20) == 16
    assert auto_batch(16 << 20) == 1
    assert auto_batch(64 << 20) == 1


def test_summarize_ns():
    s = summarize_ns(np.arange(1, 1001) * 1000)          # 1..1000 µs
    assert s["count"] == 1000 and s["min"] == 1 and s["max"] == 1000
    assert 500 <= s["p50"] <= 501 and 989 <= s["p99"] <= 991
    assert summarize_ns([])["avg"] is None


def test_pattern_finds_every_byte():
    buf = np.empty(3 * (8 << 20) + 13, np.uint8)           # several chunks and a tail
    pattern.fill(buf, 7)
    assert pattern.first_mismatch(buf, 7) == -1
    assert pattern.first_mismatch(buf, 8) == 0           # another seed differs at once
    for off in (0, 5, (8 << 20) + 1, buf.nbytes - 1):
        buf[off] ^= 0x40
        assert pattern.first_mismatch(buf, 7) == off
        buf[off] ^= 0x40
    assert pattern.expected_byte(7, 12345) == buf[12345]
    # Two blocks swapped (a request landing at the wrong address) is caught.
    a = buf[:4096].copy()
    buf[:4096] = buf[4096:8192]
    buf[4096:8192] = a
    assert pattern.first_mismatch(buf, 7) == 0


def test_config_rejects_nonsense():
    for kw in ({"ops": ["copy"]}, {"duration": 0}, {"threads": 0}, {"inflight": 0},
               {"batch_sizes": [0]}):
        with pytest.raises(ValueError):
            BenchConfig(**kw)


# --- the CLI end to end -------------------------------------------------------------------
def test_bench_json_end_to_end():
    p = cli("bench", "--block-sizes", "4K,64K", "--duration", "0.2", "--json",
            "--no-progress")
    r = json.loads(p.stdout)                  # stdout is exactly one JSON object
    # The loopback target is on this host, so "auto" takes the same-host transport.
    assert r["header"]["mode"] == "loopback" and r["header"]["transport"] == "shm"
    assert r["header"]["segment"].startswith("127.0.0.1:")
    assert r["interrupted"] is False
    pts = {(q["op"], q["block_size"]): q for q in r["points"]}
    assert set(pts) == {(op, bs) for op in ("write", "read") for bs in (4096, 65536)}
    for q in pts.values():
        assert q["batch_size"] == 64 and q["inflight"] == 4 and q["threads"] == 1
        assert q["batches"] > 0 and q["bytes"] == q["batches"] * q["batch_size"] * q["block_size"]
        assert q["gbps"] > 0 and q["requests_per_s"] > 0 and q["seconds"] > 0
        assert abs(q["gbps"] - q["bytes"] / q["seconds"] / 1e9) < 1e-6
        lat = q["lat_us"]
        assert lat["count"] == q["batches"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p99"] <= lat["max"]
        assert q["post_us"]["avg"] > 0 and q["us_per_request"] > 0
        assert q["verified"] is None
    sync = {s["op"]: s for s in r["sync"]}
    assert set(sync) == {"write", "read"}
    for s in sync.values():
        assert s["size"] == 4096 and s["count"] > 0 and s["lat_us"]["p50"] > 0
        assert s["lat_us"]["p99"] >= s["lat_us"]["p50"]
    assert r["total_bytes"] == sum(q["bytes"] for q in r["points"]) + \
        sum(s["bytes"] for s in r["sync"])
    assert r["config"]["duration"] == 0.2


def test_bench_table_and_csv(tmp_path):
    csv_path = tmp_path / "out.csv"
    p = cli("bench", "--block-sizes", "16K", "--op", "write", "--batch-size", "2,8",
            "--duration", "0.1", "--no-sync", "--csv", str(csv_path))
    assert "WRITE" in p.stdout and "GB/s" in p.stdout and "16 KiB" in p.stdout
    assert "READ" not in p.stdout
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("op,block_size,batch_size")
    assert [r.split(",")[2] for r in rows[1:]] == ["2", "8"]        # the batch sweep


def test_bench_verify_passes():
    p = cli("bench", "--block-sizes", "4K,1M", "--batch-size", "3", "--inflight", "2",
            "--threads", "2", "--duration", "0.1", "--verify", "--no-sync", "--json",
            "--no-progress")
    r = json.loads(p.stdout)
    assert len(r["points"]) == 4
    assert all(q["verified"] is True and q["bytes"] > 0 for q in r["points"])


def test_bench_bad_arguments_are_clear():
    p = cli("bench", "--block-sizes", "4Q", check=False)
    assert p.returncode == 2 and "not a size" in p.stderr
    p = cli("bench", "--block-sizes", "4M", "--buffer-size", "1M", "--duration", "0.1",
            check=False)
    assert p.returncode == 2 and "--buffer-size" in p.stderr    # usage: before any work
    p = cli("bench", "--mode", "initiator", "--host", HOST, check=False)
    assert p.returncode == 2 and "--segment" in p.stderr


def test_bench_plot(tmp_path):
    out = tmp_path / "bench.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p = cli("bench", "--plot", str(out), check=False)
        assert p.returncode == 2 and "matplotlib" in p.stderr
        assert not out.exists()               # refused before measuring anything
        return
    cli("bench", "--block-sizes", "4K,64K", "--duration", "0.1", "--no-sync", "--plot",
        str(out))
    assert out.stat().st_size > 1000


def test_target_and_initiator_modes():
    tgt = subprocess.Popen([sys.executable, "-m", "mooncake_te", "bench", "--mode", "target",
                            "--host", HOST, "--buffer-size", "8M", "--json"],
                           stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(tgt.stdout.readline())
        assert info["segment"].startswith(HOST) and info["length"] == 8 << 20
        p = cli("bench", "--mode", "initiator", "--host", HOST, "--segment", info["segment"],
                "--block-sizes", "64K,4M", "--duration", "0.1", "--verify", "--json",
                "--no-progress", "--sync-size", "8K")
        r = json.loads(p.stdout)
        assert r["header"]["mode"] == "initiator" and r["header"]["target_pid"] is None
        assert r["header"]["remote_buffer"] == 8 << 20
        # 4 MiB blocks: the default 4 in flight do not fit 8 MiB, so windows are reused.
        assert all(q["verified"] and q["gbps"] > 0 for q in r["points"])
        assert {s["size"] for s in r["sync"]} == {8192}
    finally:
        tgt.send_signal(signal.SIGTERM)       # the target's stop signal (as Ctrl-C)
        assert tgt.wait(30) == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_no_orphan_target(sig):
    # SIGINT must be deliverable: a shell's background job inherits it ignored.
    p = subprocess.Popen([sys.executable, "-m", "mooncake_te", "bench", "--duration", "5",
                          "--block-sizes", "4K", "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        kids = []
        while not kids and time.monotonic() < deadline:
            kids = _children(p.pid)
            time.sleep(0.1)
        assert kids, "the loopback target was not started"
        # Into the first 5 s point, or still setting up on a loaded machine: either way
        # a Ctrl-C says it interrupted (the report on stdout, or a line on stderr when
        # nothing was measured yet) and exits 130.
        time.sleep(4.0)
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
        if sig == signal.SIGINT:
            assert p.returncode == 130 and b"interrupted" in out + err, (out, err)
        deadline = time.monotonic() + 15
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(k) for k in kids), "the target outlived the bench"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# --- the library in one process -----------------------------------------------------------
class _Dropping:
    """An engine whose submit_arrays silently skips the last request of each batch."""

    def __init__(self, eng):
        self._eng = eng

    def submit_arrays(self, op, target, src, dst, lengths):
        return self._eng.submit_arrays(op, target, src[:-1], dst[:-1], lengths)

    def __getattr__(self, name):
        return getattr(self._eng, name)


@pytest.fixture
def pair():
    tgt = BenchTarget(1 << 20, host=HOST)
    stop = threading.Event()
    th = threading.Thread(target=tgt.serve, args=(stop,), daemon=True)
    th.start()
    eng = mte.TransferEngine(host=HOST)
    local = np.zeros(1 << 20, np.uint8)
    eng.register(local)
    try:
        yield tgt, eng, local
    finally:
        eng.close()
        stop.set()
        th.join(10)
        tgt.close()


@pytest.mark.parametrize("op", ["write", "read"])
def test_verify_catches_missing_bytes(pair, op):
    tgt, eng, local = pair
    info = tgt.info()
    cfg = BenchConfig(ops=[op], block_sizes=[4096], batch_sizes=[4], duration=0.05,
                      warmup=0, inflight=1, verify=True, sync=False)
    ok = Runner(eng, info["segment"], info["address"], info["length"], local,
                TargetControl(eng, info["segment"])).run(cfg)
    assert ok["points"][0]["verified"] is True
    bad = Runner(_Dropping(eng), info["segment"], info["address"], info["length"], local,
                 TargetControl(eng, info["segment"]))
    with pytest.raises(VerifyError, match=r"offset 12288\b"):    # the 4th block of 4
        bad.run(cfg)


# --- version ------------------------------------------------------------------------------
def test_version_json():
    r = json.loads(cli("version", "--json").stdout)
    assert r["mooncake_te"] == mte.__version__
    assert r["numpy"] == np.__version__ and r["python"].count(".") == 2
    assert r["transports"]["tcp"]["available"] is True
    for name, t in r["transports"].items():
        assert t["available"] or t["reason"], name     # every "no" says why
    assert all(not v.startswith("not built") for v in r["native"].values())


def test_version_text():
    out = cli("version").stdout
    assert "mooncake_te" in out and "numpy" in out and "tcp" in out and "available" in out


def test_target_death_is_a_clean_failure():
    p = subprocess.Popen([sys.executable, "-m", "mooncake_te", "bench", "--duration", "5",
                          "--block-sizes", "64K", "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        kids = []
        while not kids and time.monotonic() < deadline:
            kids = _children(p.pid)
            time.sleep(0.1)
        assert kids
        # Kill the target while transfers flow, not while it is still starting (on a busy
        # machine that takes longer than any fixed pause): once it listens it holds 3
        # sockets, and each connection the client makes to it adds one.
        def sockets(pid):
            n = 0
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
                except OSError:
                    pass
            return n
        while time.monotonic() < deadline and min(sockets(k) for k in kids) < 4:
            time.sleep(0.05)
        time.sleep(0.5)
        for k in kids:
            os.kill(k, signal.SIGKILL)
        _, err = p.communicate(timeout=60)      # well inside the engine's deadline
        assert p.returncode == 1 and "TransferError" in err and "Traceback" not in err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

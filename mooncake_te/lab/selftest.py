# SPDX-License-Identifier: Apache-2.0
"""``selftest``: prove the lab works, in one guest boot, with timings.

The host side (:func:`selftest`) prepares the cache, boots the guest with two rxe
devices and an NVMe-oF namespace, and runs this module's guest side
(``python -m mooncake_te.lab.selftest --in-guest``), which checks:

1. ``ibv_devinfo`` lists ``rxe0`` and ``rxe1`` with their ports ``PORT_ACTIVE``;
2. ``ib_write_bw`` (perftest) moves data from ``rxe1`` to ``rxe0`` across the veth pair,
   and each device's hardware counters saw its share of the packets;
3. the NVMe-oF namespace survives an O_DIRECT write and read-back compare.

The guest side prints one JSON line per check (after a marker), which the host turns
into the report.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import subprocess
import sys
import time

from .._spawn import python_m
from . import cache as _prepare, guest
from .errors import LabError

_MARK = "@@selftest@@ "
#: perftest's default TCP port for exchanging QP numbers (perftest README).
PERFTEST_PORT = 18515


# ----------------------------------------------------------------- guest side

def _counter(dev: str, name: str) -> int:
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/1/hw_counters/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return -1


def _listening(port: int) -> bool:
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            if parts[1].endswith(f":{port:04X}") and parts[3] == "0A":      # TCP_LISTEN
                return True
    return False


def check_devinfo(devices) -> dict:
    out = subprocess.run(["ibv_devinfo"], capture_output=True, text=True, timeout=60)
    seen = dict(re.findall(r"hca_id:\s*(\S+).*?state:\s*(\S+)", out.stdout, re.S))
    bad = [d["name"] for d in devices if seen.get(d["name"]) != "PORT_ACTIVE"]
    return {"ok": out.returncode == 0 and not bad and bool(devices),
            "detail": ", ".join(f"{k} {v}" for k, v in seen.items()) or out.stderr.strip()}


def check_write_bw(devices, size=65536, iters=200) -> dict:
    if len(devices) < 2:
        return {"ok": False, "detail": "needs two rxe devices"}
    srv, cli = devices[0], devices[1]
    before = {d["name"]: (_counter(d["name"], "sent_pkts"), _counter(d["name"], "rcvd_pkts"))
              for d in (srv, cli)}
    common = ["-s", str(size), "-n", str(iters), "-F", "-p", str(PERFTEST_PORT)]
    server = subprocess.Popen(["ib_write_bw", "-d", srv["name"], "-x", str(srv["gid_index"]),
                               *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        deadline = time.monotonic() + 30
        while not _listening(PERFTEST_PORT):
            if server.poll() is not None or time.monotonic() > deadline:
                return {"ok": False, "detail": "ib_write_bw server did not listen: "
                                               + (server.stdout.read() or "")[-300:]}
            time.sleep(0.1)
        client = subprocess.run(["ib_write_bw", "-d", cli["name"], "-x",
                                 str(cli["gid_index"]), *common, srv["addr"]],
                                capture_output=True, text=True, timeout=120)
        srv_out = server.communicate(timeout=60)[0]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    # The result row: "#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]"
    m = re.search(rf"^\s*{size}\s+{iters}\s+(\S+)\s+(\S+)\s+(\S+)", client.stdout, re.M)
    sent = _counter(cli["name"], "sent_pkts") - before[cli["name"]][0]
    rcvd = _counter(srv["name"], "rcvd_pkts") - before[srv["name"]][1]
    ok = client.returncode == 0 and m is not None and sent > 0 and rcvd > 0
    detail = (f"{cli['name']} -> {srv['name']}, {iters} x {size} B, "
              f"{float(m.group(2)):.1f} MB/s; {cli['name']} sent_pkts +{sent}, "
              f"{srv['name']} rcvd_pkts +{rcvd}") if m else \
        f"ib_write_bw failed ({client.returncode}): {(client.stdout + client.stderr)[-400:]}" \
        f" server: {srv_out[-200:]}"
    return {"ok": ok, "detail": detail}


def check_nvmeof(nv, size=8 << 20) -> dict:
    if not nv:
        return {"ok": False, "detail": "no NVMe-oF namespace"}
    # O_DIRECT needs a page-aligned buffer: an anonymous mmap is one (mmap(2)).
    data = mmap.mmap(-1, size)
    data.write(secrets.token_bytes(size))
    back = mmap.mmap(-1, size)
    fd = os.open(nv["device"], os.O_RDWR | os.O_DIRECT)
    try:
        t = time.monotonic()
        assert os.pwritev(fd, [data], 0) == size
        os.fsync(fd)
        assert os.preadv(fd, [back], 0) == size
        dt = time.monotonic() - t
    finally:
        os.close(fd)
    ok = data[:] == back[:]
    return {"ok": ok, "detail": f"{nv['device']} ({nv['transport']} {nv['traddr']}:"
                                f"{nv['trsvcid']}, {nv['nqn']}): {size >> 20} MiB written "
                                f"and read back with O_DIRECT in {dt:.1f} s, "
                                f"{'equal' if ok else 'DIFFERENT'}"}


def in_guest() -> int:
    devices = json.loads(os.environ.get("MOONCAKE_LAB_RXE", "[]"))
    nv = json.loads(os.environ.get("MOONCAKE_LAB_NVMEOF", "null"))
    rc = 0
    for name, fn, arg in (("ibv_devinfo", check_devinfo, devices),
                          ("ib_write_bw", check_write_bw, devices),
                          ("nvmeof", check_nvmeof, nv)):
        t = time.monotonic()
        try:
            r = fn(arg)
        except Exception as e:         # a check that crashes is a failed check
            r = {"ok": False, "detail": f"{type(e).__name__}: {e}"}
        r.update(name=name, seconds=round(time.monotonic() - t, 2))
        rc |= not r["ok"]
        print(_MARK + json.dumps(r), flush=True)
    return rc


# ------------------------------------------------------------------ host side

class _Collect:
    """Binary sink that keeps the guest's check lines and forwards the rest."""

    def __init__(self, verbose_out=None):
        self.buf = b""
        self.out = verbose_out

    def write(self, b):
        self.buf += b
        if self.out is not None:
            self.out.write(b)

    def flush(self):
        if self.out is not None:
            self.out.flush()

    def checks(self):
        return [json.loads(ln[len(_MARK):]) for ln in self.buf.decode(errors="replace")
                .splitlines() if ln.startswith(_MARK)]


def selftest(*, timeout: float = 600, accel: str = "auto", log=print, verbose=False) -> int:
    """Prepare, boot once and run the checks; print a report; return 0 when all pass."""
    from . import host
    t0 = time.monotonic()
    host.check(boot=True, selftest=True)
    p = _prepare.prepare(log=log)
    log(f"prepare: {p.seconds:.1f} s ({'downloaded' if p.downloaded else 'cached'} "
        f"{p.kernel.package} {p.kernel.version})")
    sink = _Collect(sys.stdout.buffer if verbose else None)
    r = guest.run(python_m("mooncake_te.lab.selftest") + ["--in-guest"], rxe=2,
                  nvmeof=True, timeout=timeout, accel=accel, out=sink, log=log,
                  echo=sys.stderr if verbose else None)
    checks = sink.checks()
    t = r.guest.get("timings", {})
    log(f"boot: {r.boot_s - t.get('setup_s', 0):.1f} s to stage 2 (accel={r.accel}), "
        f"setup {t.get('setup_s', 0):.1f} s (modules {t.get('modules_s', 0):.1f}, rxe "
        f"{t.get('rxe_s', 0):.1f}, nvmeof {t.get('nvmeof_s', 0):.1f})")
    for c in checks:
        log(f"{'PASS' if c['ok'] else 'FAIL'} {c['name']:<12} {c['seconds']:6.1f} s  "
            f"{c['detail']}")
    ok = r.returncode == 0 and len(checks) == 3 and all(c["ok"] for c in checks)
    if len(checks) != 3:
        log("the guest side ended early; its output:\n"
            + sink.buf.decode(errors="replace")[-2000:])
    log(f"selftest {'passed' if ok else 'FAILED'} in {time.monotonic() - t0:.1f} s "
        f"(guest run {r.wall_s:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--in-guest"]:
        sys.exit(in_guest())
    raise LabError("run this through 'mooncake-te lab selftest'")

# SPDX-License-Identifier: Apache-2.0
"""Stage 2 of the guest: PID 1 after ``switch_root`` into the host's root over 9p.

Run by the host's own Python as ``python -S -E -s stage2.py RUNDIR``, so this file uses
the standard library only (``-S`` leaves out site-packages, where the editable install
of mooncake_te lives). It reads ``RUNDIR/spec.json`` (written by
:mod:`mooncake_te.lab.guest`), loads modules from the cached kernel with
``modprobe -d``, makes the Soft-RoCE devices and the NVMe-oF namespace asked for, runs
the command with its output on the console between two markers, writes
``RUNDIR/result.json`` and powers the guest off.

The functions that decide *what* to run (:func:`rxe_plan`, :func:`nvmeof_plan`) are
pure, so the host's unit tests check them without booting anything.
"""
from __future__ import annotations

import glob
import ipaddress
import json
import os
import re
import subprocess
import sys
import time

#: Printed on the console right before and right after the command's own output.
BEGIN = b"@@mooncake-lab:begin@@\n"
END = b"@@mooncake-lab:end@@"
#: Console line prefix of stage 2's own progress and errors.
PREFIX = "mooncake-lab:"

#: Addresses of the Soft-RoCE netdevs: 10.99.0.1 for rxe0, 10.99.0.2 for rxe1, ...
SUBNET = "10.99.0"
#: The NVMe-oF target the lab makes: subsystem NQN, TCP address, host identity.
NQN = "nqn.2026-12.io.mooncake-te:lab"
NVMEOF_ADDR = ("127.0.0.1", "4420")
HOST_ID = "6d6f6f6e-6361-6b65-2d74-652d6c616221"
HOST_NQN = "nqn.2014-08.org.nvmexpress:uuid:" + HOST_ID

RXE_MODULES = ("crc32_generic", "veth", "ib_core", "ib_uverbs", "rdma_ucm", "rdma_rxe")
#: loop: block devices (over files) to back namespaces in tests.
NVMEOF_MODULES = ("nvmet", "nvmet_tcp", "nvme_tcp", "loop")
#: With Soft-RoCE devices too: NVMe-oF over RDMA.
NVMEOF_RDMA_MODULES = ("nvmet_rdma", "nvme_rdma")


class SetupError(Exception):
    """A setup step failed; the message names the step."""


def log(msg: str) -> None:
    sys.stdout.buffer.write(f"{PREFIX} {msg}\n".encode())
    sys.stdout.buffer.flush()


def sh(argv, what: str | None = None, input: str | None = None) -> str:
    """Run one setup command; raise :class:`SetupError` with its stderr if it fails."""
    try:
        out = subprocess.run(argv, input=input, stdin=None if input else subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SetupError(f"{what or argv[0]}: {argv[0]} not found in the guest "
                         f"(install it on the host: the guest runs the host's /)") from None
    if out.returncode != 0:
        raise SetupError(f"{what or ' '.join(argv)} failed: {' '.join(argv)}: "
                         f"{(out.stderr or out.stdout).strip()}")
    return out.stdout


def write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


# --------------------------------------------------------------------------- plans

def rxe_plan(n: int):
    """The steps that give ``n`` Soft-RoCE devices, and the devices.

    Returns
    -------
    steps : list of tuple
        In order: ``("run", argv)`` for an ``ip``/``rdma`` command, or
        ``("sysctl", path, value)`` for a write under ``/proc/sys``.
    devices : list of dict
        ``name``, ``netdev`` and ``addr`` of each rxe device.

    Notes
    -----
    Up to two devices sit on the two ends of one veth pair; more sit on veth pairs whose
    other ends are ports of one bridge, so every device reaches every other.

    Two rxe devices in one network namespace do not reach each other by default: a
    packet to a local address is delivered through ``lo`` and never crosses the veth
    wire, and rxe only receives on the netdev it is bound to. So (as found when the lab
    was first made, see docs/fabric-lab.md): the ``local`` routing rule moves from
    preference 0 to 100, and for each pair of devices a rule at preference 10 sends
    locally sent traffic *from* one device's address *to* another's out of the first
    device's netdev (policy routing: ip-rule(8)). Traffic from an address to itself
    keeps the local route, which rxe loops back internally. ``accept_local`` lets the
    receiving end take a packet whose source is a local address, ``rp_filter=0`` stops
    reverse-path filtering from dropping it (kernel Documentation/networking/
    ip-sysctl.rst), and ``arp_ignore=1`` makes only the addressed netdev answer ARP, so
    a bridge does not deliver to the wrong device.
    """
    devices = [{"name": f"rxe{i}", "netdev": f"veth{i}", "addr": f"{SUBNET}.{i + 1}"}
               for i in range(n)]
    steps: list[tuple] = []
    if n <= 0:
        return steps, devices

    def run(*argv):
        steps.append(("run", list(argv)))

    netdevs = [d["netdev"] for d in devices]
    if n <= 2:
        run("ip", "link", "add", "veth0", "type", "veth", "peer", "name", "veth1")
        links = ["veth0", "veth1"]
    else:
        run("ip", "link", "add", "mtebr0", "type", "bridge")
        links = ["mtebr0"]
        for i in range(n):
            run("ip", "link", "add", f"veth{i}", "type", "veth", "peer", "name", f"vbr{i}")
            run("ip", "link", "set", f"vbr{i}", "master", "mtebr0")
            links += [f"vbr{i}", f"veth{i}"]
    if n >= 2:
        for ifc in ["all", "default", "lo"] + netdevs:
            steps.append(("sysctl", f"net/ipv4/conf/{ifc}/accept_local", "1"))
            steps.append(("sysctl", f"net/ipv4/conf/{ifc}/rp_filter", "0"))
        for ifc in ["all"] + netdevs:
            steps.append(("sysctl", f"net/ipv4/conf/{ifc}/arp_ignore", "1"))
            steps.append(("sysctl", f"net/ipv4/conf/{ifc}/arp_announce", "2"))
    for d in devices:
        run("ip", "addr", "add", f"{d['addr']}/24", "dev", d["netdev"])
    for ifc in links:
        run("ip", "link", "set", ifc, "up")
    if n >= 2:
        run("ip", "rule", "add", "pref", "100", "lookup", "local")
        run("ip", "rule", "del", "pref", "0", "lookup", "local")
        for j, src in enumerate(devices):
            table = str(100 + j)
            for dst in devices:
                if dst is src:
                    continue
                run("ip", "route", "add", dst["addr"], "dev", src["netdev"], "src",
                    src["addr"], "table", table)
                run("ip", "rule", "add", "pref", "10", "from", src["addr"], "to",
                    dst["addr"], "iif", "lo", "lookup", table)
    for d in devices:
        run("rdma", "link", "add", d["name"], "type", "rxe", "netdev", d["netdev"])
    return steps, devices


def nvmeof_plan(image: str, size: int, nqn: str = NQN, addr=NVMEOF_ADDR):
    """configfs writes that make a file-backed nvmet namespace on a TCP port.

    Returns a list of ``(op, path, value)`` with op ``mkdir``, ``write`` or ``symlink``,
    under ``/sys/kernel/config/nvmet`` (kernel drivers/nvme/target/configfs.c).
    ``buffered_io`` must be 1 before ``enable``: the image sits on tmpfs, which has no
    O_DIRECT, and a direct-I/O namespace there fails to enable with an I/O error.
    """
    root = "/sys/kernel/config/nvmet"
    sub = f"{root}/subsystems/{nqn}"
    ns = f"{sub}/namespaces/1"
    port = f"{root}/ports/1"
    return [
        ("truncate", image, size),
        ("mkdir", sub, None),
        ("write", f"{sub}/attr_allow_any_host", "1"),
        ("mkdir", ns, None),
        ("write", f"{ns}/device_path", image),
        ("write", f"{ns}/buffered_io", "1"),
        ("write", f"{ns}/enable", "1"),
        ("mkdir", port, None),
        ("write", f"{port}/addr_trtype", "tcp"),
        ("write", f"{port}/addr_adrfam", "ipv4"),
        ("write", f"{port}/addr_traddr", addr[0]),
        ("write", f"{port}/addr_trsvcid", addr[1]),
        ("symlink", f"{port}/subsystems/{nqn}", sub),
    ]


# --------------------------------------------------------------------------- steps

def mounts() -> None:
    # The host's /run and /dev/shm must not be shared with the guest: sockets and pid
    # files of host services would look alive there. /tmp stays shared (a command may
    # run from it), but the command's TMPDIR points into the guest's own tmpfs, so a
    # pytest in the guest never cleans up the host's pytest-of-<user> folders.
    for target, fstype, opts in (("/run", "tmpfs", "mode=755"),
                                 ("/dev/shm", "tmpfs", "mode=1777"),
                                 ("/dev/pts", "devpts", "gid=5,mode=620")):
        os.makedirs(target, exist_ok=True)
        sh(["mount", "-t", fstype, "-o", opts, fstype, target], f"mounting {target}")


def modprobe(root: str, names) -> None:
    if names:
        sh(["modprobe", "-d", root, "-a", *names], f"loading modules {', '.join(names)}")


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise SetupError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


try:
    from ..topology import gids as _gids
    from ..topology.sysfs import read_attr
except ImportError:
    # Run as a script (python -S stage2.py): no package, no site-packages. The package's
    # one attribute reader and its GID chooser are standard library only at import, so
    # load those files by their paths.
    import importlib.util as _util

    def _load(name: str):
        spec = _util.spec_from_file_location(
            f"_mte_{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         os.pardir, "topology", f"{name}.py"))
        mod = _util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    read_attr = _load("sysfs").read_attr
    _gids = _load("gids")


def _read(path: str) -> str:
    return read_attr(path, "")


def gid_index(dev: str, addr: str) -> int | None:
    """Index of the RoCE v2 GID that carries IPv4 ``addr`` (::ffff:a.b.c.d), chosen as
    the RDMA transport chooses (topology.gids)."""
    want = ipaddress.IPv6Address(f"::ffff:{addr}").packed
    base = f"/sys/class/infiniband/{dev}/ports/1"
    entries = []
    for path in glob.glob(f"{base}/gids/*"):
        idx = path.rsplit("/", 1)[1]
        try:
            raw = ipaddress.IPv6Address(_read(path)).packed
        except ValueError:
            continue
        kind = _read(f"{base}/gid_attrs/types/{idx}")
        if raw == want and kind == "RoCE v2":
            entries.append((int(idx), raw, kind, True))
    best = _gids.select(entries)
    return best[0] if best else None


def setup_rxe(n: int) -> list[dict]:
    steps, devices = rxe_plan(n)
    # Consecutive commands of one tool go through its -batch mode: under software
    # emulation each process start costs a good fraction of a second (ip(8), rdma(8)).
    batch: list[list[str]] = []

    def flush():
        if batch:
            lines = "\n".join(" ".join(a[1:]) for a in batch) + "\n"
            sh([batch[0][0], "-b", "-"], f"{batch[0][0]} -b:\n{lines}", input=lines)
            batch.clear()

    for step in steps:
        if step[0] == "sysctl":
            flush()
            write(f"/proc/sys/{step[1]}", step[2])
        else:
            if batch and batch[0][0] != step[1][0]:
                flush()
            batch.append(step[1])
    flush()
    for d in devices:
        port = f"/sys/class/infiniband/{d['name']}/ports/1"
        wait_for(lambda: "ACTIVE" in _read(f"{port}/state"), 20, f"{d['name']} port ACTIVE")
        # The IPv4 GID appears once the address event reaches ib_core
        # (drivers/infiniband/core/roce_gid_mgmt.c); tuples keep an index of 0 truthy.
        d["gid_index"] = wait_for(lambda: (gid_index(d["name"], d["addr"]),)
                                  if gid_index(d["name"], d["addr"]) is not None else None,
                                  20, f"{d['name']}'s RoCE v2 GID for {d['addr']}")[0]
    return devices


def _nvme_block() -> str | None:
    for p in glob.glob("/sys/block/nvme*"):
        name = os.path.basename(p)
        # nvmeXcYnZ are the hidden per-path devices of native multipath; nvmeXnY is
        # the namespace (drivers/nvme/host/multipath.c).
        if re.fullmatch(r"nvme\d+n\d+", name) and os.path.exists(f"/dev/{name}"):
            return f"/dev/{name}"
    return None


def setup_nvmeof(size: int) -> dict:
    image = "/run/mooncake-lab/nvmeof0.img"
    os.makedirs(os.path.dirname(image), exist_ok=True)
    for op, path, value in nvmeof_plan(image, size):
        try:
            if op == "truncate":
                with open(path, "wb") as f:
                    f.truncate(value)
            elif op == "mkdir":
                os.mkdir(path)
            elif op == "write":
                write(path, value)
            elif op == "symlink":
                os.symlink(value, path)
        except OSError as e:
            raise SetupError(f"making the NVMe-oF target: {op} {path}"
                             f"{' = ' + str(value) if op == 'write' else ''}: {e}") from None
    sh(["nvme", "connect", "-t", "tcp", "-a", NVMEOF_ADDR[0], "-s", NVMEOF_ADDR[1], "-n", NQN,
        "--hostnqn", HOST_NQN, "--hostid", HOST_ID], "connecting to the NVMe-oF target")
    dev = wait_for(_nvme_block, 20, "the NVMe-oF namespace's block device")
    return {"nqn": NQN, "traddr": NVMEOF_ADDR[0], "trsvcid": NVMEOF_ADDR[1],
            "transport": "tcp", "device": dev, "image": image, "size": size}


def set_raw(fd: int) -> None:
    """Turn off output post-processing on the console, so ``\\n`` stays ``\\n``.

    A tty adds ``\\r`` before each ``\\n`` (termios(3), ONLCR); the host streams the
    command's bytes as they were written.
    """
    try:
        import termios
        attrs = termios.tcgetattr(fd)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
    except Exception:     # not a tty: nothing to undo
        pass


def run_command(spec: dict, env: dict) -> int:
    out = sys.stdout.buffer
    out.write(BEGIN)
    out.flush()
    try:
        if not os.path.isdir(spec["cwd"]):
            raise NotADirectoryError(spec["cwd"])
        proc = subprocess.Popen(spec["argv"], cwd=spec["cwd"], env=env,
                                stdin=subprocess.DEVNULL)
    except NotADirectoryError:
        out.write(f"{PREFIX} the working folder {spec['cwd']} is not there in the guest "
                  f"(the guest sees the host's / except /run and /dev/shm)\n".encode())
        rc = 127
    except FileNotFoundError:
        out.write(f"{PREFIX} command not found in the guest: {spec['argv'][0]}\n".encode())
        rc = 127
    except PermissionError:
        out.write(f"{PREFIX} command not executable in the guest: {spec['argv'][0]}\n"
                  .encode())
        rc = 126
    else:
        rc = proc.wait()
        if rc < 0:                       # killed by a signal: the shell's convention
            rc = 128 - rc
    out.write(END + b"\n")
    out.flush()
    return rc


def main(rundir: str) -> None:
    t0 = time.monotonic()
    result = {"rc": None, "error": None, "timings": {}}
    set_raw(1)
    try:
        with open(os.path.join(rundir, "spec.json")) as f:
            spec = json.load(f)
        # /init hands over PATH=/bin (busybox's); setup tools live in the sbin folders.
        os.environ["PATH"] = ":".join(filter(None, (
            spec["env"].get("PATH"), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")))
        write("/proc/sys/kernel/hostname", "mooncake-lab")
        mounts()
        modules = ["configfs"]
        if spec["rxe"] > 0:
            modules += RXE_MODULES + (("bridge",) if spec["rxe"] > 2 else ())
        if spec.get("nvmeof"):
            modules += NVMEOF_MODULES
            if spec["rxe"] > 0:
                modules += NVMEOF_RDMA_MODULES
        t = time.monotonic()
        modprobe(spec["modules_root"], modules)
        sh(["mount", "-t", "configfs", "configfs", "/sys/kernel/config"], "mounting configfs")
        sh(["ip", "link", "set", "lo", "up"])
        result["timings"]["modules_s"] = round(time.monotonic() - t, 2)
        env = dict(spec["env"])
        env["MOONCAKE_LAB"] = "1"
        env["TMPDIR"] = "/run/mooncake-lab/tmp"
        os.makedirs(env["TMPDIR"], mode=0o1777, exist_ok=True)
        t = time.monotonic()
        devices = setup_rxe(spec["rxe"])
        result["timings"]["rxe_s"] = round(time.monotonic() - t, 2)
        result["rxe"] = devices
        env["MOONCAKE_LAB_RXE"] = json.dumps(devices)
        # Soft-RoCE in an emulated guest misses the default 67 ms ACK timeout when the host
        # is busy; 6.1's rxe then fails the QP on retransmission ("invalid request"),
        # perftest too (docs/rdma.md, known issues). A 1 s timeout avoids it.
        env.setdefault("MC_RDMA_QP_TIMEOUT", "18")
        if spec.get("nvmeof"):
            # nvme-tcp over loopback: nvmet-tcp's receive copies straight out of the
            # host's pages, and a TCP fragment crossing the end of a transparent huge
            # page (numpy madvises large arrays to THP) trips 6.1's hardened usercopy
            # check: "kernel BUG at mm/usercopy.c:101" in nvmet_tcp_io_work, seen in
            # this lab with 1 MiB O_DIRECT writes from a numpy buffer. Real NICs receive
            # into their own buffers, so only the single-machine lab needs this.
            write("/sys/kernel/mm/transparent_hugepage/enabled", "never")
            t = time.monotonic()
            nv = setup_nvmeof(int(spec["nvmeof"]["size"]))
            result["timings"]["nvmeof_s"] = round(time.monotonic() - t, 2)
            result["nvmeof"] = nv
            env["MOONCAKE_LAB_NVMEOF"] = json.dumps(nv)
        result["timings"]["setup_s"] = round(time.monotonic() - t0, 2)
        t = time.monotonic()
        result["rc"] = run_command(spec, env)
        result["timings"]["command_s"] = round(time.monotonic() - t, 2)
    except SetupError as e:
        result["error"] = str(e)
        log(f"setup failed: {e}")
    except BaseException as e:        # PID 1 must reach the power-off below
        result["error"] = f"stage 2 crashed: {type(e).__name__}: {e}"
        log(result["error"])
    finally:
        try:
            tmp = os.path.join(rundir, "result.json.tmp")
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, os.path.join(rundir, "result.json"))
            os.sync()
        finally:
            # sysrq 'o' powers off at once (Documentation/admin-guide/sysrq.rst); with
            # PID 1 still alive there is no "attempted to kill init" panic.
            write("/proc/sysrq-trigger", "o")
            time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1])

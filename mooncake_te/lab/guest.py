# SPDX-License-Identifier: Apache-2.0
"""Boot the guest, run one command in it, stream its output, power it off.

The host's ``/`` is the guest's root (qemu ``-virtfs``, 9p), so the command runs with
the same Python, virtualenv and build as on the host, in the same folder. The host
writes ``spec.json`` into a run folder in the cache; stage 2 (:mod:`.stage2`) writes
``result.json`` there before powering off, because a guest's exit status does not
reach qemu's.

The serial console carries everything: boot messages, stage 2's progress and, between
two marker lines, the command's output. Only the command's output is streamed; the
rest is kept as a tail to show when something goes wrong.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import host, initramfs, kernel as _kernel, stage2
from .errors import GuestError, GuestTimeoutError, LabError, LabUnavailableError

QEMU = "qemu-system-x86_64"

#: Where the probe of KVM records whether a guest really boots under it.
_KVM_PROBE = "kvm-probe.json"


@dataclass
class Result:
    """What one guest run gave.

    Attributes
    ----------
    returncode : int
        The command's exit status (127: not found in the guest).
    boot_s : float
        Seconds from starting qemu to the command's start (boot plus device setup).
    wall_s : float
        Seconds from starting qemu to its exit.
    guest : dict
        Stage 2's result: ``timings``, and ``rxe`` / ``nvmeof`` as made.
    console : list of str
        The last console lines outside the command's output.
    """

    returncode: int
    boot_s: float
    wall_s: float
    accel: str
    guest: dict = field(default_factory=dict)
    console: list = field(default_factory=list)


class _Console:
    """Splits the serial console into the command's bytes and everything else."""

    def __init__(self, out, echo=None, tail=200):
        self.out = out                     # binary stream for the command's output
        self.echo = echo                   # text stream for boot messages, or None
        self.tail = collections.deque(maxlen=tail)
        self.state = "boot"                # boot -> command -> after
        self.pending = b""
        self.line = b""
        self.began_at = None

    def _console_bytes(self, data: bytes):
        self.line += data
        *lines, self.line = self.line.split(b"\n")
        for ln in lines:
            text = ln.decode("utf-8", "replace").rstrip("\r")
            self.tail.append(text)
            if self.echo is not None:
                self.echo.write(f"[guest] {text}\n")
                self.echo.flush()

    def feed(self, data: bytes):
        data = self.pending + data
        self.pending = b""
        while data:
            if self.state == "command":
                i = data.find(stage2.END)
                if i >= 0:
                    self._write(data[:i])
                    self.state = "after"
                    data = data[i + len(stage2.END):]
                    continue
                # Hold back a tail that may be the start of the end marker.
                keep = len(stage2.END) - 1
                cut = max(0, len(data) - keep)
                while cut < len(data) and not stage2.END.startswith(data[cut:]):
                    cut += 1
                self._write(data[:cut])
                self.pending = data[cut:]
                return
            if self.state == "boot":
                i = data.find(stage2.BEGIN)
                if i >= 0:
                    self._console_bytes(data[:i])
                    self.state = "command"
                    self.began_at = time.monotonic()
                    data = data[i + len(stage2.BEGIN):]
                    continue
                keep = len(stage2.BEGIN) - 1
                cut = max(0, len(data) - keep)
                while cut < len(data) and not stage2.BEGIN.startswith(data[cut:]):
                    cut += 1
                self._console_bytes(data[:cut])
                self.pending = data[cut:]
                return
            self._console_bytes(data)
            return

    def close(self):
        if self.state == "command" and self.pending:
            self._write(self.pending)
        elif self.pending:
            self._console_bytes(self.pending)
        self.pending = b""
        if self.line:
            self._console_bytes(b"\n")

    def _write(self, b: bytes):
        if b and self.out is not None:
            try:
                self.out.write(b)
                self.out.flush()
            except (OSError, ValueError):
                # The reader went away (``| head``): keep draining the console, or
                # qemu blocks on a full pipe and the guest hangs until the timeout.
                self.out = None


def qemu_argv(kern: _kernel.Kernel, initrd: Path, rundir: Path, *, accel: str = "tcg",
              smp: int = 2, memory_mb: int = 2048, python: str = sys.executable) -> list[str]:
    """The qemu command line for one run.

    ``-cpu max`` under TCG gives the guest SSE4.2/POPCNT/AVX2, without which numpy and
    anything else built for x86-64-v2 dies with "Illegal instruction". ``-nic none``:
    the guest's only network is the veth pairs stage 2 makes inside it. The console is
    a serial port on qemu's stdout (a pipe, never the user's terminal, so qemu never
    touches its settings); ``-no-reboot`` turns the guest's power-off, and a panic's
    reboot (``panic=-1``), into qemu's exit.
    """
    for p in (python, str(initramfs.run_root()), str(rundir)):
        if any(c.isspace() for c in p):
            raise LabError(f"the lab passes paths on the kernel command line, which splits "
                           f"on spaces: {p!r} has one (set MOONCAKE_LAB_CACHE to a path "
                           f"without spaces)")
    stage2_py = os.path.abspath(stage2.__file__)
    # /init checks and execs this path before switch_root is done resolving symlinks
    # against the guest's view, and a virtualenv's python is a symlink: pass the real
    # file (stage 2 uses the standard library only, so which prefix it sees is moot).
    python = os.path.realpath(python)
    cmdline = (f"console=ttyS0 quiet loglevel=3 panic=-1 mte.python={python} "
               f"mte.stage2={stage2_py} mte.run={rundir}")
    cpu = ["-accel", "kvm", "-cpu", "host"] if accel == "kvm" else ["-accel", "tcg", "-cpu", "max"]
    return [QEMU, "-nodefaults", "-no-user-config", *cpu, "-smp", str(smp),
            "-m", str(memory_mb), "-display", "none", "-nic", "none", "-no-reboot",
            "-chardev", "stdio,id=con,signal=off", "-serial", "chardev:con",
            "-kernel", str(kern.vmlinuz), "-initrd", str(initrd), "-append", cmdline,
            "-virtfs", f"local,path=/,mount_tag={initramfs.MOUNT_TAG},"
                       "security_model=passthrough,id=hostroot,multidevs=remap"]


def _sweep(root: Path) -> None:
    """Remove run folders left by runs whose process died without cleaning up."""
    for d in root.glob("run-*-*"):
        try:
            pid = int(d.name.split("-")[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass


def _die_with_parent():
    """In the qemu child: ask for SIGKILL when the process that started it dies.

    Our own ``finally`` stops qemu on errors, Ctrl-C and timeouts; this covers the cases
    it cannot, such as the host Python being SIGKILLed (prctl(2), PR_SET_PDEATHSIG).
    """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)          # PR_SET_PDEATHSIG = 1


def _kill(proc: subprocess.Popen):
    """Stop qemu: SIGTERM (it exits cleanly), then SIGKILL after 5 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _failure(con: _Console, fallback: str) -> tuple[str, list[str]]:
    """One line saying why the guest ended without a result, and the console lines
    that show it (for a panic, those before it: the register dump after it says less)."""
    tail = list(con.tail)
    for i, line in enumerate(tail):
        if "Kernel panic" in line:
            return f"the guest kernel panicked: {line.strip()}", tail[max(0, i - 12):i + 1]
        if line.startswith(initramfs.INIT_FAIL):
            return (f"the guest could not start: {line[len(initramfs.INIT_FAIL):].strip()}",
                    tail[max(0, i - 12):i + 1])
    return fallback, tail[-15:]


def kernel_for_run(log=None) -> _kernel.Kernel:
    """The cached kernel, preparing it first when the cache has none."""
    k = _kernel.cached()
    if k is None:
        from .cache import prepare
        if log:
            log("no guest kernel cached yet: preparing the lab first")
        k = prepare(log=log or (lambda *_: None)).kernel
    return k


def choose_accel(requested: str) -> str:
    """``tcg``, ``kvm``, or for ``auto`` KVM only where a probe saw a guest boot under it."""
    if requested in ("tcg", "kvm"):
        return requested
    try:
        d = json.loads((_kernel.cache_dir() / _KVM_PROBE).read_text())
        if d.get("works") and d.get("host") == os.uname().release:
            return "kvm"
    except (OSError, ValueError):
        pass
    return "tcg"


def run(argv, *, rxe: int = 2, nvmeof: bool = False, nvmeof_size: int = 64 << 20,
        timeout: float = 600, cwd: str | None = None, env: dict | None = None,
        accel: str = "auto", smp: int = 2, memory_mb: int = 2048, out=None, echo=None,
        log=None) -> Result:
    """Boot the guest, run ``argv`` in it, and return its :class:`Result`.

    Parameters
    ----------
    argv : sequence of str
        The command; looked up on the host's ``PATH`` first (it is the guest's too).
    rxe : int
        How many Soft-RoCE devices to make (``rxe0``...), each on its own veth end.
    nvmeof : bool
        Make a file-backed NVMe-oF target on 127.0.0.1:4420 and connect to it.
    timeout : float
        Seconds from boot to power-off before the guest is killed.
    out : binary stream
        Where the command's output goes (default: this process's stdout).
    echo : text stream, optional
        Where boot messages go as they come (default: kept as a tail only).

    Raises
    ------
    LabUnavailableError
        This host lacks something the lab needs.
    GuestTimeoutError
        The guest ran past ``timeout`` (killed; the message has the console's tail).
    GuestError
        The guest ended without running the command (panic, setup failure).
    """
    argv = [str(a) for a in argv]
    if not argv:
        raise LabError("no command to run in the guest (mooncake-te lab run -- CMD ...)")
    if rxe < 0 or rxe > 16:
        raise LabError(f"--rxe {rxe}: between 0 and 16 Soft-RoCE devices, please")
    if nvmeof and nvmeof_size < (1 << 20):
        raise LabError(f"--nvmeof-size {nvmeof_size >> 20} MiB: at least 1 MiB, please")
    host.check(boot=True, rxe=rxe > 0, nvmeof=nvmeof)
    cwd = os.path.abspath(cwd or os.getcwd())
    env = dict(os.environ if env is None else env)
    # The guest's root is this host's root: what is not here is not there, so say so
    # before spending a boot on it.
    if "/" in argv[0]:
        exe = os.path.join(cwd, argv[0])
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise LabError(f"command not found or not executable: {argv[0]}")
    elif shutil.which(argv[0], path=env.get("PATH")) is None:
        raise LabError(f"command not found: {argv[0]} (the guest runs this host's "
                       f"programs; install it here)")
    if not os.path.isdir(cwd):
        raise LabError(f"no such folder to run in: {cwd}")
    k = kernel_for_run(log)
    initrd = initramfs.ensure(k)
    accel = choose_accel(accel)
    root = initramfs.run_root()
    root.mkdir(parents=True, exist_ok=True)
    _sweep(root)
    rundir = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=root))
    out = out if out is not None else sys.stdout.buffer
    try:
        spec = {"argv": argv, "cwd": cwd, "env": env, "rxe": rxe,
                "nvmeof": {"size": nvmeof_size} if nvmeof else None,
                "modules_root": str(k.root)}
        (rundir / "spec.json").write_text(json.dumps(spec))
        cmd = qemu_argv(k, initrd, rundir, accel=accel, smp=smp, memory_mb=memory_mb)
        con = _Console(out, echo)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        except OSError as e:
            raise LabUnavailableError(f"cannot start {QEMU}: {e} (apt-get install "
                                      f"--no-install-recommends qemu-system-x86)") from None

        def pump():
            fd = proc.stdout.fileno()
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    break
                if not data:
                    break
                con.feed(data)

        reader = threading.Thread(target=pump, name="lab-console", daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Ctrl-C or any error here still ends qemu: nothing is left running.
            _kill(proc)
            reader.join(10)
            proc.stdout.close()
            con.close()
        wall = time.monotonic() - t0
        boot = (con.began_at - t0) if con.began_at else wall
        tail = list(con.tail)
        if timed_out:
            where = ("while running the command" if con.state == "command"
                     else "before the command started")
            raise GuestTimeoutError(
                f"the guest did not finish within {timeout:g} s ({where}, accel={accel}); "
                f"killed it. Last console lines:\n  " + "\n  ".join(tail[-15:] or ["(none)"]))
        try:
            res = json.loads((rundir / "result.json").read_text())
        except (OSError, ValueError):
            msg, lines = _failure(con, f"qemu exited (status {proc.returncode}) without a "
                                       f"result from the guest")
            raise GuestError(msg + ". Console:\n  " + "\n  ".join(lines or ["(none)"])) \
                from None
        if res.get("error"):
            raise GuestError(f"in the guest: {res['error']}")
        return Result(returncode=int(res["rc"]), boot_s=boot, wall_s=wall, accel=accel,
                      guest=res, console=tail)
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


def probe_kvm(timeout: float = 20) -> bool:
    """Boot once under KVM with a short timeout and record whether it worked.

    KVM on the machines this lab was made on opened fine yet every guest hung right
    after the kernel's decompressor, so KVM is only used where a probe has seen a real
    boot; software emulation (TCG) is the default and the fallback.
    """
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        works, why = False, "/dev/kvm is missing or not accessible"
    else:
        try:
            r = run(["true"], rxe=0, timeout=timeout, accel="kvm", smp=1, memory_mb=512,
                    out=open(os.devnull, "wb"))
            works, why = r.returncode == 0, f"booted in {r.boot_s:.1f} s"
        except LabError as e:
            works, why = False, str(e).splitlines()[0]
    (_kernel.cache_dir() / _KVM_PROBE).write_text(json.dumps(
        {"works": works, "why": why, "host": os.uname().release}))
    return works

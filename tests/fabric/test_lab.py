# SPDX-License-Identifier: Apache-2.0
"""The fabric lab's pieces, checked without booting anything."""
from __future__ import annotations

import gzip
import io
import os
import pickle
import stat
import sys

import pytest

from mooncake_te import lab
from mooncake_te.cli.main import main
from mooncake_te.lab import guest, host, initramfs, kernel, stage2


# ------------------------------------------------------------------- cache and kernel

def test_cache_dir_env_relocates(monkeypatch, tmp_path):
    monkeypatch.setenv("MOONCAKE_LAB_CACHE", str(tmp_path / "c"))
    assert lab.cache_dir() == (tmp_path / "c").resolve()
    monkeypatch.delenv("MOONCAKE_LAB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert lab.cache_dir() == (tmp_path / "x").resolve() / "mooncake-te" / "lab"


APT_DEPENDS = """linux-image-amd64
  Depends: linux-image-6.1.0-57-amd64
"""


def test_parse_depends_finds_the_current_image():
    assert kernel.parse_depends(APT_DEPENDS) == "linux-image-6.1.0-57-amd64"
    assert kernel.parse_depends("linux-image-amd64\n") is None
    assert kernel.parse_depends("x\n  Depends: <linux-image-virtual>\n") is None


def test_kernel_package_override(monkeypatch):
    monkeypatch.setenv("MOONCAKE_LAB_KERNEL_PACKAGE", "linux-image-9.9.9-1-amd64")
    assert kernel.current_package() == "linux-image-9.9.9-1-amd64"


def test_unknown_metapackage_is_one_clear_line(monkeypatch, tmp_path):
    """apt that knows no linux-image-amd64 (no 'apt-get update' yet) says what to do."""
    fake = tmp_path / "apt-cache"
    fake.write_text("#!/bin/sh\necho 'E: No packages found' >&2\nexit 100\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("MOONCAKE_LAB_KERNEL_PACKAGE", raising=False)
    with pytest.raises(lab.LabUnavailableError, match="apt-get update"):
        kernel.current_package()


def _fake_kernel(tmp_path, dep_lines, builtin=()):
    rel = "6.1.0-99-amd64"
    mods = tmp_path / "root" / "lib" / "modules" / rel
    mods.mkdir(parents=True)
    (mods / "modules.dep").write_text("\n".join(dep_lines) + "\n")
    (mods / "modules.builtin").write_text("".join(f"{b}\n" for b in builtin))
    for line in dep_lines:
        for p in line.replace(":", " ").split():
            (mods / p).parent.mkdir(parents=True, exist_ok=True)
            (mods / p).write_bytes(b"\x7fELF module " + p.encode())
    (tmp_path / "root" / "boot").mkdir()
    (tmp_path / "root" / "boot" / f"vmlinuz-{rel}").write_bytes(b"kernel")
    return kernel.Kernel("linux-image-" + rel, "1", rel, tmp_path / "root")


DEPS = ["kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/netfs/netfs.ko",
        "kernel/net/9p/9pnet.ko:",
        "kernel/fs/netfs/netfs.ko:",
        "kernel/net/9p/9pnet_virtio.ko: kernel/net/9p/9pnet.ko kernel/drivers/virtio/virtio_ring.ko",
        "kernel/drivers/virtio/virtio_ring.ko:",
        "kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_ring.ko",
        "kernel/drivers/nvme/host/nvme-tcp.ko: kernel/drivers/nvme/host/nvme-core.ko",
        "kernel/drivers/nvme/host/nvme-core.ko:"]


def test_load_order_puts_dependencies_first(tmp_path):
    k = _fake_kernel(tmp_path, DEPS)
    order = kernel.load_order(k, ["9pnet_virtio", "9p", "nvme_tcp"])
    names = [os.path.basename(p) for p in order]
    assert names == ["virtio_ring.ko", "9pnet.ko", "9pnet_virtio.ko", "netfs.ko", "9p.ko",
                     "nvme-core.ko", "nvme-tcp.ko"]
    with pytest.raises(lab.LabError, match="no module nope"):
        kernel.load_order(k, ["nope"])


def test_builtin_modules_are_not_loaded(tmp_path):
    k = _fake_kernel(tmp_path, DEPS, builtin=["kernel/drivers/virtio/virtio_pci.ko"])
    assert kernel.load_order(k, ["virtio_pci"]) == []


def test_cached_needs_a_complete_unpack(monkeypatch, tmp_path):
    monkeypatch.setenv("MOONCAKE_LAB_CACHE", str(tmp_path))
    assert kernel.cached() is None
    kd = tmp_path / "kernels" / "linux-image-6.1.0-99-amd64"
    kd.mkdir(parents=True)
    (kd / "kernel.json").write_text('{"package": "linux-image-6.1.0-99-amd64", '
                                    '"version": "1", "release": "6.1.0-99-amd64"}')
    assert kernel.cached() is None              # no vmlinuz, no modules.dep yet
    _fake_kernel(kd, DEPS)
    k = kernel.cached()
    assert k.release == "6.1.0-99-amd64" and k.vmlinuz.is_file()


# ------------------------------------------------------------------------ initramfs

def test_cpio_round_trip():
    c = initramfs._Cpio()
    c.dir("bin")
    c.file("bin/x", b"hello", 0o755)
    c.file("odd", b"abc")                     # lengths that need padding
    c.chardev("dev/console", 5, 1)
    got = initramfs.read_cpio(c.finish())
    assert got["bin/x"] == (stat.S_IFREG | 0o755, b"hello")
    assert got["odd"][1] == b"abc"
    assert stat.S_ISDIR(got["bin"][0]) and stat.S_ISCHR(got["dev/console"][0])


def test_initramfs_holds_busybox_modules_in_order_and_init(tmp_path):
    k = _fake_kernel(tmp_path, DEPS)
    bb = tmp_path / "busybox"
    bb.write_bytes(b"\x7fELF static busybox")
    files = initramfs.read_cpio(gzip.decompress(initramfs.build(k, str(bb))))
    assert files["bin/busybox"][1] == bb.read_bytes()
    assert stat.S_ISCHR(files["dev/console"][0])
    init = files["init"][1].decode()
    assert files["init"][0] & 0o111
    assert "for m in virtio_ring.ko virtio_pci.ko 9pnet.ko 9pnet_virtio.ko netfs.ko 9p.ko;" \
        in init
    assert "switch_root /newroot" in init and "mount_tag" not in init
    for m in ("virtio_ring.ko", "9p.ko"):
        assert f"modules/{m}" in files
    # Same inputs, same bytes: the cache key stays honest.
    assert initramfs.build(k, str(bb)) == initramfs.build(k, str(bb))


def test_static_elf_probe():
    if os.path.exists(host.BUSYBOX) and "static" in os.popen(f"file -b {host.BUSYBOX} "
                                                             "2>/dev/null").read():
        assert host.is_static_elf(host.BUSYBOX)
    assert not host.is_static_elf(os.path.realpath(sys.executable))
    assert not host.is_static_elf("/nonexistent")


# ------------------------------------------------------------------ host requirements

def test_missing_tools_name_their_packages(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(host.shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(host.os, "geteuid", lambda: 1000)
    with pytest.raises(lab.LabUnavailableError) as ei:
        host.check(prepare=True, boot=True, nvmeof=True)
    msg = str(ei.value)
    assert "\n" not in msg
    for needle in ("qemu-system-x86_64", "apt-get install --no-install-recommends "
                   "qemu-system-x86", "kmod", "nvme-cli", "root"):
        assert needle in msg
    names = [m[0] for m in ei.value.missing]
    assert "root" in names and "qemu-system-x86_64" in names
    # pickles with what was missing (errors cross process boundaries)
    again = pickle.loads(pickle.dumps(ei.value))
    assert again.missing == ei.value.missing and str(again) == msg


# -------------------------------------------------------------------------- stage 2

def _runs(steps):
    return [s[1] for s in steps if s[0] == "run"]


def test_rxe_plan_two_devices_on_one_veth_pair():
    steps, devs = stage2.rxe_plan(2)
    assert [(d["name"], d["netdev"], d["addr"]) for d in devs] == [
        ("rxe0", "veth0", "10.99.0.1"), ("rxe1", "veth1", "10.99.0.2")]
    runs = _runs(steps)
    assert runs[0] == ["ip", "link", "add", "veth0", "type", "veth", "peer", "name", "veth1"]
    assert runs[-2:] == [["rdma", "link", "add", "rxe0", "type", "rxe", "netdev", "veth0"],
                         ["rdma", "link", "add", "rxe1", "type", "rxe", "netdev", "veth1"]]
    # local rule moved below the per-pair rules, which route each way out of the sender
    assert runs.index(["ip", "rule", "add", "pref", "100", "lookup", "local"]) < \
        runs.index(["ip", "rule", "del", "pref", "0", "lookup", "local"])
    rules = [r for r in runs if r[:3] == ["ip", "rule", "add"] and "from" in r]
    assert len(rules) == 2
    assert ["ip", "route", "add", "10.99.0.2", "dev", "veth0", "src", "10.99.0.1", "table",
            "100"] in runs
    sysctls = {s[1]: s[2] for s in steps if s[0] == "sysctl"}
    assert sysctls["net/ipv4/conf/veth1/accept_local"] == "1"
    assert sysctls["net/ipv4/conf/all/rp_filter"] == "0"
    # every sysctl for a veth comes after the command that creates it
    first_sysctl = next(i for i, s in enumerate(steps) if s[0] == "sysctl")
    assert steps[0][0] == "run" and first_sysctl > 0


def test_rxe_plan_one_and_many():
    steps, devs = stage2.rxe_plan(1)
    assert len(devs) == 1 and not any("rule" in r for r in _runs(steps))
    steps, devs = stage2.rxe_plan(3)
    runs = _runs(steps)
    assert ["ip", "link", "add", "mtebr0", "type", "bridge"] in runs
    assert sum(r[:3] == ["ip", "rule", "add"] and "from" in r for r in runs) == 6
    assert stage2.rxe_plan(0) == ([], [])


def test_nvmeof_plan_sets_buffered_io_before_enable():
    ops = stage2.nvmeof_plan("/run/x.img", 1 << 20)
    paths = [p for _, p, _ in ops]
    ns = f"/sys/kernel/config/nvmet/subsystems/{stage2.NQN}/namespaces/1"
    assert paths.index(f"{ns}/buffered_io") < paths.index(f"{ns}/enable")
    assert ("write", "/sys/kernel/config/nvmet/ports/1/addr_traddr", "127.0.0.1") in ops
    assert ops[-1][0] == "symlink"


# ---------------------------------------------------------------------------- guest

def _console(chunks):
    out = io.BytesIO()
    c = guest._Console(out)
    for ch in chunks:
        c.feed(ch)
    c.close()
    return out.getvalue(), c


def test_console_streams_only_the_command_output():
    stream = (b"[ 1.0] booting\nmooncake-lab: stage2\n" + stage2.BEGIN + b"line 1\npartial"
              + stage2.END + b"\n[ 9.0] reboot: Power down\n")
    for size in (1, 3, 7, len(stream)):       # markers split across reads
        out, c = _console([stream[i:i + size] for i in range(0, len(stream), size)])
        assert out == b"line 1\npartial"
        assert "[ 1.0] booting" in c.tail and "[ 9.0] reboot: Power down" in c.tail
        assert c.state == "after"


def test_console_keeps_near_markers_that_are_not_markers():
    out, _ = _console([stage2.BEGIN, b"@@mooncake-lab:e", b"nd-ish@@ no\n", stage2.END])
    assert out == b"@@mooncake-lab:end-ish@@ no\n"


def test_failure_line_names_a_panic():
    c = guest._Console(io.BytesIO())
    c.feed(b"[ 2.0] Kernel panic - not syncing: Attempted to kill init!\n")
    assert guest._failure(c, "x")[0].startswith("the guest kernel panicked: [ 2.0] Kernel panic")
    c = guest._Console(io.BytesIO())
    c.feed(initramfs.INIT_FAIL.encode() + b" insmod 9p.ko failed\n")
    assert guest._failure(c, "x")[0] == "the guest could not start: insmod 9p.ko failed"


def test_qemu_argv(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKE_LAB_CACHE", str(tmp_path))
    k = kernel.Kernel("p", "1", "6.1.0-99-amd64", tmp_path / "root")
    argv = guest.qemu_argv(k, tmp_path / "i.img", tmp_path / "runs" / "r1", python="/usr/bin/python3")
    s = " ".join(argv)
    assert argv[0] == "qemu-system-x86_64"
    assert "-accel tcg -cpu max" in s and "-no-reboot" in s and "-nic none" in s
    assert "path=/,mount_tag=hostroot,security_model=passthrough" in s
    assert f"mte.run={tmp_path}/runs/r1" in s and "mte.python=/usr/bin/python3" in s
    assert "-accel kvm -cpu host" in " ".join(guest.qemu_argv(
        k, tmp_path / "i.img", tmp_path / "r", accel="kvm", python="/usr/bin/python3"))
    with pytest.raises(lab.LabError, match="spaces"):
        guest.qemu_argv(k, tmp_path / "i.img", tmp_path / "a b", python="/usr/bin/python3")


def test_kvm_only_after_a_probe_saw_it_boot(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKE_LAB_CACHE", str(tmp_path))
    assert guest.choose_accel("auto") == "tcg"
    (tmp_path / "kvm-probe.json").write_text(
        '{"works": true, "host": "%s"}' % os.uname().release)
    assert guest.choose_accel("auto") == "kvm"
    (tmp_path / "kvm-probe.json").write_text('{"works": true, "host": "another-kernel"}')
    assert guest.choose_accel("auto") == "tcg"
    assert guest.choose_accel("tcg") == "tcg"


def test_run_refuses_a_command_that_does_not_exist(monkeypatch):
    monkeypatch.setattr(host, "check", lambda **kw: None)
    with pytest.raises(lab.LabError, match="command not found: no-such-cmd-xyz"):
        lab.run(["no-such-cmd-xyz"])
    with pytest.raises(lab.LabError, match="not executable: ./no/such/x"):
        lab.run(["./no/such/x"])
    with pytest.raises(lab.LabError, match="--rxe 99"):
        lab.run(["true"], rxe=99)


# ------------------------------------------------------------------------ CLI

def test_cli_run_without_command(capsys):
    assert main(["lab", "run"]) == 2
    assert "no command" in capsys.readouterr().err


def test_cli_lab_without_step_prints_help(capsys):
    assert main(["lab"]) == 2
    assert "prepare" in capsys.readouterr().out


def test_cli_errors_are_one_line_and_nonzero(monkeypatch, capsys):
    def unavailable(*a, **k):
        raise lab.LabUnavailableError("this host lacks qemu-system-x86_64. qemu-system-x86_64 "
                                      "(runs the guest): apt-get install qemu-system-x86")
    monkeypatch.setattr(guest, "run", unavailable)
    assert main(["lab", "run", "--", "true"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mooncake-te lab: this host lacks qemu") and err.count("\n") == 1

    def hung(*a, **k):
        raise lab.GuestTimeoutError("the guest did not finish within 3 s; killed it")
    monkeypatch.setattr(guest, "run", hung)
    assert main(["lab", "run", "--", "true"]) == 124

# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te lab``: real RDMA verbs devices and a real NVMe-oF target in a guest.

``prepare`` fetches and caches the guest kernel, ``run`` boots the guest and runs a
command there, ``selftest`` proves the lab works. See docs/fabric-lab.md.
"""
from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "lab", help="RDMA (Soft-RoCE) and NVMe-oF in a qemu guest, for machines without the "
                   "hardware",
        description="A guest kernel under qemu gives real RDMA verbs devices (Soft-RoCE on "
                    "veth pairs) and a real NVMe-oF target on any x86-64 Linux host, "
                    "running this host's own Python and files. Software emulation: for "
                    "correctness, not for speed. Needs root and the Debian packages "
                    "qemu-system-x86, busybox-static, kmod, iproute2 (and rdma-core, "
                    "ibverbs-utils, perftest, nvme-cli for the tools inside).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="cache: $MOONCAKE_LAB_CACHE, else ~/.cache/mooncake-te/lab")
    sub = p.add_subparsers(dest="lab_command", metavar="<step>")

    pp = sub.add_parser("prepare", help="fetch the guest kernel and build the initramfs",
                        description="Download the kernel package linux-image-amd64 depends "
                                    "on (apt-get download), unpack it, index its modules "
                                    "and build the initramfs, into the cache.")
    pp.add_argument("--offline", action="store_true",
                    help="use a cached kernel without asking apt for a newer one")
    pp.add_argument("--probe-kvm", action="store_true",
                    help="also boot once under KVM (short timeout) and use it from then on "
                         "if the guest really boots")

    pr = sub.add_parser("run", help="boot the guest and run a command in it",
                        description="Boot the guest, make N Soft-RoCE devices (rxe0... on "
                                    "veth ends 10.99.0.1...) and optionally an NVMe-oF "
                                    "namespace, run CMD in this folder with this "
                                    "environment, stream its output, power off, and exit "
                                    "with CMD's exit status. The command sees "
                                    "MOONCAKE_LAB=1, MOONCAKE_LAB_RXE and "
                                    "MOONCAKE_LAB_NVMEOF (JSON).")
    pr.add_argument("--rxe", type=int, default=2, metavar="N",
                    help="Soft-RoCE devices to make (default 2; 0 for none)")
    pr.add_argument("--nvmeof", action="store_true",
                    help="make a file-backed NVMe-oF target on 127.0.0.1:4420 (tcp) and "
                         "connect to it")
    pr.add_argument("--nvmeof-size", type=int, default=64, metavar="MiB",
                    help="size of the NVMe-oF namespace (default 64 MiB, in guest memory)")
    _common(pr)
    pr.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                    help="the command to run in the guest, after --")

    ps = sub.add_parser("selftest", help="prove the lab: verbs devices, ib_write_bw, NVMe-oF",
                        description="Prepare, boot once and check: ibv_devinfo shows rxe0 "
                                    "and rxe1 ACTIVE, ib_write_bw moves data from rxe1 to "
                                    "rxe0, an NVMe-oF namespace survives a write/read "
                                    "compare. Prints timings.")
    _common(ps)
    p.set_defaults(func=run, _parser=p)


def _common(p):
    p.add_argument("--timeout", type=float, default=600, metavar="S",
                   help="kill the guest after S seconds (default 600)")
    p.add_argument("--accel", choices=("auto", "tcg", "kvm"), default="auto",
                   help="auto: software emulation unless a KVM probe saw a boot "
                        "(prepare --probe-kvm)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show the guest's console as it boots")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    from mooncake_te.lab import LabError, errors
    from mooncake_te.lab import cache as _prepare, guest, selftest
    step = getattr(args, "lab_command", None)
    try:
        if step == "prepare":
            p = _prepare.prepare(refresh=not args.offline, log=_log)
            _log(f"lab ready: kernel {p.kernel.release} ({p.kernel.package} "
                 f"{p.kernel.version}), initramfs {p.initramfs} "
                 f"({'downloaded' if p.downloaded else 'cached'}, {p.seconds:.1f} s)")
            if args.probe_kvm:
                works = guest.probe_kvm()
                _log(f"kvm: {'boots: using it' if works else 'does not boot here: software emulation'}")
            return 0
        if step == "run":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                _log("mooncake-te lab run: no command (mooncake-te lab run -- CMD ...)")
                return 2
            r = guest.run(cmd, rxe=args.rxe, nvmeof=args.nvmeof,
                          nvmeof_size=args.nvmeof_size << 20, timeout=args.timeout,
                          accel=args.accel, log=_log,
                          echo=sys.stderr if args.verbose else None)
            if args.verbose:
                _log(f"lab: exit {r.returncode}; boot+setup {r.boot_s:.1f} s, "
                     f"total {r.wall_s:.1f} s")
            return r.returncode
        if step == "selftest":
            return selftest.selftest(timeout=args.timeout, accel=args.accel, log=_log,
                                     verbose=args.verbose)
    except errors.GuestTimeoutError as e:
        _log(f"mooncake-te lab: {e}")
        return 124
    except LabError as e:
        _log(f"mooncake-te lab: {e}")
        return 1
    args._parser.print_help()
    return 2

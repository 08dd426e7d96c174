# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te nvmeof``: make NVMe-oF targets and connect hosts to them.

``target create|delete|list`` runs on the machine that owns the drives (the kernel's
nvmet, through configfs); ``connect|disconnect|list`` on the machines that use them.
See docs/nvmeof.md.
"""
from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "nvmeof", help="make NVMe-oF targets and connect to them",
        description="NVMe over Fabrics through the kernel: export block devices or files "
                    "as a subsystem (target create), connect other machines to it "
                    "(connect), then publish the namespace to engines with "
                    "TransferEngine.register_storage. Needs root; the target needs the "
                    "nvmet and nvmet-tcp (or nvmet-rdma) modules, the hosts nvme-tcp (or "
                    "nvme-rdma).",
        epilog="see docs/nvmeof.md for a walk-through")
    sub = p.add_subparsers(dest="nvmeof_command", metavar="<command>")

    pt = sub.add_parser("target", help="create, delete or list targets on this machine",
                        description="Subsystems of this machine's nvmet target (configfs "
                                    "/sys/kernel/config/nvmet).")
    tsub = pt.add_subparsers(dest="target_command", metavar="<step>")
    tc = tsub.add_parser("create", help="export devices or files as a subsystem",
                         description="Create subsystem NQN with one namespace per PATH "
                                     "(nsid 1, 2, ...; block devices or regular files) on "
                                     "a tcp or rdma port.")
    tc.add_argument("nqn", help="subsystem NQN, e.g. nqn.2026-12.io.example:pool0")
    tc.add_argument("paths", nargs="+", metavar="PATH", help="block device or file")
    _where(tc, address_default="127.0.0.1")
    tc.add_argument("--host", action="append", default=None, metavar="HOSTNQN",
                    help="allow only this host NQN (repeat for more; default: any host)")
    tc.add_argument("--buffered-io", choices=("auto", "on", "off"), default="auto",
                    help="serve files through the page cache (auto: only where the file "
                         "system has no O_DIRECT, such as tmpfs)")
    tc.add_argument("--json", action="store_true", help="print the target as JSON")
    td = tsub.add_parser("delete", help="remove a subsystem (hosts lose it)",
                         description="Remove subsystem NQN: unlink it from its ports, "
                                     "disable and remove its namespaces, and remove ports "
                                     "and host entries nothing else uses.")
    td.add_argument("nqn", help="NVMe qualified name of the subsystem to delete")
    tl = tsub.add_parser("list", help="list this machine's subsystems")
    tl.add_argument("--json", action="store_true", help="print JSON")
    pt.set_defaults(_parser=pt)

    pc = sub.add_parser("connect", help="connect this host to a subsystem",
                        description="Connect to subsystem NQN at ADDRESS:SERVICE_ID and wait "
                                    "for its namespaces' block devices.")
    pc.add_argument("nqn", help="NVMe qualified name of the subsystem to connect to")
    _where(pc, address_default=None)
    pc.add_argument("--hostnqn", default=None, help="our host NQN (default /etc/nvme/hostnqn, "
                                                    "else the kernel's)")
    pc.add_argument("--ctrl-loss-tmo", type=int, default=None, metavar="S",
                    help="seconds to keep reconnecting after losing the target before I/O "
                         "fails (default 10; -1 forever)")
    pc.add_argument("--json", action="store_true", help="print the connection as JSON")
    pd = sub.add_parser("disconnect", help="disconnect this host from a subsystem")
    pd.add_argument("nqn", help="NVMe qualified name of the subsystem to disconnect")
    pl = sub.add_parser("list", help="list the subsystems this host is connected to")
    pl.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run, _parser=p)


def _where(p, address_default) -> None:
    p.add_argument("--transport", "-t", choices=("tcp", "rdma"), default="tcp",
                   help="fabric transport (default tcp)")
    p.add_argument("--address", "-a", default=address_default, required=address_default is None,
                   help="IP address of the target's port"
                        + (f" (default {address_default})" if address_default else ""))
    p.add_argument("--service-id", "-s", default="4420",
                   help="port number (default 4420)")


def run(args) -> int:
    from .. import nvmeof_admin as nvmeof
    from ..errors import MooncakeError
    cmd = args.nvmeof_command
    if cmd is None or (cmd == "target" and args.target_command is None):
        (args._parser if cmd is None else _sub(args._parser, "target")).print_help()
        return 2
    try:
        if cmd == "target":
            return _target(args, nvmeof)
        if cmd == "connect":
            kw = {} if args.ctrl_loss_tmo is None else {"ctrl_loss_tmo": args.ctrl_loss_tmo}
            conn = nvmeof.connect(args.nqn, args.address, args.service_id, args.transport,
                                  hostnqn=args.hostnqn, **kw)
            _print(args, conn.to_json(), f"connected {conn.nqn}: {', '.join(conn.devices)}")
        elif cmd == "disconnect":
            n = nvmeof.disconnect(args.nqn)
            print(f"disconnected {args.nqn} ({n} controller{'s' if n != 1 else ''})")
        elif cmd == "list":
            conns = nvmeof.list_connections()
            if args.json:
                print(json.dumps([c.to_json() for c in conns], indent=2))
            elif not conns:
                print("not connected to any NVMe-oF subsystem")
            for c in conns if not args.json else ():
                print(f"{c.nqn}  {' '.join(c.devices) or '(no namespaces)'}")
                for k in c.controllers:
                    print(f"  {k.name} {k.transport} {k.address} {k.state}")
    except MooncakeError as e:
        print(f"mooncake-te nvmeof: error: {e}", file=sys.stderr)
        return 1
    return 0


def _target(args, nvmeof) -> int:
    step = args.target_command
    if step == "create":
        buffered = {"auto": None, "on": True, "off": False}[args.buffered_io]
        t = nvmeof.create_target(args.nqn, args.paths, args.transport, args.address,
                                 args.service_id, hosts=args.host, buffered_io=buffered)
        _print(args, t.to_json(), _describe(t))
    elif step == "delete":
        nvmeof.delete_target(args.nqn)
        print(f"deleted {args.nqn}")
    elif step == "list":
        targets = nvmeof.list_targets()
        if args.json:
            print(json.dumps([t.to_json() for t in targets], indent=2))
        elif not targets:
            print("no NVMe-oF subsystems on this machine")
        else:
            print("\n".join(_describe(t) for t in targets))
    return 0


def _describe(t) -> str:
    lines = [f"{t.nqn}  hosts: {'any' if t.allow_any_host else ', '.join(t.hosts)}"]
    for n in t.namespaces:
        lines.append(f"  namespace {n.nsid}: {n.path} ({n.size} bytes"
                     f"{', buffered' if n.buffered_io else ''}"
                     f"{'' if n.enabled else ', disabled'})")
    for p in t.ports:
        lines.append(f"  port {p.id}: {p.transport} {p.address}:{p.service_id}")
    return "\n".join(lines)


def _print(args, obj, text: str) -> None:
    print(json.dumps(obj, indent=2) if args.json else text)


def _sub(parser, name):
    for a in parser._subparsers._group_actions:
        if name in getattr(a, "choices", {}):
            return a.choices[name]
    return parser

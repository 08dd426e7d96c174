# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te doctor``: check a deployment before the first request.

Exit status: 0 all checks passed, 1 warnings only, 2 at least one error.
"""
from __future__ import annotations

import json
import os
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="check config, devices, metadata server, cache and vLLM settings",
        description="Run every check and print problems with fixes (codes are explained "
                    "in docs/troubleshooting.md). Exit status 0: fine, 1: warnings, "
                    "2: errors.")
    p.add_argument("--config", metavar="FILE",
                   help="config.toml to check (default: the vLLM config's "
                        "kv_connector_extra_config.mooncake_config_path, if any)")
    p.add_argument("--vllm-config", metavar="FILE",
                   help="vLLM config (JSON/YAML engine args, or a kv_transfer_config JSON)")
    p.add_argument("--metadata", metavar="URL",
                   help="metadata server to check instead of [metadata], as passed to "
                        "TransferEngine(metadata=...): etcd://h:2379, redis://h:6379, "
                        "http://h:8080/metadata")
    p.add_argument("--role", choices=("prefill", "decode"),
                   help="this instance's disaggregation role, checked against kv_role")
    p.add_argument("--sysfs-root", default="/sys", metavar="DIR",
                   help="sysfs tree to read (default: /sys)")
    p.add_argument("--proc-root", default="/proc", metavar="DIR",
                   help="procfs tree for driver versions (default: /proc)")
    p.add_argument("--timeout", type=float, default=1.5, metavar="SECONDS",
                   help="budget for each network probe (default: 1.5)")
    p.add_argument("--check", action="append", metavar="NAME",
                   help="run only this check (repeatable); names: config, custom_topology, "
                        "rdma_devices, gpu_nic_affinity, gpudirect, metadata, cache_dir, "
                        "memlock, vllm_config, block_size, kv_role, vllm_connector")
    p.add_argument("-v", "--verbose", action="store_true", help="also list passes and skips")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..doctor import CHECKS, Context, exit_code, report, run_checks
    from ..doctor import checks as _registered  # noqa: F401  (fills CHECKS)
    names = [c.name for c in CHECKS]
    for name in args.check or ():
        if name not in names:              # a usage error, before any probe runs
            import difflib
            close = difflib.get_close_matches(name, names, n=1)
            print(f"mooncake-te doctor: error: argument --check: no check named {name!r}"
                  + (f"; did you mean {close[0]!r}?" if close else "")
                  + f" (choose from {', '.join(names)})", file=sys.stderr)
            return 2
    config = args.config
    if config is None and args.vllm_config:
        # The file vLLM's connector will load: check that one.
        from ..doctor.vllm import load_vllm_config
        from ..errors import ConfigError
        try:
            config = load_vllm_config(args.vllm_config).mooncake_config_path
        except ConfigError:
            pass                     # reported by the vllm_config check
    ctx = Context(config_path=config, vllm_config_path=args.vllm_config,
                  sysfs_root=args.sysfs_root, proc_root=args.proc_root,
                  env=dict(os.environ), role=args.role, timeout_s=args.timeout,
                  metadata=args.metadata)
    findings = run_checks(ctx, only=args.check)
    code = exit_code(findings)
    if args.json:
        print(json.dumps({"exit_code": code,
                          "summary": {s: sum(str(f.severity) == s for f in findings)
                                      for s in ("error", "warning", "ok", "skip")},
                          "findings": [f.to_dict() for f in findings]}, indent=2,
                         default=str))
    else:
        print(report(findings, verbose=args.verbose))
    sys.stdout.flush()
    return code

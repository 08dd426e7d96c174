# SPDX-License-Identifier: Apache-2.0
"""The doctor's vocabulary: findings, severities, the context checks read, the registry.

A check is a function ``check(ctx) -> iterable of Finding`` registered with
:func:`check`. It yields one finding per problem; a check that yields nothing passed,
and the runner records that as an ``ok`` finding under the check's first code, so the
report shows what was looked at as well as what is wrong.
"""
from __future__ import annotations

import enum
import functools
import os
import resource
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Mapping


class Severity(str, enum.Enum):
    OK = "ok"
    SKIP = "skip"           # not applicable here (says why)
    WARNING = "warning"     # works, but slower or fragile than it should be
    ERROR = "error"         # the engine will fail or misbehave

    def __str__(self) -> str:
        return self.value


@dataclass
class Finding:
    """One result: a stable ``code`` (documented in docs/troubleshooting.md), a
    severity, a message with the values involved and the ``fix``."""

    code: str
    severity: Severity
    message: str
    fix: str = ""
    check: str = ""
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["severity"] = str(self.severity)
        return d


def error(code: str, message: str, fix: str = "", **data) -> Finding:
    return Finding(code, Severity.ERROR, message, fix, data=data)


def warning(code: str, message: str, fix: str = "", **data) -> Finding:
    return Finding(code, Severity.WARNING, message, fix, data=data)


def skip(code: str, message: str) -> Finding:
    return Finding(code, Severity.SKIP, message)


def ok(code: str, message: str, **data) -> Finding:
    return Finding(code, Severity.OK, message, data=data)


@dataclass
class Check:
    name: str
    title: str
    codes: tuple
    func: Callable


CHECKS: list[Check] = []


def check(name: str, title: str, codes: tuple):
    """Register a check. ``codes`` lists every code it may emit; the first is used for
    the ``ok`` finding when it emits nothing."""
    def deco(func):
        CHECKS.append(Check(name, title, tuple(codes), func))
        return func
    return deco


def _cap_ipc_lock() -> bool:
    """Whether this process holds CAP_IPC_LOCK (bit 14, include/uapi/linux/capability.h),
    which lifts RLIMIT_MEMLOCK for mlock() and for RDMA registration (ib_umem_get)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << 14))
    except (OSError, ValueError):
        pass
    return False


@dataclass
class Context:
    """What the checks look at. Everything read from the machine goes through here, so a
    test can point the doctor at a fake sysfs/proc tree.

    Parameters
    ----------
    config_path, vllm_config_path : str, optional
    sysfs_root, proc_root : str
        Trees to read (``/sys`` and ``/proc`` on a live system).
    env : mapping
        Environment for ``MC_*`` variables.
    role : str, optional
        ``"prefill"`` or ``"decode"``: this instance's disaggregation role.
    timeout_s : float
        Budget for each network probe.
    metadata : str, optional
        A metadata connection string (``etcd://h:2379``, ``redis://h:6379``,
        ``http://h:8080/metadata``, ``p2p``) overriding ``[metadata]``, as the engine's
        ``metadata=`` argument does.
    """

    config_path: "str | None" = None
    vllm_config_path: "str | None" = None
    sysfs_root: str = "/sys"
    proc_root: str = "/proc"
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    role: "str | None" = None
    timeout_s: float = 1.5
    metadata: "str | None" = None

    @functools.cached_property
    def config_and_problems(self):
        from ..config import Config, split_metadata_url
        cfg, problems = Config.load_lenient(self.config_path, env=self.env)
        if self.metadata:
            # As TransferEngine(metadata=...): the argument wins over file and MC_*.
            kind, addr = split_metadata_url(self.metadata)
            cfg.data["metadata"]["server_type"] = kind
            cfg.data["metadata"]["server_address"] = addr
        return cfg, problems

    @property
    def config(self):
        return self.config_and_problems[0]

    @property
    def config_problems(self):
        return self.config_and_problems[1]

    @functools.cached_property
    def topology(self):
        from ..topology import discover
        return discover(self.sysfs_root)

    @functools.cached_property
    def vllm(self):
        from .vllm import load_vllm_config
        return load_vllm_config(self.vllm_config_path) if self.vllm_config_path else None

    @functools.cached_property
    def memlock(self) -> tuple[int, bool]:
        """(soft RLIMIT_MEMLOCK in bytes or RLIM_INFINITY, has CAP_IPC_LOCK)."""
        return resource.getrlimit(resource.RLIMIT_MEMLOCK)[0], _cap_ipc_lock()

    def read_proc(self, *parts: str) -> "str | None":
        try:
            with open(os.path.join(self.proc_root, *parts)) as f:
                return f.read()
        except OSError:
            return None


def exit_code(findings: Iterable[Finding]) -> int:
    """0 all good, 1 warnings only, 2 any error."""
    sev = {f.severity for f in findings}
    if Severity.ERROR in sev:
        return 2
    if Severity.WARNING in sev:
        return 1
    return 0


GiB = 1 << 30

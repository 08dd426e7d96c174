# SPDX-License-Identifier: Apache-2.0
"""NVMe-oF targets, straight through the kernel's nvmet configfs tree.

Layout (kernel ``drivers/nvme/target/configfs.c``; ``Documentation/nvme/`` has no
separate page for it, the file is the reference)::

    /sys/kernel/config/nvmet/
      hosts/<host nqn>/
      subsystems/<nqn>/attr_allow_any_host
                      /allowed_hosts/<host nqn> -> ../../../hosts/<host nqn>
                      /namespaces/<nsid>/{device_path, buffered_io, enable}
      ports/<id>/{addr_trtype, addr_adrfam, addr_traddr, addr_trsvcid}
                /subsystems/<nqn> -> ../../../subsystems/<nqn>

A subsystem is exported once a port links it; a namespace serves I/O once enabled.
Deleting goes the other way round: unlink from ports (the kernel drops the hosts'
controllers), disable and remove namespaces, unlink allowed hosts, remove the
subsystem, then ports and host entries nothing else uses.
"""
from __future__ import annotations

import errno as _errno
import ipaddress
import os
import shutil
import stat
import subprocess
from dataclasses import asdict, dataclass, field

from ..errors import (DeviceNotFoundError, InvalidArgumentError, MooncakeError,
                      TransportUnavailableError)
from ..topology.sysfs import read_attr

CONFIGFS = "/sys/kernel/config"
NVMET = CONFIGFS + "/nvmet"
TRANSPORTS = ("tcp", "rdma")
DEFAULT_SERVICE_ID = 4420        # IANA port for NVMe-oF (NVMe over Fabrics spec, 7.4.9)


class TargetError(MooncakeError):
    """A configfs operation on the nvmet tree failed."""


@dataclass
class Namespace:
    nsid: int
    path: str
    enabled: bool
    buffered_io: bool
    size: int          # bytes of the backing file or device, 0 if it cannot be read


@dataclass
class Port:
    id: int
    transport: str
    address: str
    service_id: str
    adrfam: str = "ipv4"


@dataclass
class Target:
    """One subsystem as configfs shows it."""
    nqn: str
    namespaces: list = field(default_factory=list)     # list[Namespace]
    ports: list = field(default_factory=list)          # list[Port]
    allow_any_host: bool = True
    hosts: list = field(default_factory=list)          # allowed host NQNs

    def to_json(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- checks

def check_nqn(nqn, what: str = "nqn") -> str:
    """An NVMe Qualified Name: ``nqn.<yyyy-mm>.<reverse domain>:<anything>``, at most 223
    bytes (NVMe base spec 4.5 "NVMe Qualified Names"); no '/' (it is a folder name)."""
    if not isinstance(nqn, str) or not nqn:
        raise InvalidArgumentError(f"{what} must be a non-empty str, got {nqn!r}")
    if not nqn.startswith("nqn.") or "/" in nqn or len(nqn.encode()) > 223 or \
            any(c.isspace() for c in nqn):
        raise InvalidArgumentError(
            f"{what} {nqn!r} is not an NVMe Qualified Name: use 'nqn.<yyyy-mm>.<reverse "
            f"domain>:<name>' (e.g. 'nqn.2026-12.io.example:pool0'), at most 223 bytes, "
            f"no '/' or spaces")
    return nqn


def check_transport(transport) -> str:
    if transport not in TRANSPORTS:
        raise InvalidArgumentError(f"transport must be one of {', '.join(TRANSPORTS)}, "
                                   f"got {transport!r}")
    return transport


def check_address(address) -> tuple[str, str]:
    """(address, address family) of an IPv4 or IPv6 literal."""
    try:
        ip = ipaddress.ip_address(str(address).strip("[]"))
    except ValueError:
        raise InvalidArgumentError(f"address must be an IPv4 or IPv6 address (not a host "
                                   f"name), got {address!r}") from None
    return str(ip), ("ipv4" if ip.version == 4 else "ipv6")


def check_service_id(service_id) -> str:
    try:
        port = int(service_id)
    except (TypeError, ValueError):
        port = -1
    if not 1 <= port <= 65535:
        raise InvalidArgumentError(f"service_id must be a port number 1..65535 (4420 is "
                                   f"NVMe-oF's), got {service_id!r}")
    return str(port)


def require_nvmet(transport: str | None = None) -> None:
    """Raise a clear error unless configfs and nvmet (and ``nvmet-<transport>``) are there."""
    if not os.path.isdir(CONFIGFS) or not os.path.ismount(CONFIGFS):
        raise TransportUnavailableError(
            f"configfs is not mounted at {CONFIGFS}: the nvmet target is configured through "
            f"it; as root: mount -t configfs none {CONFIGFS}, then modprobe nvmet nvmet-tcp")
    if not os.path.isdir(NVMET):
        raise TransportUnavailableError(
            f"kernel module nvmet is not loaded ({NVMET} is missing); as root: "
            f"modprobe nvmet nvmet-tcp (nvmet-rdma for rdma ports)")
    if transport is not None:
        require_module(f"nvmet_{transport}", f"nvmet-{transport}",
                       f"needed for {transport} ports of the target")


def require_module(name: str, modprobe_name: str, why: str) -> None:
    """Load ``name`` if it is missing and modprobe can; raise saying which one otherwise."""
    if os.path.isdir(f"/sys/module/{name}"):
        return
    if shutil.which("modprobe") and os.geteuid() == 0:
        subprocess.run(["modprobe", modprobe_name], capture_output=True, timeout=30)
        if os.path.isdir(f"/sys/module/{name}"):
            return
    raise TransportUnavailableError(f"kernel module {modprobe_name} is not loaded ({why}); "
                                    f"as root: modprobe {modprobe_name}")


# --------------------------------------------------------------------------- configfs io

def _read(path: str) -> str:
    return read_attr(path, "") or ""


def _fs(op: str, path: str, value=None) -> None:
    """One configfs change; an OSError becomes a TargetError naming the step."""
    try:
        if op == "mkdir":
            os.mkdir(path)
        elif op == "rmdir":
            os.rmdir(path)
        elif op == "write":
            with open(path, "w") as f:
                f.write(str(value))
        elif op == "symlink":
            os.symlink(value, path)
        elif op == "unlink":
            os.unlink(path)
    except OSError as e:
        hint = ""
        if e.errno in (_errno.EACCES, _errno.EPERM):
            hint = "; configuring nvmet needs root"
        elif op == "write" and path.endswith("/enable"):
            hint = (f"; the kernel could not open {value if value != '1' else 'the backing path'}"
                    f" (see dmesg): is it a block device or regular file, and not in use "
                    f"exclusively elsewhere?")
        elif op == "symlink" and "/ports/" in path and e.errno in (_errno.EINVAL,
                                                                   _errno.EADDRINUSE):
            hint = ("; the kernel could not listen on the port's address (see dmesg): is the "
                    "address assigned to a local interface and the service id free?")
        raise TargetError(f"nvmet configfs: {op} {path}"
                          f"{' = ' + repr(str(value)) if op == 'write' else ''} failed: "
                          f"{e.strerror}{hint}", errno=e.errno) from None


def backing_size(path: str) -> int:
    """Bytes of a regular file or block device (0 if it cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def supports_o_direct(path: str) -> bool:
    """Whether ``path`` can be opened with O_DIRECT (tmpfs and some FUSE file systems
    refuse it with EINVAL; nvmet's file backend then needs ``buffered_io``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == _errno.EINVAL:
            return False
        raise
    os.close(fd)
    return True


def check_backing(path, what: str = "namespace backing", hint: str = "") -> str:
    """``path`` made absolute, after checking it names an existing block device or
    regular file (``what`` and ``hint`` word the errors: a namespace's backing, a
    storage segment's path)."""
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"{what.split()[0]} path must be a non-empty str, got "
                                   f"{path!r}")
    path = os.path.abspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DeviceNotFoundError(f"{what} {path!r} does not exist{hint}") from None
    if not (stat.S_ISBLK(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise InvalidArgumentError(f"{what} {path!r} is neither a block device "
                                   f"nor a regular file")
    return path


def _check_backing(path) -> str:
    path = check_backing(path, hint=f"; give a block device or a file (e.g. truncate -s 1G "
                                    f"{path})")
    if stat.S_ISREG(os.stat(path).st_mode) and os.stat(path).st_size == 0:
        raise InvalidArgumentError(f"namespace backing file {path!r} is empty; give it a size "
                                   f"first (truncate -s 1G {path})")
    return path


# --------------------------------------------------------------------------- create / delete

def _find_port(transport: str, address: str, adrfam: str, service_id: str) -> str | None:
    for pid in os.listdir(f"{NVMET}/ports"):
        p = f"{NVMET}/ports/{pid}"
        if (_read(f"{p}/addr_trtype"), _read(f"{p}/addr_traddr"), _read(f"{p}/addr_adrfam"),
                _read(f"{p}/addr_trsvcid")) == (transport, address, adrfam, service_id):
            return pid
    return None


def create_target(nqn: str, paths, transport: str = "tcp", address: str = "127.0.0.1",
                  service_id=DEFAULT_SERVICE_ID, hosts=None, buffered_io=None) -> Target:
    """Export ``paths`` as the namespaces (nsid 1, 2, ...) of subsystem ``nqn`` on a port.

    Parameters
    ----------
    nqn : str
        The subsystem's NVMe Qualified Name (must not exist yet).
    paths : str or list of str
        Block devices or regular files backing the namespaces.
    transport : {"tcp", "rdma"}
    address, service_id
        Where hosts connect (an IP literal assigned to this machine; the port number).
        A port with the same transport, address and service id is shared.
    hosts : list of str, optional
        Host NQNs allowed to connect; None lets any host connect (``attr_allow_any_host``).
    buffered_io : bool, optional
        Serve files through the page cache. Default: only where the file system has no
        O_DIRECT (tmpfs), where nvmet's direct file I/O would fail to enable.

    Returns
    -------
    Target
    """
    check_nqn(nqn)
    check_transport(transport)
    address, adrfam = check_address(address)
    service_id = check_service_id(service_id)
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [_check_backing(os.fspath(p)) for p in paths]
    if not paths:
        raise InvalidArgumentError("give at least one namespace path (block device or file)")
    hosts = [check_nqn(h, "host nqn") for h in (hosts or [])]
    require_nvmet(transport)
    sub = f"{NVMET}/subsystems/{nqn}"
    if os.path.exists(sub):
        raise InvalidArgumentError(f"subsystem {nqn!r} exists already; delete it first "
                                   f"(mooncake-te nvmeof target delete {nqn}) or pick another NQN")
    try:
        _fs("mkdir", sub)
        _fs("write", f"{sub}/attr_allow_any_host", "0" if hosts else "1")
        for h in hosts:
            if not os.path.isdir(f"{NVMET}/hosts/{h}"):
                _fs("mkdir", f"{NVMET}/hosts/{h}")
            _fs("symlink", f"{sub}/allowed_hosts/{h}", f"{NVMET}/hosts/{h}")
        for nsid, path in enumerate(paths, 1):
            ns = f"{sub}/namespaces/{nsid}"
            _fs("mkdir", ns)
            _fs("write", f"{ns}/device_path", path)
            regular = stat.S_ISREG(os.stat(path).st_mode)
            buffered = buffered_io if buffered_io is not None else \
                (regular and not supports_o_direct(path))
            if buffered:
                _fs("write", f"{ns}/buffered_io", "1")
            _fs("write", f"{ns}/enable", "1")
        pid = _find_port(transport, address, adrfam, service_id)
        if pid is None:
            used = {int(p) for p in os.listdir(f"{NVMET}/ports") if p.isdigit()}
            pid = str(next(i for i in range(1, 65536) if i not in used))
            port = f"{NVMET}/ports/{pid}"
            _fs("mkdir", port)
            _fs("write", f"{port}/addr_trtype", transport)
            _fs("write", f"{port}/addr_adrfam", adrfam)
            _fs("write", f"{port}/addr_traddr", address)
            _fs("write", f"{port}/addr_trsvcid", service_id)
        _fs("symlink", f"{NVMET}/ports/{pid}/subsystems/{nqn}", sub)
    except BaseException:
        try:
            delete_target(nqn)
        except MooncakeError:
            pass
        raise
    return get_target(nqn)


def delete_target(nqn: str) -> None:
    """Remove subsystem ``nqn`` (hosts connected to it lose their controllers), and the
    ports and host entries that no other subsystem uses."""
    check_nqn(nqn)
    require_nvmet()
    sub = f"{NVMET}/subsystems/{nqn}"
    if not os.path.isdir(sub):
        raise DeviceNotFoundError(f"no nvmet subsystem {nqn!r}; existing: "
                                  f"{', '.join(_subsystems()) or 'none'}")
    for pid in os.listdir(f"{NVMET}/ports"):
        link = f"{NVMET}/ports/{pid}/subsystems/{nqn}"
        if os.path.islink(link):
            _fs("unlink", link)
            if not os.listdir(f"{NVMET}/ports/{pid}/subsystems") and \
                    not os.listdir(f"{NVMET}/ports/{pid}/referrals"):
                _fs("rmdir", f"{NVMET}/ports/{pid}")
    for nsid in os.listdir(f"{sub}/namespaces"):
        ns = f"{sub}/namespaces/{nsid}"
        if _read(f"{ns}/enable") == "1":
            _fs("write", f"{ns}/enable", "0")
        _fs("rmdir", ns)
    hosts = os.listdir(f"{sub}/allowed_hosts")
    for h in hosts:
        _fs("unlink", f"{sub}/allowed_hosts/{h}")
    _fs("rmdir", sub)
    for h in hosts:
        still = any(os.path.islink(f"{NVMET}/subsystems/{s}/allowed_hosts/{h}")
                    for s in _subsystems())
        if not still and os.path.isdir(f"{NVMET}/hosts/{h}"):
            _fs("rmdir", f"{NVMET}/hosts/{h}")


def _subsystems() -> list:
    try:
        return sorted(os.listdir(f"{NVMET}/subsystems"))
    except OSError:
        return []


def get_target(nqn: str) -> Target:
    sub = f"{NVMET}/subsystems/{nqn}"
    if not os.path.isdir(sub):
        raise DeviceNotFoundError(f"no nvmet subsystem {nqn!r}")
    t = Target(nqn=nqn, allow_any_host=_read(f"{sub}/attr_allow_any_host") == "1",
               hosts=sorted(os.listdir(f"{sub}/allowed_hosts")))
    for nsid in sorted(os.listdir(f"{sub}/namespaces"), key=int):
        ns = f"{sub}/namespaces/{nsid}"
        path = _read(f"{ns}/device_path")
        t.namespaces.append(Namespace(int(nsid), path, _read(f"{ns}/enable") == "1",
                                      _read(f"{ns}/buffered_io") == "1", backing_size(path)))
    for pid in sorted(os.listdir(f"{NVMET}/ports"), key=lambda p: (len(p), p)):
        port = f"{NVMET}/ports/{pid}"
        if os.path.islink(f"{port}/subsystems/{nqn}"):
            t.ports.append(Port(int(pid), _read(f"{port}/addr_trtype"),
                                _read(f"{port}/addr_traddr"), _read(f"{port}/addr_trsvcid"),
                                _read(f"{port}/addr_adrfam")))
    return t


def list_targets() -> list:
    """Every nvmet subsystem on this machine, as :class:`Target`."""
    require_nvmet()
    return [get_target(n) for n in _subsystems()]

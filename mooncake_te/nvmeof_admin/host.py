# SPDX-License-Identifier: Apache-2.0
"""The host side of NVMe-oF: connect to a target, find its namespaces, disconnect.

We write the connect options to ``/dev/nvme-fabrics`` ourselves rather than run
``nvme connect``: the kernel parses the same option string either way (nvme-cli builds
it and writes it there, ``drivers/nvme/host/fabrics.c``), but writing it directly needs
no nvme-cli on the host, gives the kernel's own errno, and the reply line
(``instance=N,cntlid=M``) names the controller we made, so nothing has to be guessed
from sysfs afterwards. Disconnect writes ``1`` to the controller's
``delete_controller``, which is what ``nvme disconnect`` does.

Namespaces are found in sysfs: ``/sys/class/nvme-subsystem/nvme-subsysN/subsysnqn``
names the subsystem; its block devices are ``nvme<N>n<nsid>`` in that folder with native
multipath (the hidden per-path ``nvmeXcYnZ`` devices are skipped,
``drivers/nvme/host/multipath.c``), or under each controller without it.
"""
from __future__ import annotations

import errno as _errno
import glob
import os
import re
import time
from dataclasses import asdict, dataclass, field

from ..errors import (DeviceNotFoundError, InvalidArgumentError, MooncakeError,
                      TransportUnavailableError)
from ..topology.sysfs import read_attr
from .target import (DEFAULT_SERVICE_ID, check_address, check_nqn, check_service_id,
                     check_transport, require_module)

FABRICS = "/dev/nvme-fabrics"
#: Default ``ctrl_loss_tmo`` of our connections, in seconds. The kernel's is 600: a
#: target that went away would hold every I/O for ten minutes. An engine would rather
#: fail the transfer; pass ``ctrl_loss_tmo=-1`` to reconnect forever.
CTRL_LOSS_TMO = 10
_NS = re.compile(r"nvme\d+n\d+")


class HostError(MooncakeError):
    """Connecting or disconnecting failed."""


@dataclass
class Controller:
    name: str            # "nvme1"
    nqn: str
    transport: str
    address: str         # "traddr=10.0.0.2,trsvcid=4420"
    state: str           # "live", "connecting", "resetting", "deleting", ...


@dataclass
class Connection:
    """A subsystem this host is connected to, with its namespaces' block devices."""
    nqn: str
    controllers: list = field(default_factory=list)     # list[Controller]
    devices: list = field(default_factory=list)         # ["/dev/nvme1n1", ...]

    @property
    def live(self) -> bool:
        return any(c.state == "live" for c in self.controllers)

    def to_json(self) -> dict:
        return asdict(self)


def _read(path: str) -> str:
    return read_attr(path, "") or ""


def _addr(text: str) -> dict:
    """``traddr=10.0.0.2,trsvcid=4420,src_addr=...`` -> dict."""
    return dict(kv.split("=", 1) for kv in text.split(",") if "=" in kv)


def _controllers(nqn: str | None = None) -> list:
    out = []
    for path in sorted(glob.glob("/sys/class/nvme/nvme*")):
        name = os.path.basename(path)
        sub = _read(f"{path}/subsysnqn")
        transport = _read(f"{path}/transport")
        if transport not in ("tcp", "rdma", "fc", "loop") or (nqn and sub != nqn):
            continue          # PCIe drives are not ours to list or disconnect
        out.append(Controller(name, sub, transport, _read(f"{path}/address"),
                              _read(f"{path}/state")))
    return out


def namespaces(nqn: str) -> list:
    """Block devices (``/dev/nvmeXnY``) of subsystem ``nqn`` on this host, by nsid."""
    found = set()
    for sub in glob.glob("/sys/class/nvme-subsystem/*"):
        if _read(f"{sub}/subsysnqn") != nqn:
            continue
        dirs = [sub] + [c for c in glob.glob(f"{sub}/nvme*") if re.fullmatch(
            r"nvme\d+", os.path.basename(c))]
        for d in dirs:
            for entry in os.listdir(d):
                if _NS.fullmatch(entry) and os.path.exists(f"/dev/{entry}"):
                    found.add(entry)
    return [f"/dev/{n}" for n in sorted(found, key=lambda n: int(n.rsplit("n", 1)[1]))]


def find_namespace(nqn: str, nsid: int = 1) -> str | None:
    """The block device of namespace ``nsid`` of subsystem ``nqn``, or None."""
    for dev in namespaces(nqn):
        try:
            if int(_read(f"/sys/block/{os.path.basename(dev)}/nsid") or
                   dev.rsplit("n", 1)[1]) == nsid:
                return dev
        except ValueError:
            continue
    return None


def list_connections() -> list:
    """Every fabrics subsystem this host is connected to, as :class:`Connection`."""
    by: dict = {}
    for c in _controllers():
        by.setdefault(c.nqn, Connection(c.nqn)).controllers.append(c)
    for conn in by.values():
        conn.devices = namespaces(conn.nqn)
    return list(by.values())


def host_nqn() -> str | None:
    """This host's NQN as nvme-cli keeps it (``/etc/nvme/hostnqn``), or None (then the
    kernel uses the one it generated at boot)."""
    return _read("/etc/nvme/hostnqn") or None


def connect(nqn: str, address: str, service_id=DEFAULT_SERVICE_ID, transport: str = "tcp",
            hostnqn: str | None = None, ctrl_loss_tmo: int = CTRL_LOSS_TMO,
            reconnect_delay: int = 2, timeout: float = 20.0) -> Connection:
    """Connect to subsystem ``nqn`` at ``address``:``service_id`` and wait until its
    namespaces' block devices exist.

    Parameters
    ----------
    nqn : str
        The subsystem NQN.
    address, service_id
        The target port (IP literal, port number).
    transport : {"tcp", "rdma"}
    hostnqn : str, optional
        Our identity, for targets with a host allow-list (default: ``/etc/nvme/hostnqn``,
        else the kernel's).
    ctrl_loss_tmo : int
        Seconds the kernel keeps reconnecting after losing the target before it fails
        I/O and removes the controller (-1: forever). Default 10 (the kernel's: 600).
    timeout : float
        Seconds to wait for the block devices.

    Returns
    -------
    Connection
        Already connected: the existing connection (nothing changes).
    """
    check_nqn(nqn)
    check_transport(transport)
    address, _ = check_address(address)
    service_id = check_service_id(service_id)
    if hostnqn is not None:
        check_nqn(hostnqn, "hostnqn")
    for what, v in (("ctrl_loss_tmo", ctrl_loss_tmo), ("reconnect_delay", reconnect_delay)):
        if not isinstance(v, int) or (v < 0 and not (what == "ctrl_loss_tmo" and v == -1)):
            raise InvalidArgumentError(f"{what} must be a non-negative int of seconds"
                                       f"{' or -1' if what == 'ctrl_loss_tmo' else ''}, got {v!r}")
    existing = [c for c in _controllers(nqn) if c.state != "deleting"]
    if any(_addr(c.address).get("traddr") == address and
           _addr(c.address).get("trsvcid") == service_id for c in existing):
        return _wait_devices(nqn, timeout)
    require_module(f"nvme_{transport}", f"nvme-{transport}",
                   f"the NVMe-oF host driver for {transport}")
    if not os.path.exists(FABRICS):
        raise TransportUnavailableError(f"{FABRICS} is missing: as root, modprobe nvme-fabrics "
                                        f"nvme-{transport}")
    opts = [f"transport={transport}", f"traddr={address}", f"trsvcid={service_id}",
            f"nqn={nqn}", f"ctrl_loss_tmo={ctrl_loss_tmo}",
            f"reconnect_delay={max(1, reconnect_delay)}"]
    hostnqn = hostnqn or host_nqn()
    if hostnqn:
        opts.append(f"hostnqn={hostnqn}")
    try:
        fd = os.open(FABRICS, os.O_RDWR)
    except PermissionError:
        raise HostError(f"cannot open {FABRICS}: connecting needs root") from None
    try:
        try:
            os.write(fd, ",".join(opts).encode())
        except OSError as e:
            raise HostError(_connect_hint(e, nqn, transport, address, service_id),
                            errno=e.errno) from None
        reply = os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)
    if not re.search(r"instance=\d+", reply):
        raise HostError(f"connected to {nqn} but the kernel answered {reply!r}; see dmesg")
    return _wait_devices(nqn, timeout)


def _connect_hint(e: OSError, nqn, transport, address, service_id) -> str:
    where = f"{transport} {address}:{service_id}"
    why = {
        _errno.ECONNREFUSED: "nothing listens there: is the target's port made "
                             "(mooncake-te nvmeof target list on the target) and reachable?",
        _errno.ETIMEDOUT: "no answer: check the address, routes and firewalls",
        _errno.EHOSTUNREACH: "no route to the target's address",
        _errno.EIO: f"the target refused the connection: is {nqn!r} exported on that port, "
                    f"and is this host allowed (its hostnqn in the target's allow-list)?",
        _errno.EINVAL: f"the kernel rejected the options (an unknown transport module, or a "
                       f"bad address): modprobe nvme-{transport}; see dmesg",
        _errno.EALREADY: "this host is already connected to that subsystem there",
    }.get(e.errno or 0, "see dmesg")
    return f"cannot connect to {nqn!r} over {where}: {e.strerror}; {why}"


def _wait_devices(nqn: str, timeout: float) -> Connection:
    # The kernel scans a new controller's namespaces asynchronously: the first block
    # device can appear well before the last one (seen in the lab's emulated guest). Sysfs
    # does not say how many are coming, so a connection is ready when its device list has
    # stayed the same for SETTLE seconds (bounded by the deadline).
    SETTLE = 0.5
    deadline = time.monotonic() + timeout
    seen, since = None, 0.0
    while True:
        conn = next((c for c in list_connections() if c.nqn == nqn), None)
        if conn is not None and conn.live and conn.devices:
            now = time.monotonic()
            if conn.devices != seen:
                seen, since = list(conn.devices), now
            elif now - since >= SETTLE or now > deadline:
                return conn
            appearing = True          # devices listed: settle, then return (never raise)
        else:
            appearing = False
        if time.monotonic() > deadline and not appearing:
            state = ", ".join(f"{c.name} {c.state}" for c in conn.controllers) if conn else \
                "no controller"
            raise HostError(f"connected to {nqn!r}, but no namespace block device appeared "
                            f"within {timeout:.0f} s ({state}); does the subsystem have "
                            f"enabled namespaces?")
        time.sleep(0.05)


def disconnect(nqn: str, timeout: float = 10.0) -> int:
    """Delete every controller of subsystem ``nqn``; returns how many there were."""
    check_nqn(nqn)
    ctrls = _controllers(nqn)
    if not ctrls:
        known = ", ".join(c.nqn for c in list_connections()) or "none"
        raise DeviceNotFoundError(f"this host is not connected to {nqn!r}; connected: {known}")
    for c in ctrls:
        try:
            with open(f"/sys/class/nvme/{c.name}/delete_controller", "w") as f:
                f.write("1")
        except FileNotFoundError:
            continue         # went away meanwhile (ctrl_loss_tmo expired)
        except PermissionError:
            raise HostError("disconnecting needs root") from None
    deadline = time.monotonic() + timeout
    while _controllers(nqn) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(ctrls)

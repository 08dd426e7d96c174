# SPDX-License-Identifier: Apache-2.0
"""What an engine publishes about a storage segment (``register_storage``).

One entry of the descriptor's ``storage`` list::

    {"name": "disk0", "nqn": "nqn.2026-12.io.example:pool0", "nsid": 1,
     "size": 1073741824, "transport": "tcp", "address": "10.0.0.1", "service_id": "4420",
     "path": "/dev/loop0", "host_id": "..."}

``nqn``/``nsid`` let a peer find the namespace it connected to (sysfs); ``transport``,
``address`` and ``service_id`` tell it how to connect; ``path`` and ``host_id`` let the
publishing host itself use the backing file or device directly.
"""
from __future__ import annotations

import os

from ..errors import DeviceNotFoundError, InvalidArgumentError
from .host import _addr, _controllers, find_namespace
from .target import (NVMET, backing_size, check_address, check_backing, check_nqn,
                     check_service_id, check_transport, get_target)


def storage_entry(name, path=None, nqn=None, nsid=1, size=None, transport=None,
                  address=None, service_id=None) -> dict:
    """Validate ``register_storage``'s arguments and fill in what can be found.

    With ``nqn`` of a subsystem exported by this machine (nvmet configfs), the backing
    path of namespace ``nsid`` and the port (transport, address, service id) come from
    configfs; of a subsystem this machine is connected to, the block device and the
    controller's address. Explicit arguments win.
    """
    if not isinstance(name, str) or not name or "/" in name or any(c.isspace() for c in name):
        raise InvalidArgumentError(f"storage name must be a non-empty str without '/' or "
                                   f"spaces (peers address it as '<engine name>/<name>'), "
                                   f"got {name!r}")
    if not isinstance(nsid, int) or nsid < 1:
        raise InvalidArgumentError(f"nsid must be a positive int, got {nsid!r}")
    if nqn is not None:
        check_nqn(nqn)
    if path is None and nqn is None:
        raise InvalidArgumentError("give path= (a block device or file on this machine) "
                                   "or nqn= (an NVMe-oF subsystem this machine exports or is "
                                   "connected to)")
    port = None
    if nqn is not None and os.path.isdir(f"{NVMET}/subsystems/{nqn}"):
        t = get_target(nqn)
        ns = next((n for n in t.namespaces if n.nsid == nsid), None)
        if ns is None:
            raise DeviceNotFoundError(f"subsystem {nqn!r} has no namespace {nsid} (it has "
                                      f"{', '.join(str(n.nsid) for n in t.namespaces) or 'none'})")
        path = path or ns.path
        if t.ports:
            p = t.ports[0]
            port = (p.transport, p.address, p.service_id)
    elif nqn is not None:
        dev = find_namespace(nqn, nsid)
        if dev is None and path is None:
            raise DeviceNotFoundError(
                f"subsystem {nqn!r} is neither exported by this machine (nvmet configfs) nor "
                f"connected (mooncake-te nvmeof list); create the target or connect first, or "
                f"give path=")
        path = path or dev
        ctrl = next(iter(_controllers(nqn)), None)
        if ctrl is not None:
            a = _addr(ctrl.address)
            port = (ctrl.transport, a.get("traddr"), a.get("trsvcid"))
    path = check_backing(path, "storage path")
    have = backing_size(path)
    if size is None:
        size = have
    if not isinstance(size, int) or size <= 0:
        raise InvalidArgumentError(f"size must be a positive int of bytes, got {size!r}")
    if size > have:
        raise InvalidArgumentError(f"size {size} is larger than {path} ({have} bytes)")
    if port is not None:
        transport = transport or port[0]
        address = address or port[1]
        service_id = service_id or port[2]
    entry = {"name": name, "nqn": nqn, "nsid": nsid, "size": size, "path": path}
    if transport is not None or address is not None:
        if nqn is None:
            raise InvalidArgumentError("transport/address/service_id say how peers connect "
                                       "to a subsystem: give nqn= too")
        entry["transport"] = check_transport(transport or "tcp")
        entry["address"] = check_address(address)[0] if address else None
        entry["service_id"] = check_service_id(service_id or 4420)
    return entry

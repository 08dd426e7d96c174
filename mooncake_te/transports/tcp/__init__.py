# SPDX-License-Identifier: Apache-2.0
"""TCP transport, and its same-host mode: always available; the bytes move in C
(src/tcp/: client.c sends and collects, server.c answers).

A peer on the same host (same kernel, PID and network namespace: ``host_id`` in the
descriptor) is reached over an abstract unix socket instead of TCP; when it can reach our
memory (process_vm_readv/writev, same user, no Yama restriction), it moves the bytes
itself in one copy and only small headers cross the socket. Batches to such peers report
``transport == "shm"``.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from ...errors import TransferError, error_class
from ..base import Capabilities, Transport
from ...core import HOST_ID, NativeBatch, now_ns, OP_READ as READ, OP_WRITE as WRITE  # noqa: F401
from ._tcp import Peer, TcpServer
from . import settings as _declared


def default_max_connections() -> int:
    """The data port's connection limit when ``data_max_connections`` is 0: the process's
    descriptor limit less 256 for everything else, between 64 and 4096."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft - 256))


class TcpTransport(Transport):
    """Serves this engine's memory on a data port and keeps lanes to peers.

    Parameters
    ----------
    regions : Regions
        The engine's region table.
    bind_host : str
        Address to listen on for data connections (the engine's host).
    name : str
        This engine's segment name, sent in the hello so notifications name their sender.
    instance : int
        This engine's instance id, sent to peers so they notice a restart.
    lanes, slice_size : int
        Connections per peer, and the size large requests are cut into.
    stall_ms : int
        How long a peer may stall mid-message before its connection is dropped.
    token : bytes
        Shared secret: every data connection runs a mutual HMAC challenge-response.
    """

    name = "tcp"
    # GPU memory: staged through pinned host memory on our side (src/tcp/client.c,
    # src/core/stage.h); the peer's side is its own transport's business.
    capabilities = Capabilities(sync=True, sync_metrics=True, notifications=True,
                                gpu_memory=True, prepared=True)
    serves = _declared.SERVES
    settings = _declared.SETTINGS
    force_env = _declared.FORCE_ENV
    priority = 40

    def __init__(self, ctx):
        te = ctx.config
        self.server = TcpServer(ctx.regions, ctx.host, 0, ctx.name, ctx.instance,
                                te["timeout_ms"], ctx.token or b"")
        self.server.set_limits(te["data_max_connections"] or default_max_connections(),
                               te["data_max_per_peer"],
                               int(te["data_auth_timeout_s"] * 1000),
                               int(te["data_idle_timeout_s"] * 1000))
        # protocol="tcp" forces TCP even to peers on this host.
        self.same_host = ctx.protocol != "tcp" and bool(self.server.uds_name)
        self.only_same_host = ctx.protocol == "shm"
        self.lanes = te["tcp_lanes"]
        self.slice_size = te["tcp_slice_size"]
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()

    def describe(self) -> dict:
        d = {"tcp_data_port": self.server.port}
        if self.server.uds_name:
            d.update(host_id=HOST_ID, shm_socket=self.server.uds_name)
        return d

    def protocols(self) -> list:
        return ["tcp", "shm"] if self.server.uds_name else ["tcp"]

    def route(self, desc, op=None, local=None, remote=None) -> str | None:
        """"shm" for a peer on this host that offers the same-host listener, "tcp" for
        another peer with a data port, None for a peer we cannot reach."""
        if (self.same_host and HOST_ID and desc.extra.get("host_id") == HOST_ID
                and desc.extra.get("shm_socket")):
            return "shm"
        if self.only_same_host or not desc.tcp_data_port:
            return None
        return "tcp"

    def no_route_reason(self, desc) -> str:
        if self.only_same_host and self.route(desc) is None:
            return (f"protocol='shm' reaches peers on this host only; {desc.name} is "
                    f"elsewhere (or serves no same-host listener): use protocol='auto'")
        return ""

    def _peer(self, desc) -> Peer:
        inst = int(desc.instance_id, 16) if desc.instance_id else 0
        key = (desc.name, inst, desc.host, desc.tcp_data_port)
        p = self._peers.get(desc.name)
        if p is not None and p.key == key and not p.restarted:
            return p
        with self._lock:
            p = self._peers.get(desc.name)
            if p is None or p.key != key or p.restarted:
                if not desc.tcp_data_port:
                    raise TransferError(f"segment {desc.name!r} publishes no TCP data port; "
                                        f"it serves {desc.protocols}, not tcp")
                if p is not None:
                    p.shutdown()      # an older incarnation of the peer
                uds = desc.extra["shm_socket"] if self.route(desc) == "shm" else ""
                p = Peer(self.server, desc.host, desc.tcp_data_port, inst, self.lanes,
                         self.slice_size, uds, desc.name)
                p.key = key
                self._peers[desc.name] = p
            return p

    def submit(self, batch, desc, op, local, remote, lens, first, run_inline):
        """Queue the requests; returns the route taken ("tcp" or "shm")."""
        peer = self._peer(desc)
        rc = batch.submit(peer, op, local, remote, lens, first, run_inline)
        if rc != 0:
            raise error_class(rc)(f"cannot queue {len(local)} requests to {desc.name} "
                                  f"(status {rc})", status=rc)
        return "shm" if peer.uds else "tcp"

    def post_prepared(self, desc, table, op, lids, rids, deadline_ns, cell=0,
                      notify=None) -> tuple:
        """A prepared post (PreparedTransfer.post) in one native call: (sealed
        NativeBatch, route). ``table``: a core PreparedTable; ids: C-contiguous int64;
        ``notify``: bytes for the peer once every request succeeded (checked)."""
        peer = self._peer(desc)
        native = peer.post_prepared(table, op, lids, rids, deadline_ns, cell, notify)
        if type(native) is int:
            raise TransferError(f"cannot queue a prepared post of {len(lids)} blocks to "
                                f"{desc.name} (error {native})",
                                status=native if native < 0 else None)
        return native, "shm" if peer.uds else "tcp"

    def transfer_sync(self, desc, op, local, remote, length, deadline_ns, cell=0) -> tuple:
        """One request, waited for on this thread: (route, 0 or error code). ``cell``:
        the address of the metrics cell it counts in (0: none)."""
        peer = self._peer(desc)
        return ("shm" if peer.uds else "tcp",
                peer.transfer_sync(op, local, remote, length, deadline_ns, cell))

    def counters(self) -> dict:
        """Server and client counters for metrics (read on demand)."""
        open_, accepted, auth, received, dropped, refused = self.server.counters()
        with self._lock:
            peers = dict(self._peers)
        return {"connections": open_, "connections_accepted": accepted,
                "auth_failures": auth, "notifications_received": received,
                "notifications_dropped": dropped, "connections_refused": refused,
                "queued": {name: p.queued() for name, p in peers.items()}}

    def add_notify(self, batch, desc, message):
        rc = batch.add_notify(self._peer(desc), message)
        if rc != 0:
            raise TransferError(f"cannot queue a notification of {len(message)} bytes to "
                                f"{desc.name} (at most 1 MiB)")

    def forget_peer(self, name):
        with self._lock:
            p = self._peers.pop(name, None)
        if p is not None:
            p.shutdown()     # freed when the last batch naming it is gone

    def notifications(self):
        return self.server.take_notifications()

    def wait_notifications(self, timeout):
        return self.server.wait_notifications(timeout)

    def deliver_notification(self, sender, message):
        rc = self.server.push_notification(sender, message)
        if rc:
            raise error_class(rc)(f"notification from {sender!r} not queued (status {rc}): "
                                  f"the queue is full (64 MiB or 65536 messages unread) or "
                                  f"memory ran out; the receiver must drain notifications()",
                                  status=rc)

    @property
    def auth_failures(self) -> int:
        return self.server.auth_failures

    def close(self):
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:          # every peer stops before any is freed (tcp.h)
            p.shutdown()
        for p in peers:
            p.close()
        self.server.close()


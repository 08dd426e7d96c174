# SPDX-License-Identifier: Apache-2.0
"""RDMA transport: RC queue pairs, one-sided READ/WRITE, several NICs (docs/rdma.md).

The verbs objects are our own Cython classes (``_verbs.pyx`` over ``infiniband/verbs.h``);
the bytes move in C (``src/rdma/``: ``post.c`` cuts and posts, ``poll.c`` completes): requests are cut into slices, the slices go
round-robin over the rails (local NIC, peer NIC) that the NIC priority matrix prefers for
both buffers, a polling thread per NIC finishes them in the engine's batch, a slice that
fails is posted again on another rail. Queue pairs are connected through the engine's
RPC port (frame type ``RDMA_CONNECT``): both ends exchange QPN, PSN, GID, LID and their
port MTU, and both use the smaller MTU.
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass

import numpy as np

from ... import errors as E
from ...metadata import framing
from ...batch import register_status_text
from ...topology import gids
from ..base import Capabilities, DeviceCounter, Transport
from . import settings as _declared

log = logging.getLogger("mooncake_te.rdma")

try:
    from . import _verbs
    _IMPORT_ERROR = ""
except ImportError as e:           # built without libibverbs-dev, or libibverbs.so missing
    _verbs = None
    _IMPORT_ERROR = str(e)

ROUTE = "rdma"


def wc_status_text(status: int) -> str:
    """libibverbs' own text for a work-completion status (``ibv_wc_status_str``)."""
    return _verbs.wc_status_str(status) if _verbs is not None else f"status {status}"


def error_message(code, what, target, op, remote, length) -> str:
    """What the RDMA data path's codes mean (src/core/status.h: MTE_E_RDMA_WC_BASE -
    ibv_wc_status, and -115x); batch.error_for asks."""
    if code == E.ERR_RDMA_NO_RAIL:
        return (f"{what}: no RDMA rail to {target} can carry it (every rail is down or "
                f"paused, or no NIC pair has keys for both buffers)")
    if code == E.ERR_RDMA_POST:
        return (f"{what}: the RDMA NIC refused the work request (ibv_post_send failed; the "
                f"queue pair is in error)")
    if code == E.ERR_RDMA_LOCAL_KEY:
        return f"{what}: the local buffer is not registered with the RDMA NICs"
    if code == E.ERR_RDMA_PORT_DOWN:
        return (f"{what}: the port of the local RDMA NIC went down (link or netdev down; "
                f"ibv_devinfo shows the port state) and no other rail could take over")
    st = E.ERR_RDMA_WC_BASE - code
    text = wc_status_text(st)
    if st == 10:       # IBV_WC_REM_ACCESS_ERR
        return (f"{what} was refused by the NIC of {target}: {text} (IBV_WC_REM_ACCESS_ERR): "
                f"[{remote:#x}, {remote + length:#x}) is outside the memory region it "
                f"registered (stale address or rkey?) or the region forbids remote "
                f"{'writes' if op == 1 else 'reads'}")
    if st in (2, 12, 13, 20):
        hint = ("the peer's NIC did not answer: link down, peer gone, or an MTU/GID mismatch "
                "on the path (docs/rdma.md, troubleshooting)")
    elif st == 5:
        hint = "flushed after an earlier error on the same queue pair"
    else:
        hint = "see docs/rdma.md, troubleshooting"
    return f"{what} failed over RDMA: {text} (ibv_wc_status {st}); {hint}"


register_status_text(E.ERR_RDMA_PORT_DOWN, E.ERR_RDMA_WC_BASE - 1, error_message)
_ACC = {"rw": 1 | 2, "r": 1, "local": 0}         # MTE_ACC_REMOTE_READ | _WRITE


def unavailable_reason() -> str | None:
    """Why this machine or build cannot run the RDMA transport, or None."""
    if _verbs is None:
        if "libibverbs" in _IMPORT_ERROR:
            return (f"libibverbs cannot be loaded ({_IMPORT_ERROR}): apt-get install "
                    f"libibverbs1 ibverbs-providers")
        return ("the RDMA extension is not built (no infiniband/verbs.h when the package was "
                "built): apt-get install libibverbs-dev, then reinstall (pip install -e .)")
    try:
        names = _verbs.device_names()
    except OSError as e:
        return f"libibverbs cannot list devices: {e}"
    if not names:
        return ("no RDMA devices: ibv_devices lists none and /sys/class/infiniband is empty "
                "(no NIC, no driver loaded, or a container without /dev/infiniband); try "
                "the fabric lab (mooncake-te lab)")
    return None


# GIDs: topology.gids chooses (the one chooser; doctor and the lab use it too).

def _covers(desc, remote, lens) -> bool:
    """Every [remote_i, +len_i) lies in one buffer of ``desc`` (vectorized)."""
    if len(remote) == 0:
        return True
    return desc.buffer_table().covers(remote, lens)


# --------------------------------------------------------------------------- devices

@dataclass
class _Device:
    index: int
    name: str
    ctx: object
    pd: object
    channel: object
    cq: object
    port: int
    lid: int
    gid: bytes
    gid_index: int
    gid_type: str
    netdev: str | None
    mtu: int
    link_layer: str


def _missing(name: str, found: list) -> str:
    from ...topology.devices import missing_device_message
    return missing_device_message(name, found)


class RdmaTransport(Transport):
    """RC RDMA between engines' registered memory, over every NIC the matrix prefers."""

    name = ROUTE
    capabilities = Capabilities(gpu_memory=True, wants_keys=True)
    serves = _declared.SERVES
    settings = _declared.SETTINGS
    force_env = _declared.FORCE_ENV
    priority = 30

    def __init__(self, ctx):
        why = unavailable_reason()
        if why:
            raise E.TransportUnavailableError(f"transport 'rdma' is unavailable: {why}")
        te = ctx.config
        self.ctx = ctx
        self.slice_size = int(te.get("rdma_slice_size", 64 << 10))
        self.nqp = int(te.get("rdma_qps_per_endpoint", 2))
        self.max_wr = int(te.get("rdma_max_wr", 256))
        # Local ACK timeout exponent (4.096 us x 2^n; 14 = 67 ms, as Mooncake): how long a
        # QP waits for an ACK before retransmitting (docs/rdma.md, known issues).
        self.qp_timeout = int(te.get("rdma_qp_timeout", 14))
        self.mtu_cap = int(te.get("rdma_mtu", 4096))
        self.port = int(te.get("rdma_ib_port", 1))
        self.retry_count = int(te.get("retry_count", 3))
        self.multi_nic = bool(te.get("enable_multi_nic", True))
        self.pause_s = float(te.get("rdma_rail_pause_s", 30))
        self.use_gpu_direct = bool(te.get("use_gpu_direct", True))
        self._closed = False
        self._lock = threading.RLock()            # passive queue pairs
        self._connect_lock = threading.RLock()    # peers we initiate to
        self._peers: dict = {}          # name -> _PeerState (we initiate)
        self._passive: dict = {}        # (peer name, peer instance, ldev, pdev) -> [QP]
        self._mrs: dict = {}            # address -> [MR per device]
        self._nomr: dict = {}           # address -> end of regions the NICs could not take
        self.devices: list[_Device] = []
        found = _verbs.device_names()
        names = list(ctx.devices) if ctx.devices else list(found)
        for n in names:
            if n not in found:
                raise E.DeviceNotFoundError(_missing(n, found))
        try:
            for n in names:
                d = self._open(len(self.devices), n, int(te.get("rdma_gid_index", -1)),
                               int(te.get("rdma_cq_entries", 4096)), explicit=bool(ctx.devices))
                if d is not None:
                    self.devices.append(d)
            if not self.devices:
                raise E.DeviceNotFoundError(
                    f"no usable RDMA device: {', '.join(names)} "
                    f"{'has' if len(names) == 1 else 'have'} no ACTIVE port {self.port} with "
                    f"a GID (ibv_devinfo shows the port states; found: {', '.join(found)})")
            self.matrix = self._matrix(bool(te.get("topology_aware", True)))
            self.dp = _verbs.DataPath(ctx.regions, self.slice_size,
                                      self.retry_count, self.multi_nic,
                                      int(self.pause_s * 1000))
            for d in self.devices:
                self.dp.add_device(d.index, d.cq)
            self.dp.start()
        except BaseException:
            self._close_devices()
            raise
        if ctx.rpc is not None:
            ctx.rpc.add_handler(framing.RDMA_CONNECT, self._on_connect)

    # --- devices ----------------------------------------------------------------------
    def _open(self, index, name, pinned, cqe, explicit) -> _Device | None:
        c = _verbs.Context(name)
        try:
            port = c.query_port(self.port)
        except OSError as e:
            c.close()
            raise E.DeviceNotFoundError(f"RDMA device {name} has no port {self.port} "
                                        f"({e}); set rdma_ib_port / MC_IB_PORT") from None
        if not port["active"]:
            c.close()
            if explicit:
                raise E.DeviceNotFoundError(
                    f"RDMA device {name} port {self.port} is {port['state']}, not ACTIVE "
                    f"(cable, link or netdev down? ibv_devinfo -d {name})")
            log.info("skipping %s: port %d is %s", name, self.port, port["state"])
            return None
        entries = []
        for i in range(port["gid_tbl_len"]):
            g = c.query_gid(self.port, i)
            if g is None:
                continue
            netdev, up = gids.netdev_of(g[2])
            entries.append((i, g[0], g[1], up, netdev))
        try:
            best = gids.select(entries, pinned)
        except E.DeviceNotFoundError as e:
            c.close()
            raise E.DeviceNotFoundError(f"RDMA device {name}: {e}") from None
        if best is None and port["link_layer"] != "InfiniBand":
            c.close()
            if explicit:
                raise E.DeviceNotFoundError(f"RDMA device {name} has an empty GID table (no "
                                            f"IP address on its netdev?)")
            return None
        gid = best[1] if best else b"\0" * 16
        pd = _verbs.PD(c)
        ch = _verbs.CompChannel(c)
        cq = _verbs.CQ(c, cqe, ch)
        return _Device(index=index, name=name, ctx=c, pd=pd, channel=ch, cq=cq, port=self.port,
                       lid=port["lid"], gid=gid, gid_index=best[0] if best else 0,
                       gid_type=best[2] if best else "IB", netdev=best[4] if best else None,
                       mtu=min(port["active_mtu"], self.mtu_cap), link_layer=port["link_layer"])

    def _matrix(self, topology_aware: bool) -> dict:
        names = [d.name for d in self.devices]
        matrix = {}
        if topology_aware:
            try:
                from ...topology import local_priority_matrix
                m = local_priority_matrix(devices=names)
                matrix = {loc: [[n for n in v[0] if n in names], [n for n in v[1] if n in names]]
                          for loc, v in m.items()}
            except E.MooncakeError as e:
                log.warning("NIC priority matrix unavailable (%s); every NIC is preferred", e)
        matrix = {k: v for k, v in matrix.items() if v[0] or v[1]}
        matrix["*"] = [names, []]
        return matrix

    def _masks(self, location: str, matrix: dict, names: list) -> tuple[int, int]:
        entry = matrix.get(location) or matrix.get("*") or [names, []]
        pref = avail = 0
        for n in entry[0]:
            if n in names:
                pref |= 1 << names.index(n)
        for n in entry[1]:
            if n in names:
                avail |= 1 << names.index(n)
        if not pref:
            pref, avail = avail or (1 << len(names)) - 1, 0
        return pref, avail

    # --- descriptor -------------------------------------------------------------------
    def describe(self) -> dict:
        return {"devices": [{"name": d.name, "lid": d.lid, "gid": gids.text(d.gid),
                             "gid_index": d.gid_index, "mtu": d.mtu,
                             "link_layer": d.link_layer} for d in self.devices],
                "priority_matrix": {k: v for k, v in self.matrix.items() if k != "*"}}

    def buffer_keys(self, region):
        mrs = self._mrs.get(region.address)
        if not mrs:
            return (), ()
        return [m.rkey for m in mrs], [m.lkey for m in mrs]

    # --- registration -----------------------------------------------------------------
    def register(self, region) -> None:
        access = _verbs.ACCESS_LOCAL_WRITE
        if region.access in ("rw", "r"):
            access |= _verbs.ACCESS_REMOTE_READ
        if region.access == "rw":
            access |= _verbs.ACCESS_REMOTE_WRITE
        if region.readonly:
            access &= ~(_verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_WRITE)
        loc = region.location or "cpu:0"
        mrs = []
        try:
            if loc.startswith("cuda:"):
                try:
                    mrs = self._register_gpu(region, access)
                except E.TransportUnavailableError as e:
                    if self.ctx.protocol == "rdma":
                        raise
                    # auto: the other transports (TCP staging, CUDA IPC) carry it.
                    log.warning("%s; RDMA will not carry this region", e)
                    self._nomr[region.address] = region.end
                    return
            else:
                for d in self.devices:
                    mrs.append(_verbs.MR(d.pd, region.address, region.length, access))
        except OSError as e:
            for m in mrs:
                m.close()
            raise E.TransportUnavailableError(
                f"cannot register [{region.address:#x}, +{region.length}) with the RDMA "
                f"NICs: {e}; check the memlock limit (ulimit -l) and the NIC's max_mr_size",
                errno=e.errno) from None
        except BaseException:
            for m in mrs:
                m.close()
            raise
        names = [d.name for d in self.devices]
        pref, avail = self._masks(loc, self.matrix, names)
        self.dp.add_mr(region.address, region.length, [m.lkey for m in mrs], pref, avail)
        self._mrs[region.address] = mrs

    def _register_gpu(self, region, access) -> list:
        """GPU memory: a dma-buf of the allocation on every NIC (CUDA driver at run time);
        else ibv_reg_mr on the device pointer where nvidia-peermem is loaded."""
        if not self.use_gpu_direct:
            raise E.TransportUnavailableError(
                f"{region.location} memory needs GPUDirect RDMA, and use_gpu_direct is false "
                f"in [transfer_engine]; enable it or stage through host memory")
        dmabuf_err = None
        fd, offset = -1, 0
        try:
            from ... import cuda as _cuda
            # The driver exports page-aligned ranges; the MR starts `offset` bytes in.
            page = os.sysconf("SC_PAGE_SIZE")
            start = region.address & ~(page - 1)
            end = (region.address + region.length + page - 1) & ~(page - 1)
            got = _cuda.dmabuf_fd(start, end - start)
            fd, offset = (got if isinstance(got, tuple) else (got, 0))
            offset += region.address - start
        except Exception as e:        # module missing, no driver, old driver, no dma-buf
            dmabuf_err = f"{type(e).__name__}: {e}"
        mrs = []
        if fd >= 0:
            try:
                for d in self.devices:
                    mrs.append(_verbs.MR.dmabuf(d.pd, fd, offset, region.length,
                                                region.address, access))
                return mrs
            except OSError as e:
                for m in mrs:
                    m.close()
                mrs = []
                dmabuf_err = f"ibv_reg_dmabuf_mr failed: {e}"
            finally:
                os.close(fd)
        if os.path.exists("/sys/module/nvidia_peermem"):
            for d in self.devices:
                mrs.append(_verbs.MR(d.pd, region.address, region.length, access))
            return mrs
        raise E.TransportUnavailableError(
            f"cannot register {region.location} memory [{region.address:#x}, "
            f"+{region.length}) with the RDMA NICs: dma-buf failed ({dmabuf_err}) and "
            f"nvidia-peermem is not loaded (/sys/module/nvidia_peermem missing). Fix one: "
            f"a CUDA driver >= 515 with an open kernel module and rdma-core >= 34 for "
            f"dma-buf, or 'modprobe nvidia-peermem'")

    def unregister(self, region) -> None:
        self._nomr.pop(region.address, None)
        mrs = self._mrs.pop(region.address, None)
        if mrs is None:
            return
        self.dp.remove_mr(region.address)
        for m in mrs:
            m.close()

    # --- routing ----------------------------------------------------------------------
    def route(self, desc, op=None, local=None, remote=None) -> str | None:
        """"rdma" when the peer serves RDMA and publishes devices with GIDs (or LIDs)."""
        if ROUTE not in (desc.protocols or [desc.protocol]):
            return None
        devs = [d for d in desc.devices if isinstance(d, dict) and (d.get("gid") or d.get("lid"))]
        if not devs:
            return None
        if self._nomr and local is not None:
            # A local region the NICs could not register (GPU memory without dma-buf or
            # peermem, protocol="auto"): another transport carries it.
            addrs = np.atleast_1d(np.asarray(local, dtype=np.uint64))
            for start, end in list(self._nomr.items()):
                if ((addrs >= start) & (addrs < end)).any():
                    return None
        if remote is not None and any(not b.rkey for b in desc.buffers):
            # The peer has buffers without NIC keys: requests into them go elsewhere.
            r = np.atleast_1d(np.asarray(remote, dtype=np.uint64))
            for b in desc.buffers:
                if not b.rkey and ((r >= b.address) & (r < b.address + b.length)).any():
                    return None
        return ROUTE

    def route_by_address(self, desc) -> bool:
        # route() looks at the addresses only for regions the NICs could not take and
        # for peer buffers without NIC keys.
        return bool(self._nomr) or any(not b.rkey for b in desc.buffers)

    def submit(self, batch, desc, op, local, remote, lens, first, run_inline):
        if not _covers(desc, remote, lens):
            # A buffer the peer registered after we fetched its descriptor: ask again
            # once (Mooncake re-fetches a descriptor that lacks the target, too).
            if self.ctx.refresh_peer is not None:
                try:
                    desc = self.ctx.refresh_peer(desc.name)
                except E.MooncakeError:
                    pass
        st = self._peer(desc)
        rc = st.peer.submit(batch, op, local, remote, lens, first)
        if rc != 0:
            raise E.error_class(rc)(f"cannot queue {len(local)} requests to {desc.name} "
                                    f"over RDMA (status {rc})", status=rc)
        batch.keep(st.peer)
        return ROUTE

    # --- peers and connections ----------------------------------------------------------
    def _peer(self, desc) -> "_PeerState":
        # Not self._lock: the handshake below may be answered by this very engine
        # (a transfer to itself), whose handler takes self._lock.
        with self._connect_lock:
            if self._closed:
                raise E.ClosedError("the RDMA transport is closed")
            st = self._peers.get(desc.name)
            if st is not None and st.instance != desc.instance_id:
                self._drop_peer(desc.name)
                st = None
            if st is None:
                st = _PeerState(self, desc)
                self._peers[desc.name] = st
            if st.desc is not desc:
                st.set_buffers(desc)
            st.repair()
            return st

    def _drop_peer(self, name: str) -> None:
        st = self._peers.pop(name, None)
        if st is not None:
            st.close()
            self._goodbye(st.desc)

    def _goodbye(self, desc, timeout: float = 1.0) -> None:
        """Tell the peer to release the queue pairs it keeps for us (best effort)."""
        body = json.dumps({"name": self.ctx.name, "instance": f"{self.ctx.instance:016x}",
                           "disconnect": True, "endpoints": []}).encode()
        try:
            framing.request(desc.host, desc.rpc_port, framing.RDMA_CONNECT, body,
                            timeout=timeout, token=self.ctx.token or None)
        except E.MooncakeError:
            pass

    def forget_peer(self, name: str) -> None:
        with self._connect_lock:
            self._drop_peer(name)
        with self._lock:
            for key in [k for k in self._passive if k[0] == name]:
                for q in self._passive.pop(key):
                    q.close()

    def _new_qps(self, dev: _Device) -> list:
        qps = []
        try:
            for _ in range(self.nqp):
                q = _verbs.QP(dev.pd, dev.cq, self.max_wr)
                q.init(dev.port)
                qps.append(q)
        except BaseException:
            for q in qps:
                q.close()
            raise
        return qps

    def _connect_qps(self, dev: _Device, qps, psns, remote: dict, mtu: int) -> None:
        gid = bytes.fromhex(remote["gid"].replace(":", "")) if remote.get("gid") else None
        for q, psn, rq, rpsn in zip(qps, psns, remote["qpns"], remote["psns"]):
            q.rtr(int(rq), int(rpsn), mtu, gid, int(remote.get("lid", 0)), dev.gid_index)
            q.rts(psn, timeout=self.qp_timeout)

    def _on_connect(self, payload: bytes) -> bytes:
        """Passive side of the queue-pair handshake (RpcServer handler)."""
        req = json.loads(payload)
        out = []
        with self._lock:
            # Queue pairs of an older incarnation of this peer, or of one saying goodbye.
            stale = [k for k in self._passive if k[0] == req["name"] and
                     (k[1] != req["instance"] or req.get("disconnect"))]
            for key in stale:
                for q in self._passive.pop(key):
                    q.close()
            if req.get("disconnect"):
                return json.dumps({"endpoints": []}).encode()
            if self._closed:
                raise E.TransferError("engine closing")
            for ep in req["endpoints"]:
                dev = next((d for d in self.devices if d.name == ep["peer_dev"]), None)
                if dev is None:
                    raise E.DeviceNotFoundError(f"no RDMA device {ep['peer_dev']} here")
                mtu = min(dev.mtu, int(ep["mtu"]), self.mtu_cap)
                qps = self._new_qps(dev)
                psns = [random.getrandbits(24) for _ in qps]
                try:
                    self._connect_qps(dev, qps, psns, ep, mtu)
                except BaseException:
                    for q in qps:
                        q.close()
                    raise
                key = (req["name"], req["instance"], dev.name, ep["local_dev"])
                for q in self._passive.pop(key, []):
                    q.close()
                self._passive[key] = qps
                out.append({"id": ep["id"], "gid": gids.text(dev.gid), "lid": dev.lid,
                            "mtu": dev.mtu, "path_mtu": mtu,
                            "qpns": [q.qp_num for q in qps], "psns": psns})
        return json.dumps({"endpoints": out}).encode()

    def handshake(self, desc, pairs) -> list:
        """Connect fresh queue pairs for each (local _Device, peer device dict) pair in
        one RPC; returns [(qps, path_mtu)] in the same order."""
        eps, mine = [], []
        try:
            for i, (dev, pdev) in enumerate(pairs):
                qps = self._new_qps(dev)
                psns = [random.getrandbits(24) for _ in qps]
                mine.append((dev, qps, psns))
                eps.append({"id": i, "local_dev": dev.name, "peer_dev": pdev["name"],
                            "gid": gids.text(dev.gid), "lid": dev.lid, "mtu": dev.mtu,
                            "qpns": [q.qp_num for q in qps], "psns": psns})
            body = json.dumps({"name": self.ctx.name, "instance": f"{self.ctx.instance:016x}",
                               "endpoints": eps}).encode()
            raw = framing.request(desc.host, desc.rpc_port, framing.RDMA_CONNECT, body,
                                  timeout=5.0, token=self.ctx.token or None)
            reply = json.loads(raw)
            if "endpoints" not in reply:
                raise E.TransferError(f"{desc.name} refused the RDMA connection: "
                                      f"{reply.get('reply_msg', reply)}", status=E.ERR_REJECT_HANDSHAKE)
            out = []
            for (dev, qps, psns), ep in zip(mine, reply["endpoints"]):
                mtu = min(dev.mtu, int(ep["mtu"]), self.mtu_cap)
                self._connect_qps(dev, qps, psns, ep, mtu)
                out.append((qps, mtu))
            return out
        except BaseException:
            for _, qps, _ in mine:
                for q in qps:
                    q.close()
            raise

    # --- stats, lifetime -------------------------------------------------------------
    device_counter_defs = (
        DeviceCounter("slices", "slices", "RDMA slices posted"),
        DeviceCounter("bytes", "posted_bytes", "Bytes posted to the NIC"),
        DeviceCounter("completions", "completions", "RDMA work completions"),
        DeviceCounter("errors", "errors", "RDMA work completions with an error"),
        DeviceCounter("retries", "retries", "Slices posted again on another rail after a "
                                            "transport error (rail failovers)"))

    def device_counters(self) -> dict:
        return self.stats()

    def stats(self) -> dict:
        """Per local device: slices and bytes posted, completions, errors, retries."""
        out = {}
        for d in self.devices:
            s = self.dp.device_stats(d.index)
            out[d.name] = dict(zip(("slices", "bytes", "completions", "errors", "retries"), s))
        return out

    def peer_rails(self, name: str) -> list:
        """[(local NIC, peer NIC, dead, path MTU)] of the rails to ``name``."""
        st = self._peers.get(name)
        return st.rail_info() if st else []

    def close(self) -> None:
        with self._connect_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            passive, self._passive = list(self._passive.values()), {}
        if self.ctx.rpc is not None:
            self.ctx.rpc.remove_handler(framing.RDMA_CONNECT)
        for st in peers:
            st.peer.shutdown()
        self.dp.stop(2000)
        for st in peers:
            st.close()
            self._goodbye(st.desc)
        for qps in passive:
            for q in qps:
                q.close()
        for mrs in self._mrs.values():
            for m in mrs:
                m.close()
        self._mrs = {}
        self.dp.close()
        self._close_devices()

    def _close_devices(self) -> None:
        for d in self.devices:
            d.ctx.close()         # closes its CQs, channels, PDs, MRs and QPs
        self.devices = []


class _PeerState:
    """A peer we initiate transfers to: the data path's Peer and how its rails map."""

    def __init__(self, t: RdmaTransport, desc):
        self.t = t
        self.name = desc.name
        self.instance = desc.instance_id
        self.pdevs = [d for d in desc.devices if isinstance(d, dict) and d.get("name")]
        if not self.pdevs:
            raise E.TransportUnavailableError(f"{desc.name} publishes no RDMA devices")
        self.peer = t.dp.peer(len(self.pdevs))
        self.peer.key = (desc.name, desc.instance_id)
        self.desc = None
        self.rails: list = []           # rail index -> (local _Device, peer dev dict, mtu)
        self.set_buffers(desc)
        self._connect_all(desc)

    def set_buffers(self, desc) -> None:
        pnames = [d["name"] for d in self.pdevs]
        matrix = dict(desc.priority_matrix or {})
        bufs = [b for b in desc.buffers if len(b.rkey) == len(pnames)]
        n = len(bufs)
        addrs = np.fromiter((b.address for b in bufs), np.uint64, n)
        lens = np.fromiter((b.length for b in bufs), np.uint64, n)
        access = np.fromiter((_ACC.get(b.access, 0) for b in bufs), np.uint8, n)
        rkeys = np.array([k for b in bufs for k in b.rkey], dtype=np.uint32)
        masks = [self.t._masks(b.location, matrix, pnames) for b in bufs]
        pref = np.fromiter((m[0] for m in masks), np.uint64, n)
        avail = np.fromiter((m[1] for m in masks), np.uint64, n)
        self.peer.set_buffers(addrs, lens, access, rkeys, pref, avail)
        self.desc = desc

    def _connect_all(self, desc) -> None:
        pairs = [(dev, pdev) for dev in self.t.devices for pdev in self.pdevs]
        done = self.t.handshake(desc, pairs)
        for (dev, pdev), (qps, mtu) in zip(pairs, done):
            idx = self.peer.add_rail(dev.index, self.pdevs.index(pdev), qps,
                                     min(self.t.max_wr, qps[0].max_send_wr))
            self.rails.append((dev, pdev, mtu))
            assert idx == len(self.rails) - 1

    def repair(self) -> None:
        """Reconnect dead rails whose pause is over (or every dead one when none lives)."""
        info = self.peer.rails()
        dead = [i for i, r in enumerate(info) if r[2]]
        if not dead:
            self.peer.reap()
            return
        now = time.monotonic_ns()
        alive = len(info) - len(dead)
        due = [i for i in dead if info[i][3] <= now or alive == 0]
        if not due:
            return
        pairs = [(self.rails[i][0], self.rails[i][1]) for i in due]
        try:
            done = self.t.handshake(self.desc, pairs)
        except E.MooncakeError as e:
            log.warning("reconnecting %d RDMA rail(s) to %s failed: %s", len(due), self.name, e)
            return
        for i, (qps, mtu) in zip(due, done):
            self.peer.reconnect_rail(i, qps)
            self.rails[i] = (self.rails[i][0], self.rails[i][1], mtu)

    def rail_info(self) -> list:
        info = self.peer.rails()
        return [(self.rails[i][0].name, self.rails[i][1]["name"], info[i][2], self.rails[i][2])
                for i in range(len(self.rails))]

    def close(self) -> None:
        self.peer.close()


__all__ = ["RdmaTransport", "unavailable_reason"]

# SPDX-License-Identifier: Apache-2.0
"""Transfer requests, batches and their status."""
from __future__ import annotations

import enum
import time
from typing import NamedTuple

from . import errors as E


class Op(enum.IntEnum):
    """Direction of a one-sided transfer: READ copies remote -> local, WRITE local -> remote."""
    WRITE = 1
    READ = 2


READ, WRITE = Op.READ, Op.WRITE


class TransferRequest(NamedTuple):
    """One request: ``length`` bytes between local ``source`` and ``target_address`` in
    segment ``target`` (a name or a Segment)."""
    op: Op
    source: int
    target: object
    target_address: int
    length: int


class TransferStatus(NamedTuple):
    state: str                 # "pending" | "completed" | "failed" | "timeout" | "canceled"
    transferred_bytes: int


class Notification(NamedTuple):
    sender: str
    message: bytes


STATES = ("pending", "completed", "failed", "timeout", "canceled")


def error_for(code: int, target: str, index: int, op: int, local: int, remote: int,
              length: int) -> E.MooncakeError:
    """The exception for a failed request, saying what failed and what to do."""
    what = f"request {index} ({Op(op).name} of {length} bytes, local {local:#x}, " \
           f"remote {remote:#x} in {target})"
    if code == -3:
        return E.AddressNotRegisteredError(
            f"{what} was refused by {target}: [{remote:#x}, {remote + length:#x}) is not inside "
            f"a region it registered; check the address against open_segment({target!r}).buffers")
    if code == -1004:
        return E.AddressNotRegisteredError(
            f"{what} was refused by {target}: the region does not allow remote "
            f"{'writes' if op == Op.WRITE else 'reads'} (registered with access='r' or 'local')")
    if code == -1003:
        return E.AddressNotRegisteredError(
            f"{what}: local [{local:#x}, {local + length:#x}) is not inside a region registered "
            f"with this engine (it was unregistered while the request was queued)")
    if code == -801:
        return E.TransferTimeoutError(f"{what} did not complete before its deadline; the peer "
                                      f"may be overloaded, hung or unreachable")
    if code == -805:
        return E.TransferCanceledError(f"{what} was canceled")
    if code == -1006:
        return E.TransferError(f"{what}: {target} restarted (its instance id changed); its "
                               f"descriptor was refreshed, re-resolve addresses with "
                               f"open_segment({target!r})")
    if code == -803:
        return E.AuthenticationError(f"{what}: {target} refused the data connection, or could "
                                     f"not prove the token: the engines' auth_token values differ")
    if code == -1012:
        return E.TransferError(
            f"{what}: {target}'s notification queue is full (64 MiB or 65536 messages "
            f"unread); the notification was dropped. The receiver must drain "
            f"notifications() more often", status=code)
    if code == -1011:
        return E.AuthenticationError(
            f"{what}: the engine that answered for segment {target!r} could not prove it is "
            f"{target!r} (it is another engine of the cluster, or the tokens differ): the "
            f"descriptor of {target!r} in the metadata store is stale or forged; nothing was "
            f"sent. Check the store's key for {target!r}", status=code)
    if code == -102:
        return E.TransferError(f"{what}: the connection to {target} failed or was lost (peer "
                               f"dead, restarted or unreachable)", status=-102)
    if code == -1008:
        return E.TransferError(f"{what}: the connections to {target} were closed (engine "
                               f"closed, or the peer was dropped after a failure or restart)")
    if code == -1009:
        return E.TransferError(f"{what}: {target} could not copy to or from this process's "
                               f"memory (same-host transport); the local buffer may be gone")
    if code == -1010:
        return E.TransferError(f"{what}: a CUDA copy of GPU memory failed on one side (its "
                               f"staging or IPC mapping); check that the GPU buffer is still "
                               f"allocated and the device healthy (nvidia-smi)", status=code)
    if -1199 <= code <= -1100:
        return _rdma_error(code, what, target, op, remote, length)
    if code == -1021 or -1600 < code <= -1400:   # storage segments (src/nvmeof/nvmeof.h)
        from .transports.nvmeof import error_message
        msg = error_message(code)
        if msg:
            return E.TransferError(f"{what}: {msg}", status=code)
    return E.TransferError(f"{what} failed (status {code})", status=code if code < 0 else None)


# ibv_wc_status (infiniband/verbs.h) and libibverbs' text for each.
_WC_STATUS = {
    1: "local length error", 2: "local QP operation error", 3: "local EE context operation "
    "error", 4: "local protection error", 5: "Work Request Flushed Error", 6: "memory "
    "management operation error", 7: "bad response error", 8: "local access error",
    9: "remote invalid request error", 10: "remote access error", 11: "remote operation "
    "error", 12: "transport retry counter exceeded", 13: "RNR retry counter exceeded",
    14: "local RDD violation error", 15: "remote invalid RD request", 16: "aborted error",
    17: "invalid EE context number", 18: "invalid EE context state", 19: "fatal error",
    20: "response timeout error", 21: "general error",
}


def _rdma_error(code, what, target, op, remote, length) -> E.MooncakeError:
    """The RDMA data path's codes (src/rdma/rdma.h): -1100 - ibv_wc_status, and -115x."""
    if code == -1150:
        return E.TransferError(f"{what}: no RDMA rail to {target} can carry it (every rail is "
                               f"down or paused, or no NIC pair has keys for both buffers)",
                               status=code)
    if code == -1151:
        return E.TransferError(f"{what}: the RDMA NIC refused the work request "
                               f"(ibv_post_send failed; the queue pair is in error)", status=code)
    if code == -1152:
        return E.AddressNotRegisteredError(f"{what}: the local buffer is not registered with "
                                           f"the RDMA NICs", status=code)
    if code == -1153:
        return E.TransferError(f"{what}: the port of the local RDMA NIC went down (link or "
                               f"netdev down; ibv_devinfo shows the port state) and no other "
                               f"rail could take over", status=code)
    st = -1100 - code
    text = _WC_STATUS.get(st, f"status {st}")
    if st == 10:       # IBV_WC_REM_ACCESS_ERR
        return E.AddressNotRegisteredError(
            f"{what} was refused by the NIC of {target}: {text} (IBV_WC_REM_ACCESS_ERR): "
            f"[{remote:#x}, {remote + length:#x}) is outside the memory region it registered "
            f"(stale address or rkey?) or the region forbids remote "
            f"{'writes' if op == Op.WRITE else 'reads'}", status=code)
    if st in (2, 12, 13, 20):
        hint = ("the peer's NIC did not answer: link down, peer gone, or an MTU/GID mismatch "
                "on the path (docs/rdma.md, troubleshooting)")
    elif st == 5:
        hint = "flushed after an earlier error on the same queue pair"
    else:
        hint = "see docs/rdma.md, troubleshooting"
    return E.TransferError(f"{what} failed over RDMA: {text} (ibv_wc_status {st}); {hint}",
                           status=code)


class Batch:
    """Requests in flight. ``wait`` blocks (with a deadline); ``done`` never blocks."""

    def __init__(self, native, transport: str, deadline_ns: int, parts: list, engine=None,
                 order=None):
        self._native = native
        self._order = order            # caller's index -> native index (submit()), or None
        self.transport = transport
        self._deadline_ns = deadline_ns
        self._parts = parts            # [(target name, first, local, remote, lens, op)]
        self._engine = engine

    def __len__(self) -> int:
        return self._native.size

    def __repr__(self) -> str:
        return f"<Batch of {len(self)} via {self.transport}, {'done' if self.done() else 'pending'}>"

    def done(self) -> bool:
        return self._native.done()

    def cancel(self) -> None:
        """Requests not yet on the wire are dropped (state "canceled"); slices already
        sent finish."""
        self._native.cancel()

    def _status(self):
        states, nbytes, errs = self._native.status()
        if self._order is not None:
            states, nbytes, errs = states[self._order], nbytes[self._order], errs[self._order]
        return states, nbytes, errs

    def status(self) -> list:
        states, nbytes, _ = self._status()
        return [TransferStatus(STATES[s], int(b)) for s, b in zip(states.tolist(), nbytes.tolist())]

    def wait(self, timeout: float | None = None) -> None:
        """Return when every request finished; raise the first failure.

        ``timeout`` (seconds) bounds this wait only: when it passes first,
        TransferTimeoutError is raised and the batch goes on. The batch's own deadline
        (``timeout_ms`` / ``MC_TRANSFER_TIMEOUT``) always holds: when it passes, pending
        requests are marked "timeout" and TransferTimeoutError is raised.
        """
        limit = self._deadline_ns
        own = timeout is not None
        if own:
            from .arguments import wait_timeout
            limit = min(limit, time.monotonic_ns() + int(wait_timeout(timeout) * 1e9))
        if not self._native.wait(limit):
            if not own or limit >= self._deadline_ns:
                self._native.expire()
            else:
                raise E.TransferTimeoutError(f"batch of {len(self)} requests not finished "
                                             f"within {timeout} s (it continues)")
        self.raise_for_status()

    def _target_names(self) -> str:
        return ", ".join(dict.fromkeys(str(p[0]) for p in self._parts)) or "the peer"

    def raise_for_status(self) -> None:
        states, _, errs = self._status()
        bad = (states != 1).nonzero()[0]
        if len(bad) == 0:
            ne = self._native.notify_error
            if ne == -1012:
                raise E.TransferError(
                    f"the data landed but {self._target_names()}'s notification queue is "
                    f"full (64 MiB or 65536 messages unread): the notification was dropped; "
                    f"the receiver must drain notifications() more often", status=ne)
            if ne:
                raise E.TransferError(f"the data landed but the notification was not "
                                      f"delivered (status {ne})", status=ne)
            return
        i = int(bad[0])
        code = int(errs[i]) or (-801 if states[i] == 3 else -805 if states[i] == 4 else -800)
        raise self._error(i, code)

    def _error(self, i: int, code: int) -> E.MooncakeError:
        """Exception for the caller's request ``i``."""
        native_i = int(self._order[i]) if self._order is not None else i
        for target, first, local, remote, lens, op in self._parts:
            if first <= native_i < first + len(local):
                k = native_i - first
                length = int(lens[k] if len(lens) > 1 else lens[0])
                if code in (-1006, -102) and self._engine is not None:
                    # Lost or restarted peer: re-resolve its descriptor before next use.
                    self._engine._peer_restarted(target)
                return error_for(code, target, i, op, int(local[k]), int(remote[k]), length)
        return E.TransferError(f"request {i} failed (status {code})", status=code)

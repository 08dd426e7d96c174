# SPDX-License-Identifier: Apache-2.0
"""Transfer requests, batches and their status."""
from __future__ import annotations

import enum
import time
from typing import NamedTuple

from . import errors as E
from .core import ST_CANCELED, ST_COMPLETED, ST_TIMEOUT


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


STATES = ("pending", "completed", "failed", "timeout", "canceled")   # by MTE_ST_* (status.h)


def error_for(code: int, target: str, index: int, op: int, local: int, remote: int,
              length: int) -> E.MooncakeError:
    """The exception for a failed request: the class that owns ``code``
    (:func:`mooncake_te.errors.error_class`), saying what failed and what to do."""
    what = f"request {index} ({Op(op).name} of {length} bytes, local {local:#x}, " \
           f"remote {remote:#x} in {target})"
    text = _message(code, what, target, op, local, remote, length)
    return E.error_class(code)(text, status=code if code < 0 else None)


def _message(code, what, target, op, local, remote, length) -> str:
    if code == E.ERR_ADDRESS_NOT_REGISTERED:
        return (f"{what} was refused by {target}: [{remote:#x}, {remote + length:#x}) is not "
                f"inside a region it registered; check the address against "
                f"open_segment({target!r}).buffers")
    if code == E.ERR_REMOTE_ACCESS:
        return (f"{what} was refused by {target}: the region does not allow remote "
                f"{'writes' if op == Op.WRITE else 'reads'} (registered with access='r' or "
                f"'local')")
    if code == E.ERR_LOCAL_NOT_REGISTERED:
        return (f"{what}: local [{local:#x}, {local + length:#x}) is not inside a region "
                f"registered with this engine (it was unregistered while the request was "
                f"queued)")
    if code == E.ERR_TRANSFER_TIMEOUT:
        return (f"{what} did not complete before its deadline; the peer may be overloaded, "
                f"hung or unreachable")
    if code == E.ERR_CANCELED:
        return f"{what} was canceled"
    if code == E.ERR_PEER_RESTARTED:
        return (f"{what}: {target} restarted (its instance id changed); its descriptor was "
                f"refreshed, re-resolve addresses with open_segment({target!r})")
    if code == E.ERR_AUTHENTICATION:
        return (f"{what}: {target} refused the data connection, or could not prove the "
                f"token: the engines' auth_token values differ")
    if code == E.ERR_WRONG_PEER:
        return (f"{what}: the engine that answered for segment {target!r} could not prove it "
                f"is {target!r} (it is another engine of the cluster, or the tokens differ): "
                f"the descriptor of {target!r} in the metadata store is stale or forged; "
                f"nothing was sent. Check the store's key for {target!r}")
    if code == E.ERR_NOTIFY_FULL:
        return (f"{what}: {target}'s notification queue is full (64 MiB or 65536 messages "
                f"unread); the receiver must drain notifications() more often")
    if code == E.ERR_SOCKET:
        return (f"{what}: the connection to {target} failed or was lost (peer dead, "
                f"restarted or unreachable)")
    if code == E.ERR_PROTOCOL:
        return (f"{what}: {target} broke the data protocol (a different mooncake_te "
                f"version, or not a mooncake_te data port)")
    if code == E.ERR_CLOSED:
        return (f"{what}: the connections to {target} were closed (engine closed, or the "
                f"peer was dropped after a failure or restart)")
    if code == E.ERR_CROSS_MEMORY:
        return (f"{what}: {target} could not copy to or from this process's memory "
                f"(same-host transport); the local buffer may be gone")
    if code == E.ERR_CUDA:
        return (f"{what}: a CUDA copy of GPU memory failed on one side (its staging or IPC "
                f"mapping); check that the GPU buffer is still allocated and the device "
                f"healthy (nvidia-smi)")
    if code == E.ERR_MEMORY:
        return (f"{what}: memory (or pinned staging memory for GPU buffers) ran out on one "
                f"side")
    for lo, hi, text in _status_texts:
        if lo <= code <= hi:
            msg = text(code, what, target, op, remote, length)
            if msg:
                return msg
    return f"{what} failed (status {code})"


# Texts that only a transport knows (RDMA work completions, a storage segment's errors),
# for the codes of src/core/status.h that transport owns. A transport registers them
# when it loads; nothing here imports a transport (layering: the batch sits below the
# transports). A completion can only carry such a code if that transport ran, so it has
# registered.
_status_texts: list = []      # [(lowest code, highest code, text function)]


def register_status_text(lo: int, hi: int, text) -> None:
    """Describe the status codes in [``lo``, ``hi``] with ``text(code, what, target, op,
    remote, length) -> str | None`` (``what``: "write of 64 bytes to ...", already
    worded; None: the generic text)."""
    if lo > hi:
        raise ValueError(f"empty code range [{lo}, {hi}]")
    _status_texts[:] = [r for r in _status_texts if r[:2] != (lo, hi)] + [(lo, hi, text)]


class Batch:
    """Requests in flight. ``wait`` blocks (with a deadline); ``done`` never blocks."""

    def __init__(self, native, transport: str, deadline_ns: int, parts: list,
                 on_peer_lost=None, order=None):
        self._native = native
        self._order = order            # caller's index -> native index (submit()), or None
        self.transport = transport
        self._deadline_ns = deadline_ns
        self._parts = parts            # [(target name, first, local, remote, lens, op)]
        # on_peer_lost(name): a request failed because the peer was lost or restarted;
        # the engine re-resolves it before its next use (injected: no engine here).
        self._on_peer_lost = on_peer_lost

    def __len__(self) -> int:
        return self._native.size

    def __repr__(self) -> str:
        return f"<Batch of {len(self)} via {self.transport}, {'done' if self.done() else 'pending'}>"

    def done(self) -> bool:
        """Whether every request has finished (completed, failed or canceled); never
        blocks."""
        return self._native.done()

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether the batch is over, never raising: True once every request finished,
        or once the batch's deadline passed (pending requests are then marked "timeout",
        as :meth:`wait` would). :meth:`raise_for_status` then says how it went. For a
        caller that checks once per step instead of waiting; ``timeout`` (seconds,
        default 0: do not block) lets it wait that long at most, the GIL released."""
        if self._native.done():
            return True
        if timeout > 0:
            from .arguments import wait_timeout
            limit = min(self._deadline_ns or (1 << 62),
                        time.monotonic_ns() + int(wait_timeout(timeout) * 1e9))
            if self._native.wait(limit):
                return True
        if self._deadline_ns and time.monotonic_ns() >= self._deadline_ns:
            self._native.expire()
            return True
        return False

    @property
    def elapsed(self) -> "float | None":
        """Seconds from submission until the last request finished and the notification,
        if any, was delivered; None while any request is pending. It is the transfer's own
        time, independent of when the caller looks (a caller that polls :meth:`done` once
        per step still gets the bandwidth the transport achieved)."""
        ns = self._native.elapsed_ns
        return None if ns < 0 else ns / 1e9

    def cancel(self) -> None:
        """Requests not yet on the wire are dropped (state "canceled"); slices already
        sent finish."""
        self._native.cancel()

    def _status(self):
        states, nbytes, errs = self._native.status()
        if self._order is not None:
            states, nbytes, errs = states[self._order], nbytes[self._order], errs[self._order]
        return states, nbytes, errs

    def status(self) -> "list[TransferStatus]":
        """Per-request state and bytes moved so far, in submission order; never blocks.

        Returns
        -------
        list of TransferStatus
            ``state`` is one of "pending", "completed", "failed", "timeout", "canceled"
            (``STATES``); ``transferred_bytes`` counts what reached its destination.
        """
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
        bad = (states != ST_COMPLETED).nonzero()[0]
        if len(bad) == 0:
            ne = self._native.notify_error
            if ne == E.ERR_NOTIFY_FULL:
                raise E.NotificationQueueFullError(
                    f"the data landed but {self._target_names()}'s notification queue is "
                    f"full (64 MiB or 65536 messages unread): the notification was dropped; "
                    f"the receiver must drain notifications() more often", status=ne)
            if ne:
                raise E.TransferError(f"the data landed but the notification was not "
                                      f"delivered (status {ne})", status=ne)
            return
        i = int(bad[0])
        code = int(errs[i]) or (E.ERR_TRANSFER_TIMEOUT if states[i] == ST_TIMEOUT else
                                E.ERR_CANCELED if states[i] == ST_CANCELED else
                                E.ERR_TRANSFER_FAIL)
        raise self._error(i, code)

    def _error(self, i: int, code: int) -> E.MooncakeError:
        """Exception for the caller's request ``i``."""
        native_i = int(self._order[i]) if self._order is not None else i
        for target, first, local, remote, lens, op in self._parts:
            if first <= native_i < first + len(local):
                k = native_i - first
                length = int(lens[k] if len(lens) > 1 else lens[0])
                if code in (E.ERR_PEER_RESTARTED, E.ERR_SOCKET) and \
                        self._on_peer_lost is not None:
                    # Lost or restarted peer: re-resolve its descriptor before next use.
                    self._on_peer_lost(target)
                return error_for(code, target, i, op, int(local[k]), int(remote[k]), length)
        return E.TransferError(f"request {i} failed (status {code})", status=code)

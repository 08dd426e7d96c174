# SPDX-License-Identifier: Apache-2.0
"""The target side of ``mooncake-te bench``, and how the initiator talks to it.

The target registers one buffer and otherwise only answers control messages. Control
(fill a pattern, check a pattern) travels as engine notifications rather than on a
socket of its own, so an initiator and a target on two hosts need nothing but the
engine's own ports, and the bench exercises the notification path as a side effect.

In loopback mode the target is a child process (``python -m mooncake_te.bench._child``)
that exits when its stdin reaches EOF: the parent closes it on the way out, and the
kernel closes it when the parent dies however it dies, so no target is ever orphaned.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import threading
import time

import numpy as np

from .._spawn import python_m
from . import pattern

PREFIX = b"mte-bench/1 "            # marks bench control messages among notifications


def _encode(obj: dict) -> bytes:
    return PREFIX + json.dumps(obj, separators=(",", ":")).encode()


def _decode(message: bytes):
    if not message.startswith(PREFIX):
        return None
    try:
        return json.loads(message[len(PREFIX):])
    except ValueError:
        return None


class BenchTarget:
    """An engine with one registered buffer that answers bench control messages.

    Parameters
    ----------
    buffer_size : int
        Bytes to register (peers may read and write all of it).
    **engine_kwargs
        Passed to :class:`mooncake_te.TransferEngine` (``host``, ``metadata``, ...).
    """

    def __init__(self, buffer_size: int, **engine_kwargs):
        from ..engine import TransferEngine
        self.engine = TransferEngine(**engine_kwargs)
        try:
            # Touch every page now: a first write into calloc'd zero pages would be
            # timed as transfer cost in the first point.
            self.buffer = np.empty(buffer_size, dtype=np.uint8)
            self.buffer.fill(0x5A)
            self.region = self.engine.register(self.buffer)
        except BaseException:
            self.engine.close()
            raise

    def info(self) -> dict:
        """What an initiator needs: segment name, buffer address and length, protocol."""
        return {"segment": self.engine.name, "address": self.region.address,
                "length": self.region.length, "protocol": self.engine.protocol,
                "pid": os.getpid()}

    def handle(self, request: dict) -> dict:
        """Run one control request and return the reply."""
        cmd = request.get("cmd")
        length = min(int(request.get("length", self.buffer.nbytes)), self.buffer.nbytes)
        if cmd == "ping":
            return {"ok": True}
        if cmd == "fill":
            pattern.fill(self.buffer, int(request["seed"]), length)
            return {"ok": True}
        if cmd == "check":
            seed = int(request["seed"])
            off = pattern.first_mismatch(self.buffer, seed, length)
            if off < 0:
                return {"ok": True, "checked": length}
            return {"ok": False, "offset": off, "got": int(self.buffer[off]),
                    "want": pattern.expected_byte(seed, off)}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def poll(self) -> int:
        """Answer the control messages that arrived; return how many."""
        n = 0
        for sender, message in self.engine.notifications():
            req = _decode(message)
            if req is None:
                continue
            try:
                reply = self.handle(req)
            except Exception as e:            # a bad request must not kill the target
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            reply["id"] = req.get("id")
            self.engine.send_notification(sender, _encode(reply))
            n += 1
        return n

    def serve(self, stop: threading.Event, interval: float = 0.005) -> None:
        """Answer control messages until ``stop`` is set.

        Polling every few ms costs nothing measurable and keeps the data path free of
        any control-plane thread of ours.
        """
        while not stop.is_set():
            if not self.poll():
                stop.wait(interval)

    def close(self) -> None:
        self.engine.close()


class TargetControl:
    """The initiator's handle on a bench target: control requests over notifications.

    Parameters
    ----------
    engine : TransferEngine
        The initiator's engine.
    segment : str
        The target's segment name.
    """

    def __init__(self, engine, segment: str):
        self.engine = engine
        self.segment = segment
        self._next = 0

    def request(self, cmd: str, timeout: float = 60.0, **fields) -> dict:
        """Send ``cmd`` and wait for its reply.

        Raises
        ------
        TimeoutError
            When no reply came; the target may be an engine that is not a bench
            target, or it cannot reach this host's address to answer.
        """
        self._next += 1
        rid = self._next
        self.engine.send_notification(self.segment, _encode({"id": rid, "cmd": cmd, **fields}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, message in self.engine.notifications():
                reply = _decode(message)
                if reply is not None and reply.get("id") == rid:
                    return reply
            time.sleep(0.002)
        raise TimeoutError(
            f"the target {self.segment} did not answer {cmd!r} within {timeout:.0f} s; is it "
            f"running `mooncake-te bench --mode target`, and can it reach {self.engine.name}?")


class LoopbackTarget:
    """A bench target in a child process on this host; a context manager.

    Parameters
    ----------
    host : str
        Address the target engine serves on (127.0.0.1 for loopback).
    buffer_size : int
        Bytes the target registers.
    metadata, protocol : str, optional
        Passed to the target's engine.
    start_timeout : float
        Seconds to wait for the target to report its segment.
    """

    def __init__(self, host: str, buffer_size: int, metadata: str | None = None,
                 protocol: str | None = None, start_timeout: float = 60.0,
                 devices: str | None = None):
        cmd = python_m("mooncake_te.bench._child") + ["--host", host,
                                                      "--buffer-size", str(buffer_size)]
        if metadata:
            cmd += ["--metadata", metadata]
        if protocol:
            cmd += ["--protocol", protocol]
        if devices:
            cmd += ["--devices", devices]
        env = dict(os.environ)
        # The child must import this same mooncake_te, installed or not.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        try:
            self.info = self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise RuntimeError(f"the bench target (pid {self.proc.pid}) did not start "
                                   f"within {timeout:.0f} s")
        finally:
            sel.close()
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise RuntimeError(f"the bench target exited with status {rc} before it was "
                               f"ready (its error is printed above)")
        return json.loads(line)

    @property
    def segment(self) -> str:
        return self.info["segment"]

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child: EOF on its stdin, then SIGKILL if it has not gone. Idempotent."""
        p = self.proc
        if p.returncode is not None:
            return
        try:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        finally:
            if p.stdout and not p.stdout.closed:
                p.stdout.close()

    def __enter__(self) -> "LoopbackTarget":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

# SPDX-License-Identifier: Apache-2.0
"""An in-process transport for routing tests: a real implementation of the transport
contract (``mooncake_te.transports.base``) that moves bytes with ``memmove`` between
engines of this process. No sockets, no threads: a request is copied and finished inside
``submit``.

It shows what adding a transport takes: this class plus one registration point
(``mooncake_te.transports.register``). What it declares is all the rest of the package
learns about it: its ``protocol=`` name (``serves``), its ``[transfer_engine]`` key with
an ``MC_*`` variable (``settings``), a foreign name for its protocol
(``protocol_aliases``), a variable that forces it (``force_env``), its counters and a
status text (tests/transports/test_fake_settings.py checks each reaches config.toml,
the environment, the vLLM connector's settings, metrics and error messages). Its behaviour is set per class (make a subclass
with ``fake_class(...)``) so one test can run several side by side.
"""
from __future__ import annotations

import ctypes
import itertools
import threading

import numpy as np

from mooncake_te.config import Setting
from mooncake_te.core import ACC_READ, ACC_WRITE
from mooncake_te.transports.base import Capabilities, DeviceCounter, Transport

_ERR_REMOTE_NOT_REG = -3        # src/core/status.h: MTE_E_REMOTE_NOT_REG
_ERR_LOCAL_NOT_REG = -1003      # MTE_E_LOCAL_NOT_REG
_ERR_CLOSED = -1008             # MTE_E_CLOSED

_live: dict = {}                # fake id -> transport (the peers this process holds)
_ids = itertools.count(1)
_lock = threading.Lock()


def _declarations(name: str) -> dict:
    """What a fake transport called ``name`` declares besides its class: one key, its
    variable, a foreign protocol name and a forcing variable, all named after it."""
    return {"settings": (Setting(f"{name}_delay_us", (int,), 0,
                                 bounds=(0, 10 ** 6, "microseconds, 0 to 1000000"),
                                 env=((f"MC_{name.upper()}_DELAY_US", int),)),),
            "protocol_aliases": {f"mooncake_{name}": name},
            "force_env": {f"MC_FORCE_{name.upper()}": name}}


class FakeTransport(Transport):
    """Reaches engines of this process that run a fake transport of the same ``name``."""

    name = "fake"
    capabilities = Capabilities(sync=True)
    serves: tuple = ("auto", "fake")
    priority = 10                    # asked before TCP (40)
    settings = _declarations("fake")["settings"]
    protocol_aliases = _declarations("fake")["protocol_aliases"]
    force_env = _declarations("fake")["force_env"]
    device_counter_defs = (DeviceCounter("copies", "copies", "Requests the fake copied"),
                           DeviceCounter("bytes", "copied_bytes", "Bytes the fake copied"))

    def __init__(self, ctx):
        self.ctx = ctx
        self.regions = ctx.regions
        self.id = f"{self.name}-{next(_ids)}"
        self.calls: dict = {"route": 0, "submit": 0, "transfer_sync": 0}
        self.delay_us = ctx.config.get(f"{self.name}_delay_us", 0)     # its own key
        self.refuse: set = set()    # peer names this transport will not route (a test's knob)
        self.fail_with = 0          # a status code every request then fails with (a knob)
        self.copied = [0, 0]        # requests, bytes (its device counters)
        self.closed = False
        with _lock:
            _live[self.id] = self

    # --- the contract ----------------------------------------------------------------
    def describe(self) -> dict:
        return {f"{self.name}_id": self.id}

    def _other(self, desc):
        with _lock:
            return _live.get(desc.extra.get(f"{self.name}_id", ""))

    def route(self, desc, op, local, remote):
        self.calls["route"] += 1
        if self.closed or desc.name in self.refuse:
            return None
        return self.name if self._other(desc) is not None else None

    def _copy(self, other, op, src, dst, n) -> int:
        """One request: 0 or a status code, with both sides' tables checked."""
        if self.fail_with:
            return self.fail_with
        if other is None or other.closed or self.closed:
            return _ERR_CLOSED
        if self.regions.check(src, n, ACC_READ if op == 1 else 0) != 0:
            return _ERR_LOCAL_NOT_REG
        if other.regions.check(dst, n, ACC_WRITE if op == 1 else ACC_READ) != 0:
            return _ERR_REMOTE_NOT_REG
        if op == 1:
            ctypes.memmove(dst, src, n)
        else:
            ctypes.memmove(src, dst, n)
        self.copied[0] += 1
        self.copied[1] += n
        return 0

    def submit(self, batch, desc, op, local, remote, lens, first, run_inline):
        self.calls["submit"] += 1
        other = self._other(desc)
        lens = np.asarray(lens, np.uint64)
        for j in range(len(local)):
            n = int(lens[j] if len(lens) == len(local) else lens[0])
            batch.begin(first + j, 1)
            err = self._copy(other, op, int(local[j]), int(remote[j]), n)
            batch.finish(first + j, 0 if err else n, err)
        return self.name

    def transfer_sync(self, desc, op, local, remote, length, deadline_ns, cell=0):
        # One request through a one-request batch, so the core counts it in ``cell``
        # exactly as it counts a batch (src/core/metrics.h).
        self.calls["transfer_sync"] += 1
        b = self.ctx.new_batch(1, deadline_ns)
        if cell:
            b.tag(0, 1, cell)
        b.begin(0, 1)
        err = self._copy(self._other(desc), op, local, remote, length)
        b.finish(0, 0 if err else length, err)
        b.seal()
        b.wait(deadline_ns)
        _, _, errs = b.status()
        return self.name, int(errs[0])

    def counters(self):
        # Engine-wide counters: the fake holds no connection; what it reports is added to
        # the other transports' (one notification "received" per copied request, so a
        # test can tell the sum from TCP's alone).
        return {"notifications_received": self.copied[0], "queued": {"fake-peer": 1}}

    def device_counters(self):
        return {"memmove": {"copies": self.copied[0], "bytes": self.copied[1]}}

    def close(self):
        self.closed = True
        with _lock:
            _live.pop(self.id, None)


def fake_class(name: str = "fake", priority: int = 10, **caps):
    """A FakeTransport subclass called ``name`` (its protocol and route name) with
    ``caps`` as its Capabilities (default: sync only)."""
    return type(f"Fake_{name}", (FakeTransport,),
                {"name": name, "priority": priority, "serves": ("auto", name),
                 "capabilities": Capabilities(**({"sync": True} | caps)),
                 **_declarations(name)})

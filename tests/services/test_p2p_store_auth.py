# SPDX-License-Identifier: Apache-2.0
"""The P2P store's control port is guarded like the engine's RPC port (issue #20 item 9):
with the engine's auth_token a peer proves the token before its first request; without
it, nothing is answered. Its accept loop sheds floods and keeps serving."""
from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.errors import AuthenticationError
from mooncake_te.metadata import framing
from mooncake_te.p2p_store import P2PStore
from mooncake_te.p2p_store.control import FRAME, ControlClient

TOKEN = b"p2p-cluster-secret"


@pytest.fixture
def seed_store():
    eng = mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN)
    store = P2PStore(eng, metadata="p2p")
    yield eng, store
    store.close()
    eng.close()


def _raw_request(address: str, request: dict) -> tuple[int, dict]:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        framing.send_frame(s, FRAME, json.dumps(request).encode())
        kind, raw = framing.recv_frame(s)
        return kind, json.loads(raw)


def test_control_port_refuses_unauthenticated_requests(seed_store):
    eng, store = seed_store
    data = np.arange(1 << 16, dtype=np.uint8)
    store.register("obj", data)
    kind, reply = _raw_request(store.address, {"op": "list"})
    assert kind == framing.AUTH_FAILED and "auth_token" in reply["reply_msg"]
    deadline = time.monotonic() + 5         # counted just after the refusal is sent
    while store._server.auth_failures < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store._server.auth_failures == 1
    with pytest.raises(AuthenticationError, match="does not authenticate|differ"):
        ControlClient(store.address, 2.0, b"wrong-token").call({"op": "list"})
    reply = ControlClient(store.address, 2.0, TOKEN).call({"op": "list"})
    assert reply["ok"]


def test_stores_with_a_token_share_objects(seed_store):
    eng, store = seed_store
    data = np.random.default_rng(3).integers(0, 256, 1 << 18, dtype=np.uint8)
    store.register("obj", data)
    with mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN) as eng2:
        getter = P2PStore(eng2, metadata="p2p", seeds=[store.address])
        try:
            got = getter.get("obj")
            assert bytes(got) == data.tobytes()
        finally:
            getter.close()


def test_getter_without_the_token_is_refused(seed_store):
    eng, store = seed_store
    store.register("obj", np.zeros(1 << 16, np.uint8))
    with mte.TransferEngine(host="127.0.0.1") as eng2:
        getter = P2PStore(eng2, metadata="p2p", seeds=[store.address])
        try:
            with pytest.raises(mte.errors.MooncakeError):
                getter.get("obj")
        finally:
            getter.close()


def test_control_port_sheds_a_flood_and_keeps_serving(seed_store):
    from mooncake_te.p2p_store import control
    eng, store = seed_store
    host, port = store.address.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=5)
             for _ in range(control.MAX_PER_PEER + 10)]
    time.sleep(0.5)
    assert store._server.shed >= 10
    for s in socks:
        s.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert ControlClient(store.address, 2.0, TOKEN).call({"op": "list"})["ok"]
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)

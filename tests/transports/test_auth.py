# SPDX-License-Identifier: Apache-2.0
"""Peer authentication: mutual HMAC challenge-response on RPC and data connections."""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te.transports.tcp._tcp import hmac_sha256
from peers import PeerProcess

TOKEN = b"correct horse battery staple"


@pytest.mark.parametrize("key,data", [(b"", b""), (b"k" * 100, b"x" * 1000),
                                      (b"key", b"The quick brown fox jumps over the lazy dog"),
                                      (os.urandom(64), os.urandom(63))])
def test_native_hmac_matches_python(key, data):
    assert hmac_sha256(key, data) == hmac.new(key, data, hashlib.sha256).digest()


@pytest.fixture
def guarded_peer():
    p = PeerProcess(1 << 20, auth_token=TOKEN.decode())
    yield p
    p.close()


def test_same_token_moves_data(guarded_peer):
    with mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN) as eng:
        buf = np.arange(65536, dtype=np.uint8)
        r = eng.register(buf)
        eng.write(guarded_peer.name, r.address, guarded_peer.address, 65536)
        assert guarded_peer.call("get", guarded_peer.address, 65536) == buf.tobytes()


@pytest.mark.parametrize("token", [None, "wrong token"])
def test_wrong_or_missing_token_is_refused(guarded_peer, token):
    before = guarded_peer.call("sha", guarded_peer.address, 1 << 20)
    with mte.TransferEngine(host="127.0.0.1", auth_token=token) as eng:
        r = eng.register(np.full(4096, 0xEE, np.uint8))
        with pytest.raises(mte.AuthenticationError):
            eng.open_segment(guarded_peer.name)
        with pytest.raises(mte.AuthenticationError):
            eng.write(guarded_peer.name, r.address, guarded_peer.address, 4096)
    assert guarded_peer.call("sha", guarded_peer.address, 1 << 20) == before


def test_token_on_the_initiator_only_is_refused(peer):
    with mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN) as eng:
        with pytest.raises(mte.AuthenticationError, match="does not authenticate"):
            eng.open_segment(peer.name)


def _data_port(eng, name):
    # The descriptor is public to token holders; we are one here.
    return eng.open_segment(name).descriptor.tcp_data_port


def _hello(nonce: bytes, name: bytes, instance=1) -> bytes:
    return (struct.pack("<IIQII", 0x4845544D, 2, instance, len(name), 1) + nonce
            + struct.pack("<QQ", 0, 0) + name)


def _recv(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "server closed"
        out += chunk
    return out


def test_data_hello_proof_cannot_be_replayed():
    """Speak the data-connection hello by hand: a correct proof works once; replaying it
    on a new connection (the server picks a fresh nonce) is refused, and no request is
    read after a refusal."""
    with mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN) as target, \
            mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN) as helper:
        buf = np.zeros(4096, np.uint8)
        r = target.register(buf)
        port = _data_port(helper, target.name)
        name, cn = b"intruder", os.urandom(16)

        def handshake(proof_for=None):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(_hello(cn, name))
            reply = _recv(s, 72)
            magic, status, inst = struct.unpack("<IiQ", reply[:16])
            sn, sproof = reply[16:32], reply[32:64]
            assert status == 0
            assert sproof == hmac.new(TOKEN, b"mte-data-server" + cn + sn + reply[8:16],
                                      hashlib.sha256).digest()
            proof = proof_for or hmac.new(TOKEN, b"mte-data-client" + sn + cn + name,
                                          hashlib.sha256).digest()
            s.sendall(proof)
            return s, proof, struct.unpack("<Ii", _recv(s, 8))[1]

        s1, proof, status = handshake()
        assert status == 0
        # Authenticated: a WRITE of 4 bytes lands.
        s1.sendall(struct.pack("<IHHQQQ", 0x3245544D, 1, 0, 0, r.address, 4) + b"\x01\x02\x03\x04")
        assert struct.unpack("<IiQQ", _recv(s1, 24))[1] == 0
        assert bytes(buf[:4]) == b"\x01\x02\x03\x04"
        s1.close()
        failures = target.stats()["auth_failures"]
        s2, _, status = handshake(proof_for=proof)          # the recorded proof, replayed
        assert status == -803
        # Whatever it sends next is not applied: the server has closed the connection.
        try:
            s2.sendall(struct.pack("<IHHQQQ", 0x3245544D, 1, 0, 0, r.address, 4) + b"\xff" * 4)
            assert s2.recv(24) == b""
        except OSError:
            pass
        s2.close()
        assert bytes(buf[:4]) == b"\x01\x02\x03\x04"
        assert target.stats()["auth_failures"] == failures + 1


def test_rpc_requires_auth_when_token_set():
    from mooncake_te.metadata import framing
    from mooncake_te.metadata.p2p import split_host_port
    with mte.TransferEngine(host="127.0.0.1", auth_token=TOKEN) as eng:
        host, port = split_host_port(eng.name)
        with pytest.raises(mte.AuthenticationError, match="authentication required"):
            framing.request(host, port, framing.METADATA, b"{}", 2.0)
        assert b'"buffers"' in framing.request(host, port, framing.METADATA, b"{}", 2.0,
                                               token=TOKEN)
        with pytest.raises(mte.AuthenticationError):
            framing.request(host, port, framing.METADATA, b"{}", 2.0, token=b"nope")
        assert eng.stats()["auth_failures"] >= 1


def test_token_validation():
    with pytest.raises(mte.InvalidArgumentError, match="1 to 256"):
        mte.TransferEngine(host="127.0.0.1", auth_token=b"x" * 300)
    with pytest.raises(mte.InvalidArgumentError, match="str or bytes"):
        mte.TransferEngine(host="127.0.0.1", auth_token=1234)

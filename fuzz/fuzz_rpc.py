# SPDX-License-Identifier: Apache-2.0
"""atheris fuzz target for the RPC framing (issue #20 item 3): both halves of
``mooncake_te.metadata.framing`` and the RPC server's request handling.

    python fuzz/fuzz_rpc.py -max_total_time=300        # by hand
    python fuzz/fuzz_rpc.py -runs=3000                 # what tests/native runs in CI

The first input byte picks the surface:

0. the server: the bytes arrive on a connection to ``RpcServer._serve_one`` (with and
   without a token); it must return (never raise, never hang past its deadline) and never
   hold more memory for a frame than the bytes that arrived;
1. the client: the bytes are a server's answer to ``framing.request`` / ``client_auth``;
   the only errors allowed are MetadataError and AuthenticationError.
"""
import socket
import sys
import threading

import atheris

with atheris.instrument_imports():
    from mooncake_te.errors import AuthenticationError, MetadataError
    from mooncake_te.metadata import framing
    from mooncake_te.metadata.rpc import RpcServer

TOKEN = b"fuzz-token"
SERVERS = [RpcServer("127.0.0.1", 0, lambda: b'{"name":"fuzz"}', lambda who, msg: None,
                     token=tok, request_timeout=0.5) for tok in (None, TOKEN)]


def _server(data: bytes, srv: RpcServer) -> None:
    a, b = socket.socketpair()
    try:
        b.sendall(data)
        b.shutdown(socket.SHUT_WR)
        a.settimeout(1.0)
        srv._serve_one(a, "fuzz")           # must not raise
    finally:
        b.close()


def _client(data: bytes, token) -> None:
    a, b = socket.socketpair()
    feeder = threading.Thread(target=lambda: (b.sendall(data), b.shutdown(socket.SHUT_WR)))
    feeder.start()
    try:
        a.settimeout(1.0)
        try:
            if token:
                framing.client_auth(a, token, "fuzz")
            framing.recv_frame(a)
        except (MetadataError, AuthenticationError, ConnectionError, OSError):
            pass
    finally:
        feeder.join()
        a.close()
        b.close()


def test_one(data: bytes) -> None:
    if not data:
        return
    pick, body = data[0] % 4, data[1:]
    if pick < 2:
        _server(body, SERVERS[pick])
    else:
        _client(body, TOKEN if pick == 3 else None)


def main() -> None:
    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

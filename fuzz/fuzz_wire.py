# SPDX-License-Identifier: Apache-2.0
"""atheris fuzz target for everything a peer can send us: the data-path hello and
request headers, the RPC framing, and the descriptor JSON.

Run by hand for long runs; CI runs a bounded number of inputs (tests/native/test_fuzz.py),
and the hypothesis tests in tests/transports/test_robustness.py cover the same surfaces:

    pip install atheris
    python fuzz/fuzz_wire.py -max_total_time=300

The first input byte picks the surface. After each input the engine must still serve a
well-formed transfer, or the fuzzer stops with the input that broke it.
"""
import socket
import struct
import sys

import atheris

with atheris.instrument_imports():
    import numpy as np

    import mooncake_te as mte
    from mooncake_te.metadata import SegmentDescriptor, framing
    from mooncake_te.metadata.p2p import split_host_port

TARGET = mte.TransferEngine(host="127.0.0.1")
INITIATOR = mte.TransferEngine(host="127.0.0.1")
DST = TARGET.register(np.zeros(1 << 20, np.uint8))
SRC = INITIATOR.register(np.ones(1 << 20, np.uint8))
DATA_PORT = INITIATOR.open_segment(TARGET.name).descriptor.tcp_data_port
RPC = split_host_port(TARGET.name)
HELLO = struct.pack("<IIQII", 0x4845544D, 2, 7, 6, 0) + b"\0" * 32 + b"fuzzer"
COUNT = 0


def _send(port, data):
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass


def TestOneInput(data: bytes):
    global COUNT
    if not data:
        return
    surface, body = data[0] % 4, data[1:]
    if surface == 0:
        _send(DATA_PORT, HELLO + body)          # requests after a valid hello
    elif surface == 1:
        _send(DATA_PORT, body)                  # a hostile hello
    elif surface == 2:
        _send(RPC[1], body)                     # RPC frames
    else:
        try:
            SegmentDescriptor.decode(body)
        except mte.MetadataError:
            pass
    COUNT += 1
    if COUNT % 50 == 0:                         # the engine still serves honest peers
        INITIATOR.write(TARGET.name, SRC.address, DST.address, 4096, timeout=10)


atheris.Setup(sys.argv, TestOneInput)
atheris.Fuzz()

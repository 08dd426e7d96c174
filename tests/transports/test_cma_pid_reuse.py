# SPDX-License-Identifier: Apache-2.0
"""Same-host copies and pid reuse (issue #20 item 10).

A same-uid client connects to the target's unix socket, passes the CMA probe, hands the
socket to its parent and exits. Its pid is then given (ns_last_pid) to an unrelated
process holding a secret at the address the parent names. The target must not copy that
process's memory: it copies only while the process that connected is alive (pidfd)."""
from __future__ import annotations

import ctypes
import os
import socket
import struct

import numpy as np
import pytest

import mooncake_te as mte

MAGIC_HELLO, MAGIC_REQ, MAGIC_RESP = 0x4845544D, 0x3245544D, 0x5245544D
OP_WRITE_CMA = 4
N = 4096


def _recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        k = s.recv(n - len(buf))
        if not k:
            raise ConnectionError("closed")
        buf += k
    return buf


def _set_last_pid(pid: int) -> bool:
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK),
                    reason="cannot choose the next pid (/proc/sys/kernel/ns_last_pid)")
def test_reused_pid_is_not_copied_from():
    target = mte.TransferEngine(host="127.0.0.1")
    try:
        desc = target.open_segment(target.name).descriptor
        uds = desc.extra.get("shm_socket")
        if not uds:
            pytest.skip("the target has no same-host socket")
        dst = np.zeros(N, np.uint8)
        region = target.register(dst)
        secret = np.frombuffer(b"S3CR3T!!" * (N // 8), np.uint8).copy()   # in every fork
        probe = np.frombuffer(os.urandom(8), np.uint8).copy()
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

        pid = os.fork()
        if pid == 0:                                  # the client that connects and leaves
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect("\0" + uds)
                name = b"leaver"
                s.sendall(struct.pack("<IIQII", MAGIC_HELLO, 2, 7, len(name), 0)
                          + os.urandom(16)
                          + struct.pack("<Q", probe.ctypes.data) + probe.tobytes() + name)
                reply = _recv_exact(s, 72)
                cma = struct.unpack_from("<I", reply, 64)[0] & 1
                socket.send_fds(child_end, [bytes([cma])], [s.fileno()])
            finally:
                os._exit(0)
        msg, fds, _, _ = socket.recv_fds(parent_end, 1, 1)
        os.waitpid(pid, 0)                            # reaped: its pid is free
        conn = socket.socket(fileno=fds[0])
        if msg != b"\x01":
            pytest.skip("the target did not offer same-host copies to the client")

        # An unrelated process under the dead client's pid, holding the secret.
        victim = None
        for _ in range(50):
            if not _set_last_pid(pid - 1):
                break
            r, w = os.pipe()
            v = os.fork()
            if v == 0:
                os.close(w)
                os.read(r, 1)                          # lives until the parent says
                os._exit(0)
            os.close(r)
            if v == pid:
                victim = (v, w)
                break
            os.close(w)
            os.waitpid(v, 0)
        if victim is None:
            pytest.skip("could not place a process under the reused pid")
        try:
            conn.sendall(struct.pack("<IIQQQ", MAGIC_REQ, OP_WRITE_CMA, 0, region.address, N)
                         + struct.pack("<Q", secret.ctypes.data))
            conn.settimeout(10)
            resp = _recv_exact(conn, 24)
            magic, status = struct.unpack_from("<Ii", resp)
            assert magic == MAGIC_RESP
            assert status != 0, "the target copied from a process that never connected"
            assert not dst.any(), "the secret of an unrelated process reached the target"
        finally:
            os.close(victim[1])
            os.waitpid(victim[0], 0)
            conn.close()
    finally:
        target.close()

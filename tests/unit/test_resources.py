# SPDX-License-Identifier: Apache-2.0
"""The compiled tier's lifetime discipline (mooncake_te.core._core.Resource), on real
native objects: the TCP server and peers, and storage devices."""
import gc
import os
import pickle

import numpy as np
import pytest

from mooncake_te import errors as E
from mooncake_te.core import NativeBatch, OP_WRITE, Regions, now_ns
from mooncake_te.transports.nvmeof._nvmeof import Device
from mooncake_te.transports.tcp._tcp import Peer, TcpServer


def _server(regions):
    return TcpServer(regions, "127.0.0.1", 0, "resource-test", 7)


def test_close_is_idempotent_and_with_closes():
    regions = Regions()
    with _server(regions) as srv:
        assert not srv.closed and srv.port > 0
    assert srv.closed
    srv.close()
    srv.close()


def test_closed_objects_raise_closed_error():
    regions = Regions()
    srv = _server(regions)
    peer = Peer(srv, "127.0.0.1", srv.port, 7, 1, 1 << 20)
    peer.close()
    with pytest.raises(E.ClosedError, match="closed") as ei:
        peer.transfer_sync(OP_WRITE, 0, 0, 8, now_ns() + 10**9)
    assert ei.value.status == E.ERR_CLOSED
    assert isinstance(ei.value, RuntimeError)          # what a closed peer raised before
    with pytest.raises(E.ClosedError):
        peer.submit(NativeBatch(1, 0), OP_WRITE, np.zeros(1, np.uint64), np.zeros(1, np.uint64),
                    np.ones(1, np.uint64), 0)
    srv.close()
    with pytest.raises(E.ClosedError, match="TCP server"):
        Peer(srv, "127.0.0.1", 1, 7, 1, 1 << 20)


def test_a_leaked_object_warns_and_is_released():
    regions = Regions()
    srv = _server(regions)
    port = srv.port
    with pytest.warns(ResourceWarning, match="unclosed TcpServer"):
        del srv
        gc.collect()
    # Released: the port can be bound again.
    again = TcpServer(regions, "127.0.0.1", port, "again", 8)
    again.close()


def test_a_shut_down_peer_is_freed_quietly(recwarn):
    regions = Regions()
    srv = _server(regions)
    peer = Peer(srv, "127.0.0.1", srv.port, 7, 1, 1 << 20)
    peer.shutdown()               # freed once no batch names it: no warning then
    del peer
    gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]
    srv.close()


def test_storage_device_closes_like_the_others(tmp_path):
    path = tmp_path / "disk.img"
    path.write_bytes(b"\0" * (1 << 20))
    regions = Regions()
    with Device(str(path), regions, threads=2) as dev:
        assert dev.size == 1 << 20
    assert dev.closed and dev.close() is False
    assert dev.transfer(OP_WRITE, 0, 0, 8, now_ns() + 10**9) == E.ERR_CLOSED


def test_a_forked_child_does_not_tear_down_the_parents_objects():
    regions = Regions()
    srv = _server(regions)
    pid = os.fork()
    if pid == 0:                   # child: closing must not stop the parent's threads
        try:
            srv.close()
            os._exit(0 if srv.closed else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    # The parent's server still answers: a transfer to it completes.
    buf = np.zeros(4096, np.uint8)
    src = np.arange(4096, dtype=np.uint8)
    regions.add(buf.ctypes.data, buf.nbytes, 3)
    regions.add(src.ctypes.data, src.nbytes, 0)
    peer = Peer(srv, "127.0.0.1", srv.port, 7, 1, 1 << 20)
    rc = peer.transfer_sync(OP_WRITE, src.ctypes.data, buf.ctypes.data, 4096, now_ns() + 5 * 10**9)
    assert rc == 0 and (buf == src).all()
    peer.close()
    srv.close()


def test_closed_error_pickles():
    e = E.ClosedError("the TCP peer x:1 is closed")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is E.ClosedError and back.status == E.ERR_CLOSED


def test_native_os_errors_are_mooncake_errors_with_the_errno():
    import errno
    regions = Regions()
    with _server(regions) as srv:
        with pytest.raises(E.NativeOSError, match="cannot listen") as ei:
            TcpServer(regions, "127.0.0.1", srv.port, "second", 9)
    assert isinstance(ei.value, OSError) and isinstance(ei.value, E.MooncakeError)
    assert ei.value.errno == errno.EADDRINUSE
    with pytest.raises(E.NativeOSError, match="cannot open") as ei:
        Device("/nonexistent/disk.img", regions)
    assert ei.value.errno == errno.ENOENT

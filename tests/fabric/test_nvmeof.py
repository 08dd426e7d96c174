# SPDX-License-Identifier: Apache-2.0
"""NVMe-oF: targets, host connections, storage segments and their data path.

Tests marked ``nvmeof`` make real nvmet targets through configfs and connect to them
over nvme-tcp (and nvme-rdma over Soft-RoCE), so they run where the kernel has nvmet:
in the fabric lab guest on machines without it (tests/fabric.py). The others run
anywhere: argument checks, errors on a machine without configfs, and storage segments
backed by a plain file on this host (the publishing host's own route).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import errors as E
from mooncake_te import nvmeof_admin as nvmeof
from mooncake_te.cli.main import main as cli_main

from peers import PeerProcess


def _nqn(tag: str) -> str:
    return f"nqn.2026-12.io.mooncake-te:test-{tag}-{uuid.uuid4().hex[:8]}"


def _cli(*args, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "mooncake_te", "nvmeof", *args],
                       capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


# --------------------------------------------------------------------------- anywhere

@pytest.mark.parametrize("argv", [["nvmeof", "--help"], ["nvmeof", "target", "--help"],
                                  ["nvmeof", "target", "create", "--help"],
                                  ["nvmeof", "connect", "--help"], ["nvmeof", "list", "--help"]])
def test_cli_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: mooncake-te nvmeof" in out


def test_cli_requires_address_and_checks_values(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["nvmeof", "connect", "nqn.2026-12.io.x:y"])
    assert e.value.code == 2
    assert "--address" in capsys.readouterr().err
    assert cli_main(["nvmeof", "connect", "nqn.2026-12.io.x:y", "-a", "127.0.0.1",
                     "-s", "70000"]) == 1
    assert "service_id must be a port number" in capsys.readouterr().err
    assert cli_main(["nvmeof", "connect", "not-an-nqn", "-a", "127.0.0.1"]) == 1
    assert "is not an NVMe Qualified Name" in capsys.readouterr().err
    assert cli_main(["nvmeof", "connect", "nqn.2026-12.io.x:y", "-a", "host.example"]) == 1
    assert "IPv4 or IPv6 address" in capsys.readouterr().err


def test_argument_errors_say_what_to_do(tmp_path):
    with pytest.raises(E.InvalidArgumentError, match="NVMe Qualified Name"):
        nvmeof.create_target("pool0", str(tmp_path))
    with pytest.raises(E.InvalidArgumentError, match="transport must be one of tcp, rdma"):
        nvmeof.create_target("nqn.2026-12.io.x:y", str(tmp_path), transport="fc")
    with pytest.raises(E.DeviceNotFoundError, match="does not exist"):
        nvmeof.create_target("nqn.2026-12.io.x:y", str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.touch()
    with pytest.raises(E.InvalidArgumentError, match="is empty; give it a size"):
        nvmeof.create_target("nqn.2026-12.io.x:y", str(empty))
    with pytest.raises(E.InvalidArgumentError, match="neither a block device nor"):
        nvmeof.create_target("nqn.2026-12.io.x:y", str(tmp_path))
    with pytest.raises(E.InvalidArgumentError, match="ctrl_loss_tmo"):
        nvmeof.connect("nqn.2026-12.io.x:y", "127.0.0.1", ctrl_loss_tmo=-5)
    with pytest.raises(E.DeviceNotFoundError, match="not connected to"):
        nvmeof.disconnect("nqn.2026-12.io.x:never-connected")


@pytest.mark.skipif(os.path.isdir("/sys/kernel/config/nvmet"), reason="this kernel has nvmet")
def test_missing_configfs_or_nvmet_is_a_clear_error(tmp_path):
    img = tmp_path / "img"
    img.write_bytes(b"\0" * 4096)
    with pytest.raises(E.TransportUnavailableError, match=r"configfs|modprobe nvmet") as e:
        nvmeof.create_target("nqn.2026-12.io.x:y", str(img))
    assert "modprobe nvmet" in str(e.value) or "mount -t configfs" in str(e.value)
    with pytest.raises(E.TransportUnavailableError):
        nvmeof.list_targets()


def test_register_storage_checks_arguments(tmp_path):
    img = tmp_path / "img"
    img.write_bytes(b"\0" * 65536)
    with mte.TransferEngine(host="127.0.0.1") as eng:
        with pytest.raises(E.InvalidArgumentError, match="without '/'"):
            eng.register_storage("a/b", path=str(img))
        with pytest.raises(E.InvalidArgumentError, match="give path="):
            eng.register_storage("disk")
        with pytest.raises(E.InvalidArgumentError, match="larger than"):
            eng.register_storage("disk", path=str(img), size=1 << 20)
        with pytest.raises(E.DeviceNotFoundError, match="neither exported"):
            eng.register_storage("disk", nqn="nqn.2026-12.io.x:not-here")
        seg = eng.register_storage("disk", path=str(img))
        with pytest.raises(E.InvalidArgumentError, match="registered already"):
            eng.register_storage("disk", path=str(img))
        assert [s.name for s in eng.storage] == [f"{eng.name}/disk"]
        eng.unregister_storage(seg)
        assert eng.storage == []
        with pytest.raises(E.SegmentNotFoundError):
            eng.unregister_storage("disk")


def test_file_storage_on_the_publishing_host(tmp_path):
    """The publishing host reaches its own storage segment through the backing file:
    unaligned memory, offsets and lengths; bounds; a peer in another process."""
    size = 4 << 20
    img = tmp_path / "img"
    with open(img, "wb") as f:
        f.truncate(size)
    rng = np.random.default_rng(7)
    with mte.TransferEngine(host="127.0.0.1") as owner:
        seg = owner.register_storage("disk", path=str(img))
        buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        back = np.zeros_like(buf)
        r, rb = owner.register(buf), owner.register(back)
        owner.write(seg.name, r.address + 3, 4095, 200001)
        owner.read(seg.name, rb.address + 1, 4095, 200001)
        assert (back[1:200002] == buf[3:200004]).all()
        assert img.read_bytes()[4095:4095 + 200001] == buf[3:200004].tobytes()
        before = img.read_bytes()[-64:]
        with pytest.raises(E.AddressNotRegisteredError, match="outside storage segment"):
            owner.write(seg.name, r.address, size - 10, 64)
        with pytest.raises(E.AddressNotRegisteredError):
            owner.submit_arrays(mte.WRITE, seg.name, np.array([r.address] * 2, np.uint64),
                                np.array([0, size], np.uint64), 1)
        assert img.read_bytes()[-64:] == before
        with PeerProcess(1 << 20) as peer:
            sha = peer.call("write_pattern", seg.name, 1 << 20, 700000, 11, 65536 + 5)
            import hashlib
            owner.read(seg.name, rb.address, 1 << 20, 700000)
            assert hashlib.sha256(back[:700000]).hexdigest() == sha


@pytest.mark.parametrize("kind", ["etcd", "redis", "http"])
def test_storage_segment_through_metadata_stores(kind, tmp_path):
    """With etcd, redis or the HTTP metadata server, the storage list travels in the
    owner's descriptor under mooncake/ram/<owner>; a peer in another process resolves
    '<owner>/<storage>' through it."""
    import hashlib
    from servers import EtcdServer, HttpMetadataServer, RedisServer, _serve
    cls = {"etcd": EtcdServer, "redis": RedisServer, "http": HttpMetadataServer}[kind]
    gen = _serve(cls)
    server = next(gen)
    try:
        img = tmp_path / "img"
        with open(img, "wb") as f:
            f.truncate(2 << 20)
        with mte.TransferEngine(name=f"nvmeof-owner-{kind}", metadata=server.url,
                                host="127.0.0.1") as owner:
            seg = owner.register_storage("disk", path=str(img))
            assert seg.name == f"nvmeof-owner-{kind}/disk"
            with PeerProcess(1 << 20, metadata=server.url, name=f"nvmeof-peer-{kind}") as peer:
                sha = peer.call("write_pattern", seg.name, 777, 300000, 3, 65536)
            back = np.zeros(300000, np.uint8)
            owner.read(seg.name, owner.register(back).address, 777, 300000)
            assert hashlib.sha256(back).hexdigest() == sha
            owner.unregister_storage(seg)
            with pytest.raises(E.SegmentNotFoundError, match="publishes no storage segment"):
                owner.open_segment(seg.name)
    finally:
        gen.close()


# --------------------------------------------------------------------------- fabric tier

def _losetup(path: str) -> str:
    return subprocess.run(["losetup", "-f", "--show", path], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


@pytest.fixture
def workdir():
    d = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"nvmeof-{uuid.uuid4().hex[:6]}")
    os.makedirs(d)
    yield d
    subprocess.run(["rm", "-rf", d])


def _image(workdir, size=32 << 20, name="img") -> str:
    path = os.path.join(workdir, name)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.fixture(params=["file", "loop"])
def exported(request, workdir):
    """A target over tcp on 127.0.0.1 (file-backed, buffered since the file is on tmpfs;
    or a loop block device over a file), connected from this host: (nqn, block device,
    backing path, image file). Checks read the image file: the loop driver writes it
    through the page cache, while the loop device's own cache would be bypassed by
    nvmet's bios and could be stale."""
    img = _image(workdir)
    backing = img if request.param == "file" else _losetup(img)
    nqn = _nqn(request.param)
    port = 4421 if request.param == "file" else 4422
    t = nvmeof.create_target(nqn, backing, "tcp", "127.0.0.1", port)
    try:
        assert t.namespaces[0].buffered_io == (request.param == "file")
        conn = nvmeof.connect(nqn, "127.0.0.1", port, "tcp")
        try:
            yield nqn, conn.devices[0], backing, img
        finally:
            try:
                nvmeof.disconnect(nqn)
            except E.DeviceNotFoundError:
                pass
    finally:
        if nqn in [x.nqn for x in nvmeof.list_targets()]:
            nvmeof.delete_target(nqn)
        if backing.startswith("/dev/loop"):
            subprocess.run(["losetup", "-d", backing], timeout=60)


@pytest.mark.nvmeof
def test_target_create_list_delete(workdir):
    img, img2 = _image(workdir, 8 << 20), _image(workdir, 4 << 20, "img2")
    nqn = _nqn("list")
    host = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001"
    t = nvmeof.create_target(nqn, [img, img2], "tcp", "127.0.0.1", 4423, hosts=[host])
    try:
        assert [(n.nsid, n.path, n.size, n.enabled) for n in t.namespaces] == \
            [(1, img, 8 << 20, True), (2, img2, 4 << 20, True)]
        assert [(p.transport, p.address, p.service_id) for p in t.ports] == \
            [("tcp", "127.0.0.1", "4423")]
        assert not t.allow_any_host and t.hosts == [host]
        assert nqn in [x.nqn for x in nvmeof.list_targets()]
        with pytest.raises(E.InvalidArgumentError, match="exists already"):
            nvmeof.create_target(nqn, img)
        # Not on the allow-list: the target refuses our host NQN.
        with pytest.raises(nvmeof.HostError, match="cannot connect"):
            nvmeof.connect(nqn, "127.0.0.1", 4423,
                           hostnqn="nqn.2014-08.org.nvmexpress:uuid:"
                                   "00000000-0000-0000-0000-000000000002")
        conn = nvmeof.connect(nqn, "127.0.0.1", 4423, hostnqn=host)
        assert len(conn.devices) == 2 and conn.live
        assert nvmeof.disconnect(nqn) == 1
    finally:
        nvmeof.delete_target(nqn)
    assert nqn not in [x.nqn for x in nvmeof.list_targets()]
    ports = "/sys/kernel/config/nvmet/ports"
    assert not any(open(f"{ports}/{p}/addr_trsvcid").read().strip() == "4423"
                   for p in os.listdir(ports)), "the port nobody uses was not removed"
    assert not os.path.isdir(f"/sys/kernel/config/nvmet/hosts/{host}")
    with pytest.raises(E.DeviceNotFoundError, match="no nvmet subsystem"):
        nvmeof.delete_target(nqn)


@pytest.mark.nvmeof
def test_random_offsets_written_by_one_engine_read_by_another(exported):
    """The owner publishes the namespace; an engine in another process writes random
    data at random offsets through the connected namespace; the owner reads it back;
    the backing store holds the same bytes."""
    nqn, dev, backing, img = exported
    size = 32 << 20
    rng = np.random.default_rng(1)
    with mte.TransferEngine(host="127.0.0.1") as owner, PeerProcess(4 << 20) as peer:
        seg = owner.register_storage("pool", nqn=nqn)
        assert (seg.size, seg.transport, seg.address, seg.path) == \
            (size, "tcp", "127.0.0.1", backing)
        assert seg.service_id in ("4421", "4422")
        back = np.zeros(4 << 20, np.uint8)
        rb = owner.register(back)
        import hashlib
        placed = []
        for k in range(6):
            n = int(rng.integers(1, 1 << 20))
            off = int(rng.integers(0, size - n))
            if any(off < o + m and o < off + n for o, m in placed):
                continue
            placed.append((off, n))
            sha = peer.call("write_pattern", seg.name, off, n, 100 + k,
                            int(rng.choice([4096, 65536, 65536 + 7, 1 << 20])))
            owner.read(seg.name, rb.address, off, n)
            assert hashlib.sha256(back[:n]).hexdigest() == sha, (off, n)
            with open(img, "rb") as f:              # what the target itself stored
                f.seek(off)
                assert hashlib.sha256(f.read(n)).hexdigest() == sha
        tr = owner._transports["nvmeof"]
        assert tr.device_path(owner._resolve(seg.name)) == dev       # through NVMe-oF
        b = owner.submit_arrays(mte.READ, seg.name, np.array([rb.address], np.uint64),
                                np.array([placed[0][0]], np.uint64), placed[0][1])
        b.wait(timeout=30)
        assert b.transport == "nvmeof"


@pytest.mark.nvmeof
def test_unaligned_and_out_of_range(exported):
    nqn, dev, backing, img = exported
    size = 32 << 20
    rng = np.random.default_rng(2)
    with mte.TransferEngine(host="127.0.0.1") as a, mte.TransferEngine(host="127.0.0.1") as b:
        seg = a.register_storage("pool", nqn=nqn)
        src = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        rs, rd = b.register(src), b.register(dst)
        # Adjacent unaligned requests in one batch share edge blocks: read-modify-write
        # must not lose either side's bytes.
        offs = np.array([1, 513, 4097, 1000003, 2 * (1 << 20) + 77], np.uint64)
        lens = np.array([512, 3584, 995906, 1048575, 1234], np.uint64)
        mem = rs.address + np.array([0, 7, 4096 + 3, 1 << 20, 2 * (1 << 20) + 1], np.uint64)
        bt = b.submit_arrays(mte.WRITE, seg.name, mem, offs, lens)
        bt.wait(timeout=60)
        assert bt.transport == "nvmeof"
        with open(img, "rb") as f:
            data = f.read(int(offs[-1] + lens[-1]))
        for m, o, n in zip(mem, offs, lens):
            m0 = int(m) - rs.address
            assert data[int(o):int(o + n)] == src[m0:m0 + int(n)].tobytes(), (o, n)
            b.read(seg.name, rd.address + 5, int(o), int(n))
            assert (dst[5:5 + int(n)] == src[m0:m0 + int(n)]).all(), (o, n)
        with open(img, "rb") as f:
            f.seek(size - 512)
            tail = f.read(512)
        with pytest.raises(E.AddressNotRegisteredError, match="outside storage segment"):
            b.write(seg.name, rs.address, size - 100, 101)
        with pytest.raises(E.AddressNotRegisteredError, match="outside storage segment"):
            b.submit_arrays(mte.WRITE, seg.name, np.array([rs.address] * 2, np.uint64),
                            np.array([0, size], np.uint64), 512)
        b.write(seg.name, rs.address, size - 100, 100)          # the last byte is fine
        with open(img, "rb") as f:
            f.seek(size - 512)
            assert f.read(412) == tail[:412]                       # nothing else changed


@pytest.mark.nvmeof
def test_target_deleted_while_connected(workdir):
    """The target goes away under a connected host: transfers fail with an error that
    says so, within the deadline; nothing hangs."""
    img = _image(workdir, 8 << 20)
    nqn = _nqn("gone")
    nvmeof.create_target(nqn, img, "tcp", "127.0.0.1", 4424)
    try:
        nvmeof.connect(nqn, "127.0.0.1", 4424, ctrl_loss_tmo=3, reconnect_delay=1)
        with mte.TransferEngine(host="127.0.0.1") as eng:
            seg = eng.register_storage("pool", nqn=nqn)
            buf = np.ones(65536, np.uint8)
            r = eng.register(buf)
            eng.write(seg.name, r.address, 0, 65536)
            nvmeof.delete_target(nqn)
            t0 = time.monotonic()
            failures = []
            for _ in range(3):
                with pytest.raises((E.TransferError, E.TransportUnavailableError)) as e:
                    eng.write(seg.name, r.address, 4096, 65536, timeout=10)
                failures.append(f"{time.monotonic() - t0:.1f}s {e.value}")
                time.sleep(1.1)        # past the transport's one-second sysfs cache
            elapsed = time.monotonic() - t0
            assert elapsed < 30, elapsed
            text = " | ".join(failures)
            assert any(w in text for w in ("not live", "storage device failed",
                                           "not connected on this host", "deadline")), text
            print(text)
    finally:
        if nqn in [x.nqn for x in nvmeof.list_targets()]:
            nvmeof.delete_target(nqn)
        try:
            nvmeof.disconnect(nqn)
        except E.DeviceNotFoundError:
            pass


@pytest.mark.nvmeof
def test_cli_round_trip(workdir):
    img = _image(workdir, 8 << 20)
    nqn = _nqn("cli")
    t = json.loads(_cli("target", "create", nqn, img, "--address", "127.0.0.1",
                        "--service-id", "4425", "--json").stdout)
    assert t["nqn"] == nqn and t["namespaces"][0]["path"] == img and t["namespaces"][0]["buffered_io"]
    assert nqn in _cli("target", "list").stdout
    assert [x["nqn"] for x in json.loads(_cli("target", "list", "--json").stdout)].count(nqn) == 1
    c = json.loads(_cli("connect", nqn, "-a", "127.0.0.1", "-s", "4425", "--json").stdout)
    assert c["nqn"] == nqn and c["devices"][0].startswith("/dev/nvme")
    listed = json.loads(_cli("list", "--json").stdout)
    assert [x["devices"] for x in listed if x["nqn"] == nqn] == [c["devices"]]
    assert "disconnected" in _cli("disconnect", nqn).stdout
    assert nqn not in _cli("list").stdout
    bad = _cli("disconnect", nqn, check=False)
    assert bad.returncode == 1 and "not connected" in bad.stderr
    assert "deleted" in _cli("target", "delete", nqn).stdout
    assert nqn not in _cli("target", "list").stdout


def _rxe() -> list:
    return json.loads(os.environ.get("MOONCAKE_LAB_RXE", "[]"))


@pytest.mark.nvmeof
def test_over_rdma_soft_roce(workdir):
    """The same round trip over nvme-rdma, on the lab's Soft-RoCE device rxe0."""
    if not _rxe() or not os.path.isdir("/sys/module/nvmet_rdma"):
        pytest.skip("no Soft-RoCE device with nvmet-rdma here (the lab guest makes them)")
    addr = _rxe()[0]["addr"]
    backing = _losetup(_image(workdir, 16 << 20))
    nqn = _nqn("rdma")
    nvmeof.create_target(nqn, backing, "rdma", addr, 4430)
    try:
        conn = nvmeof.connect(nqn, addr, 4430, "rdma")
        assert conn.controllers[0].transport == "rdma"
        with mte.TransferEngine(host="127.0.0.1") as owner, PeerProcess(2 << 20) as peer:
            seg = owner.register_storage("pool", nqn=nqn)
            assert seg.transport == "rdma" and seg.address == addr
            import hashlib
            sha = peer.call("write_pattern", seg.name, 12345, (2 << 20) - 3, 5, 65536)
            back = np.zeros(2 << 20, np.uint8)
            rb = owner.register(back)
            owner.read(seg.name, rb.address, 12345, (2 << 20) - 3)
            assert hashlib.sha256(back[:(2 << 20) - 3]).hexdigest() == sha
        nvmeof.disconnect(nqn)
    finally:
        nvmeof.delete_target(nqn)
        subprocess.run(["losetup", "-d", backing], timeout=60)


# --------------------------------------------------------------------------- GPU memory

@pytest.mark.gpu
def test_gpu_memory_to_and_from_storage(tmp_path):
    """GPU memory moves to and from a storage segment through pinned staging buffers:
    unaligned offsets, a request larger than the staging buffer, batches and single
    calls; the bytes in the file are the GPU's."""
    import cupy as cp
    size = 8 << 20
    img = tmp_path / "img"
    with open(img, "wb") as f:
        f.truncate(size)
    n = (3 << 20) + 333
    src = cp.random.randint(0, 256, n + 5, dtype=cp.uint8)
    dst = cp.zeros(n + 5, dtype=cp.uint8)
    host = np.zeros(n, np.uint8)
    with mte.TransferEngine(host="127.0.0.1") as eng:
        seg = eng.register_storage("disk", path=str(img))
        rs, rd, rh = eng.register(src), eng.register(dst), eng.register(host)
        assert rs.location == "cuda:0"
        eng.write(seg.name, rs.address + 5, 4097, n)                     # one call
        with open(img, "rb") as f:
            f.seek(4097)
            assert f.read(n) == cp.asnumpy(src[5:]).tobytes()
        eng.read(seg.name, rd.address + 1, 4097, n)
        assert bool((dst[1:n + 1] == src[5:]).all())
        b = eng.submit_arrays(mte.READ, seg.name,                         # a batch
                              np.array([rd.address, rh.address], np.uint64),
                              np.array([4097, 4097], np.uint64), n)
        b.wait(timeout=60)
        assert b.transport == "nvmeof"
        assert bool((dst[:n] == src[5:]).all()) and (host == cp.asnumpy(src[5:])).all()
        b = eng.submit_arrays(mte.WRITE, seg.name, np.array([rs.address], np.uint64),
                              np.array([size - 100], np.uint64), 100)
        b.wait(timeout=60)
        with open(img, "rb") as f:
            f.seek(size - 100)
            assert f.read(100) == cp.asnumpy(src[:100]).tobytes()
        with pytest.raises(E.AddressNotRegisteredError, match="outside storage segment"):
            eng.write(seg.name, rs.address, size - 10, 11)

# SPDX-License-Identifier: Apache-2.0
"""The tensor calls of the store drop-in, run in a Python that has torch (issue 39).

``python store_tensor_driver.py INDEX_URL`` sets up two stores on 127.0.0.1 with the
index at ``INDEX_URL`` and runs every check below; it prints ``ok NAME`` or ``FAIL NAME:
why`` per check and exits 1 when one failed. ``test_compat_store_tensor.py`` runs it with
the first Python it finds that has torch (this one, or ``MTE_VLLM_VENV``'s), since the
dev environment has none. The header offsets checked here are read off Mooncake's
``TensorMetadata`` (``mooncake-integration/integration_utils.h``), independently of
``mooncake_te.compat.tensor``'s struct.
"""
from __future__ import annotations

import ctypes
import os
import struct
import sys
import traceback
import uuid

import torch

from mooncake_te.compat.store import (MooncakeDistributedStore, ParallelAxis,
                                      ReadTarget, ReplicateConfig, TensorParallelism,
                                      _deserialize_tensor, _serialize_tensor,
                                      _tensor_metadata_size)

MIB = 1 << 20
URL = sys.argv[1]
TENANT = "tensor-" + uuid.uuid4().hex[:8]
DTYPES = ["float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
          "int64", "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def store():
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", URL, 32 * MIB, 32 * MIB, "tcp", "", "127.0.0.1:50051",
                   tenant_id=TENANT) == 0
    return s


A = store()
B = store()


def raw(t) -> bytes:
    """A tensor's bytes (C order), any dtype and shape."""
    t = t.contiguous()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def sample(name: str, shape=(3, 5)):
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.int64).reshape(shape)
    if name == "bool":
        return (base % 2).to(torch.bool)
    if name.startswith("float8"):
        return (base.to(torch.float32) / 4).to(getattr(torch, name))
    return (base % 100).to(getattr(torch, name))


def same(a, b) -> bool:
    return (a is not None and b is not None and a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape) and raw(a) == raw(b))


def header(b: bytes) -> dict:
    """The header fields at Mooncake's offsets (TensorObjectHeader, 40 bytes, then
    TensorLayoutMetadata: two 8 x int64 shapes, axis_count, reserved0, 4 x 32-byte
    LayoutAxis)."""
    u32 = lambda o: struct.unpack_from("<I", b, o)[0]          # noqa: E731
    i32 = lambda o: struct.unpack_from("<i", b, o)[0]          # noqa: E731
    return {"magic": u32(0), "version": struct.unpack_from("<H", b, 4)[0],
            "header_size": struct.unpack_from("<H", b, 6)[0], "dtype": i32(8),
            "ndim": i32(12), "layout_kind": u32(16), "reserved_flags": u32(20),
            "data_offset": struct.unpack_from("<Q", b, 24)[0],
            "data_bytes": struct.unpack_from("<Q", b, 32)[0],
            "global_shape": struct.unpack_from("<8q", b, 40),
            "local_shape": struct.unpack_from("<8q", b, 104),
            "axis_count": u32(168), "reserved0": u32(172),
            "axis0": struct.unpack_from("<iiiiiiq", b, 176)}


@check
def every_dtype_round_trips():
    for i, name in enumerate(DTYPES):
        t = sample(name)
        k = f"dt-{name}"
        assert A.put_tensor(k, t) == 0, name
        got = B.get_tensor(k)                      # another client reads it
        assert same(got, t), (name, got)
        h = header(A.get(k))
        assert h["dtype"] == i, (name, h["dtype"])


@check
def batch_calls():
    ts = [sample("float32"), sample("int64", (2, 2)), sample("bfloat16", (7,))]
    keys = ["b0", "b1", "b2"]
    assert A.batch_put_tensor(keys, ts) == [0, 0, 0]
    got = B.batch_get_tensor(keys + ["b-missing"])
    assert len(got) == 4 and got[3] is None
    assert all(same(g, t) for g, t in zip(got, ts))
    assert A.batch_put_tensor(keys, ts[:2]) == [-600] * 3


@check
def shapes_zero_d_empty_eight_d_non_contiguous():
    cases = {"s0": torch.tensor(3.5, dtype=torch.float64),
             "s-empty": torch.empty((0, 4), dtype=torch.int32),
             "s8": torch.arange(256, dtype=torch.int16).reshape((2,) * 8),
             "s-t": torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),
             "s-step": torch.arange(40, dtype=torch.int8)[::3],
             "s0-bf16": torch.tensor(1.25, dtype=torch.bfloat16)}
    assert not cases["s-t"].is_contiguous()
    for k, t in cases.items():
        assert A.put_tensor(k, t) == 0, k
        got = B.get_tensor(k)
        assert same(got, t.contiguous()), (k, got)
        assert torch.equal(got.to(torch.float64), t.to(torch.float64)), k
        h = header(A.get(k))
        assert h["ndim"] == t.dim(), k
        assert h["local_shape"][:t.dim()] == tuple(t.shape), k
    assert A.put_tensor("s9", torch.zeros((1,) * 9)) == -600      # Mooncake: at most 8


@check
def header_bytes_at_mooncakes_offsets():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert A.put_tensor("hdr", t) == 0
    b = A.get("hdr")
    assert len(b) == 304 + 48 == A.get_size("hdr")
    h = header(b)
    assert h["magic"] == 0x4D4F4F4E and h["version"] == 1 and h["header_size"] == 304
    assert (h["dtype"], h["ndim"], h["layout_kind"], h["reserved_flags"]) == (0, 2, 0, 0)
    assert (h["data_offset"], h["data_bytes"]) == (304, 48)
    assert h["global_shape"] == (3, 4) + (-1,) * 6 == h["local_shape"]
    assert (h["axis_count"], h["reserved0"]) == (0, 0)
    assert b[176:304] == bytes(128)
    assert b[304:] == raw(t)
    assert _tensor_metadata_size() == 304
    head, ptr, n, owner = _serialize_tensor(t)
    assert head == b[:304] and n == 48 and ptr == owner.data_ptr()
    assert torch.equal(_deserialize_tensor(b), t)


@check
def tp_split_and_reassemble():
    t = torch.arange(48, dtype=torch.float32).reshape(4, 12)
    assert A.put_tensor_with_tp("tp", t, tp_rank=0, tp_size=3, split_dim=1) == 0
    parts = [B.get_tensor_with_tp("tp", tp_rank=r, tp_size=3) for r in range(3)]
    for r, (p, e) in enumerate(zip(parts, torch.chunk(t, 3, dim=1))):
        assert same(p, e.contiguous()), r
        h = header(A.get(f"tp_tp_{r}"))
        assert h["layout_kind"] == 1 and h["axis_count"] == 1
        assert h["global_shape"][:2] == (4, 12) and h["local_shape"][:2] == (4, 4)
        # LayoutAxis: kind TP=1, axis_index 0, shard_rank, shard_count, split_dim,
        # reserved0 0, reserved1 = the shard's extent along split_dim
        assert h["axis0"] == (1, 0, r, 3, 1, 0, 4), h["axis0"]
    assert torch.equal(torch.cat(parts, dim=1), t)
    assert A.is_exist("tp") == 0                     # only the per-rank keys
    assert A.get_tensor_with_tp("tp", tp_rank=1, tp_size=1) is None
    # batch forms, split_dim 0
    u = torch.arange(8, dtype=torch.int64).reshape(4, 2)
    assert A.batch_put_tensor_with_tp(["tq", "tr"], [u, u + 1], tp_size=2) == [0, 0]
    got = B.batch_get_tensor_with_tp(["tq", "tr"], tp_rank=1, tp_size=2)
    assert same(got[0], u[2:]) and same(got[1], (u + 1)[2:])
    # tp_size 1: the plain key
    assert A.put_tensor_with_tp("tp1", u, tp_size=1) == 0
    assert same(B.get_tensor_with_tp("tp1"), u)
    # an uneven split is refused and stores nothing
    assert A.put_tensor_with_tp("tpu", torch.zeros(5, 3), tp_size=2) == -600
    assert A.is_exist("tpu_tp_0") == 0 and A.is_exist("tpu_tp_1") == 0
    assert A.put_tensor_with_tp("tpd", torch.zeros(4), tp_size=2, split_dim=1) == -600


@check
def missing_key():
    assert A.get_tensor("nope") is None
    assert A.get_tensor_with_tp("nope", tp_rank=0, tp_size=2) is None
    assert A.batch_get_tensor(["nope", "nope2"]) == [None, None]


@check
def not_a_tensor_object():
    assert A.put("plain", b"x" * 400) == 0
    assert A.get_tensor("plain") is None


@check
def unsupported_inputs_refused():
    assert A.put_tensor("cx", torch.zeros(3, dtype=torch.complex64)) == -600
    assert A.put_tensor("np", [1, 2, 3]) == -600
    assert A.is_exist("cx") == 0 and A.is_exist("np") == 0
    assert A.batch_put_tensor(["ok1", "cx2"], [torch.ones(2), torch.zeros(2, dtype=torch.complex128)]) == [0, -600]


def _buffer(n: int):
    """A registered buffer of ``n`` bytes plus 64 sentinel bytes before and after."""
    raw_buf = (ctypes.c_ubyte * (n + 128))()
    ctypes.memset(raw_buf, 0xAB, n + 128)
    base = ctypes.addressof(raw_buf)
    return raw_buf, base + 64


@check
def get_tensor_into_and_put_tensor_from():
    t = torch.arange(30, dtype=torch.int32).reshape(5, 6)
    assert A.put_tensor("into", t) == 0
    n = B.get_size("into")
    assert n == 304 + 120
    keep, ptr = _buffer(n)
    assert B.register_buffer(ptr - 64, n + 128) == 0
    try:
        # too small: nothing written anywhere in the buffer
        assert B.get_tensor_into("into", ptr, n - 1) is None
        assert bytes(keep) == b"\xab" * (n + 128)
        got = B.get_tensor_into("into", ptr, n)
        assert same(got, t)
        assert got.data_ptr() == ptr + 304                       # a view of the buffer
        assert bytes(keep[:64]) == b"\xab" * 64 and bytes(keep[64 + n:]) == b"\xab" * 64
        assert B.get_tensor_into("nope", ptr, n) is None
        assert B.get_tensor_with_tp_into("into", ptr, n) is not None
        # the buffer now holds [header][data]: put it back under another key
        assert B.put_tensor_from("from", ptr, n) == 0
        assert same(A.get_tensor("from"), t)
        assert B.batch_put_tensor_from(["from2"], [ptr], [n]) == [0]
        assert B.upsert_tensor_from("from2", ptr, n) == 0
        # a buffer without a valid header is refused
        ctypes.memset(ptr, 0, 8)
        assert B.put_tensor_from("bad", ptr, n) == -600
        assert B.is_exist("bad") == 0
        # unequal lists: every key -600 (Mooncake)
        assert B.batch_get_tensor_into(["into", "x"], [ptr], [n]) == [-600, -600]
        got = B.batch_get_tensor_into(["into"], [ptr], [n])
        assert same(got[0], t)
    finally:
        B.unregister_buffer(ptr - 64)
    # an unregistered buffer: put_tensor_from refuses it (as put_from); get_tensor_into
    # fills it by a copy when this process has it mapped (Mooncake's TCP path reads into
    # any memory; Mooncake's structured object store does), never past its size
    keep2, p2 = _buffer(n)
    assert B.put_tensor_from("unreg", p2, n) == -600
    assert B.get_tensor_into("into", p2, n - 1) is None
    assert bytes(keep2) == b"\xab" * (n + 128)
    got = B.get_tensor_into("into", p2, n)
    assert same(got, t) and got.data_ptr() == p2 + 304
    assert bytes(keep2[:64]) == b"\xab" * 64 and bytes(keep2[64 + n:]) == b"\xab" * 64
    # memory nobody mapped (below mmap_min_addr): refused, no fault
    assert B.get_tensor_into("into", 0x1000, n) is None
    assert B.batch_get_tensor_into(["into", "into"], [0x1000, p2], [n, n])[0] is None


@check
def tp_from_buffer():
    t = torch.arange(16, dtype=torch.float16).reshape(2, 8)
    assert A.put_tensor("tpf-src", t) == 0
    n = A.get_size("tpf-src")
    keep, ptr = _buffer(n)
    assert A.register_buffer(ptr - 64, n + 128) == 0
    try:
        assert A.get_tensor_into("tpf-src", ptr, n) is not None
        assert A.put_tensor_with_tp_from("tpf", ptr, n, tp_size=2, split_dim=1) == 0
        m = B.get_size("tpf_tp_1")
        keep2, p2 = _buffer(m)
        assert B.register_buffer(p2 - 64, m + 128) == 0
        got = B.get_tensor_with_tp_into("tpf", p2, m, tp_rank=1, tp_size=2)
        assert same(got, t[:, 4:].contiguous())
        got = B.batch_get_tensor_with_tp_into(["tpf"], [p2], [m], tp_rank=0, tp_size=2)
        assert same(got[0], t[:, :4].contiguous())
        B.unregister_buffer(p2 - 64)
    finally:
        A.unregister_buffer(ptr - 64)


@check
def upsert_pub_and_parallelism_defaults():
    t = torch.ones(3)
    assert A.put_tensor("up", t) == 0
    assert A.put_tensor("up", t + 1) == 0                 # put of an existing key: kept
    assert same(B.get_tensor("up"), t)
    assert A.upsert_tensor("up", t + 2) == 0
    assert same(B.get_tensor("up"), t + 2)
    assert A.batch_upsert_tensor(["up"], [t + 3]) == [0]
    assert same(B.get_tensor("up"), t + 3)
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    assert A.pub_tensor("pub", t, cfg) == 0 and same(B.get_tensor("pub"), t)
    assert A.batch_pub_tensor(["pub2"], [t], cfg) == [0]
    assert A.upsert_pub_tensor("pub", t * 5, cfg) == 0 and same(B.get_tensor("pub"), t * 5)
    assert A.pub_tensor_with_tp("pubtp", torch.ones(4, 2), cfg, tp_size=2) == 0
    assert same(B.get_tensor_with_tp("pubtp", 1, 2), torch.ones(2, 2))
    assert A.put_tensor_with_parallelism("par", t) == 0 and same(B.get_tensor("par"), t)
    assert A.batch_put_tensor_with_parallelism(["par2"], [t]) == [0]
    assert same(B.get_tensor_with_parallelism("par2"), t)
    assert A.put_tensor_with_parallelism("par3", t, parallelism=object()) == -600
    assert A.is_exist("par3") == 0


@check
def get_tensor_into_cuda_copies_through_the_host():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert A.put_tensor("cu", t) == 0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dst = torch.zeros(2, 3, device=dev)
    assert B.get_tensor_into_cuda("cu", dst) == 24
    assert torch.equal(dst.cpu(), t)
    assert B.get_tensor_into_cuda("cu", torch.zeros(3, 2, device=dev)) == -600
    assert B.batch_get_tensor_into_cuda(["nope"], [dst]) == [-704]
    if torch.cuda.is_available():
        assert A.put_tensor("cu-src", t.to("cuda")) == 0
        assert same(B.get_tensor("cu-src"), t)


@check
def byte_calls_take_cuda_tensors():
    """Mooncake's test_cuda_local_copy_paths: get_into a CUDA tensor's ``data_ptr()``
    (never registered) returns the bytes, put_from one stores them, a range past the
    CUDA allocation is -600 with nothing written, and a put_from made on a side stream
    waits for it. Without CUDA: an unregistered CPU tensor is still refused."""
    raw_bytes = bytes(range(32))
    assert A.put("cuda-raw", raw_bytes) == 0
    cpu = torch.zeros(32, dtype=torch.uint8)
    assert B.get_into("cuda-raw", cpu.data_ptr(), 32) == -600    # not registered
    assert not cpu.any()
    if not torch.cuda.is_available():
        return
    from mooncake_te import cuda
    dst = torch.empty(32, dtype=torch.uint8, device="cuda")
    assert B.get_into("cuda-raw", dst.data_ptr(), 32) == 32
    assert torch.equal(dst, torch.tensor(list(raw_bytes), dtype=torch.uint8, device="cuda"))
    src = torch.arange(64, dtype=torch.uint8, device="cuda")
    assert B.put_from("cuda-from", src.data_ptr(), 64) == 0
    assert A.get("cuda-from") == bytes(range(64))
    base, size = cuda.allocation_range(dst.data_ptr())
    tail = base + size - 16
    keep = torch.empty(16, dtype=torch.uint8)
    cuda.memcpy(keep.data_ptr(), tail, 16)
    assert B.get_into("cuda-from", tail, 64) == -600
    now = torch.empty(16, dtype=torch.uint8)
    cuda.memcpy(now.data_ptr(), tail, 16)
    assert torch.equal(keep, now)
    if hasattr(torch.cuda, "_sleep"):
        side, cur = torch.cuda.Stream(), torch.cuda.Stream()
        big = torch.zeros(4 * MIB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
            big.fill_(7)
        with torch.cuda.stream(cur):           # the current stream: not the legacy one
            cur.wait_stream(side)
            assert B.put_from("cuda-late", big.data_ptr(), big.numel()) == 0
        assert A.get("cuda-late") == b"\x07" * big.numel()


@check
def safetensors_files():
    import tempfile
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert A.put_tensor("st", t) == 0
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "st.safetensors")
        assert A.save_tensor_to_safetensor("st", f) == 0
        assert A.save_tensor_to_safetensor("st-missing", f + "2") == -1100
        got = B.load_tensor_from_safetensor("st-loaded", f)     # not in the file: 1st
        assert same(got, t) and same(A.get_tensor("st-loaded"), t)
        assert B.load_tensor_from_safetensor("x", os.path.join(d, "none")) is None


@check
def dummy_client_tensor_calls():
    """A dummy client (setup_dummy) runs the tensor calls in its own process over the
    byte calls the real client serves; its shared-memory buffers take get_tensor_into."""
    import socket
    from mooncake_te.compat.dummy import RealClient
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    real = RealClient(store(), "127.0.0.1", port)
    C = MooncakeDistributedStore()
    try:
        assert C.setup_dummy(64 * MIB, 16 * MIB, real.addr) == 0
        t = torch.arange(20, dtype=torch.float16).reshape(4, 5)
        assert C.put_tensor("dm", t) == 0
        assert same(C.get_tensor("dm"), t) and same(A.get_tensor("dm"), t)
        assert C.put_tensor_with_tp("dmtp", t, tp_size=2, split_dim=0) == 0
        assert same(A.get_tensor_with_tp("dmtp", 1, 2), t[2:].contiguous())
        n = C.get_size("dm")
        ptr = C.alloc_from_mem_pool(n)
        assert ptr and C.register_buffer(ptr, n) == 0
        got = C.get_tensor_into("dm", ptr, n)
        assert same(got, t) and got.data_ptr() == ptr + 304
        assert C.get_tensor_into("dm", ptr, n - 1) is None
        assert C.put_tensor_from("dm-from", ptr, n) == 0
        assert same(A.get_tensor("dm-from"), t)
        assert C.unregister_buffer(ptr) == 0
    finally:
        C.close()
        real.close()


@check
def dummy_tensor_puts_bounded_by_the_dummys_local_buffer():
    """Mooncake's dummy stages a tensor object in its own local buffer and the real
    client stores it with batch_put_from: a 16 MiB tensor (test_dummy_client.py's CUDA
    IPC readiness payload) goes through a real client whose local buffer is 16 MiB
    (mooncake_client's default), alone and in a batch; one larger than the dummy's
    local buffer is -200 (NO_AVAILABLE_HANDLE)."""
    import socket
    from mooncake_te.compat.dummy import RealClient
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    R = MooncakeDistributedStore()
    assert R.setup("127.0.0.1", URL, 96 * MIB, 16 * MIB, "tcp", "", "127.0.0.1:50051",
                   tenant_id=TENANT) == 0
    real = RealClient(R, "127.0.0.1", port)
    C = MooncakeDistributedStore()
    try:
        assert C.setup_dummy(64 * MIB, 24 * MIB, real.addr) == 0
        big = torch.full((16 * MIB,), 0xA7, dtype=torch.uint8)
        assert C.put_tensor("dbig", big) == 0
        assert same(C.get_tensor("dbig"), big) and same(A.get_tensor("dbig"), big)
        two = [torch.full((16 * MIB,), v, dtype=torch.uint8) for v in (1, 2)]
        assert C.batch_put_tensor(["dbig1", "dbig2"], two) == [0, 0]   # one at a time
        assert all(same(C.get_tensor(k), t) for k, t in zip(["dbig1", "dbig2"], two))
        assert C.upsert_tensor("dbig", two[0]) == 0 and same(A.get_tensor("dbig"), two[0])
        assert C.put_tensor("dhuge", torch.zeros(40 * MIB, dtype=torch.uint8)) == -200
        assert C.is_exist("dhuge") == 0
    finally:
        C.close()
        real.close()
        R.close()


# --- the *_with_parallelism calls ------------------------------------------------------
def axis(kind, rank, size, split_dim=None, expert_id=None, stage_id=None):
    """Built field by field, as Mooncake's scripts do (its ParallelAxis takes no
    constructor arguments)."""
    a = ParallelAxis()
    a.kind, a.rank, a.size, a.split_dim = kind, rank, size, split_dim
    if expert_id is not None:
        a.expert_id = expert_id
    if stage_id is not None:
        a.stage_id = stage_id
    return a


def par(*axes):
    p = TensorParallelism()
    p.axes = list(axes)
    return p


def target(mode, parallelism=None):
    t = ReadTarget()
    t.mode = mode
    t.parallelism = parallelism
    return t


def tp(rank, size, split_dim):
    return par(axis("tp", rank, size, split_dim))


class Writer:
    """A writer partition: any object with rank, size and split_dim (Mooncake's scripts
    use a dataclass)."""

    def __init__(self, rank, size, split_dim):
        self.rank, self.size, self.split_dim = rank, size, split_dim


def manifest(b: bytes) -> tuple:
    """Mooncake's WriterShardManifest: magic u32, version u16, header_size u16, dtype,
    ndim, split_dim, shard_count, reserved0 (i32), padding to 8, 8 x i64 shape."""
    assert len(b) == 96, len(b)
    return struct.unpack_from("<IHHiiiii", b, 0) + (struct.unpack_from("<8q", b, 32),)


@check
def parallelism_tp_writers_then_full_read():
    """Each TP rank stores its own shard (alternating clients); a FULL read by any rank
    reassembles the tensor, bytes as Mooncake lays them out."""
    t = torch.arange(48, dtype=torch.float32).reshape(4, 12)
    for r, shard in enumerate(t.chunk(3, dim=1)):
        w = A if r % 2 else B
        assert w.put_tensor_with_parallelism("pt", shard.contiguous(), tp(r, 3, 1)) == 0
    for r in range(3):
        h = header(A.get(f"pt_tp_{r}"))
        assert h["layout_kind"] == 1 and h["axis_count"] == 1
        assert h["global_shape"][:2] == (4, 12) and h["local_shape"][:2] == (4, 4)
        assert h["axis0"] == (1, 0, r, 3, 1, 0, 4), h["axis0"]
    m = manifest(A.get("pt__parallelism_manifest"))
    assert m[:8] == (0x574D414E, 1, 96, 0, 2, 1, 3, 0), m
    assert m[8] == (4, 12) + (-1,) * 6
    for r in range(3):
        full = B.get_tensor_with_parallelism("pt", target("full", tp(r, 3, 1)))
        assert same(full, t), r
        shard = A.get_tensor_with_parallelism("pt", target("shard", tp(r, 3, 1)))
        assert same(shard, t.chunk(3, dim=1)[r].contiguous()), r
        assert same(shard, A.get_tensor_with_tp("pt", tp_rank=r, tp_size=3))
    # a FULL read into a buffer: [FULL header][data], the tensor a view of it
    n = 304 + t.numel() * 4
    keep, ptr = _buffer(n)
    assert B.register_buffer(ptr - 64, n + 128) == 0
    try:
        assert B.get_tensor_with_parallelism_into("pt", ptr, n - 1,
                                                  target("full", tp(0, 3, 1))) is None
        assert bytes(keep) == b"\xab" * (n + 128)
        got = B.get_tensor_with_parallelism_into("pt", ptr, n, target("FULL", tp(0, 3, 1)))
        assert same(got, t) and got.data_ptr() == ptr + 304
        h = header(bytes(keep[64:64 + n]))
        assert (h["layout_kind"], h["axis_count"]) == (0, 0)
        assert h["global_shape"][:2] == (4, 12) == h["local_shape"][:2]
        assert bytes(keep[64 + n:]) == b"\xab" * 64
    finally:
        B.unregister_buffer(ptr - 64)
    # a shard missing: no FULL read
    assert A.put_tensor_with_parallelism("pt-gap", t[:, :4].contiguous(), tp(0, 3, 1)) == 0
    assert A.get_tensor_with_parallelism("pt-gap", target("full", tp(0, 3, 1))) is None


@check
def parallelism_shard_read_reshards():
    """Shards stored for TP 4 along dim 0, read as TP 2 and TP 8 (Mooncake re-shards
    from the stored shards); a size that does not divide is refused."""
    t = torch.arange(8 * 3, dtype=torch.int64).reshape(8, 3)
    for r, shard in enumerate(t.chunk(4, dim=0)):
        assert A.put_tensor_with_parallelism("rs", shard.contiguous(), tp(r, 4, 0)) == 0
    assert same(B.get_tensor_with_parallelism("rs", target("shard", tp(1, 2, 0))), t[4:])
    assert same(B.get_tensor_with_parallelism("rs", target("shard", tp(5, 8, 0))), t[5:6])
    # into: a SHARD header with the request's axis
    n = 304 + 4 * 3 * 8
    keep, ptr = _buffer(n)
    assert B.register_buffer(ptr - 64, n + 128) == 0
    try:
        # no re-shard to a TP size that does not divide the dimension, or along another
        # split_dim (the plain get then falls back to f"{key}_tp_{rank}", as Mooncake's)
        for bad in (tp(0, 3, 0), tp(0, 2, 1)):
            assert B.get_tensor_with_parallelism_into("rs", ptr, n,
                                                      target("shard", bad)) is None
        assert same(B.get_tensor_with_parallelism("rs", target("shard", tp(0, 3, 0))),
                    t[:2])
        got = B.get_tensor_with_parallelism_into("rs", ptr, n, target("shard", tp(0, 2, 0)))
        assert same(got, t[:4])
        h = header(bytes(keep[64:64 + n]))
        assert h["layout_kind"] == 1 and h["axis0"] == (1, 0, 0, 2, 0, 0, 4), h
        assert h["global_shape"][:2] == (8, 3) and h["local_shape"][:2] == (4, 3)
    finally:
        B.unregister_buffer(ptr - 64)
    # the *_with_tp objects (no manifest) reassemble and re-shard too
    assert A.put_tensor_with_tp("rs-tp", t, tp_size=2, split_dim=0) == 0
    assert same(B.get_tensor_with_parallelism("rs-tp", target("full", tp(0, 4, 0))), t)
    assert same(B.get_tensor_with_parallelism("rs-tp", target("shard", tp(3, 4, 0))), t[6:])


@check
def parallelism_as_stored():
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    assert A.put_tensor_with_parallelism("as", t) == 0
    assert same(B.get_tensor_with_parallelism("as"), t)
    assert same(B.get_tensor_with_parallelism("as", target("as_stored")), t)
    assert same(B.get_tensor_with_parallelism("as", target("AS_STORED")), t)
    assert same(B.get_tensor_with_parallelism("as", target("full")), t)   # no writer shards
    assert B.get_tensor_with_parallelism("as", target("as_stored", tp(0, 2, 0))) is None
    assert B.get_tensor_with_parallelism("as-missing", target("as_stored")) is None
    assert same(B.batch_get_tensor_with_parallelism(["as", "nope"])[0], t)


@check
def parallelism_multi_axis_and_generic():
    t = torch.arange(6 * 8, dtype=torch.float64).reshape(6, 8)
    # DP x TP: every TP rank writes the whole tensor; rank r's part is stored
    for r in range(4):
        p = par(axis("tp", r, 4, 1), axis("dp", 1, 2))           # any axis order
        assert A.put_tensor_with_parallelism("ma", t, p) == 0
    for r in range(4):
        k = f"ma__dp_1of2__tp_{r}of4_sd1"
        h = header(A.get(k))
        assert h["axis_count"] == 2 and h["local_shape"][:2] == (6, 2)
        assert h["axis0"] == (1, 0, r, 4, 1, 0, 2), h["axis0"]       # the order given
        assert struct.unpack_from("<iiiiiiq", A.get(k), 208) == (0, 1, 1, 2, -1, 0, 0)
    want = par(axis("dp", 1, 2), axis("tp", 2, 4, 1))
    assert same(B.get_tensor_with_parallelism("ma", target("shard", want)), t[:, 4:6])
    assert same(B.get_tensor_with_parallelism("ma", target("full", want)), t)
    other_dp = par(axis("dp", 0, 2), axis("tp", 2, 4, 1))
    assert B.get_tensor_with_parallelism("ma", target("shard", other_dp)) is None
    assert B.get_tensor_with_parallelism("ma", target("full", other_dp)) is None
    # PP x TP with a stage id (reserved0 of the PP axis)
    for r in range(2):
        p = par(axis("pp", 0, 2, stage_id=7), axis("tp", r, 2, 0))
        assert A.put_tensor_with_parallelism("pp", t, p) == 0
    b = A.get("pp__tp_1of2_sd0__pp_0of2_sid7")
    assert struct.unpack_from("<iiiiiiq", b, 176) == (3, 0, 0, 2, -1, 7, 0)
    p = par(axis("pp", 0, 2, stage_id=7), axis("tp", 1, 2, 0))
    assert same(B.get_tensor_with_parallelism("pp", target("shard", p)), t[3:])
    assert same(B.get_tensor_with_parallelism("pp", target("full", p)), t)
    # EP alone (no TP): the tensor as it is, under the axes' key, expert id recorded
    ep = par(axis("ep", 1, 4, expert_id=11))
    assert A.put_tensor_with_parallelism("ep", t, ep) == 0
    h = header(A.get("ep__ep_1of4_eid11"))
    assert h["layout_kind"] == 1 and h["axis0"] == (2, 0, 1, 4, -1, 11, 0)
    assert h["global_shape"] == h["local_shape"]
    assert same(B.get_tensor_with_parallelism("ep", target("shard", ep)), t)
    assert B.get_tensor_with_parallelism("ep", target("full", ep)) is None     # no TP
    ep12 = par(axis("ep", 1, 4, expert_id=12))
    assert B.get_tensor_with_parallelism("ep", target("shard", ep12)) is None


@check
def parallelism_writer_partitions():
    """Writers each store their part of the whole tensor; FULL (no parallelism)
    reassembles it, a TP SHARD read finds a writer's part."""
    t = torch.arange(4 * 9, dtype=torch.bfloat16).reshape(4, 9)
    for r in range(3):
        w = A if r % 2 else B
        assert w.put_tensor_with_parallelism("wp", t, writer_partition=Writer(r, 3, 1)) == 0
    for r in range(3):
        h = header(A.get(f"wp__writer_{r}of3_sd1"))
        assert h["axis0"] == (1, 0, r, 3, 1, 0, 3) and h["global_shape"][:2] == (4, 9)
    m = manifest(A.get("wp__writer_manifest"))
    assert m[:8] == (0x574D414E, 1, 96, 12, 2, 1, 3, 0) and m[8][:2] == (4, 9)
    assert same(B.get_tensor_with_parallelism("wp", target("full")), t)
    for r in range(3):
        got = B.get_tensor_with_parallelism("wp", target("shard", tp(r, 3, 1)))
        assert same(got, t[:, 3 * r:3 * r + 3].contiguous()), r
    assert A.put_tensor_with_parallelism("wp2", t, writer_partition=Writer(0, 2, 1)) == -600
    assert A.put_tensor_with_parallelism("wp2", t, writer_partition=Writer(0, 3, 2)) == -600
    assert A.put_tensor_with_parallelism("wp2", t, writer_partition=Writer(3, 3, 1)) == -600


@check
def parallelism_batch_into_from_and_upsert():
    ts = [torch.arange(24, dtype=torch.float32).reshape(4, 6),
          torch.arange(16, dtype=torch.int32).reshape(8, 2)]
    keys = ["bp0", "bp1"]
    for r in range(2):
        shards = [ts[0].chunk(2, 1)[r].contiguous(), ts[1].chunk(2, 0)[r].contiguous()]
        assert A.batch_put_tensor_with_parallelism(
            keys, shards, [tp(r, 2, 1), tp(r, 2, 0)]) == [0, 0]
    full = B.batch_get_tensor_with_parallelism(
        keys, [target("full", tp(0, 2, 1)), target("full", tp(1, 2, 0))])
    assert same(full[0], ts[0]) and same(full[1], ts[1])
    shard = B.batch_get_tensor_with_parallelism(
        keys, [target("shard", tp(1, 2, 1)), target("shard", tp(0, 4, 0))])
    assert same(shard[0], ts[0][:, 3:].contiguous()) and same(shard[1], ts[1][:2])
    assert B.batch_get_tensor_with_parallelism(keys, [target("full", tp(0, 2, 1))]) == \
        [None, None]
    n = 1024
    keep, base = _buffer(2 * n)
    assert B.register_buffer(base - 64, 2 * n + 128) == 0
    try:
        got = B.batch_get_tensor_with_parallelism_into(
            keys + ["nope"], [base, base + n, base], [n, n, n],
            [target("full", tp(0, 2, 1)), target("shard", tp(1, 2, 0)), None])
        assert same(got[0], ts[0]) and got[0].data_ptr() == base + 304
        assert same(got[1], ts[1][4:]) and got[1].data_ptr() == base + n + 304
        assert got[2] is None
        assert B.batch_get_tensor_with_parallelism_into(keys, [base], [n]) == [None, None]
        # _from with a TP axis: the buffer's whole tensor, every rank's shard stored
        assert B.put_tensor_with_parallelism_from("pf", base, 304 + 96, tp(0, 2, 1)) == 0
        assert same(A.get_tensor_with_tp("pf", 1, 2), ts[0][:, 3:].contiguous())
        assert same(A.get_tensor_with_parallelism("pf", target("full", tp(1, 2, 1))), ts[0])
        assert B.batch_put_tensor_with_parallelism_from(
            ["pf2", "pf3"], [base, base], [400, 400],
            writer_partitions=[Writer(1, 2, 0), Writer(1, 3, 0)]) == [0, -600]
        assert same(A.get_tensor_with_parallelism("pf2", target("shard", tp(1, 2, 0))),
                    ts[0][2:])
        assert B.put_tensor_with_parallelism_from("pf4", base, 400, tp(0, 4, 1)) == -600
        assert B.put_tensor_with_parallelism_from("pf4", base, 399, tp(0, 2, 1)) == -600
        # upsert: the shard and its manifest replaced
        assert B.upsert_tensor_with_parallelism_from("pf", base, 400, tp(0, 2, 1)) == 0
        assert B.batch_upsert_tensor_with_parallelism_from(["pf"], [base], [400],
                                                           [tp(0, 3, 1)]) == [0]
        assert same(A.get_tensor_with_parallelism("pf", target("shard", tp(2, 3, 1))),
                    ts[0][:, 4:].contiguous())
    finally:
        B.unregister_buffer(base - 64)
    u = torch.ones(4, 2)
    assert A.put_tensor_with_parallelism("ups", u[:2].contiguous(), tp(0, 2, 0)) == 0
    assert A.put_tensor_with_parallelism("ups", u[2:].contiguous(), tp(1, 2, 0)) == 0
    assert A.put_tensor_with_parallelism("ups", u[:2] * 5, tp(0, 2, 0)) == 0       # kept
    assert same(B.get_tensor_with_parallelism("ups", target("full", tp(0, 2, 0))), u)
    assert A.upsert_tensor_with_parallelism("ups", u[:2] * 5, tp(0, 2, 0)) == 0
    assert A.batch_upsert_tensor_with_parallelism(["ups"], [u[2:] * 7], [tp(1, 2, 0)]) == [0]
    assert same(B.get_tensor_with_parallelism("ups", target("full", tp(1, 2, 0))),
                torch.cat([u[:2] * 5, u[2:] * 7]))


@check
def parallelism_bad_requests():
    """Mooncake's answers: -600 for a bad put request (nothing stored), None for a bad
    read, -600 / None for every key of a batch whose request list is wrong."""
    t = torch.zeros(4, 6)
    bad = {"rank>=size": tp(2, 2, 0), "rank<0": tp(-1, 2, 0),
           "size 0": tp(0, 0, 0), "split_dim out of range": tp(0, 2, 2),
           "TP without split_dim": tp(0, 2, None), "kind": par(axis("xp", 0, 2)),
           "DP with split_dim": par(axis("dp", 0, 2, 0)),
           "EP without expert_id": par(axis("ep", 0, 2)),
           "EP with split_dim": par(axis("ep", 0, 2, 0, expert_id=1)),
           "PP without stage_id": par(axis("pp", 0, 2)),
           "duplicate kinds": par(axis("dp", 0, 2), axis("dp", 1, 2)),
           "no axes": par(),
           "five axes": par(*[axis(k, 0, 1) for k in ("dp", "dp", "dp", "dp", "dp")]),
           "uneven multi-axis": par(axis("dp", 0, 2), axis("tp", 0, 4, 1)),
           "not a parallelism": object()}
    for why, p in bad.items():
        assert A.put_tensor_with_parallelism("bad", t, p) == -600, why
        assert A.upsert_tensor_with_parallelism("bad", t, p) == -600, why
        if why != "not a parallelism":
            assert A.get_tensor_with_parallelism("bad", target("shard", p)) is None, why
    assert A.is_exist("bad") == 0 and A.is_exist("bad_tp_0") == 0
    assert A.is_exist("bad__parallelism_manifest") == 0
    assert A.put_tensor_with_parallelism("bad", t, tp(0, 2, 0), writer_partition=Writer(0, 2, 0)) == -600
    assert A.put_tensor_with_parallelism("bad", torch.zeros(3, dtype=torch.complex64),
                                         tp(0, 2, 0)) == -600
    assert A.batch_put_tensor_with_parallelism(["b1", "b2"], [t, t], [tp(0, 2, 0)]) == [-600] * 2
    assert A.batch_put_tensor_with_parallelism(["b1", "b2"], [t, t],
                                               (tp(0, 2, 0), tp(0, 2, 0))) == [-600] * 2
    assert A.batch_put_tensor_with_parallelism(["b1", "b2"], [t], None) == [-600] * 2
    assert A.batch_put_tensor_with_parallelism(["b1", "b2"], [t, t], [tp(0, 2, 0)] * 2,
                                               writer_partitions=[Writer(0, 2, 0)] * 2) == [-600] * 2
    assert A.batch_put_tensor_with_parallelism(["b1", "b2"], [t, t],
                                               [tp(0, 2, 0), tp(5, 2, 0)]) == [0, -600]
    assert A.get_tensor_with_parallelism("b1", object()) is None
    assert A.batch_get_tensor_with_parallelism(["b1", "b2"], [None]) == [None, None]
    try:
        target("sharded")
        raise AssertionError("a bad mode was taken")
    except RuntimeError as e:
        assert "Unsupported ReadTarget mode" in str(e)


@check
def parallelism_through_a_dummy_client():
    """A dummy client runs the parallelism calls in its own process over the real
    client's byte calls: its writes read anywhere, reassembly lands in its shared
    buffer."""
    import socket
    from mooncake_te.compat.dummy import RealClient
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    real = RealClient(store(), "127.0.0.1", port)
    C = MooncakeDistributedStore()
    try:
        assert C.setup_dummy(64 * MIB, 16 * MIB, real.addr) == 0
        t = torch.arange(24, dtype=torch.float16).reshape(4, 6)
        for r in range(2):
            assert C.put_tensor_with_parallelism("dp", t.chunk(2, 1)[r].contiguous(),
                                                 tp(r, 2, 1)) == 0
        assert same(A.get_tensor_with_parallelism("dp", target("full", tp(0, 2, 1))), t)
        assert same(C.get_tensor_with_parallelism("dp", target("full", tp(1, 2, 1))), t)
        assert same(C.batch_get_tensor_with_parallelism(
            ["dp"], [target("shard", tp(2, 3, 1))])[0], t[:, 4:].contiguous())
        n = 304 + 48
        ptr = C.alloc_from_mem_pool(n)
        assert ptr and C.register_buffer(ptr, n) == 0
        got = C.get_tensor_with_parallelism_into("dp", ptr, n, target("full", tp(0, 2, 1)))
        assert same(got, t) and got.data_ptr() == ptr + 304
        assert C.put_tensor_with_parallelism_from("dp-from", ptr, n,
                                                  writer_partition=Writer(1, 2, 0)) == 0
        assert same(A.get_tensor_with_parallelism("dp-from", target("shard", tp(1, 2, 0))),
                    t[2:])
        assert C.unregister_buffer(ptr) == 0
    finally:
        C.close()
        real.close()


def main() -> int:
    bad = 0
    only = set(os.environ.get("MTE_TENSOR_CHECKS", "").split(",")) - {""}
    for fn in CHECKS:
        if only and fn.__name__ not in only:
            continue
        try:
            fn()
            print(f"ok {fn.__name__}", flush=True)
        except Exception:
            bad += 1
            print(f"FAIL {fn.__name__}: {traceback.format_exc()}", flush=True)
    A.close()
    B.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

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

from mooncake_te.compat.store import (MooncakeDistributedStore, ReplicateConfig,
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

# SPDX-License-Identifier: Apache-2.0
"""Block id -> address math for a paged KV cache, and coalescing of contiguous runs.

A KV cache is a list of *regions*: one per layer when K and V share a block (vLLM's CPU
layout ``[num_blocks, kv_heads, block_size, 2*head_dim]``, FlashInfer's
``[num_blocks, 2, ...]``), two per layer when K and V are separate planes
(``[2, num_blocks, ...]``). Block ``b`` of region ``r`` starts at
``base[r] + b * stride[r]`` and is ``block_len[r]`` bytes long. Everything here is numpy
arrays: a transfer of n blocks over R regions builds R*n addresses with two broadcasts,
never a Python object per block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KVLayout:
    """Regions of a KV cache (parallel arrays, one entry per region).

    Attributes
    ----------
    names : tuple of str
        ``"<layer name>"`` or ``"<layer name>#k"`` / ``"#v"`` for split planes.
    base, stride, block_len : numpy.ndarray of uint64
        Address of block 0, bytes between blocks, bytes in one block.
    num_blocks : int
        Blocks in every region.
    """

    names: tuple
    base: np.ndarray
    stride: np.ndarray
    block_len: np.ndarray
    num_blocks: int

    @classmethod
    def from_regions(cls, names, base, stride, block_len, num_blocks: int) -> "KVLayout":
        arrs = [np.asarray(a, dtype=np.uint64).reshape(-1) for a in (base, stride, block_len)]
        if not len(names) == len(arrs[0]) == len(arrs[1]) == len(arrs[2]):
            raise ValueError(f"names ({len(names)}), base ({len(arrs[0])}), stride "
                             f"({len(arrs[1])}) and block_len ({len(arrs[2])}) differ in length")
        if (arrs[2] > arrs[1]).any():
            r = int(np.flatnonzero(arrs[2] > arrs[1])[0])
            raise ValueError(f"region {names[r]!r}: block_len {int(arrs[2][r])} exceeds the "
                             f"block stride {int(arrs[1][r])}")
        return cls(tuple(names), arrs[0], arrs[1], arrs[2], int(num_blocks))

    def __len__(self) -> int:
        return len(self.names)

    def addresses(self, block_ids) -> np.ndarray:
        """Start addresses, region-major: ``out[r * n + i]`` is block ``block_ids[i]`` of
        region ``r``."""
        ids = np.asarray(block_ids, dtype=np.uint64).reshape(-1)
        if len(ids) and int(ids.max()) >= self.num_blocks:
            raise ValueError(f"block id {int(ids.max())} out of range: the cache has "
                             f"{self.num_blocks} blocks")
        return (self.base[:, None] + ids[None, :] * self.stride[:, None]).reshape(-1)

    def lengths(self, n: int) -> np.ndarray:
        """Lengths matching :meth:`addresses` for ``n`` blocks."""
        return np.repeat(self.block_len, n)

    def reordered(self, names) -> "KVLayout":
        """The same regions in the order of ``names`` (a peer's order). Raises KeyError
        naming the first missing region."""
        pos = {n: i for i, n in enumerate(self.names)}
        try:
            idx = np.array([pos[n] for n in names], dtype=np.int64)
        except KeyError as e:
            raise KeyError(f"region {e.args[0]!r} is not in this cache") from None
        return KVLayout(tuple(names), self.base[idx], self.stride[idx], self.block_len[idx],
                        self.num_blocks)

    def to_json(self) -> dict:
        return {"names": list(self.names), "base": [int(x) for x in self.base],
                "stride": [int(x) for x in self.stride],
                "block_len": [int(x) for x in self.block_len], "num_blocks": self.num_blocks}

    @classmethod
    def from_json(cls, d: dict) -> "KVLayout":
        return cls.from_regions(d["names"], d["base"], d["stride"], d["block_len"],
                                d["num_blocks"])


def coalesce(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray):
    """Merge neighbouring descriptors that are contiguous on both sides.

    Descriptor i+1 joins i when ``local[i] + lengths[i] == local[i+1]`` and the same holds
    for ``remote``. Order is kept; the result moves exactly the same bytes.

    Returns
    -------
    (local, remote, lengths) : tuple of numpy.ndarray (uint64)
    """
    local = np.asarray(local, dtype=np.uint64)
    remote = np.asarray(remote, dtype=np.uint64)
    lengths = np.asarray(lengths, dtype=np.uint64)
    if len(local) <= 1:
        return local, remote, lengths
    ends_l = local[:-1] + lengths[:-1]
    ends_r = remote[:-1] + lengths[:-1]
    cut = (local[1:] != ends_l) | (remote[1:] != ends_r)
    starts = np.flatnonzero(np.concatenate(([True], cut)))
    return local[starts], remote[starts], np.add.reduceat(lengths, starts).astype(np.uint64)


def plan(local: KVLayout, remote: KVLayout, local_ids, remote_ids):
    """Descriptors moving blocks ``remote_ids`` of ``remote`` into ``local_ids`` of
    ``local`` (region by region, matched by name).

    Returns
    -------
    (local_addrs, remote_addrs, lengths, n_blocks_descriptors) : the coalesced arrays and
    the descriptor count before coalescing.
    """
    local_ids = np.asarray(local_ids, dtype=np.uint64).reshape(-1)
    remote_ids = np.asarray(remote_ids, dtype=np.uint64).reshape(-1)
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks but {len(remote_ids)} remote blocks")
    remote = remote.reordered(local.names)
    if (remote.block_len != local.block_len).any():
        r = int(np.flatnonzero(remote.block_len != local.block_len)[0])
        raise ValueError(f"region {local.names[r]!r}: block is {int(local.block_len[r])} bytes "
                         f"here but {int(remote.block_len[r])} bytes at the peer")
    n = len(local_ids)
    lens = local.lengths(n)
    loc, rem, lens = coalesce(local.addresses(local_ids), remote.addresses(remote_ids), lens)
    return loc, rem, lens, n * len(local)


def layout_from_tensors(kv_caches: dict, num_blocks: "int | None" = None):
    """Regions and distinct storages of vLLM's per-layer KV tensors (torch, any device
    the engine can register).

    Returns
    -------
    (KVLayout, storages) : storages is a list of ``(address, nbytes, tensor)`` with each
    underlying allocation once (several layers may share one).
    """
    names, base, stride, blen, storages, seen = [], [], [], [], [], set()
    nb = num_blocks
    for name, t in kv_caches.items():
        shape = tuple(t.shape)
        if nb is None:
            nb = shape[1] if shape[0] == 2 and len(shape) > 2 else shape[0]
        if shape[0] == nb:
            parts = [(name, t)]
        elif len(shape) > 1 and shape[0] == 2 and shape[1] == nb:
            parts = [(name + "#k", t[0]), (name + "#v", t[1])]
        else:
            raise ValueError(f"layer {name!r}: no block dimension of size {nb} in KV cache "
                             f"shape {shape}; this layout is not supported")
        for part_name, p in parts:
            if not _dense(p[0]):
                raise ValueError(f"layer {name!r}: one block is not contiguous in memory "
                                 f"(shape {shape}, strides {tuple(t.stride())})")
            esz = p.element_size()
            names.append(part_name)
            base.append(p.data_ptr())
            stride.append(p.stride(0) * esz)
            blen.append(p[0].numel() * esz)
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            storages.append((st.data_ptr(), st.nbytes(), t))
    return KVLayout.from_regions(names, base, stride, blen, nb or 0), storages


def _dense(block) -> bool:
    """Whether a block's elements fill one gap-free stretch of memory in some dimension
    order: contiguous, or a permutation of contiguous (vLLM's HND stride order keeps the
    FlashAttention shape over a heads-first physical layout). Only the bytes move, so
    either is one piece; both sides' stride order is in the handshake's layout field."""
    dims = sorted((st, n) for st, n in zip(block.stride(), block.shape) if n != 1)
    want = 1
    for st, n in dims:
        if st != want:
            return False
        want *= n
    return True

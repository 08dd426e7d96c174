# SPDX-License-Identifier: Apache-2.0
"""One answer to "which buffer holds this address" (issue 40, item 3): the AddressTable
of mooncake_te/addresses.py, used by the descriptor, prepared transfers and the
transports, and no copy of the lookup elsewhere."""
from __future__ import annotations

import pathlib
import re

import numpy as np

from mooncake_te.addresses import AddressTable
from mooncake_te.metadata.descriptor import BufferInfo, SegmentDescriptor

PKG = pathlib.Path(__file__).resolve().parents[2] / "mooncake_te"


def test_index_finds_the_span_that_holds_each_request_whole():
    t = AddressTable([BufferInfo(0x3000, 0x1000), BufferInfo(0x1000, 0x1000)])
    assert [b.address for b in t.items] == [0x1000, 0x3000]          # sorted
    a = np.array([0x1000, 0x1fff, 0x1800, 0x2000, 0x3000, 0x0fff], np.uint64)
    assert t.index(a, 1).tolist() == [0, 0, 0, -1, 1, -1]
    # A request must lie whole inside one span.
    assert t.index(a, np.array([0x1000, 1, 0x801, 1, 0x1000, 1], np.uint64)).tolist() == \
        [0, 0, -1, -1, 1, -1]
    assert t.covers([0x1000, 0x3800], 0x800) and not t.covers([0x1000, 0x3801], 0x800)
    assert t.first_outside([0x1000, 0x2000, 0x3000]) == 1
    assert t.first_outside([0x1000]) == -1
    assert t.find(0x3010, 16).address == 0x3000 and t.find(0x2ff0, 32) is None


def test_an_empty_table_holds_nothing():
    t = AddressTable([])
    assert t.index([1, 2]).tolist() == [-1, -1]
    assert not t.covers([1]) and t.find(1) is None


def test_the_descriptor_answers_through_one_cached_table():
    d = SegmentDescriptor(name="p", protocol="tcp", host="h", rpc_port=1, instance_id="1",
                          buffers=[BufferInfo(0x1000, 0x100)])
    t = d.buffer_table()
    assert t is d.buffer_table() and t.covers([0x1080], 0x80)
    d.buffers = d.buffers + [BufferInfo(0x9000, 0x100)]              # a new list: rebuilt
    assert d.buffer_table().covers([0x9000])
    d.buffers.append(BufferInfo(0xa000, 0x10))                       # grown in place
    assert d.buffer_table().covers([0xa000])


def test_no_module_keeps_its_own_copy_of_the_lookup():
    # Before issue 40 the lookup was written out in prepared.py, rdma, cuda_ipc (three
    # times), host_dma, the P2P store and the compat store.
    copies = re.compile(r"searchsorted\(|(?<!self)\.address <= \w+ and \w+ \+ \w+ <= \w+\.address \+")
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        if p.name == "addresses.py":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if copies.search(line):
                bad.append(f"{p.relative_to(PKG)}:{i}: {line.strip()}")
    assert not bad, "use mooncake_te.addresses.AddressTable (or .contains):\n" + \
        "\n".join(bad)

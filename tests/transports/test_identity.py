# SPDX-License-Identifier: Apache-2.0
"""A forged or stale descriptor cannot redirect a transfer (issue #20 item 7).

Engine A's key in the metadata store is overwritten with a descriptor that sends A's
traffic to engine B (another member of the cluster, with the same auth_token). The
initiator must refuse before a byte moves: a descriptor naming another segment is
refused when fetched, and one that claims to be A but points at B's ports fails the
data handshake, where B's HMAC proves B's name, not A's."""
from __future__ import annotations

import json

import numpy as np
import pytest

from servers import http_metadata_server  # noqa: F401

import mooncake_te as mte
from mooncake_te.errors import AuthenticationError, MetadataError
from mooncake_te.metadata import ram_key
from mooncake_te.metadata.descriptor import SegmentDescriptor

TOKEN = b"identity-token"
N = 65536


@pytest.fixture
def trio(http_metadata_server):
    # An unauthenticating metadata server (auth=off): the handshake is what proves names.
    url = http_metadata_server.url + "?auth=off"
    engines = [mte.TransferEngine(host="127.0.0.1", metadata=url, auth_token=TOKEN,
                                  name=n, protocol="tcp") for n in ("ini", "seg-a", "seg-b")]
    bufs = [np.zeros(N, np.uint8) for _ in engines]
    regions = [e.register(b) for e, b in zip(engines, bufs)]
    yield engines, bufs, regions
    for e in engines:
        e.close()


def _overwrite(eng_victim, desc: SegmentDescriptor):
    backend = eng_victim.metadata
    backend.put(ram_key(eng_victim.name, backend.cluster_id), desc.encode())


def test_descriptor_of_another_segment_is_refused(trio):
    (ini, a, b), (bi, ba, bb), (ri, ra, rb) = trio
    bi[:] = 7
    forged = SegmentDescriptor.decode(b.metadata.get(ram_key(b.name, b.metadata.cluster_id)))
    a.metadata._renew = lambda records: None     # A's renewals would repair the key
    _overwrite(a, forged)
    with pytest.raises(MetadataError, match="holds the descriptor of segment 'seg-b'"):
        ini.write("seg-a", ri.address, rb.address, N)
    assert not bb.any() and not ba.any()


def test_descriptor_claiming_a_but_pointing_at_b_fails_the_handshake(trio):
    (ini, a, b), (bi, ba, bb), (ri, ra, rb) = trio
    bi[:] = 9
    doc = json.loads(b.metadata.get(ram_key(b.name, b.metadata.cluster_id)))
    doc["name"] = "seg-a"                       # B's ports, instance and buffers, A's name
    a.metadata._renew = lambda records: None
    a.metadata.put(ram_key("seg-a", a.metadata.cluster_id), json.dumps(doc).encode())
    with pytest.raises(AuthenticationError) as ei:
        ini.write("seg-a", ri.address, rb.address, N)
    assert "seg-a" in str(ei.value) and "stale or forged" in str(ei.value)
    assert not bb.any() and not ba.any()


def test_genuine_segments_still_work(trio):
    (ini, a, b), (bi, ba, bb), (ri, ra, rb) = trio
    bi[:] = np.arange(N, dtype=np.uint8)
    ini.write("seg-a", ri.address, ra.address, N)
    ini.write("seg-b", ri.address, rb.address, N)
    assert (ba == bi).all() and (bb == bi).all()

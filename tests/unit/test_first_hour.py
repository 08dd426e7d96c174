# SPDX-License-Identifier: Apache-2.0
"""Issue 23 (a newcomer's first hour), the Python API items: a GPU location for host
memory is refused at registration (3), and a P2P getter's buffer that lies in a region
it registered already is used as it is (4)."""
from __future__ import annotations

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import cuda
from mooncake_te.p2p_store import P2PStore


@pytest.mark.parametrize("obj", [bytearray(4096), np.zeros(4096, np.uint8)],
                         ids=["bytearray", "numpy"])
def test_cuda_location_for_host_memory_is_refused_at_registration(engine, obj):
    with pytest.raises(mte.InvalidArgumentError) as ei:
        engine.register(obj, location="cuda:0")
    msg = str(ei.value)
    assert "location 'cuda:0'" in msg and "host memory" in msg and "location='auto'" in msg
    ok, why = cuda.available()
    if not ok:
        assert why in msg            # the machine has no CUDA: say so
    assert engine.regions == []     # nothing half-registered
    engine.register(obj, location="auto")     # the right call still works


def test_p2p_get_into_an_already_registered_array():
    engines = [mte.TransferEngine(host="127.0.0.1") for _ in range(2)]
    pub = P2PStore(engines[0], metadata="p2p", chunk_size=64 << 10)
    get = P2PStore(engines[1], metadata="p2p", seeds=[pub.address])
    try:
        data = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8)
        pub.register("obj", [engines[0].register(data, access="r")])
        whole = np.zeros(1 << 20, np.uint8)
        region = engines[1].register(whole)             # the getter's own big region
        into = whole[4096:4096 + len(data)]            # a view inside it
        assert get.get("obj", [into]) is not None
        assert (into == data).all()
        assert engines[1].regions == [region]          # used, not registered again
    finally:
        for s in (get, pub):
            s.close()
        for e in engines:
            e.close()


@pytest.mark.parametrize("token", ["", b""], ids=["str", "bytes"])
def test_empty_auth_token_is_refused(token):
    """Issue 41, item 12: auth_token="" meant no authentication, silently."""
    with pytest.raises(mte.InvalidArgumentError) as ei:
        mte.TransferEngine(host="127.0.0.1", metadata="p2p", auth_token=token)
    msg = str(ei.value)
    assert "auth_token is empty" in msg and "1 to 256 bytes" in msg and "None" in msg

# SPDX-License-Identifier: Apache-2.0
"""``TransferEngine.internal.register_address``: register and publish, all or nothing
(issue 40, item (a)). The Mooncake compatibility layer registers through it instead of
looking at the engine's regions around a failed ``register_address``."""
from __future__ import annotations

import ctypes

import pytest

from servers import HttpMetadataServer
import mooncake_te as mte
from mooncake_te.errors import MooncakeError


def _addr(buf) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def test_register_and_publish_is_all_or_nothing():
    srv = HttpMetadataServer(persist=False)
    srv.start()
    try:
        with mte.TransferEngine(name="internal-reg", metadata=srv.url,
                                host="127.0.0.1") as eng:
            a, b = bytearray(1 << 16), bytearray(1 << 16)
            mr = eng.internal.register_address(_addr(a), len(a))
            assert [r.address for r in eng.regions] == [mr.address]
            srv.kill()                                  # the publish now fails
            with pytest.raises(MooncakeError):
                eng.internal.register_address(_addr(b), len(b))
            assert [r.address for r in eng.regions] == [mr.address], \
                "a failed publish must leave the region unregistered"
            # a local-only region publishes nothing, so the store being down is no error
            loc = eng.internal.register_address(_addr(b), len(b), access="local")
            assert loc.access == "local"
            eng.unregister(loc)
            srv.start()
            eng.unregister(mr)
    finally:
        srv.close()


def test_compat_engine_registers_through_the_internal_door():
    """compat/engine.py keeps no rollback of its own (it had _region_at/_drop_region
    around the engine's register_address)."""
    import inspect
    import mooncake_te.compat.engine as ce
    src = inspect.getsource(ce)
    assert "internal.register_address" in src
    assert "_drop_region" not in src and "_region_at" not in src

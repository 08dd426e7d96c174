# SPDX-License-Identifier: Apache-2.0
"""A transport owns its settings (issue 40, item d): what the fake transport declares
(tests/fake_transport.py) reaches config.toml, the MC_* environment, protocol=, the vLLM
connector's settings, the engine's transport context and metrics through its one
registration point (``transports.register``), and leaves with ``unregister``. The
built-in transports declare theirs the same way (transports/<name>/settings.py), so the
configuration names none of them."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest

import mooncake_te as mte
from mooncake_te import config, transports
from mooncake_te.config import Config
from mooncake_te.errors import ConfigError
from mooncake_te.integrations.vllm.settings import parse_extra_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_transport import fake_class  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fakecfg():
    cls = fake_class("fakecfg")
    transports.register("fakecfg", cls)
    yield cls
    transports.unregister("fakecfg")


def _toml(tmp_path, body: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(body)
    return p


def test_its_key_and_variable_are_accepted_and_checked(fakecfg, tmp_path):
    cfg = Config.load(_toml(tmp_path, "[transfer_engine]\nfakecfg_delay_us = 5\n"), env={})
    assert cfg["transfer_engine"]["fakecfg_delay_us"] == 5
    cfg = Config.load(None, env={"MC_FAKECFG_DELAY_US": "7"})
    assert cfg["transfer_engine"]["fakecfg_delay_us"] == 7
    assert Config.load(None, env={})["transfer_engine"]["fakecfg_delay_us"] == 0
    with pytest.raises(ConfigError, match="fakecfg_delay_us.*microseconds, 0 to 1000000"):
        Config.load(_toml(tmp_path, "[transfer_engine]\nfakecfg_delay_us = -1\n"), env={})
    assert config.owner_of("fakecfg_delay_us") == "fakecfg"
    assert config.owner_of("MC_FAKECFG_DELAY_US") == "fakecfg"


def test_its_protocol_name_alias_and_forcing_variable(fakecfg, tmp_path):
    assert "fakecfg" in config.protocols()
    cfg = Config.load(_toml(tmp_path, '[transfer_engine]\nprotocol = "fakecfg"\n'), env={})
    assert cfg["transfer_engine"]["protocol"] == "fakecfg"
    assert Config.load(None, env={"MC_FORCE_FAKECFG": "1"})["transfer_engine"][
        "protocol"] == "fakecfg"
    assert parse_extra_config({"protocol": "fakecfg"}).protocol == "fakecfg"
    assert parse_extra_config({"protocol": "mooncake_fakecfg"}).protocol == "fakecfg"
    with pytest.raises(ConfigError, match="MC_FORCE_TCP and MC_FORCE_FAKECFG are both set"):
        Config.load(None, env={"MC_FORCE_TCP": "1", "MC_FORCE_FAKECFG": "1"})


def test_unregister_takes_everything_back(tmp_path):
    transports.register("fakecfg", fake_class("fakecfg"))
    transports.unregister("fakecfg")
    assert "fakecfg" not in config.protocols()
    assert "fakecfg_delay_us" not in config.SCHEMA["transfer_engine"]
    assert "MC_FORCE_FAKECFG" not in config.ENV
    with pytest.raises(ConfigError, match="fakecfg_delay_us"):
        Config.load(_toml(tmp_path, "[transfer_engine]\nfakecfg_delay_us = 5\n"), env={})
    with pytest.raises(ConfigError, match="expected one of"):
        parse_extra_config({"protocol": "fakecfg"})


def test_a_key_another_transport_owns_is_refused():
    cls = fake_class("fakeclash")
    cls.settings = (config.Setting("tcp_lanes", (int,), 1),)
    with pytest.raises(ValueError, match="tcp_lanes.*transport 'tcp'"):
        transports.register("fakeclash", cls)
    assert "fakeclash" not in config.protocols()
    cls.settings = (config.Setting("timeout_ms", (int,), 1),)
    with pytest.raises(ValueError, match="timeout_ms.*the engine"):
        transports.register("fakeclash", cls)


def test_the_engine_hands_it_its_own_key(fakecfg, tmp_path):
    cfg = _toml(tmp_path, '[transfer_engine]\nprotocol = "fakecfg"\nfakecfg_delay_us = 3\n')
    with mte.TransferEngine(host="127.0.0.1", config=str(cfg)) as a, \
            mte.TransferEngine(host="127.0.0.1", config=str(cfg)) as b:
        fake = [t for t in a.internal.transports() if t.name == "fakecfg"]
        assert fake and fake[0].delay_us == 3
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, dtype=np.uint8)
        ma, mb = a.register(src), b.register(dst)
        a.write(b.name, ma.address, mb.address, 4096)
        assert (dst == src).all()
        m = a.metrics()
        assert m["fakecfg"] == {"memmove": {"copies": 1, "bytes": 4096}}


def test_the_built_in_transports_declare_their_keys():
    """config.py spells no transport's key or variable: each comes from the transport
    that owns it (before issue 40 item d, config.py listed tcp_* and rdma_* itself)."""
    te = config.SCHEMA["transfer_engine"]
    for key, owner in [("tcp_lanes", "tcp"), ("data_idle_timeout_s", "tcp"),
                       ("rdma_mtu", "rdma"), ("rdma_gid_index", "rdma")]:
        assert key in te and config.owner_of(key) == owner
    for var, owner in [("MC_TCP_SLICE_SIZE", "tcp"), ("MC_FORCE_TCP", "tcp"),
                       ("MC_GID_INDEX", "rdma"), ("MC_FORCE_HCA", "rdma")]:
        assert var in config.ENV and config.owner_of(var) == owner
    src = (ROOT / "mooncake_te" / "config.py").read_text()
    spelled = sorted({n.value for n in ast.walk(ast.parse(src))
                      if isinstance(n, ast.Constant) and isinstance(n.value, str)
                      and n.value.startswith(("tcp_", "rdma_", "MC_TCP_L", "MC_TCP_S",
                                              "MC_FORCE_"))})
    assert not spelled, spelled


def test_a_native_prepared_post_is_a_declared_capability(fakecfg, tmp_path):
    """PreparedTransfer posts in one native call only through a transport declaring
    ``prepared`` (TCP); others gather (before: a probe for post_prepared, and the vLLM
    worker compared the route with "tcp"/"shm")."""
    n, block = 8, 4096
    for proto, native in (("tcp", True), ("fakecfg", False)):
        cfg = _toml(tmp_path, f'[transfer_engine]\nprotocol = "{proto}"\n')
        with mte.TransferEngine(host="127.0.0.1", config=str(cfg)) as a, \
                mte.TransferEngine(host="127.0.0.1", config=str(cfg)) as b:
            src = np.arange(n * block, dtype=np.uint64).view(np.uint8)[:n * block].copy()
            dst = np.zeros(n * block, dtype=np.uint8)
            ma, mb = a.register(src), b.register(dst)
            steps = np.arange(n, dtype=np.uint64) * block
            p = a.prepare(b.name, ma.address + steps, mb.address + steps, block)
            assert p.native is native, (proto, p.transport)
            p.post(mte.Op.WRITE, [1, 3], [1, 3]).wait()
            assert bytes(dst[block:2 * block]) == bytes(src[block:2 * block])
            assert bytes(dst[3 * block:4 * block]) == bytes(src[3 * block:4 * block])

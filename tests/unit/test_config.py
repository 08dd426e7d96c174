# SPDX-License-Identifier: Apache-2.0
"""config.toml loading, validation messages, MC_* overrides."""
from __future__ import annotations

import pickle
import textwrap

import pytest

from mooncake_te.transports.tcp.settings import default_tcp_lanes
from mooncake_te.config import (Config, find_problems, split_metadata_url,
                                validate)
from mooncake_te.errors import ConfigError

FULL = """
[metadata]
server_type = "etcd"
server_address = "10.0.0.1:2379"

[transfer_engine]
protocol = "rdma"
device_names = ["mlx5_0", "mlx5_1"]
use_gpu_direct = true
enable_multi_nic = true
topology_aware = true
timeout_ms = 5000
retry_count = 3
tcp_lanes = 8
tcp_slice_size = 1048576
host = "10.0.0.2"
port = 15003
auth_token = "s3cret"

[kvcache]
cache_dir = "/mnt/nvme/mooncake_kvcache"
dram_cache_gb = 64
ssd_cache_gb = 512.5
eviction_policy = "lfu"
block_size = 16

[p2p_store]
metadata_server = "etcd"
metadata_address = "127.0.0.1:2379"
decentralized = true
"""


def write(tmp_path, text, name="config.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_defaults():
    cfg = Config.load(None, env={})
    assert cfg.source == "<defaults>"
    assert cfg["metadata"]["server_type"] == "p2p"
    assert cfg.get("transfer_engine", "protocol") == "auto"
    assert cfg["transfer_engine"]["tcp_lanes"] == default_tcp_lanes()
    assert cfg.timeout_s == 30.0
    assert cfg["kvcache"]["block_size"] == 16


def test_full_skeleton_loads(tmp_path):
    path = write(tmp_path, FULL)
    cfg = Config.load(path, env={})
    assert cfg.source == path
    assert cfg["transfer_engine"]["device_names"] == ["mlx5_0", "mlx5_1"]
    assert cfg.timeout_s == 5.0
    assert cfg["transfer_engine"]["tcp_slice_size"] == 1 << 20
    assert cfg["transfer_engine"]["auth_token"] == "s3cret"
    assert cfg["kvcache"]["ssd_cache_gb"] == 512.5
    assert cfg["kvcache"]["eviction_policy"] == "lfu"
    # A Config passes through load() as a copy: changing one leaves the other alone.
    again = Config.load(cfg, env={})
    again["transfer_engine"]["device_names"].append("mlx5_2")
    assert cfg["transfer_engine"]["device_names"] == ["mlx5_0", "mlx5_1"]


@pytest.mark.parametrize("body, needles", [
    ("[transfer_engine]\ndevice_name = [\"mlx5_0\"]\n",
     ["unknown key 'device_name' in [transfer_engine]", "did you mean 'device_names'?"]),
    ("[kvcahce]\nblock_size = 16\n",
     ["unknown section [kvcahce]", "did you mean [kvcache]?"]),
    ("protocol = \"rdma\"\n",
     ["protocol = 'rdma' is outside any section", "put it under [transfer_engine]"]),
    ("[metadata]\nblock_size = 16\n",
     ["unknown key 'block_size' in [metadata]", "'block_size' belongs in [kvcache]"]),
    ("[transfer_engine]\ntimeout_ms = \"5000\"\n",
     ["[transfer_engine] timeout_ms = '5000' (str): expected an integer"]),
    ("[transfer_engine]\nuse_gpu_direct = 1\n",
     ["use_gpu_direct = 1 (int): expected true or false"]),
    ("[kvcache]\nblock_size = true\n", ["block_size = True (bool): expected an integer"]),
    ("[metadata]\nserver_type = \"etcd3\"\n",
     ["server_type = 'etcd3': expected one of 'p2p', 'etcd', 'redis', 'http'",
      "did you mean 'etcd'?"]),
    ("[kvcache]\nblock_size = 0\n", ["block_size = 0: expected a positive number"]),
    ("[transfer_engine]\nport = 70000\n", ["port = 70000: expected a TCP port"]),
    ("[transfer_engine]\nretry_count = 200\n", ["retry_count = 200: expected 0 to 127"]),
    ("[transfer_engine]\ndevice_names = [\"mlx5_0\", 1]\n",
     ["device_names = ['mlx5_0', 1]: expected a list of non-empty strings"]),
    ("[transfer_engine]\ndevice_names = \"mlx5_0\"\n",
     ["device_names = 'mlx5_0' (str): expected a list of strings"]),
    ("metadata = 3\n", ["[metadata] must be a table, got 3"]),
])
def test_errors_name_file_key_value_and_expectation(tmp_path, body, needles):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        Config.load(path, env={})
    msg = str(e.value)
    assert path in msg
    for n in needles:
        assert n in msg, msg
    assert e.value.status == -804
    assert str(pickle.loads(pickle.dumps(e.value))) == msg


def test_every_problem_is_reported_at_once(tmp_path):
    path = write(tmp_path, """
        [metadata]
        server_adress = "x"
        [transfer_engine]
        timeout_ms = -1
        [kvcache]
        eviction_policy = "fifo"
    """)
    with pytest.raises(ConfigError) as e:
        Config.load(path, env={})
    msg = str(e.value)
    assert msg.startswith(f"3 problems in {path}:")
    assert "server_adress" in msg and "timeout_ms = -1" in msg and "'fifo'" in msg


def test_syntax_and_missing_files(tmp_path):
    path = write(tmp_path, "[transfer_engine]\nprotocol = rdma\n")
    with pytest.raises(ConfigError, match=r"not valid TOML: .*line 2"):
        Config.load(path, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="is a directory"):
        Config.load(tmp_path, env={})


def test_find_problems_kinds():
    kinds = {(p.section, p.key): p.kind for p in find_problems(
        {"kvcache": {"blok_size": 1, "block_size": "16"}, "nope": {}})}
    assert kinds == {("kvcache", "blok_size"): "unknown", ("kvcache", "block_size"): "type",
                     ("nope", ""): "unknown"}
    (p,) = find_problems({"kvcache": {"blok_size": 1}}, "f.toml")
    assert (p.where, p.suggestion) == ("f.toml", "block_size")


def test_load_lenient_keeps_good_keys(tmp_path):
    path = write(tmp_path, """
        [transfer_engine]
        protocol = "tcp"
        device_name = ["mlx5_0"]
        timeout_ms = "soon"
        [kvcache]
        block_size = 32
    """)
    cfg, problems = Config.load_lenient(path, env={})
    assert cfg["transfer_engine"]["protocol"] == "tcp"
    assert cfg["kvcache"]["block_size"] == 32
    assert cfg["transfer_engine"]["timeout_ms"] == 30000          # bad value: default kept
    assert sorted(p.key for p in problems) == ["device_name", "timeout_ms"]
    cfg, problems = Config.load_lenient(write(tmp_path, "[x\n", "bad.toml"), env={})
    assert [p.kind for p in problems] == ["syntax"]


def test_env_overrides_file(tmp_path):
    path = write(tmp_path, FULL)
    cfg = Config.load(path, env={"MC_TRANSFER_TIMEOUT": "2.5", "MC_TE_FILTERS": "mlx5_2, mlx5_3,",
                                 "MC_TCP_LANES_PER_PEER": "2", "MC_TCP_SLICE_SIZE": "65536",
                                 "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_RETRY_CNT": "9",
                                 "MC_AUTH_TOKEN": "other"})
    te = cfg["transfer_engine"]
    assert cfg.timeout_s == 2.5
    assert te["device_names"] == ["mlx5_2", "mlx5_3"]
    assert (te["tcp_lanes"], te["tcp_slice_size"], te["host"], te["retry_count"],
            te["auth_token"]) == (2, 65536, "127.0.0.1", 9, "other")
    assert cfg.env_applied["MC_TE_FILTERS"] == ("transfer_engine", "device_names")
    # Empty variables are ignored, as unset.
    assert Config.load(path, env={"MC_TE_FILTERS": ""})["transfer_engine"]["device_names"] == [
        "mlx5_0", "mlx5_1"]


def test_default_lanes_follow_the_cores():
    assert [default_tcp_lanes(n) for n in (1, 2, 4, 8, 16, 64)] == [2, 2, 2, 4, 8, 8]


def test_rdma_qp_timeout_default_and_variable():
    assert Config.load(None, env={})["transfer_engine"]["rdma_qp_timeout"] == 14
    assert Config.load(None, env={"MC_RDMA_QP_TIMEOUT": "18"})[
        "transfer_engine"]["rdma_qp_timeout"] == 18


def test_force_tcp_and_hca():
    assert Config.load(None, env={"MC_FORCE_TCP": "1"})["transfer_engine"]["protocol"] == "tcp"
    assert Config.load(None, env={"MC_FORCE_HCA": "true"})["transfer_engine"]["protocol"] == "rdma"
    assert Config.load(None, env={"MC_FORCE_TCP": "0"})["transfer_engine"]["protocol"] == "auto"
    with pytest.raises(ConfigError, match="MC_FORCE_TCP and MC_FORCE_HCA"):
        Config.load(None, env={"MC_FORCE_TCP": "1", "MC_FORCE_HCA": "1"})


@pytest.mark.parametrize("env, needle", [
    ({"MC_TCP_LANES_PER_PEER": "many"}, "MC_TCP_LANES_PER_PEER='many' is not valid for "
                                        "[transfer_engine] tcp_lanes: expected an integer"),
    # said in the variable's units, seconds (issue 41, item 12)
    ({"MC_TRANSFER_TIMEOUT": "0"}, "MC_TRANSFER_TIMEOUT='0' is not valid for [transfer_engine] "
                                   "timeout_ms: expected a number of seconds"),
    ({"MC_METADATA_SERVER": "zookeeper://h:1"}, "server_type = 'zookeeper'"),
    ({"MC_RDMA_QP_TIMEOUT": "32"}, "rdma_qp_timeout = 32: expected 1 to 31"),
])
def test_bad_env_values(env, needle):
    with pytest.raises(ConfigError) as e:
        Config.load(None, env=env)
    assert needle in str(e.value)


@pytest.mark.parametrize("spec, want", [
    ("P2PHANDSHAKE", ("p2p", "")),
    ("etcd://10.0.0.1:2379,10.0.0.2:2379", ("etcd", "10.0.0.1:2379,10.0.0.2:2379")),
    ("10.0.0.1:2379", ("etcd", "10.0.0.1:2379")),        # Mooncake: no scheme means etcd
    ("redis://10.0.0.1:6379", ("redis", "10.0.0.1:6379")),
    ("http://10.0.0.1:8080/metadata", ("http", "10.0.0.1:8080/metadata")),
    ("https://md.example:8443/metadata", ("http", "https://md.example:8443/metadata")),
])
def test_metadata_server_variable(spec, want):
    assert split_metadata_url(spec) == want
    md = Config.load(None, env={"MC_METADATA_SERVER": spec})["metadata"]
    assert (md["server_type"], md["server_address"]) == want


def test_validate_single_setting():
    assert validate("kvcache", "block_size", 64) == 64
    with pytest.raises(ConfigError, match="did you mean 'block_size'"):
        validate("kvcache", "blocksize", 64)


def test_without_a_toml_parser_the_error_says_what_to_install(tmp_path):
    """Pythons before 3.11 have no tomllib; without tomli either, loading a file must
    fail with the fix, and importing the package must still work."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    for name in ("tomllib", "tomli"):
        (shadow / f"{name}.py").write_text(
            f"raise ModuleNotFoundError('hidden for this test', name={name!r})\n")
    cfg = write(tmp_path, "[kvcache]\nblock_size = 16\n")
    code = ("from mooncake_te.config import Config, ConfigError\n"
            "print(Config.load(None, env={})['kvcache']['block_size'])\n"
            f"try:\n    Config.load({cfg!r}, env={{}})\n"
            "except ConfigError as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=f"{shadow}{os.pathsep}{root}"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "16"
    assert "has no tomllib; pip install tomli" in lines[1] and cfg in lines[1]


def test_with_overrides_is_a_validated_copy(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[transfer_engine]\nuse_gpu_direct = false\ntimeout_ms = 7000\n")
    base = Config.load(p, env={})
    cfg = base.with_overrides({"transfer_engine": {"use_gpu_direct": True}}, "extra")
    assert cfg["transfer_engine"]["use_gpu_direct"] is True
    assert cfg["transfer_engine"]["timeout_ms"] == 7000 and cfg.source == str(p)
    assert base["transfer_engine"]["use_gpu_direct"] is False        # untouched
    with pytest.raises(ConfigError, match=r"extra: \[transfer_engine\] enable_multi_nic = "
                                          r"'on' \(str\): expected true or false"):
        base.with_overrides({"transfer_engine": {"enable_multi_nic": "on"}}, "extra")
    with pytest.raises(ConfigError, match="unknown key 'use_gpu_drect'"):
        base.with_overrides({"transfer_engine": {"use_gpu_drect": True}}, "extra")

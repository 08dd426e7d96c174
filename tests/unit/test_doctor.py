# SPDX-License-Identifier: Apache-2.0
"""``mooncake-te doctor``: every check with a setup that trips it and one that does not.

Machines are the fake sysfs trees of tests/data/sysfs/machines.py; driver versions come
from a fake procfs folder; the metadata checks, which talk to real servers, are in
tests/metadata/test_doctor_metadata.py.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys

import pytest

from mooncake_te.doctor import Context, Severity, exit_code, report, run_checks
from mooncake_te.doctor.base import CHECKS, check
from doctor_support import (HERE, OPEN_580, PROPRIETARY_535, ROOT, _cli, _need,  # noqa: F401
                            fake_proc, machines, problems, run, toml, trees)


# ---- overall ---------------------------------------------------------------------

def test_nothing_configured_nothing_wrong(trees):
    findings = run(trees, "empty")
    assert problems(findings) == []
    assert exit_code(findings) == 0
    assert {c.name for c in CHECKS} == {f.check for f in findings}   # every check ran
    assert "0 error(s), 0 warning(s)" in report(findings)


def test_every_finding_has_code_and_fix(trees, tmp_path):
    cfg = toml(tmp_path, """
        [transfer_engine]
        protocol = "rdma"
        device_names = ["mlx5_bond0"]
        [kvcache]
        cache_dir = "/nonexistent/cache"
    """)
    findings = run(trees, "onebox", config=cfg, tmp_path=tmp_path)
    bad = [f for f in findings if f.severity in (Severity.ERROR, Severity.WARNING)]
    assert bad and all(f.code.startswith("MTE") and len(f.code) == 6 for f in bad)
    assert all(f.fix for f in bad)
    text = report(findings)
    assert "MTE201" in text and "fix: replace 'mlx5_bond0' with 'mlx5_0'" in text


def test_a_crashing_check_is_reported_not_raised(trees):
    @check("boom", "always fails", ("MTE999",))
    def boom(ctx):
        raise RuntimeError("kaput")
    try:
        (f,) = run(trees, only=["boom"])
    finally:
        CHECKS.pop()
    assert (f.code, f.severity, f.check) == ("MTE000", Severity.ERROR, "boom")
    assert "RuntimeError: kaput" in f.message


# ---- MTE1xx configuration ----------------------------------------------------------

def test_mte100_unparsable_config(trees, tmp_path):
    bad = run(trees, config=toml(tmp_path, "[transfer_engine\nprotocol='tcp'\n"))
    (f,) = problems(bad, "MTE100")
    assert "not valid TOML" in f.message and "line 1" in f.message
    good = run(trees, config=toml(tmp_path, "[transfer_engine]\nprotocol='tcp'\n", "ok.toml"))
    assert problems(good) == []


def test_mte101_unknown_keys_with_suggestions(trees, tmp_path):
    findings = run(trees, config=toml(tmp_path, """
        [transfer_engine]
        device_name = ["mlx5_0"]
        [kvcahce]
        block_size = 16
    """))
    found = {f.data["key"] or f.data["section"]: f for f in problems(findings, "MTE101")}
    assert found["device_name"].data["suggestion"] == "device_names"
    assert found["device_name"].fix == "rename it to 'device_names'"
    assert found["kvcahce"].fix == "rename the section to [kvcache]"
    assert exit_code(findings) == 2
    ok = run(trees, config=toml(tmp_path, """
        [transfer_engine]
        device_names = []
        [kvcache]
        block_size = 16
    """, "ok.toml"))
    assert problems(ok) == []


def test_mte102_wrong_type(trees, tmp_path):
    (f,) = problems(run(trees, config=toml(tmp_path, "[kvcache]\nblock_size = '16'\n")),
                    "MTE102")
    assert f.data["key"] == "block_size" and f.data["value"] == "16"
    assert "expected an integer" in f.message
    assert problems(run(trees, config=toml(tmp_path, "[kvcache]\nblock_size = 16\n", "b"))) == []


def test_mte103_bad_environment(trees):
    (f,) = problems(run(trees, env={"MC_TCP_LANES_PER_PEER": "lots"}), "MTE103")
    assert "MC_TCP_LANES_PER_PEER='lots'" in f.message
    assert problems(run(trees, env={"MC_TCP_LANES_PER_PEER": "8"})) == []


def test_mte104_custom_topology_file(trees, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"cuda:0": [["mlx5_0"]]}')
    (f,) = problems(run(trees, "hgx8", env={"MC_CUSTOM_TOPO_JSON": str(bad)},
                        only=["custom_topology"]), "MTE104")
    assert "must be exactly [[preferred NICs], [available NICs]]" in f.message
    typo = tmp_path / "typo.json"
    typo.write_text('{"cuda:0": [["mlx5_00"], []]}')
    (f,) = problems(run(trees, "hgx8", env={"MC_CUSTOM_TOPO_JSON": str(typo)},
                        only=["custom_topology"]), "MTE104")
    assert "'mlx5_00'" in f.message
    good = tmp_path / "good.json"
    good.write_text('{"cuda:0": [["mlx5_0"], ["mlx5_1"]]}')
    findings = run(trees, "hgx8", env={"MC_CUSTOM_TOPO_JSON": str(good)},
                   only=["custom_topology"])
    assert problems(findings) == [] and findings[0].severity == Severity.OK


# ---- MTE2xx devices and topology ---------------------------------------------------

RDMA = "[transfer_engine]\nprotocol = 'rdma'\n"


def test_mte200_rdma_without_devices(trees, tmp_path):
    cfg = toml(tmp_path, RDMA)
    (f,) = problems(run(trees, "empty", config=cfg), "MTE200")
    assert "no RDMA device at all" in f.message
    (f,) = problems(run(trees, "onebox_down", config=cfg, only=["rdma_devices"]), "MTE200")
    assert "mlx5_0: port 1 DOWN" in f.message
    assert problems(run(trees, "vm_rxe", config=cfg, only=["rdma_devices"])) == []
    # protocol auto falls back to TCP: fine.
    assert problems(run(trees, "empty", only=["rdma_devices"])) == []


def test_mte201_misspelled_device(trees, tmp_path):
    cfg = toml(tmp_path, RDMA + "device_names = ['mlx5_bond0']\n")
    (f,) = problems(run(trees, "onebox", config=cfg, only=["rdma_devices"]), "MTE201")
    assert f.severity == Severity.ERROR
    assert "'mlx5_bond0'" in f.message and "found: mlx5_0" in f.message
    assert f.data["suggestion"] == "mlx5_0"
    assert "[transfer_engine] device_names" in f.message
    # The same through MC_TE_FILTERS names the variable.
    (f,) = problems(run(trees, "onebox", env={"MC_TE_FILTERS": "mlx5_bond0"},
                        only=["rdma_devices"]), "MTE201")
    assert "MC_TE_FILTERS" in f.message
    ok = toml(tmp_path, RDMA + "device_names = ['mlx5_0']\n", "ok.toml")
    assert problems(run(trees, "onebox", config=ok, only=["rdma_devices"])) == []


def test_mte202_no_active_port(trees, tmp_path):
    cfg = toml(tmp_path, RDMA + "device_names = ['mlx5_0']\n")
    (f,) = problems(run(trees, "onebox_down", config=cfg, only=["rdma_devices"]), "MTE202")
    assert "port 1 DOWN" in f.message
    assert problems(run(trees, "onebox", config=cfg, only=["rdma_devices"])) == []


def test_mte203_empty_gid_table(trees, tmp_path):
    cfg = toml(tmp_path, RDMA + "device_names = ['mlx5_0']\n")
    (f,) = problems(run(trees, "onebox_nogid", config=cfg, only=["rdma_devices"]), "MTE203")
    assert "empty GID table" in f.message
    assert problems(run(trees, "onebox", config=cfg, only=["rdma_devices"])) == []


def test_mte204_gpu_nic_on_other_socket(trees, tmp_path):
    remote = tmp_path / "remote.json"
    remote.write_text(json.dumps({"cuda:0": [["mlx5_4"], ["mlx5_0"]]}))
    findings = run(trees, "hgx8", env={"MC_CUSTOM_TOPO_JSON": str(remote)},
                   only=["gpu_nic_affinity"])
    (f,) = problems(findings, "MTE204")
    assert f.severity == Severity.WARNING and exit_code(findings) == 1
    assert f.data == {"gpu": "cuda:0", "nic": "mlx5_4", "link": "SYS", "suggestion": "mlx5_0"}
    assert "NUMA node 0" in f.message and "NUMA node 1" in f.message
    assert str(remote) in f.fix and "mlx5_0 (PIX)" in f.fix
    # The discovered matrix pairs every GPU with the NIC under its switch.
    assert problems(run(trees, "hgx8", only=["gpu_nic_affinity"])) == []


def test_mte205_gpu_nic_not_under_one_switch(trees, tmp_path):
    cfg = toml(tmp_path, "[transfer_engine]\ndevice_names = ['mlx5_0', 'mlx5_4']\n")
    found = {f.data["gpu"]: f for f in problems(run(trees, "hgx8", config=cfg,
                                                    only=["gpu_nic_affinity"]), "MTE205")}
    assert sorted(found) == ["cuda:1", "cuda:2", "cuda:3", "cuda:5", "cuda:6", "cuda:7"]
    assert {g: f.data["link"] for g, f in found.items()} == {
        "cuda:1": "PXB", "cuda:2": "PHB", "cuda:3": "PHB",
        "cuda:5": "PXB", "cuda:6": "NODE", "cuda:7": "NODE"}
    assert found["cuda:2"].fix == "add mlx5_2 (PIX to cuda:2) to [transfer_engine] device_names"
    # One socket, GPU and HCA on separate root ports: nothing better exists; say so.
    (f,) = problems(run(trees, "onebox", only=["gpu_nic_affinity"]), "MTE205")
    assert "board's layout" in f.message and "slots" in f.fix
    off = toml(tmp_path, "[transfer_engine]\ndevice_names = ['mlx5_0', 'mlx5_4']\n"
                         "use_gpu_direct = false\ntopology_aware = false\n", "off.toml")
    (f,) = run(trees, "hgx8", config=off, only=["gpu_nic_affinity"])
    assert f.severity == Severity.SKIP


def test_mte206_gpudirect_registration(trees, tmp_path):
    only = ["gpudirect"]
    (f,) = problems(run(trees, "hgx8", proc=fake_proc(tmp_path, PROPRIETARY_535), only=only),
                    "MTE206")
    assert "driver 535 is the proprietary kernel module" in f.message
    (f,) = problems(run(trees, "hgx8", proc=fake_proc(tmp_path / "k", OPEN_580, "5.4.0-150"),
                        only=only), "MTE206")
    assert "kernel 5.4.0-150 is older than 5.12" in f.message
    (f,) = problems(run(trees, "hgx8", proc=fake_proc(tmp_path / "n", None), only=only),
                    "MTE206")
    assert "driver is not loaded" in f.message
    # Open kernel modules R515+ on Linux 5.12+: dma-buf works.
    assert problems(run(trees, "hgx8", proc=fake_proc(tmp_path / "o", OPEN_580),
                        only=only)) == []
    # nvidia-peermem loaded: fine even with the proprietary driver.
    peer = machines.build_hgx8(str(tmp_path / "peer"))
    os.makedirs(os.path.join(peer, "module", "nvidia_peermem"))
    ctx = Context(sysfs_root=peer, proc_root=fake_proc(tmp_path / "p", PROPRIETARY_535), env={})
    assert problems(run_checks(ctx, only=only)) == []
    # Not applicable: no GPU, or GPUDirect off.
    (f,) = run(trees, "vm_rxe", proc=fake_proc(tmp_path / "q", None), only=only)
    assert f.severity == Severity.SKIP
    cfg = toml(tmp_path, "[transfer_engine]\nuse_gpu_direct = false\n")
    (f,) = run(trees, "hgx8", config=cfg, proc=fake_proc(tmp_path / "r", None), only=only)
    assert f.severity == Severity.SKIP


# ---- MTE4xx local resources --------------------------------------------------------

def cache_toml(tmp_path, cache_dir, ssd=0, dram=0, name="cache.toml"):
    return toml(tmp_path, f"[kvcache]\ncache_dir = '{cache_dir}'\nssd_cache_gb = {ssd}\n"
                          f"dram_cache_gb = {dram}\n", name)


def test_mte400_cache_dir_missing(trees, tmp_path):
    (f,) = problems(run(trees, config=cache_toml(tmp_path, tmp_path / "nope" / "cache"),
                        only=["cache_dir"]), "MTE400")
    assert "does not exist" in f.message and "is the SSD mounted?" in f.fix
    (f,) = problems(run(trees, config=toml(tmp_path, "[kvcache]\nssd_cache_gb = 10\n", "x"),
                        only=["cache_dir"]), "MTE400")
    assert "cache_dir is not set" in f.message
    (tmp_path / "cache").mkdir()
    assert problems(run(trees, config=cache_toml(tmp_path, tmp_path / "cache", ssd=0.001),
                        only=["cache_dir"])) == []


def test_mte402_no_room(trees, tmp_path):
    (tmp_path / "cache").mkdir()
    (f,) = problems(run(trees, config=cache_toml(tmp_path, tmp_path / "cache", ssd=10 ** 7),
                        only=["cache_dir"]), "MTE402")
    assert "ssd_cache_gb = 10000000 needs" in f.message and f.data["needed_bytes"] == 10 ** 7 << 30


def test_mte403_memlock_limit(trees, tmp_path):
    cfg = cache_toml(tmp_path, "", dram=4)
    ctx = Context(config_path=cfg, sysfs_root=trees["empty"], env={})
    ctx.__dict__["memlock"] = (8 << 20, False)      # Debian's default: 8 MiB, no CAP_IPC_LOCK
    (f,) = problems(run_checks(ctx, only=["memlock"]), "MTE403")
    assert "8192 KiB" in f.message and "ulimit -l unlimited" in f.fix
    ctx = Context(config_path=cfg, sysfs_root=trees["empty"], env={})
    ctx.__dict__["memlock"] = (resource.RLIM_INFINITY, False)
    assert problems(run_checks(ctx, only=["memlock"])) == []
    ctx = Context(config_path=cfg, sysfs_root=trees["empty"], env={})
    ctx.__dict__["memlock"] = (8 << 20, True)       # CAP_IPC_LOCK lifts the limit
    assert problems(run_checks(ctx, only=["memlock"])) == []


def _unprivileged():
    """preexec_fn for a child without the capabilities that let root ignore file modes
    and RLIMIT_MEMLOCK (CAP_DAC_OVERRIDE 1, CAP_DAC_READ_SEARCH 2, CAP_IPC_LOCK 14),
    with ulimit -l at 64 KiB."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2, 14):
            if libc.prctl(24, cap, 0, 0, 0) != 0:        # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))


def test_cache_dir_and_memlock_in_a_real_unprivileged_process(trees, tmp_path):
    """MTE401 and MTE403 for real: a child process without CAP_DAC_OVERRIDE and
    CAP_IPC_LOCK, with ulimit -l 64 KiB, against a read-only folder."""
    ro = tmp_path / "ro-cache"
    ro.mkdir()
    ro.chmod(0o555)
    rw = tmp_path / "rw-cache"
    rw.mkdir()

    def doctor(cfg):
        env = dict(os.environ, PYTHONPATH=ROOT)
        try:
            p = subprocess.run([sys.executable, "-m", "mooncake_te", "doctor", "--config", cfg,
                                "--sysfs-root", trees["empty"], "--check", "cache_dir",
                                "--check", "memlock", "--json"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=60,
                               preexec_fn=_unprivileged)
        except subprocess.SubprocessError as e:
            pytest.skip(f"cannot start an unprivileged child here: {e}")
        return p.returncode, json.loads(p.stdout)

    rc, doc = doctor(cache_toml(tmp_path, ro, ssd=0.001, dram=1))
    assert rc == 2 and doc["exit_code"] == 2
    codes = {f["code"]: f for f in doc["findings"] if f["severity"] == "error"}
    assert set(codes) == {"MTE401", "MTE403"}
    assert "not writable" in codes["MTE401"]["message"]
    assert codes["MTE403"]["data"]["limit_bytes"] == 64 << 10
    # 10 KiB of DRAM cache under a 64 KiB limit, a writable folder: all good.
    rc, doc = doctor(cache_toml(tmp_path, rw, ssd=0.001, dram=0.00001, name="ok.toml"))
    assert rc == 0, doc
    assert doc["summary"]["error"] == 0 and doc["summary"]["ok"] == 2


# ---- MTE5xx vLLM -----------------------------------------------------------------

def _yaml():
    try:
        import yaml  # noqa: F401
    except ImportError:
        _need("PyYAML (reads YAML vLLM configs)", "pip install pyyaml")


def vllm_file(tmp_path, doc, name="vllm.json"):
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


VLLM_ONLY = ["vllm_config", "block_size", "kv_role"]


def test_mte500_unreadable_vllm_config(trees, tmp_path):
    (f,) = problems(run(trees, vllm=str(tmp_path / "missing.json"), only=VLLM_ONLY), "MTE500")
    assert "does not exist" in f.message
    (f,) = problems(run(trees, vllm=vllm_file(tmp_path, '["a list"]', "l.json"),
                        only=VLLM_ONLY), "MTE500")
    assert "expected a mapping" in f.message
    (f,) = problems(run(trees, vllm=vllm_file(tmp_path, {"kv_transfer_config": "{oops"}, "s"),
                        only=VLLM_ONLY), "MTE500")
    assert "kv_transfer_config is a string but not JSON" in f.message


def test_mte500_unreadable_yaml(trees, tmp_path):
    _yaml()
    (f,) = problems(run(trees, vllm=vllm_file(tmp_path, "block_size: [16\n", "v.yaml"),
                        only=VLLM_ONLY), "MTE500")
    assert "neither valid JSON nor valid YAML" in f.message


def test_mte501_block_size(trees, tmp_path):
    cfg64 = toml(tmp_path, "[kvcache]\nblock_size = 64\n")
    v16 = vllm_file(tmp_path, {"cache_config": {"block_size": 16},
                               "kv_transfer_config": {"kv_connector": "MooncakeConnector",
                                                      "kv_role": "kv_both"}})
    (f,) = problems(run(trees, config=cfg64, vllm=v16, only=VLLM_ONLY), "MTE501")
    assert f.severity == Severity.ERROR and (f.data["toml"], f.data["vllm"]) == (64, 16)
    assert "cache_config.block_size = 16" in f.message
    # `vllm serve --config` style with dashes and the CLI's JSON string, equal sizes: fine.
    serve = vllm_file(tmp_path, {"block-size": 64, "kv-transfer-config": json.dumps(
        {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"})}, "serve.json")
    assert problems(run(trees, config=cfg64, vllm=serve, only=VLLM_ONLY)) == []
    # vLLM silent, ours not its default: a warning.
    unset = vllm_file(tmp_path, {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}, "b")
    (f,) = problems(run(trees, config=cfg64, vllm=unset, only=VLLM_ONLY), "MTE501")
    assert f.severity == Severity.WARNING
    assert problems(run(trees, vllm=unset, only=VLLM_ONLY)) == []     # 16 and 16


def test_vllm_serve_yaml(trees, tmp_path):
    _yaml()
    cfg64 = toml(tmp_path, "[kvcache]\nblock_size = 64\n")
    text = ("model: Qwen/Qwen3-8B\nblock-size: 32\nkv-transfer-config: "
            "'{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\"}'\n")
    found = problems(run(trees, config=cfg64, vllm=vllm_file(tmp_path, text, "serve.yaml"),
                         role="decode", only=VLLM_ONLY))
    assert found == [("MTE501", "error"), ("MTE502", "error")]


def test_mte502_kv_role_vs_disaggregation_role(trees, tmp_path):
    consumer = vllm_file(tmp_path, {"kv_transfer_config": {"kv_connector": "MooncakeConnector",
                                                           "kv_role": "kv_consumer"}})
    (f,) = problems(run(trees, vllm=consumer, role="prefill", only=VLLM_ONLY), "MTE502")
    assert "prefill instance" in f.message and "'kv_consumer'" in f.message
    assert "'kv_producer'" in f.fix
    assert problems(run(trees, vllm=consumer, role="decode", only=VLLM_ONLY)) == []
    # The role can come from the vLLM file (SGLang-style disaggregation_mode).
    producer_decode = vllm_file(tmp_path, {
        "disaggregation_mode": "decode",
        "kv_transfer_config": {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}},
        "pd.json")
    (f,) = problems(run(trees, vllm=producer_decode, only=VLLM_ONLY), "MTE502")
    assert "(disaggregation_mode)" in f.message
    both = vllm_file(tmp_path, {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}, "c")
    assert problems(run(trees, vllm=both, role="prefill", only=VLLM_ONLY)) == []
    # Role unknown: nothing to compare, said as a skip.
    skips = [f for f in run(trees, vllm=consumer, only=["kv_role"])]
    assert [f.severity for f in skips] == [Severity.SKIP] and "--role" in skips[0].message


def test_mte503_unknown_vllm_keys(trees, tmp_path):
    v = vllm_file(tmp_path, {"blok_size": 16, "tensor_parallel_size": 8,
                             "kv_transfer_config": {"kv_connector": "MooncakeConnector",
                                                    "kv_role": "kv_both", "kv_rnak": 0}})
    found = {f.data["key"]: f for f in problems(run(trees, vllm=v, only=VLLM_ONLY), "MTE503")}
    assert set(found) == {"blok_size", "kv_rnak"}           # real vLLM args are left alone
    assert found["kv_rnak"].data["suggestion"] == "kv_rank"
    assert found["blok_size"].data["suggestion"] == "block_size"
    assert all(f.severity == Severity.WARNING for f in found.values())


def test_mte504_kv_role_missing_or_invalid(trees, tmp_path):
    v = vllm_file(tmp_path, {"kv_transfer_config": {"kv_connector": "MooncakeConnector"}})
    (f,) = problems(run(trees, vllm=v, only=VLLM_ONLY), "MTE504")
    assert "without kv_role" in f.message
    v = vllm_file(tmp_path, {"kv_connector": "MooncakeConnector", "kv_role": "producer"}, "b")
    (f,) = problems(run(trees, vllm=v, only=VLLM_ONLY), "MTE504")
    assert f.fix == "use 'kv_producer'"


SEED = os.path.join(HERE, "data", "vllm", "seed-settings.json")


def test_mte505_the_seed_deployments_vllm_settings(trees, tmp_path):
    # tests/data/vllm/seed-settings.json: a `vllm serve --config` file with the seed's
    # kv_connector_extra_config, use_gpu_direct and enable_multi_nic included (issue #34).
    vllm_checks = ["vllm_config", "block_size", "kv_role", "vllm_connector"]
    found = run(trees, vllm=SEED, only=vllm_checks)
    assert problems(found) == []
    assert [str(f.severity) for f in found if f.code == "MTE505"] == ["ok"]
    # A switch that is not a boolean is named, with what is expected.
    with open(SEED) as f:
        doc = json.load(f)
    extra = doc["kv_transfer_config"]["kv_connector_extra_config"]
    extra["mooncake_config_path"] = os.path.join(os.path.dirname(SEED), "seed-mooncake.toml")
    extra["enable_multi_nic"] = "yes"
    bad = vllm_file(tmp_path, doc, "bad.json")
    (f,) = problems(run(trees, vllm=bad, only=["vllm_connector"]), "MTE505")
    assert "enable_multi_nic = 'yes' (str): expected true or false" in f.message


# ---- the command -------------------------------------------------------------------

def _with_thp(base: str, dest, mode: str) -> str:
    """A copy of a sysfs tree whose transparent_hugepage/enabled says ``mode``."""
    import shutil
    shutil.copytree(base, dest, symlinks=True)
    thp = dest / "kernel" / "mm" / "transparent_hugepage"
    thp.mkdir(parents=True)
    words = ["always", "madvise", "never"]
    (thp / "enabled").write_text(" ".join(f"[{w}]" if w == mode else w for w in words) + "\n")
    return str(dest)


def test_mte507_mte508_cpu_vllm_host(trees, tmp_path):
    ours = {"kv_connector": "MooncakeTEConnector",
            "kv_connector_module_path": "mooncake_te.integrations.vllm",
            "kv_role": "kv_producer"}
    v = vllm_file(tmp_path, {"kv_transfer_config": ours})
    never = _with_thp(trees["empty"], tmp_path / "never", "never")
    madvise = _with_thp(trees["empty"], tmp_path / "madvise", "madvise")

    def found(sysfs, env, vllm=v):
        ctx = Context(vllm_config_path=vllm, sysfs_root=sysfs, env=env, timeout_s=1.0)
        return run_checks(ctx, only=["vllm_cpu_host"])

    bad = found(never, {})
    assert problems(bad) == [("MTE507", "warning"), ("MTE508", "warning")]
    (f507,), (f508,) = problems(bad, "MTE507"), problems(bad, "MTE508")
    assert "= never" in f507.message and "echo madvise" in f507.fix
    assert "GOMP_SPINCOUNT=10000" in f508.fix
    # THP on and the spin shortened (either variable): nothing to say.
    assert problems(found(madvise, {"GOMP_SPINCOUNT": "10000"})) == []
    assert problems(found(madvise, {"OMP_WAIT_POLICY": "PASSIVE"})) == []
    # hugepages switched off in the connector: THP does not matter.
    off = vllm_file(tmp_path, {"kv_transfer_config": dict(
        ours, kv_connector_extra_config={"hugepages": False})}, "off.json")
    assert problems(found(never, {"GOMP_SPINCOUNT": "10000"}, off)) == []
    # GPUs here, or not our connector, or no vLLM config: skipped with the reason.
    (s,) = found(trees["hgx8"], {})
    assert s.severity == Severity.SKIP and "GPU" in s.message
    nixl = vllm_file(tmp_path, {"kv_transfer_config": {"kv_connector": "NixlConnector",
                                                       "kv_role": "kv_producer"}}, "n.json")
    (s,) = found(never, {}, nixl)
    assert s.severity == Severity.SKIP
    (s,) = found(never, {}, None)
    assert s.severity == Severity.SKIP and "--vllm-config" in s.message


def test_cli_exit_status_0_1_2(trees, tmp_path):
    rc, out = _cli("--sysfs-root", trees["empty"])
    assert rc == 0 and "0 error(s), 0 warning(s)" in out
    rc, out = _cli("--sysfs-root", trees["onebox"], "--check", "gpu_nic_affinity")
    assert rc == 1 and "WARN  MTE205" in out
    cfg = toml(tmp_path, RDMA + "device_names = ['mlx5_bond0']\n")
    rc, out = _cli("--sysfs-root", trees["onebox"], "--config", cfg, "--json")
    doc = json.loads(out)
    assert rc == 2 and doc["exit_code"] == 2 and doc["summary"]["error"] >= 1
    f = next(f for f in doc["findings"] if f["code"] == "MTE201")
    assert set(f) >= {"code", "severity", "message", "fix", "check", "data"}
    assert f["severity"] == "error" and f["check"] == "rdma_devices"


def test_device_checks_skip_for_tcp(trees, tmp_path):
    cfg = toml(tmp_path, "[transfer_engine]\nprotocol = 'tcp'\ndevice_names = ['mlx5_bond0']\n")
    (f,) = run(trees, "onebox", config=cfg, only=["rdma_devices"])
    assert f.severity == Severity.SKIP and "not used" in f.message


def test_mte404_cache_dir_of_another_user(trees, tmp_path):
    """Issue 35: a cache_dir another user can write is reported (the engine refuses it)."""
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o1777)
    (f,) = problems(run(trees, config=cache_toml(tmp_path, d), only=["cache_dir"]), "MTE404")
    assert "writable by every user" in f.message and "chmod o-w" in f.fix


def test_mte405_kv_sharing_needs_a_token(trees, tmp_path):
    """Issue 35, item 1: without a token the pool does not share, and the doctor says why."""
    store = '[metadata]\nserver_type = "redis"\nserver_address = "127.0.0.1:6379"\n'
    (f,) = problems(run(trees, config=toml(tmp_path, store, "a.toml"),
                        only=["kv_sharing"]), "MTE405")
    assert "no auth_token" in f.message and "share_without_token" in f.fix
    (f,) = problems(run(trees, config=toml(tmp_path, store + "[kvcache]\nshare_without_token"
                                                          " = true\n", "b.toml"),
                        only=["kv_sharing"]), "MTE406")
    assert problems(run(trees, config=toml(tmp_path, store + '[transfer_engine]\nauth_token = '
                                                          '"t"\n', "c.toml"),
                        only=["kv_sharing"])) == []

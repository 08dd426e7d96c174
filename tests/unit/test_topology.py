# SPDX-License-Identifier: Apache-2.0
"""Topology discovery against fake sysfs trees modeled on real machines
(tests/data/sysfs/machines.py), distances and the NIC priority matrix."""
from __future__ import annotations

import ctypes
import json
import os

import pytest

from mooncake_te.errors import ConfigError, DeviceNotFoundError
from mooncake_te.topology import (Link, discover, load_priority_matrix, local_priority_matrix,
                                  pci_link, resolve_priority_matrix, roce_mtu)
from mooncake_te.topology.render import render
from mooncake_te.topology.sysfs import format_cpulist, parse_cpulist, pci_chain

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/


from sysfs_trees import machines  # noqa: E402


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("sysfs")
    return {name: build(str(base / name)) for name, build in machines.MACHINES.items()}


# ---- the two-socket, 8-GPU, 8-NIC server ------------------------------------------

HGX_DIST = {   # nvidia-smi topo -m as it prints this board
    "cpu:0": "NODE NODE NODE NODE SYS SYS SYS SYS",
    "cpu:1": "SYS SYS SYS SYS NODE NODE NODE NODE",
    "cuda:0": "PIX PXB PHB PHB SYS SYS SYS SYS",
    "cuda:1": "PXB PIX PHB PHB SYS SYS SYS SYS",
    "cuda:2": "PHB PHB PIX PXB SYS SYS SYS SYS",
    "cuda:3": "PHB PHB PXB PIX SYS SYS SYS SYS",
    "cuda:4": "SYS SYS SYS SYS PIX PXB NODE NODE",
    "cuda:5": "SYS SYS SYS SYS PXB PIX NODE NODE",
    "cuda:6": "SYS SYS SYS SYS NODE NODE PIX PXB",
    "cuda:7": "SYS SYS SYS SYS NODE NODE PXB PIX",
}


def test_hgx8_devices(trees):
    t = discover(trees["hgx8"])
    assert [n.id for n in t.numa_nodes] == [0, 1]
    assert t.numa_nodes[1].cpus[:2] == [56, 57] and len(t.numa_nodes[1].cpus) == 112
    # Eight H100s in PCI order; the ASPEED BMC VGA is display class but not a GPU.
    assert [g.location for g in t.gpus] == [f"cuda:{i}" for i in range(8)]
    assert all(g.vendor == "NVIDIA" and g.device_id == 0x2330 for g in t.gpus)
    assert "0000:03:00.0" not in [g.pci for g in t.gpus]
    assert [g.numa_node for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.nic_names == [f"mlx5_{i}" for i in range(8)]
    nic = t.nic("mlx5_3")
    assert nic.pci == "0000:29:00.0" and nic.numa_node == 0 and not nic.virtual
    assert nic.netdevs == ["ens4np0"] and nic.usable
    port = nic.ports[0]
    assert (port.state, port.link_layer, port.rate_gbps, port.mtu) == ("ACTIVE", "Ethernet",
                                                                       400.0, 4096)
    # Zero entries of the GID table are dropped; the IPv4-mapped RoCE v2 GID is index 3.
    assert [g.index for g in port.gids] == [0, 1, 2, 3]
    assert (port.gids[3].ip, port.gids[3].type, port.gids[3].netdev) == ("10.3.0.1", "RoCE v2",
                                                                         "ens4np0")
    assert port.gids[0].ip.startswith("fe80::")
    (ssd,) = t.nvme
    assert (ssd.name, ssd.transport, ssd.pci, ssd.numa_node, ssd.fabric) == (
        "nvme0", "pcie", "0000:04:00.0", 0, False)
    assert ssd.namespaces[0].name == "nvme0n1"
    assert ssd.namespaces[0].size_bytes == 7501476528 * 512


def test_hgx8_distances_match_nvidia_smi(trees):
    t = discover(trees["hgx8"])
    dist = t.distances()
    assert list(dist) == list(HGX_DIST)
    for loc, row in HGX_DIST.items():
        assert " ".join(dist[loc][f"mlx5_{i}"] for i in range(8)) == row, loc
    # The NVMe on socket 0's root bus is PHB to GPU 0 and SYS to GPU 4.
    assert t.link(t.gpus[0], t.nvme[0])[0] == Link.PHB
    assert t.link(t.gpus[4], t.nvme[0])[0] == Link.SYS


def test_hgx8_matrix_pairs_gpu_i_with_nic_i(trees):
    m = discover(trees["hgx8"]).priority_matrix()
    assert m["cpu:0"] == [["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"],
                          ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]]
    assert m["cpu:1"] == [["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"],
                          ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]]
    for i in range(8):
        pref, avail = m[f"cuda:{i}"]
        assert pref == [f"mlx5_{i}"]
        # Fallbacks nearest first: the switch neighbour (PXB) leads, the other socket last.
        assert avail[0] == f"mlx5_{i ^ 1}"
        other_socket = {f"mlx5_{j}" for j in range(8) if (j < 4) != (i < 4)}
        assert set(avail[-4:]) == other_socket
        assert sorted(pref + avail) == sorted(f"mlx5_{j}" for j in range(8))
    assert list(m) == ["cpu:0", "cpu:1"] + [f"cuda:{i}" for i in range(8)]


def test_allow_list_restricts_and_validates(trees):
    t = discover(trees["hgx8"])
    m = t.priority_matrix(devices="mlx5_0, mlx5_4")
    assert m["cuda:1"] == [["mlx5_0"], ["mlx5_4"]]
    assert m["cuda:6"] == [["mlx5_4"], ["mlx5_0"]]
    assert m["cpu:1"] == [["mlx5_4"], ["mlx5_0"]]
    with pytest.raises(DeviceNotFoundError) as e:
        t.priority_matrix(devices=["mlx5_bond0"])
    assert "'mlx5_bond0'" in str(e.value) and "did you mean 'mlx5_0'" in str(e.value)
    assert e.value.status == -6


def test_down_port_is_left_out_of_the_matrix(tmp_path):
    t = discover(machines.build_hgx8(str(tmp_path / "m"), port_state="DOWN"))
    assert not t.nic("mlx5_0").usable and t.nic("mlx5_0").ports[0].state == "DOWN"
    m = t.priority_matrix()
    assert "mlx5_0" not in sum((p + a for p, a in m.values()), [])
    assert m["cuda:0"][0] == ["mlx5_1"]           # next best: PXB under the same switch
    assert "mlx5_0" in t.priority_matrix(usable_only=False)["cuda:0"][0]


# ---- one socket, one GPU, one NIC --------------------------------------------------

def test_onebox(trees):
    t = discover(trees["onebox"])
    (gpu,), (hca,) = t.gpus, t.nics
    assert gpu.location == "cuda:0" and gpu.numa_node == -1
    # numa_node -1 on a one-node machine means node 0.
    assert t.numa_of(gpu) == 0 and t.numa_of(hca) == 0
    port = hca.ports[0]
    assert (port.link_layer, port.lid, port.rate_gbps, port.mtu) == ("InfiniBand", 0x12, 200.0,
                                                                     None)
    assert t.link(gpu, hca) == (Link.PHB, 4)           # separate root ports on one bus
    assert t.distances() == {"cpu:0": {"mlx5_0": "NODE"}, "cuda:0": {"mlx5_0": "PHB"}}
    assert t.priority_matrix() == {"cpu:0": [["mlx5_0"], []], "cuda:0": [["mlx5_0"], []]}


def test_onebox_without_gids_has_no_usable_nic(tmp_path):
    t = discover(machines.build_onebox(str(tmp_path / "m"), with_gids=False))
    assert t.nic("mlx5_0").active_ports and not t.nic("mlx5_0").usable
    assert t.priority_matrix() == {}


# ---- VM with Soft-RoCE only --------------------------------------------------------

def test_vm_soft_roce(trees):
    t = discover(trees["vm_rxe"])
    assert t.gpus == []
    rxe0, rxe1 = t.nics
    assert rxe0.virtual and rxe0.pci is None and rxe0.netdevs == ["eth0"]
    # rxe0 sits on a virtio-net PCI function, found through its netdev.
    assert rxe0.pci_chain == ["pci0000:00", "0000:00:03.0"]
    assert rxe1.pci_chain == [] and rxe1.netdevs == ["veth0"]
    assert rxe0.ports[0].mtu == 1024                  # netdev MTU 1500 minus RoCE headers
    assert rxe0.ports[0].gids[-1].ip == "192.168.122.10"
    assert t.priority_matrix() == {"cpu:0": [["rxe0", "rxe1"], []]}
    (ctrl,) = t.nvme
    assert ctrl.fabric and ctrl.transport == "tcp" and ctrl.pci is None
    assert ctrl.address.startswith("traddr=127.0.0.1,trsvcid=4420")
    assert ctrl.namespaces[0].size_bytes == 16384 * 512


def test_empty_machine(trees):
    t = discover(trees["empty"])
    assert [(n.id, n.cpus) for n in t.numa_nodes] == [(0, [0, 1])]
    assert (t.gpus, t.nics, t.nvme) == ([], [], [])
    assert t.priority_matrix() == {}
    assert t.distances() == {"cpu:0": {}}
    assert "empty: no usable RDMA device" in render(t, {})
    with pytest.raises(DeviceNotFoundError, match="found: none"):
        t.priority_matrix(devices=["mlx5_0"])


def test_missing_root_is_an_empty_machine(tmp_path):
    t = discover(tmp_path / "nothing-here")
    assert (t.gpus, t.nics, t.nvme) == ([], [], []) and len(t.numa_nodes) == 1


# ---- distance classes on their own -------------------------------------------------

@pytest.mark.parametrize("a, b, numa, single, want", [
    # multi-function device: same bridge, one level
    (["pci0000:00", "0000:00:01.0", "0000:01:00.0"],
     ["pci0000:00", "0000:00:01.0", "0000:01:00.1"], (0, 0), False, Link.PIX),
    # across the host bridge of one root bus
    (["pci0000:00", "0000:00:01.0"], ["pci0000:00", "0000:00:02.0"], (0, 0), False, Link.PHB),
    # two root buses, same node / different nodes / unknown node on a 2-node box
    (["pci0000:00", "0000:00:01.0"], ["pci0000:20", "0000:20:01.0"], (0, 0), False, Link.NODE),
    (["pci0000:00", "0000:00:01.0"], ["pci0000:80", "0000:80:01.0"], (0, 1), False, Link.SYS),
    (["pci0000:00", "0000:00:01.0"], ["pci0000:80", "0000:80:01.0"], (-1, -1), False, Link.SYS),
    (["pci0000:00", "0000:00:01.0"], ["pci0000:80", "0000:80:01.0"], (-1, -1), True, Link.NODE),
    # a device with no PCI path is placed by NUMA node only
    ([], ["pci0000:00", "0000:00:01.0"], (0, 0), False, Link.NODE),
    ([], ["pci0000:00", "0000:00:01.0"], (0, 1), False, Link.SYS),
])
def test_pci_link(a, b, numa, single, want):
    assert pci_link(a, b, *numa, single_node=single)[0] == want
    assert pci_link(b, a, *numa[::-1], single_node=single)[0] == want


def test_pci_chain_stops_at_non_pci_parent():
    assert pci_chain(["pci0000:00", "0000:00:03.0", "virtio2", "net", "eth0"]) == [
        "pci0000:00", "0000:00:03.0"]
    assert pci_chain(["virtual", "net", "veth0"]) == []
    assert pci_chain(["pci0000:00"]) == []


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == [] and parse_cpulist(None) == []
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_roce_mtu():
    # iboe_get_mtu(): netdev MTU minus 96 bytes of RoCE headers, rounded down to an IB MTU.
    assert [roce_mtu(m) for m in (9000, 4192, 4191, 1500, 1100, 300, None)] == [
        4096, 4096, 2048, 1024, 512, None, None]


# ---- custom matrix files (MC_CUSTOM_TOPO_JSON) -------------------------------------

def test_custom_matrix_replaces_discovery(trees, tmp_path):
    t = discover(trees["hgx8"])
    f = tmp_path / "topo.json"
    f.write_text(json.dumps({"cpu:0": [["mlx5_1"], []], "cuda:0": [["mlx5_7"], ["mlx5_0"]]}))
    env = {"MC_CUSTOM_TOPO_JSON": str(f)}
    assert local_priority_matrix(t, env=env) == {"cpu:0": [["mlx5_1"], []],
                                                 "cuda:0": [["mlx5_7"], ["mlx5_0"]]}
    assert local_priority_matrix(t, env={}) == t.priority_matrix()
    f.write_text(json.dumps({"cuda:0": [["mlx5_9"], []]}))
    with pytest.raises(DeviceNotFoundError, match="'mlx5_9'"):
        local_priority_matrix(t, env=env)


@pytest.mark.parametrize("text, match", [
    ('{"cpu:0": [["mlx5_0"]]}', r"entry 'cpu:0' must be exactly \[\[preferred"),
    ('{"cpu:0": "mlx5_0"}', "entry 'cpu:0'"),
    ('{"cpu:0": [["mlx5_0"], [1]]}', "entry 'cpu:0'"),
    ('[["mlx5_0"], []]', "must be a JSON object"),
    ('{"cpu:0": [["mlx5_0"], []],\n}', "not valid JSON at line 2"),
])
def test_bad_matrix_files(tmp_path, text, match):
    f = tmp_path / "m.json"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        load_priority_matrix(f)
    assert str(f) in str(e.value)


def test_missing_matrix_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_priority_matrix(tmp_path / "nope.json")


def test_resolve_numbers_devices_in_first_seen_order():
    devices, table = resolve_priority_matrix({"cpu:0": [["b", "a"], ["c"]],
                                              "cuda:0": [["c"], ["a", "d"]]})
    assert devices == ["b", "a", "c", "d"]
    assert table["cpu:0"] == ([0, 1], [2]) and table["cuda:0"] == ([2], [1, 3])
    assert table["*"] == ([0, 1, 2, 3], [])


# ---- the command -------------------------------------------------------------------

def test_cli_json_and_matrix_round_trip(trees, tmp_path, capsys, monkeypatch):
    from mooncake_te.cli.main import main
    monkeypatch.delenv("MC_CUSTOM_TOPO_JSON", raising=False)
    monkeypatch.delenv("MC_TE_FILTERS", raising=False)
    assert main(["topology", "--sysfs-root", trees["hgx8"], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["priority_matrix"]["cuda:5"][0] == ["mlx5_5"]
    assert doc["distances"]["cuda:0"]["mlx5_1"] == "PXB"
    assert [g["location"] for g in doc["gpus"]] == [f"cuda:{i}" for i in range(8)]
    assert doc["nics"][0]["ports"][0]["gids"][3]["ip"] == "10.0.0.1"

    assert main(["topology", "--sysfs-root", trees["hgx8"], "--matrix-only"]) == 0
    saved = tmp_path / "matrix.json"
    saved.write_text(capsys.readouterr().out)
    monkeypatch.setenv("MC_CUSTOM_TOPO_JSON", str(saved))
    assert main(["topology", "--sysfs-root", trees["hgx8"], "--json"]) == 0
    doc2 = json.loads(capsys.readouterr().out)
    assert doc2["priority_matrix"] == doc["priority_matrix"]
    assert doc2["priority_matrix_source"].startswith("MC_CUSTOM_TOPO_JSON")


def test_cli_table(trees, capsys, monkeypatch):
    from mooncake_te.cli.main import main
    monkeypatch.delenv("MC_CUSTOM_TOPO_JSON", raising=False)
    assert main(["topology", "--sysfs-root", trees["vm_rxe"]]) == 0
    out = capsys.readouterr().out
    assert "rxe0" in out and "virtual" in out and "nvme1" in out and "tcp" in out
    assert main(["topology", "--sysfs-root", trees["hgx8"], "--devices", "mlx5_bond0"]) == 2
    assert "did you mean 'mlx5_0'" in capsys.readouterr().err


def test_live_gpus_get_cuda_ordinals():
    """On a machine with an NVIDIA driver, every GPU sysfs shows gets its CUDA ordinal."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("no CUDA driver (libcuda.so.1) on this machine")
    t = discover("/sys")
    nvidia = [g for g in t.gpus if g.kind == "cuda"]
    if not nvidia:
        pytest.skip("libcuda is present but sysfs shows no NVIDIA GPU")
    assert t.cuda_enriched
    visible = [g for g in nvidia if g.cuda_index is not None]
    assert visible and all(g.name for g in visible)
    assert sorted(g.cuda_index for g in visible) == list(range(len(visible)))

"""NUMA placement: the node chosen from a faked sysfs topology, the option's checks, and the
binding really applied by this machine's kernel (read back with get_mempolicy and move_pages)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from kvoffload.config import OffloadConfig
from kvoffload.store import numa
from kvoffload.store.arena import HostArena
from kvoffload.store.numa import NumaUnavailable, Placement, Topology, resolve
from kvoffload.transfer import topology

NEAR0, NEAR1, UNKNOWN = "0000:18:00.0", "0000:9a:00.0", "0000:3b:00.0"
GIB = 1 << 30


def fake_sysfs(root: Path, nodes: dict[int, str], devices: dict[str, int]) -> Topology:
    """A sysfs tree: ``nodes`` (id -> cpulist, 64 GiB each) and PCI devices (bus id -> node)."""
    base = root / "devices/system/node"
    base.mkdir(parents=True)
    (base / "online").write_text(",".join(map(str, nodes)) + "\n")
    for n, cpus in nodes.items():
        (base / f"node{n}").mkdir()
        (base / f"node{n}/cpulist").write_text(cpus + "\n")
        (base / f"node{n}/meminfo").write_text(f"Node {n} MemTotal:       {64 << 20} kB\n")
    for bus, node in devices.items():
        (root / "bus/pci/devices" / bus).mkdir(parents=True)
        (root / "bus/pci/devices" / bus / "numa_node").write_text(f"{node}\n")
    return Topology(root)


@pytest.fixture
def two_sockets(tmp_path: Path) -> Topology:
    return fake_sysfs(tmp_path, {0: "0-7", 1: "8-15"}, {NEAR0: 0, NEAR1: 1, UNKNOWN: -1})


def this_host_nodes() -> list[int]:
    nodes = Topology().nodes()
    if not nodes:
        pytest.skip("this kernel shows no NUMA nodes")
    return nodes


def test_auto_picks_the_node_of_the_gpus_pci_device(two_sockets):
    assert resolve("auto", NEAR1, topology=two_sockets) == Placement(
        1, False, "auto: nearest GPU 0000:9a:00.0"
    )
    assert resolve("auto", NEAR0, topology=two_sockets).node == 0
    # nvidia-smi's form (8-digit domain, upper case) names the same device
    assert resolve("auto", "00000000:9A:00.0", topology=two_sockets).node == 1
    assert two_sockets.cpus(1) == list(range(8, 16))
    assert two_sockets.mem_total(1) == 64 * GIB
    assert two_sockets.describe()["0"] == {"cpus": list(range(8)), "mem_total_bytes": 64 * GIB}


def test_auto_places_nothing_and_says_why(two_sockets, tmp_path):
    unknown = resolve("auto", UNKNOWN, topology=two_sockets)
    assert unknown.node is None
    assert "no NUMA node for GPU 0000:3b:00.0" in unknown.reason
    assert f"bus/pci/devices/{UNKNOWN}/numa_node is missing or -1" in unknown.reason
    assert resolve("auto", "0000:01:00.0", topology=two_sockets).node is None  # not in sysfs
    assert resolve("auto", None, topology=two_sockets).reason == "auto: the KV is not on a GPU"
    one = fake_sysfs(tmp_path / "one", {0: "0-3"}, {NEAR0: 0})
    single = resolve("auto", NEAR0, topology=one)
    assert single == Placement.none("auto: this host has one NUMA node ([0]), nothing to choose")
    assert resolve("off", NEAR1, topology=two_sockets) == Placement.none("numa_node='off'")


def test_a_node_asked_for_by_id_is_strict_and_checked(two_sockets):
    assert resolve(1, NEAR0, topology=two_sockets) == Placement(1, True, "numa_node=1")
    assert resolve(0, None, topology=two_sockets).strict
    with pytest.raises(ValueError, match=r"expected numa_node in this host's online NUMA nodes "):
        resolve(3, NEAR0, topology=two_sockets)
    with pytest.raises(ValueError, match=r"nodes \[0, 1\], got 3$"):
        resolve(3, NEAR0, topology=two_sockets)
    with pytest.raises(
        ValueError,
        match=rf"expected at most node 1's {64 * GIB} bytes of RAM with numa_node=1, "
        rf"got {65 * GIB} bytes",
    ):
        resolve(1, NEAR0, 65 * GIB, topology=two_sockets)


@pytest.mark.parametrize("bad", ["near", "", -1, True, 1.5, None])
def test_the_option_refuses_what_it_is_not(bad):
    want = rf"expected numa_node 'auto', 'off' or a node id >= 0, got {bad!r}"
    with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(")", r"\)")):
        OffloadConfig(numa_node=bad)
    with pytest.raises(ValueError, match="expected numa_node"):
        resolve(bad, NEAR0)
    assert OffloadConfig(numa_node=2).numa_node == 2
    assert OffloadConfig().numa_node == "auto"


def test_bus_ids_and_kernel_lists():
    assert numa.normalize_bus_id("00000000:9A:00.0") == NEAR1
    assert numa.normalize_bus_id("9a:00.0") == NEAR1
    assert numa.normalize_bus_id(" 0001:18:1f.3\n") == "0001:18:1f.3"
    with pytest.raises(ValueError, match=r"expected a PCI bus id like 0000:18:00.0, got 'gpu0'"):
        numa.normalize_bus_id("gpu0")
    assert numa.parse_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.parse_list("") == []


def test_gpu_placement_reads_torchs_pci_ids(monkeypatch, two_sockets):
    import torch

    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x9A, pci_device_id=0)
    asked: list[str] = []

    def properties(device: object) -> object:
        asked.append(str(device))
        return props

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert topology.gpu_bus_id("cuda:1") == NEAR1
    assert asked == ["cuda:1"]
    assert topology.arena_placement("auto", "cuda:1", GIB, two_sockets).node == 1
    asked_0 = topology.arena_placement(0, "cuda:1", GIB, two_sockets)
    assert asked_0 == Placement(0, True, "numa_node=0")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace())
    with pytest.raises(RuntimeError, match="expected torch's device properties to carry"):
        topology.gpu_bus_id("cuda:0")
    degraded = topology.arena_placement("auto", "cuda:0", GIB, two_sockets)
    assert degraded.node is None and "auto: expected torch's device properties" in degraded.reason
    # a node given by id needs no PCI address
    assert topology.arena_placement(1, "cuda:0", GIB, two_sockets).node == 1


# -- the kernel's answer on this machine ------------------------------------------------------


def test_a_strict_binding_is_applied_before_the_pages_exist():
    node = this_host_nodes()[0]
    with HostArena(8, 1 << 20, placement=Placement(node, True, "test")) as arena:
        before = arena.numa_where()
        assert before["policy"] == "bind" and before["policy_nodes"] == [node]
        assert before["untouched"] == before["sampled_pages"] == 64  # nothing allocated yet
        arena.slots[:] = 7
        after = arena.numa_where()
        assert after["pages_on_node"] == {str(node): 64} and after["untouched"] == 0
        assert "policy bind" in numa.summary(after) and f"64 on node {node}" in numa.summary(after)
        assert np.all(arena.slots == 7)


def test_auto_prefers_and_no_placement_leaves_the_default():
    node = this_host_nodes()[0]
    with HostArena(4, 1 << 20, placement=Placement(node, False, "auto: test")) as arena:
        arena.slots[:2] = 1
        found = arena.numa_where(samples=8)
        assert found["policy"] == "preferred" and found["policy_nodes"] == [node]
        assert found["pages_on_node"] == {str(node): 4} and found["untouched"] == 4
    with HostArena(4, 1 << 20) as arena:
        assert arena.placement.reason == "no placement asked for"
        assert arena.numa_where()["policy"] == "default"


def test_a_node_the_kernel_refuses_raises_when_asked_and_degrades_for_auto():
    missing = max(this_host_nodes()) + 1  # not online: mbind answers EINVAL
    with pytest.raises(NumaUnavailable, match=rf"mbind\(bind\) of {4 << 20} bytes at 0x"):
        HostArena(4, 1 << 20, placement=Placement(missing, True, f"numa_node={missing}"))
    with HostArena(4, 1 << 20, placement=Placement(missing, False, "auto: test")) as arena:
        assert arena.placement.node is None
        assert arena.placement.reason.startswith("auto: test, but mbind(preferred) of")
        assert "Invalid argument" in arena.placement.reason
        assert arena.numa_where()["policy"] == "default"


def test_build_local_places_its_arena_as_configured():
    import torch

    from kvoffload.offload.local import build_local
    from kvoffload.transfer.layout import KVLayout

    node = this_host_nodes()[0]
    kv = [torch.zeros(2, 8, 16, 4, 8) for _ in range(2)]
    layout = KVLayout.from_tensors(kv, block_size=16, block_dim=1)
    off = build_local(layout, OffloadConfig(host_capacity_blocks=8, numa_node=node))
    try:
        assert off.arena.placement == Placement(node, True, f"numa_node={node}")
        assert off.arena.numa_where()["policy_nodes"] == [node]
    finally:
        off.close()
    off = build_local(layout, OffloadConfig(host_capacity_blocks=8))
    try:
        assert off.arena.placement.reason == "auto: the KV is not on a GPU"
        assert off.arena.numa_where()["policy"] == "default"
    finally:
        off.close()
    with pytest.raises(ValueError, match=r"expected numa_node in this host's online NUMA nodes"):
        build_local(layout, OffloadConfig(host_capacity_blocks=8, numa_node=1023))


def test_doctor_says_where_the_arena_landed():
    from kvoffload.doctor import numa_line

    node = this_host_nodes()[0]
    auto = numa_line("auto", "cpu")
    assert auto.startswith(f"nodes {Topology().nodes()}; arena on no node (auto: the KV is not")
    assert "probe policy default; of 64 sampled pages" in auto
    bound = numa_line(str(node), "cpu")
    assert f"arena on node {node} (numa_node={node}); probe policy bind {node}" in bound
    assert bound.endswith(f"of 64 sampled pages 64 on node {node}")
    assert "expected numa_node in this host's online NUMA nodes" in numa_line("1023", "cpu")
    assert "expected numa_node 'auto', 'off' or a node id >= 0, got 'near'" in numa_line(
        "near", "cpu"
    )


def test_vllm_says_its_shared_region_is_not_placed():
    from kvoffload.integrations.vllm.options import parse_options

    with pytest.raises(ValueError, match=r"\['numa_node'\] are not supported with vLLM \(the "):
        parse_options({"cpu_bytes_to_use": 1 << 30, "numa_node": 0})

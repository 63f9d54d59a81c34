"""NUMA placement on a real GPU: torch's PCI ids name a device sysfs knows, a placed arena is
pinned on its node (pinning allocates every page there), and copies through it are exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvoffload.store.arena import HostArena
from kvoffload.store.numa import Placement, Topology
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.topology import arena_placement, gpu_bus_id


def test_the_gpus_bus_id_is_a_pci_device_of_sysfs():
    bus = gpu_bus_id("cuda:0")
    assert (Path("/sys/bus/pci/devices") / bus / "numa_node").exists(), bus
    placement = arena_placement("auto", "cuda:0", 1 << 20)
    nodes = Topology().nodes()
    if len(nodes) > 1 and Topology().device_node(bus) is not None:
        assert placement.node == Topology().device_node(bus)
    else:
        assert placement.node is None and placement.reason.startswith("auto: ")


def test_a_pinned_arena_lands_on_its_node_and_copies_exactly():
    node = Topology().nodes()[0]
    with HostArena(16, 1 << 20, pin=cuda_pin, placement=Placement(node, True, "t")) as arena:
        found = arena.numa_where()
        assert found["policy"] == "bind" and found["policy_nodes"] == [node]
        assert found["pages_on_node"] == {str(node): 64} and found["untouched"] == 0
        arena.slots[:] = np.arange(2 << 20, dtype=np.uint64).view(np.uint8).reshape(16, -1)
        host = torch.from_numpy(arena.slots.reshape(-1))
        dev = host.to("cuda", non_blocking=True)
        back = torch.empty_like(host)
        back.copy_(dev)
        assert torch.equal(back, host)

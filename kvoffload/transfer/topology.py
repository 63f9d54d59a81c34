"""Which NUMA node a GPU's host memory belongs on: the GPU's PCI address, then sysfs
(``kvoffload.store.numa``). Imports torch only when the KV is on a GPU."""

from __future__ import annotations

import logging

from kvoffload.store.numa import NumaSetting, Placement, Topology, resolve

log = logging.getLogger(__name__)


def gpu_bus_id(device: str) -> str:
    """The PCI address (``0000:18:00.0``) of CUDA ``device`` ("cuda", "cuda:1"), from torch's
    device properties (domain, bus and device ids; a GPU is function 0)."""
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    ids = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if any(i is None for i in ids):
        raise RuntimeError(
            f"expected torch's device properties to carry pci_domain_id, pci_bus_id and "
            f"pci_device_id, got torch {torch.__version__} without them: set numa_node to a "
            "node id (or 'off')"
        )
    domain, bus, dev = (int(i) for i in ids)  # type: ignore[arg-type]
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def arena_placement(
    setting: NumaSetting, device: str, nbytes: int, topology: Topology | None = None
) -> Placement:
    """The placement of ``nbytes`` of host memory for KV on ``device`` (a torch device string).
    Only "auto" needs the GPU's address; where torch cannot give it, "auto" places nothing (logged,
    and said in the reason)."""
    bus_id = None
    if setting == "auto" and device.startswith("cuda"):
        try:
            bus_id = gpu_bus_id(device)
        except RuntimeError as err:
            log.warning("host memory not NUMA-placed: %s", err)
            return Placement.none(f"auto: {err}")
    return resolve(setting, bus_id, nbytes, topology)

"""``kvoffload doctor``: what this machine offers the GPU data plane.

Prints the GPU, the CUDA driver version, whether ``cuMemcpyBatchAsync`` resolved (else the
``cuMemcpyAsync`` fallback is used), Triton's and cuda-python's status, the calibration table in
use, which path the ``staged`` backend runs (the native core or ``dma``, and why), whether the
native block index is built, the link GB/s measured now (contiguous pinned copies after a
warm-up), where a host arena lands: the NUMA node chosen for GPU 0 (or why none) and the
nodes of a probe arena's pages, read back, and how many hardware queues the streams share.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Mapping
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--link-mib", type=int, default=512, help="MiB per link test copy (0: skip)")
    p.add_argument("--reps", type=int, default=3, help="timed link copies per direction")
    p.add_argument(
        "--numa-node", default="auto", help="the numa_node option to try: auto, off or a node id"
    )


def report(args: argparse.Namespace) -> dict[str, Any]:
    from kvoffload.transfer.pinning import cuda_available

    out: dict[str, Any] = {}
    for mod, key in (("triton", "triton"), ("cuda.bindings", "cuda_python"), ("torch", "torch")):
        try:
            out[key] = str(importlib.import_module(mod).__version__)
        except ImportError as err:
            out[key] = f"unavailable ({err})"
    out["staged_enqueue"] = staged_enqueue()
    out["block_index"] = block_index()
    if not cuda_available():
        out["gpu"] = "none (CUDA not available): the host backend is used"
        out["numa"] = numa_line(args.numa_node, "cpu")
        return out
    import torch

    from kvoffload.transfer.calibration import load_cached, table_path
    from kvoffload.transfer.cuda.driver import CudaDriver

    drv = CudaDriver.load()
    name = torch.cuda.get_device_name()
    out["gpu"] = name
    out["driver"] = drv.version
    out["cuMemcpyBatchAsync"] = (
        "resolved (version 12080)" if drv.batch_resolved else "missing: cuMemcpyAsync loop"
    )
    path = table_path(name, drv.version)
    table = load_cached(name, drv.version)
    out["calibration"] = (
        f"{path} ({len(table.entries)} measurements)"
        if table
        else f"none at {path}: the planner uses 'staged' (run kvoffload calibrate)"
    )
    out["numa"] = numa_line(args.numa_node, "cuda:0")
    out["hardware_queues"] = hardware_queues(os.environ)
    if args.link_mib > 0:
        from kvoffload.transfer.timing import Sleeper, measure_link

        link = measure_link(Sleeper(), args.link_mib << 20, args.reps)
        out["link_GBps"] = {k: round(v["median"], 1) for k, v in link["GBps"].items()}
    return out


# The probe arena: large enough to sample 64 pages spread over it, small enough to pin anywhere.
NUMA_PROBE_BYTES = 64 << 20


def numa_line(setting: str, device: str) -> str:
    """Where a host arena for KV on ``device`` lands with ``numa_node=setting``: the placement
    chosen (or why none) and the nodes of a pinned (on a GPU), touched probe arena's pages."""
    from kvoffload.store.arena import HostArena
    from kvoffload.store.numa import NumaUnavailable, Topology, summary
    from kvoffload.transfer.topology import arena_placement

    value: int | str = int(setting) if setting.isdigit() else setting
    nodes = Topology().nodes()
    try:
        placement = arena_placement(value, device, NUMA_PROBE_BYTES)
        pin = None
        if device.startswith("cuda"):
            from kvoffload.transfer.pinning import cuda_pin

            pin = cuda_pin
        with HostArena(NUMA_PROBE_BYTES >> 20, 1 << 20, pin=pin, placement=placement) as arena:
            arena.slots[:] = 1  # unpinned pages are allocated on first touch
            found = summary(arena.numa_where())
            placement = arena.placement
    except (ValueError, NumaUnavailable) as err:
        return f"nodes {nodes}; numa_node={value!r}: {err}"
    chosen = "no node" if placement.node is None else f"node {placement.node}"
    return f"nodes {nodes}; arena on {chosen} ({placement.reason}); probe {found}"


def hardware_queues(env: Mapping[str, str]) -> str:
    """How many hardware queues this process's streams share (``CUDA_DEVICE_MAX_CONNECTIONS``,
    read by CUDA when it starts) and what one queue means for kvoffload: there a stream's unmet
    wait holds the kernels other streams enqueue after it (``benchmarks/queue_probe.py``, H100,
    2026-11-28), which kvoffload's waits never depend on (each follows the work that meets it);
    but a ``StallTimer``'s first event then queues behind the stall it should time."""
    value = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is None:
        return "8 (CUDA's default; CUDA_DEVICE_MAX_CONNECTIONS is unset)"
    if value.strip() == "1":
        return (
            "1 (CUDA_DEVICE_MAX_CONNECTIONS=1): every stream shares one queue; layer waits "
            "still pass (each follows the copies that meet it), but a StallTimer reads ~0 "
            "(docs/transfer.md, 'twentieth round')"
        )
    return f"{value.strip()} (CUDA_DEVICE_MAX_CONNECTIONS)"


def staged_enqueue() -> str:
    """Which path the ``staged`` backend runs: the native core (the compiled extension) or, where
    it is unavailable, the ``dma`` backend, and why."""
    from kvoffload.transfer.cuda import extension

    module = extension.module()
    if module is None:
        return f"dma fallback: {extension.unavailable()}"
    try:
        module.cuda_driver()  # every entry point, stream memory operations included
    except RuntimeError as err:
        return f"dma fallback: the driver cannot run the native core here ({err})"
    return (
        f"native core ({module.__file__}, built at install; readiness on the GPU: stream "
        "memory operations)"
    )


def block_index() -> str:
    """Whether the native block index (the compiled extension every Offloader needs) is there."""
    from kvoffload.store.index import native_index

    try:
        return f"native ({native_index().__file__}, built at install)"
    except ImportError as err:
        return f"missing: {err}"


def run(args: argparse.Namespace) -> int:
    from kvoffload.console import console

    for key, value in report(args).items():
        console.print(f"{key:>20}: {value}")
    return 0

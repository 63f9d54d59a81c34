"""``kvoffload doctor``: what this machine offers the GPU data plane.

Prints the GPU, the CUDA driver version, whether ``cuMemcpyBatchAsync`` resolved (else the
``cuMemcpyAsync`` fallback is used), Triton's and cuda-python's status, the calibration table in
use, which path the ``staged`` backend runs (the native engine or Python, and why), whether the
native block index is built, and the link
GB/s measured now (contiguous pinned copies after a warm-up).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--link-mib", type=int, default=512, help="MiB per link test copy (0: skip)")
    p.add_argument("--reps", type=int, default=3, help="timed link copies per direction")


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
    if args.link_mib > 0:
        from kvoffload.transfer.timing import Sleeper, measure_link

        link = measure_link(Sleeper(), args.link_mib << 20, args.reps)
        out["link_GBps"] = {k: round(v["median"], 1) for k, v in link["GBps"].items()}
    return out


def staged_enqueue() -> str:
    """Which path the ``staged`` backend runs: the native engine (the compiled extension) or the
    Python path, and why."""
    from kvoffload.transfer.cuda import native

    module = native.module()
    if module is not None:
        return f"native engine ({module.__file__}, built at install)"
    return f"Python path: {native.unavailable()}"


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

"""Pieces the GPU probes of issue 25 share (``replay_hold_probe``, ``launch_beside_copy_probe``,
``load_rate_probe``): an engine's KV tensors and a ``LocalOffload`` over them, blocks stored
through the public API, a result file with the device and the date."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvoffload import KVLayout, LocalOffload, OffloadConfig, build_local
from kvoffload.transfer.shapes import MODELS, engine_tensors


def engine(model: str, layout: str, pool: int, block_size: int = 16) -> tuple[list[Any], int, Any]:
    """``model``'s KV tensors in ``layout`` on the GPU, ``pool`` blocks of random int16 bytes:
    (tensors, block_dim, KVLayout)."""
    gen = torch.Generator().manual_seed(0)
    tensors, block_dim = engine_tensors(
        MODELS[model],
        layout,
        pool,
        block_size,
        lambda s: torch.randint(-100, 100, s, dtype=torch.int16, generator=gen).to("cuda"),
    )
    return tensors, block_dim, KVLayout.from_tensors(tensors, block_size, block_dim=block_dim)


def offload(kv: Any, slots: int, backend: str) -> LocalOffload:
    return build_local(kv, OffloadConfig(host_capacity_blocks=slots, backend=backend))


def finish(local: LocalOffload, job_id: int, what: str) -> None:
    """Wait for job ``job_id`` and complete what finished (RuntimeError if any of it failed)."""
    local.worker.wait([job_id], 60)
    results = local.worker.get_finished()
    local.offloader.complete(results)
    if not all(r.ok for r in results):
        raise RuntimeError(f"{what} failed: {results}")


def store(local: LocalOffload, req: str, keys: np.ndarray, blocks: np.ndarray) -> None:
    """Store ``blocks`` under ``keys`` and wait for it (RuntimeError if it failed)."""
    job = local.offloader.schedule_store(req, keys, blocks)
    if job is None:
        raise RuntimeError(f"store {req}: nothing scheduled")
    local.worker.submit(job)
    finish(local, job.job_id, f"store {req}")


def sleep_cycles_per_ms() -> float:
    """The clock rate of ``torch.cuda._sleep``'s spin kernel (cycles per ms), timed by CUDA
    events after a first launch (which loads the kernel: timing that launch undercounts)."""
    sleep: Any = torch.cuda._sleep
    sleep(1000)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / float(start.elapsed_time(end))


def stored_llama(
    nbytes: int, backends: tuple[str, ...] = ("staged", "dma")
) -> tuple[Any, np.ndarray, np.ndarray, dict[str, LocalOffload]]:
    """``nbytes`` of Llama-3-8B pages (2 MiB blocks) stored through each of ``backends``' own
    ``LocalOffload`` from blocks 0..n-1, ready to load into blocks n..2n-1: (the engine's
    tensors, to keep alive, the keys, the load's destination blocks, the offloads by backend)."""
    blocks = nbytes // (2 << 20)
    tensors, _dim, kv = engine("llama3-8b", "page", 2 * blocks)
    keys = np.random.default_rng(1).integers(0, 256, (blocks, 16), dtype=np.uint8)
    offloads = {b: offload(kv, blocks, b) for b in backends}
    for each in offloads.values():
        store(each, "store", keys, np.arange(blocks))
    return tensors, keys, np.arange(blocks, 2 * blocks), offloads


def rotated_medians(
    kinds: Sequence[str], reps: int, run: Callable[[str], float]
) -> dict[str, float]:
    """Per kind, the median of ``run(kind)`` over ``reps`` rounds; each round runs every kind once,
    starting one kind later than the round before (no kind always runs first)."""
    times: dict[str, list[float]] = {k: [] for k in kinds}
    order = list(kinds)
    for r in range(reps):
        for kind in order[r % len(order) :] + order[: r % len(order)]:
            times[kind].append(run(kind))
    return {k: statistics.median(v) for k, v in times.items()}


def dump(path: str, benchmark: str, **fields: Any) -> None:
    """Write ``fields`` as JSON with the benchmark's name, the device and the date."""
    out = {
        "benchmark": benchmark,
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        **fields,
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)

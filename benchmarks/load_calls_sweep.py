"""How many CUDA driver calls a load's enqueue makes, per model shape, load size and runs of host
slots, with a coupled load's chunk in one staging area against a span of areas (CPU, no GPU).

The native core runs for real over the CPU tests' fake driver (``tests/fake_cuda.py``: real
bytes, each driver call logged), with ``StagedConfig``'s defaults (128 MiB of staging per
direction, 4 areas, 2 DMA streams, the slice rules and the enqueue cost model) at each shape's
real block bytes. ``blocks`` blocks are stored in ``runs`` jobs with a one-block store between
them, so the load reads ``runs`` runs of consecutive host slots, then loaded in one job. Counts
are the driver's entry points the load called (each stream memory operation batch one call);
what a call costs is the GPU's (``api_gpu.py --driver-times``, ``bench e2e --driver-times``).
Where every layer slice of a load fits one area (loads up to 32 MiB a slice) the span changes
nothing; where slices are larger it saves a launch and a join per extra chunk.

    PYTHONPATH=. python -m benchmarks.load_calls_sweep [--out OUT.json]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.common import console, machine_info, write_json

SHAPES = (
    ("llama3-8b", "page"),
    ("qwen2.5-7b", "kv_split"),
    ("qwen2.5-1.5b", "kv_split"),
    ("llama3-70b-tp8-fp8", "page"),
    ("deepseek-v2-lite-mla", "page"),
)
BLOCKS = (37, 176, 512)
RUNS = (1, 4, 12)
AREAS = (1, 0)  # one area a chunk (before 2026-11-28), the default span
MEMOPS = {"write32", "wait32"}  # logged per operation; counted by call through ``calls.memops``


def count(model: str, layout: str, blocks: int, runs: int, areas: int) -> dict[str, Any]:
    """The load's driver calls by entry point, and its slices and chunks (launches)."""
    import torch

    from kvoffload.config import OffloadConfig
    from kvoffload.offload import TransferWorker, build_local
    from kvoffload.store.arena import HostArena
    from kvoffload.transfer.cuda.staged import NativeStagedBackend
    from kvoffload.transfer.cuda.staged_config import StagedConfig
    from kvoffload.transfer.layout import KVLayout
    from kvoffload.transfer.shapes import MODELS, engine_tensors
    from tests.fake_cuda import cuda_layout, faked, no_pin

    if not 1 <= runs <= blocks:
        raise ValueError(f"expected 1 <= runs <= blocks ({blocks}), got {runs}")
    with pytest.MonkeyPatch.context() as mp, faked(mp) as calls:
        shape = MODELS[model]
        dtype = torch.bfloat16 if shape.dtype_bytes == 2 else torch.uint8
        tensors, block_dim = engine_tensors(
            shape, layout, 2 * blocks + runs, 16, lambda s: torch.zeros(s, dtype=dtype)
        )
        kv = KVLayout.from_tensors(tensors, block_size=16, block_dim=block_dim)
        local = build_local(kv, OffloadConfig(host_capacity_blocks=blocks + runs + 1))
        off = local.offloader
        local.worker.close()
        pinned = HostArena(local.arena.num_slots, local.arena.slot_bytes, pin=no_pin)
        backend = NativeStagedBackend(
            cuda_layout(kv), pinned, config=StagedConfig(load_chunk_areas=areas)
        )
        worker = TransferWorker(backend, off)
        span = backend.config.load_span
        try:
            keys = [(i + 1).to_bytes(16, "little") for i in range(blocks)]
            cuts = [blocks * r // runs for r in range(runs + 1)]  # runs <= blocks: none empty
            for r in range(runs):  # each run its own store, a one-block store between them
                part = keys[cuts[r] : cuts[r + 1]]
                gap = [(1 << 64 | r).to_bytes(16, "little")]
                for name, ks in ((f"s{r}", part), (f"g{r}", gap)):
                    job = off.schedule_store(name, ks, list(range(len(ks))))
                    if job is None:
                        raise RuntimeError(f"expected a store job for {name}, got none")
                    got = worker.step([job])
                    worker.wait([job.job_id], 60)
                    off.complete(got + worker.get_finished())
            start, memops = len(calls.log), calls.memops
            job = off.schedule_load("load", keys, list(range(blocks, 2 * blocks)))
            got = worker.step([job])
            if worker.wait([job.job_id], 60):
                raise RuntimeError("the load did not finish in 60 s")
            results = got + worker.get_finished()
            off.complete(results)
            if not all(r.ok for r in results):
                raise RuntimeError(f"expected every job to land, got {results}")
            log = calls.log[start:]
            if calls.errors:
                raise RuntimeError(f"the fake driver's callbacks raised: {calls.errors}")
        finally:
            worker.close()
            pinned.close()
    by = collections.Counter(e[0] for e in log if e[0] not in MEMOPS)
    by["memops"] = calls.memops - memops
    return {
        "model": model,
        "layout": layout,
        "blocks": blocks,
        "runs": runs,
        "load_chunk_areas": areas,
        "load_span": span,
        "slot_bytes": kv.slot_bytes,
        "driver_calls": sum(by.values()),
        "by_entry": dict(by),
        "chunks": by.get("launch", 0),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for model, layout in SHAPES:
        for blocks in BLOCKS:
            for runs in RUNS:
                pair = [count(model, layout, blocks, runs, a) for a in AREAS]
                rows += pair
                one, span = pair
                console.print(
                    f"{model:22} {layout:9} {blocks:4} blocks {runs} run(s) "
                    f"{one['slot_bytes'] >> 10:5} KiB/block: driver calls {one['driver_calls']:3} "
                    f"-> {span['driver_calls']:3} (chunks {one['chunks']} -> {span['chunks']})"
                )
    if args.out is not None:
        data = {"benchmark": "load_calls_sweep", **machine_info(), "rows": rows}
        console.print(f"wrote {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

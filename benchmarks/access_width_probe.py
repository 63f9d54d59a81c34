"""The copy kernel with 8-byte against 16-byte memory accesses (``StagedConfig.access_bytes``).

The staged path's gather (engine blocks into a staging area laid out like host slots) and scatter
(the reverse) are one Triton kernel; until 2026-11-28 it built its pointers from integers, so the
compiler knew nothing of their alignment and issued one 8-byte load and store per lane. With
``VEC=2`` it is told that every piece is 16-byte aligned and issues 16-byte ones (PTX
``ld.global.v2.b64``). Per shape (the engine's layout of a model, the staging area of 32 MiB
that the core fills per chunk), this probe times, with CUDA events after a warm-up:

- ``alone``: one gather / scatter of the area's blocks, all their layers, at 16 programs (the
  stores' count) and 128 (a load chunk's scatter at one program per 256 KiB), median of 30;
- ``beside``: a chain of bf16 GEMMs on one stream while another stream scatters back to back
  (128 programs): the GEMMs' time against alone, the model's kernels beside the copy's.

Both widths' bytes are compared (the gather's staging areas and the scatter's engine blocks
must be identical). Run on the GPU machine:

    PYTHONPATH=. python3 benchmarks/access_width_probe.py OUT.json
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvoffload.bench.common import machine_info
from kvoffload.bench.e2e.command import device_info
from kvoffload.transfer.cuda.chunks import tile, vector_words
from kvoffload.transfer.cuda.driver import driver_version
from kvoffload.transfer.descriptors import region_arrays
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.shapes import MODELS, engine_tensors

if TYPE_CHECKING:
    from kvoffload.transfer.cuda.kernels import CopyLauncher

SHAPES = (
    ("llama3-8b", "page"),
    ("llama3-8b", "kv_split"),
    ("qwen2.5-7b", "page"),
    ("llama3-70b-tp8-fp8", "page"),
    ("deepseek-v2-lite-mla", "page"),
)
AREA = 32 << 20
REPS = 30
GEMMS = 40


def timed(fn: Any, reps: int, stream: Any) -> float:
    """Median ms of ``fn()`` on ``stream`` over ``reps`` runs (CUDA events)."""
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(float(a.elapsed_time(b)))
    return statistics.median(times)


def shape(model: str, layout: str, launcher: CopyLauncher) -> dict[str, Any]:
    m = MODELS[model]
    probe, _ = engine_tensors(m, layout, 1, 16, lambda s: torch.empty(s, dtype=torch.uint8))
    slot = sum(t.numel() for t in probe)  # bytes of one block, every layer
    n = max(1, AREA // slot)
    tensors, block_dim = engine_tensors(
        m, layout, n, 16, lambda s: torch.randint(0, 255, s, dtype=torch.uint8).to("cuda")
    )
    kv = KVLayout.from_tensors(tensors, 16, block_dim=block_dim)
    (g,) = kv.groups
    table = torch.from_numpy(np.ascontiguousarray(np.stack(region_arrays(g)))).to("cuda")
    ids = torch.randperm(n, device="cuda")
    areas = [torch.zeros(n * g.slot_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    jobs, words = tile(max(r.page_bytes for r in g.regions), 32768)
    allowed = vector_words(
        [*np.concatenate(region_arrays(g)).tolist(), g.slot_bytes, *(a.data_ptr() for a in areas)]
    )
    if allowed != 2:
        raise RuntimeError(f"{model} {layout}: pieces not 16-byte aligned here")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def run(to_host: bool, vec: int, programs: int, area: torch.Tensor) -> None:
        launcher.launch(
            stream,
            programs,
            ids,
            ids,
            table,
            0,
            n,
            table.shape[1],
            area.data_ptr(),
            g.slot_bytes,
            to_host=to_host,
            identity=True,
            jobs=jobs,
            words=words,
            num_warps=8,
            vec=vec,
        )

    # bytes: the gathers of both widths agree; a scatter of either width puts back the same
    for vec, area in ((1, areas[0]), (2, areas[1])):
        run(True, vec, 16, area)
    stream.synchronize()
    if not torch.equal(areas[0], areas[1]):
        raise RuntimeError(f"{model} {layout}: the 16-byte gather differs from the 8-byte one")
    before = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    run(False, 2, 128, areas[1])
    stream.synchronize()
    if not all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True)):
        raise RuntimeError(f"{model} {layout}: the 16-byte scatter did not restore the blocks")
    rows = []
    for direction, to_host in (("gather", True), ("scatter", False)):
        for programs in (16, 128):
            for vec in (1, 2, 1, 2):  # alternated, each timed twice
                ms = timed(functools.partial(run, to_host, vec, programs, areas[0]), REPS, stream)
                rows.append(
                    {
                        "direction": direction,
                        "programs": programs,
                        "access_bytes": 8 * vec,
                        "ms": ms,
                        "GBps": 2 * n * g.slot_bytes / ms / 1e6,  # read + write
                    }
                )
    beside = gemm_beside(lambda vec: run(False, vec, 128, areas[0]), stream)
    return {
        "model": model,
        "layout": layout,
        "blocks": n,
        "slot_bytes": g.slot_bytes,
        "pieces": len(g.regions),
        "piece_bytes": max(r.page_bytes for r in g.regions),
        "jobs": jobs,
        "words": words,
        "alone": rows,
        "beside": beside,
    }


def gemm_beside(scatter: Any, side: Any) -> list[dict[str, Any]]:
    """A chain of GEMMs alone, then beside scatters back to back at each width, alternated."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    main = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def chain() -> None:
        with torch.cuda.stream(main):
            for _ in range(GEMMS):
                a @ a

    out = []
    for arm in ("alone", 8, 16, "alone", 16, 8):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(main)
        chain()
        end.record(main)
        scatters = 0
        if arm != "alone":
            while not end.query():  # type: ignore[no-untyped-call]
                scatter(int(arm) // 8)
                side.synchronize()
                scatters += 1
        end.synchronize()
        out.append({"arm": arm, "gemm_ms": start.elapsed_time(end), "scatters": scatters})
    return out


def main() -> int:
    if len(sys.argv) != 2:
        raise SystemExit(
            f"access_width_probe.py: expected one argument, OUT.json, got {sys.argv[1:]}"
        )
    if not torch.cuda.is_available():
        raise RuntimeError("expected a CUDA device, got none")
    from kvoffload.transfer.cuda.kernels import CopyLauncher  # imports Triton

    launcher = CopyLauncher()
    results = []
    for model, layout in SHAPES:
        r = shape(model, layout, launcher)
        results.append(r)
        for row in r["alone"]:
            print(
                f"{model:22} {layout:9} {row['direction']:7} p{row['programs']:<4} "
                f"{row['access_bytes']:2} B  {row['ms']:.4f} ms  {row['GBps']:7.1f} GB/s"
            )
        print(f"{model:22} {layout:9} GEMMs beside 128-program scatters: {r['beside']}")
    out = {
        "benchmark": "access_width_probe",
        **machine_info(),
        "device": device_info("cuda"),
        "cuda_driver_api": driver_version(),
        "results": results,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

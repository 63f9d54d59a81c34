"""``kvoffload bench transfer``: store and load GB/s per model shape and engine layout.

Without a GPU it measures the ``host`` backend (CPU memory to CPU memory). Each configuration
copies ``--blocks`` randomly chosen engine blocks to randomly chosen host slots and back, checks
the round trip byte for byte, and reports the median of ``--reps`` timed copies after a warm-up.

With a GPU (``--device auto`` finds one) it runs ``kvoffload.bench.transfer.gpu``: the link limit,
every method of ``cases.METHODS`` side by side over the sweep's cases, store+load at once,
a GEMM and a Python thread beside transfers, host time, and issue 21's targets
(``targets``), writing JSON and a PNG plot next to it (see docs/transfer.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.common import (
    console,
    default_out,
    machine_info,
    median_seconds,
    progress,
    write_json,
)
from kvoffload.bench.transfer.cases import (
    CASES,
    GPU_BLOCKS,
    METHODS,
    SECTIONS,
    parse_cases,
    print_plan,
)
from kvoffload.transfer.shapes import LAYOUTS, MODELS, engine_tensors

DEFAULT_LAYOUTS = ("kv_split", "page", "cross_layer")
# The GPU run's default bound: ~5 minutes on an H100 for the whole run (4 cases of the sweep with
# all six methods, the host section and the tail; estimate_case's time model).
TIME_BUDGET_S = 280.0


def _csv(kind: type) -> Any:
    return lambda s: [kind(x) for x in s.split(",") if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=_csv(str), default=list(MODELS), help="model shapes")
    p.add_argument(
        "--layouts", type=_csv(str), default=list(DEFAULT_LAYOUTS), help="engine layouts"
    )
    p.add_argument("--blocks", type=_csv(int), default=[64, 512], help="blocks per transfer")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement")
    p.add_argument("--out", type=Path, default=None, help="JSON result path")
    g = p.add_argument_group("GPU run (ignored without CUDA)")
    g.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if present"
    )
    g.add_argument(
        "--cases",
        default=None,
        help="GPU: model:layout:block_size items, comma-separated (default: a sweep of pieces "
        "2-256 KiB, slots 0.24-8 MiB, fp8 and bf16, K+V and K-only)",
    )
    g.add_argument(
        "--gpu-blocks",
        type=_csv(int),
        default=list(GPU_BLOCKS),
        help="GPU: blocks per transfer (capped by --max-transfer-mib)",
    )
    g.add_argument("--max-transfer-mib", type=int, default=1024, help="GPU: largest transfer")
    g.add_argument(
        "--latency-reps", type=int, default=30, help="GPU: repetitions of transfers of <= 16 blocks"
    )
    g.add_argument(
        "--time-budget-s",
        type=float,
        default=TIME_BUDGET_S,
        help="GPU: the whole run's seconds; a fifth goes to the host section (all of it with "
        "--sections host), and a case whose estimate no longer fits is skipped (and listed)",
    )
    g.add_argument(
        "--methods", type=_csv(str), default=list(METHODS), help=f"GPU methods, of {METHODS}"
    )
    g.add_argument(
        "--sections",
        type=_csv(str),
        default=list(SECTIONS),
        help="GPU: what to measure: sweep (GB/s, latency, store+load), gemm (GEMM and a Python "
        "thread beside transfers), host (GIL per submit, eager engine step), calls (submit's "
        "parts, driver calls)",
    )
    g.add_argument(
        "--dma-max-pieces",
        type=int,
        default=1 << 16,
        help="GPU: measure dma (one descriptor per piece, as vLLM does) only on transfers of at "
        "most this many pieces (past it each transfer costs dma seconds of host time)",
    )
    g.add_argument("--link-bytes", type=int, default=1 << 30, help="GPU: bytes per link copy")
    g.add_argument("--link-reps", type=int, default=5, help="GPU: timed link copies")
    g.add_argument(
        "--gemm-reps", type=int, default=12, help="GPU: interleaved GEMM windows (0: skip)"
    )
    g.add_argument("--gemms", type=int, default=8, help="GPU: GEMMs per window")
    g.add_argument(
        "--binding-counts", type=_csv(int), default=[2048, 10000], help="GPU: descriptors per call"
    )
    g.add_argument("--plot", type=Path, default=None, help="GPU: PNG path (default: next to JSON)")
    g.add_argument(
        "--quick", action="store_true", help="GPU: fewer repetitions and a shorter time budget"
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="GPU sweep: list its cases (blocks, pieces, bytes), methods and sections with a rough "
        "time estimate; runs nothing, needs no GPU",
    )


def _check(args: argparse.Namespace) -> None:
    for m in args.models:
        if m not in MODELS:
            raise SystemExit(f"--models: expected names from {sorted(MODELS)}, got {m!r}")
    for lay in args.layouts:
        if lay not in LAYOUTS:
            raise SystemExit(f"--layouts: expected names from {sorted(LAYOUTS)}, got {lay!r}")
    if any(b <= 0 for b in args.blocks) or args.block_size <= 0 or args.reps <= 0:
        given = f"{','.join(map(str, args.blocks))}, {args.block_size}, {args.reps}"
        raise SystemExit(f"--blocks, --block-size, --reps: expected values > 0, got {given}")


def measure_host(
    model: str, layout: str, n_blocks: int, block_size: int, reps: int
) -> dict[str, Any]:
    """One configuration through the host backend; raises if the round trip is not exact."""
    from kvoffload.store.arena import HostArena
    from kvoffload.transfer.host import HostBackend
    from kvoffload.transfer.layout import KVLayout
    from kvoffload.transfer.spec import TransferSpec

    shape = MODELS[model]
    rng = np.random.default_rng(0)
    pool = n_blocks + n_blocks // 4 + 1  # spare blocks that must stay untouched
    tensors, block_dim = engine_tensors(
        shape, layout, pool, block_size, lambda s: rng.integers(0, 1 << 16, s, dtype=np.uint16)
    )
    kv = KVLayout.from_tensors(tensors, block_size=block_size, block_dim=block_dim)
    arena = HostArena(pool, kv.slot_bytes)
    backend = HostBackend(kv, arena)
    try:
        blocks = rng.permutation(pool)[:n_blocks]
        slots = rng.permutation(pool)[:n_blocks]
        store = [TransferSpec.of("store", blocks, slots)]
        dest = rng.permutation(pool)[:n_blocks]
        load = [TransferSpec.of("load", dest, slots)]
        t_store = median_seconds(lambda: backend.copy(store), reps)
        want = [np.take(t, blocks, axis=block_dim) for t in tensors]  # a copy, taken before loads
        t_load = median_seconds(lambda: backend.copy(load), reps)
        ok = all(
            np.array_equal(np.take(t, dest, axis=block_dim), w)
            for t, w in zip(tensors, want, strict=True)
        )
    finally:
        backend.close()
        arena.close()
    if not ok:
        raise RuntimeError(f"host backend round trip corrupted bytes ({model}, {layout})")
    nbytes = n_blocks * kv.slot_bytes
    return {
        "model": model,
        "layout": layout,
        "blocks": n_blocks,
        "block_size": block_size,
        "slot_bytes": kv.slot_bytes,
        "piece_bytes": kv.groups[0].regions[0].page_bytes,
        "regions": len(kv.groups[0].regions),
        "store_GBps": nbytes / t_store / 1e9,
        "load_GBps": nbytes / t_load / 1e9,
        "round_trip_exact": ok,
    }


def _use_gpu(args: argparse.Namespace) -> bool:
    if args.device == "cpu":
        return False
    from kvoffload.transfer.pinning import cuda_available

    if cuda_available():
        return True
    if args.device == "cuda":
        raise SystemExit("--device cuda: expected a CUDA GPU, got none")
    return False


def run(args: argparse.Namespace) -> int:
    _check(args)
    if args.dry_run:
        _gpu_args(args)
        from kvoffload.bench.transfer.methods import unavailable

        notes = {m: why for m in args.methods if (why := unavailable(m)) is not None}
        print_plan(args, notes)
        return 0
    if _use_gpu(args):
        return run_gpu(args)
    configs = [(m, lay, n) for m in args.models for lay in args.layouts for n in args.blocks]
    rows = []
    limit = memcpy_limit(args.reps)
    with progress() as bar:
        task = bar.add_task("host backend", total=len(configs))
        for model, layout, n in configs:
            bar.update(task, description=f"{model} {layout} x{n}")
            row = measure_host(model, layout, n, args.block_size, args.reps)
            row["store_of_memcpy"] = row["store_GBps"] / limit
            row["load_of_memcpy"] = row["load_GBps"] / limit
            rows.append(row)
            bar.advance(task)
    _print(rows, limit)
    out = args.out or default_out("transfer", "cpu")
    result = {"benchmark": "transfer", "device": "cpu", "backend": "host", **machine_info()}
    result["memcpy_GBps"] = limit
    result["rows"] = rows
    console.print(f"wrote {write_json(out, result)}")
    return 0


# The CPU's own limit for the host backend: one contiguous copy this large (well past the caches),
# after a warm-up, median of ``reps``.
MEMCPY_BYTES = 512 << 20


def memcpy_limit(reps: int) -> float:
    """GB/s of one contiguous ``MEMCPY_BYTES`` numpy copy: what a CPU copy path can approach."""
    src = np.random.default_rng(0).integers(0, 256, MEMCPY_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    return MEMCPY_BYTES / median_seconds(lambda: np.copyto(dst, src), max(reps, 3)) / 1e9


def _print(rows: list[dict[str, Any]], limit: float) -> None:
    from rich.table import Table

    table = Table(
        title=f"host backend (CPU memory <-> host arena), GB/s and share of one contiguous "
        f"memcpy ({limit:.1f} GB/s)"
    )
    for col in ("model", "layout", "blocks", "piece", "store GB/s", "load GB/s"):
        table.add_column(col, justify="right" if col not in ("model", "layout") else "left")
    for r in rows:
        table.add_row(
            r["model"],
            r["layout"],
            str(r["blocks"]),
            f"{r['piece_bytes'] // 1024} KiB",
            f"{r['store_GBps']:.2f} ({r['store_of_memcpy']:.0%})",
            f"{r['load_GBps']:.2f} ({r['load_of_memcpy']:.0%})",
        )
    console.print(table)
    console.print(
        "blocks: blocks per transfer; piece: bytes of each contiguous region of a block; store: "
        "engine tensors to the host arena, load: back; (%): that GB/s as a share of the "
        f"contiguous memcpy's {limit:.1f} GB/s"
    )


def run_gpu(args: argparse.Namespace) -> int:
    import torch

    from kvoffload.bench.transfer.gpu import run_gpu as measure
    from kvoffload.bench.transfer.plot import plot
    from kvoffload.bench.transfer.report import print_gpu
    from kvoffload.bench.transfer.targets import summarize

    _gpu_args(args)
    out = args.out or default_out("transfer", torch.cuda.get_device_name())
    partial = out.with_name(f"{out.stem}.partial.json")  # the cases so far, if the run is cut
    result = {**measure(args, lambda r: write_json(partial, r)), **machine_info()}
    result["targets"] = summarize(result)
    console.print(f"wrote {write_json(out, result)}")
    partial.unlink(missing_ok=True)
    console.print(f"wrote {plot(result, args.plot or out.with_suffix('.png'))}")
    print_gpu(result)
    return 0


def _gpu_args(args: argparse.Namespace) -> None:
    """Check and complete the GPU sweep's arguments (torch-free: the dry run uses it too)."""
    args.cases = args.cases or CASES
    parse_cases(args.cases)
    if any(b <= 0 for b in args.gpu_blocks) or args.max_transfer_mib <= 0:
        given = f"{','.join(map(str, args.gpu_blocks))}, {args.max_transfer_mib}"
        raise SystemExit(f"--gpu-blocks, --max-transfer-mib: expected values > 0, got {given}")
    for flag, given, known in (
        ("--methods", args.methods, METHODS),
        ("--sections", args.sections, SECTIONS),
    ):
        for name in given:
            if name not in known:
                raise SystemExit(f"{flag}: expected names from {list(known)}, got {name!r}")
    if args.time_budget_s <= 0:
        raise SystemExit(f"--time-budget-s: expected seconds > 0, got {args.time_budget_s}")
    if args.quick:
        args.reps = min(args.reps, 3)
        args.latency_reps = min(args.latency_reps, 15)
        args.gemm_reps = min(args.gemm_reps, 4)
        args.time_budget_s = min(args.time_budget_s, 150.0)

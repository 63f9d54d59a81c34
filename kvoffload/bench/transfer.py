"""``kvoffload bench transfer``: store and load GB/s per model shape and engine layout.

Without a GPU it measures the ``host`` backend (CPU memory to CPU memory). Each configuration
copies ``--blocks`` randomly chosen engine blocks to randomly chosen host slots and back, checks
the round trip byte for byte, and reports the median of ``--reps`` timed copies after a warm-up.

With a GPU (``--device auto`` finds one) it runs ``kvoffload.bench.transfer_gpu``: the link limit,
``staged`` / ``dma`` / ``sm`` side by side, store+load at once, GEMM interference and binding host
time, writing JSON and a PNG plot next to it (see docs/transfer.md).
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
from kvoffload.transfer.shapes import LAYOUTS, MODELS, engine_tensors

DEFAULT_LAYOUTS = ("kv_split", "page", "cross_layer")
# (model, layout, block size) cases of the GPU sweep: pieces of 2 KiB (fp8 at TP8) to 256 KiB,
# slots of 243 KiB to 8 MiB, K+V and K-only layouts. The cases the targets read come first (a time
# budget cuts the tail).
CASES = (
    "llama3-8b:page:16,llama3-70b-tp8-fp8:kv_split:16,deepseek-v2-lite-mla:page:16,"
    "qwen2.5-7b:kv_split:32,llama3-70b-tp8-fp8:page:16,llama3-8b:kv_split:16,"
    "llama3-8b:cross_layer:16,llama3-8b:page:64,qwen2.5-7b:page:16,llama3-70b-tp8:kv_split:16,"
    "llama3-70b-tp8-fp8:kv_split:32,deepseek-v2-lite-mla:page:8"
)


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
        default=[1, 3, 16, 256, 1000, 2048],
        help="GPU: blocks per transfer (capped by --max-transfer-mib)",
    )
    g.add_argument("--max-transfer-mib", type=int, default=1024, help="GPU: largest transfer")
    g.add_argument(
        "--latency-reps", type=int, default=30, help="GPU: repetitions of transfers of <= 16 blocks"
    )
    g.add_argument(
        "--time-budget-s",
        type=float,
        default=200.0,
        help="GPU: start no new case after this many seconds (skipped cases are listed)",
    )
    g.add_argument(
        "--methods", type=_csv(str), default=["staged", "dma", "auto"], help="GPU methods"
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
        help="GPU sweep: list its cases (blocks, pieces, bytes) with a rough time estimate; runs "
        "nothing, needs no GPU",
    )


def _check(args: argparse.Namespace) -> None:
    for m in args.models:
        if m not in MODELS:
            raise SystemExit(f"--models: expected names from {sorted(MODELS)}, got {m!r}")
    for lay in args.layouts:
        if lay not in LAYOUTS:
            raise SystemExit(f"--layouts: expected names from {sorted(LAYOUTS)}, got {lay!r}")
    if any(b <= 0 for b in args.blocks) or args.block_size <= 0 or args.reps <= 0:
        raise SystemExit("--blocks, --block-size and --reps must be positive")


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
        raise SystemExit("--device cuda: expected a CUDA GPU, found none")
    return False


def parse_cases(text: str) -> list[tuple[str, str, int]]:
    """``model:layout:block_size`` items, comma-separated; SystemExit naming a bad one."""
    out = []
    for item in text.split(","):
        try:
            model, layout, bs = item.split(":")
            out.append((model, layout, int(bs)))
        except ValueError:
            raise SystemExit(
                f"--cases: expected model:layout:block_size items, got {item!r}"
            ) from None
        if model not in MODELS or layout not in LAYOUTS or int(bs) <= 0:
            raise SystemExit(
                f"--cases: expected a model in {sorted(MODELS)}, a layout in {sorted(LAYOUTS)} "
                f"and a block size > 0, got {item!r}"
            )
    return out


def case_blocks(model: str, bs: int, gpu_blocks: list[int], max_transfer_mib: int) -> list[int]:
    """Blocks per transfer of one case: ``gpu_blocks``, each capped at ``max_transfer_mib``."""
    slot = MODELS[model].block_bytes(bs)
    cap = max_transfer_mib << 20
    return sorted({min(n, max(1, cap // slot)) for n in gpu_blocks})


def layout_pieces(model: str, layout: str, bs: int) -> tuple[int, int]:
    """(regions per block, bytes of one) of ``layout``: a piece is one region of one block."""
    shape = MODELS[model]
    if layout in ("kv_split", "kv_pair"):
        return shape.kv * shape.layers, shape.piece_bytes(bs)
    if layout == "page":
        return shape.layers, shape.kv * shape.piece_bytes(bs)
    return 1, shape.block_bytes(bs)


# The dry run's time model (rough; H100 VM, 2026-11-23 run): a descriptor costs the host ~0.85 us
# in cuMemcpyBatchAsync, a transfer ~0.3 ms of Python and synchronisation; the copy engines move
# pieces of these sizes at about these GB/s when given one descriptor each, the staged path ~50
# GB/s; filling and pinning the arena ~2 GB/s, the byte checks ~3 GB/s, ~5 s per case besides
# (tensors, backends, kernel builds). The 2026-11-23 run took 25, 38, 16 and 18 s for the first
# four cases (the first with ~10 s of GEMM, launch-stall and submit probes) before dma was capped.
_DESCRIPTOR_S = 0.85e-6
_TRANSFER_S = 0.3e-3
_DMA_GBPS = ((4 << 10, 2.0), (16 << 10, 5.0), (32 << 10, 25.0), (64 << 10, 40.0), (1 << 62, 52.0))
_STAGED_GBPS = 50.0
_SETUP_GBPS = 2.0
_CHECK_GBPS = 3.0
_CASE_S = 5.0


def estimate_case(
    model: str, layout: str, bs: int, blocks: list[int], args: argparse.Namespace
) -> float:
    """Rough seconds one case of the GPU sweep takes (setup, every method and count, store+load)."""
    regions, piece = layout_pieces(model, layout, bs)
    slot = MODELS[model].block_bytes(bs)
    dma_gbps = next(g for limit, g in _DMA_GBPS if piece <= limit)

    def one(method: str, n: int, copies: int = 1) -> tuple[float, float]:
        """(host s, GPU s) of ``copies`` transfers of n blocks at once."""
        descriptors = n * regions if method == "dma" else n
        gbps = dma_gbps if method == "dma" else _STAGED_GBPS
        host = _TRANSFER_S + descriptors * _DESCRIPTOR_S
        return copies * host, copies * n * slot / gbps / 1e9

    total = _CASE_S + 2 * (2 * max(blocks) + 8) * slot / _SETUP_GBPS / 1e9  # engine + arena
    for method in args.methods:
        for n in blocks:
            if method == "dma" and n * regions > args.dma_max_pieces:
                continue
            host, gpu = one(method, n)
            total += 2 * n * slot / _CHECK_GBPS / 1e9  # the byte checks
            e2e = (args.latency_reps if n <= 16 else args.reps) + 1
            lead = min(max(2e-3, 2 * host), 0.5)
            total += 2 * (e2e * (host + gpu) + (args.reps + 1) * (max(lead, host) + gpu))
        both = min(512, max(blocks))
        if method != "sm" and (method != "dma" or both * regions <= args.dma_max_pieces):
            host, gpu = one(method, both, copies=2)
            total += 3 * (args.reps + 1) * (host + gpu / 2)
    return total


def print_plan(args: argparse.Namespace) -> float:
    """The GPU sweep's cases, what each moves and a rough time; returns the estimated seconds."""
    from rich.table import Table

    table = Table(title="bench transfer on a GPU: the sweep's cases (dry run, rough times)")
    for col in ("case", "slot", "pieces/block", "piece", "blocks per transfer", "~s"):
        table.add_column(col, justify="left" if col == "case" else "right", no_wrap=True)
    total = 0.0
    for model, layout, bs in parse_cases(args.cases):
        blocks = case_blocks(model, bs, args.gpu_blocks, args.max_transfer_mib)
        regions, piece = layout_pieces(model, layout, bs)
        seconds = estimate_case(model, layout, bs, blocks, args)
        total += seconds
        table.add_row(
            f"{model}:{layout}:{bs}",
            f"{MODELS[model].block_bytes(bs) // 1024} KiB",
            str(regions),
            f"{piece / 1024:g} KiB",
            ",".join(map(str, blocks)),
            f"{seconds:.0f}",
        )
    console.print(table)
    console.print(
        f"methods {','.join(args.methods)}; all cases ~{total:.0f} s; the run stops taking new "
        f"cases after --time-budget-s {args.time_budget_s:.0f} s (the first case also measures "
        "GEMM interference, launch stalls and submit costs: add ~10 s)"
    )
    return total


def run(args: argparse.Namespace) -> int:
    _check(args)
    if args.dry_run:
        _gpu_args(args)
        print_plan(args)
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


def run_gpu(args: argparse.Namespace) -> int:
    from kvoffload.bench.transfer_gpu import METHODS
    from kvoffload.bench.transfer_gpu import run_gpu as measure
    from kvoffload.bench.transfer_plot import plot
    from kvoffload.bench.transfer_targets import summarize

    for m in args.methods:
        if m not in METHODS:
            raise SystemExit(f"--methods: expected names from {list(METHODS)}, got {m!r}")
    _gpu_args(args)
    result = {**measure(args), **machine_info()}
    result["targets"] = summarize(result)
    device = result["device"]
    out = args.out or default_out("transfer", device)
    console.print(f"wrote {write_json(out, result)}")
    console.print(f"wrote {plot(result, args.plot or out.with_suffix('.png'))}")
    _print_gpu(result)
    return 0


def _gpu_args(args: argparse.Namespace) -> None:
    """Check and complete the GPU sweep's arguments (torch-free: the dry run uses it too)."""
    args.cases = args.cases or CASES
    parse_cases(args.cases)
    if any(b <= 0 for b in args.gpu_blocks) or args.max_transfer_mib <= 0:
        raise SystemExit("--gpu-blocks and --max-transfer-mib must be positive")
    if args.quick:
        args.reps = min(args.reps, 3)
        args.latency_reps = min(args.latency_reps, 15)
        args.gemm_reps = min(args.gemm_reps, 4)
        args.time_budget_s = min(args.time_budget_s, 150.0)


def _print_gpu(result: dict[str, Any]) -> None:
    from rich.table import Table

    from kvoffload.bench.transfer_targets import link_limit

    link = result["link"]["GBps"]
    console.print(
        "link (1 GiB, median [min-max]): "
        + ", ".join(
            f"{k} {v['median']:.1f} [{v['min']:.1f}-{v['max']:.1f}]" for k, v in link.items()
        )
    )
    table = Table(
        title=f"GPU transfers on {result['device']}: share of the link, copies alone / end to "
        "end; p50 / p99 us of transfers of <= 16 blocks"
    )
    cols = ("model", "layout", "bs", "blocks", "piece", "slot", "method", "store", "load")
    for col in (*cols, "store us", "load us"):
        table.add_column(col, justify="left" if col in ("model", "layout", "method") else "right")
    limit = link_limit(result)
    d2h, h2d = limit["d2h"], limit["h2d"]
    for r in result["rows"]:
        lat = ["", ""]
        if "store_p50_us" in r and r["blocks"] <= 16:
            lat = [f"{r[f'{d}_p50_us']:.0f} / {r[f'{d}_p99_us']:.0f}" for d in ("store", "load")]
        table.add_row(
            r["model"],
            r["layout"],
            str(r["block_size"]),
            str(r["blocks"]),
            f"{r['piece_bytes'] // 1024} KiB",
            f"{r['slot_bytes'] // 1024} KiB",
            r["method"],
            f"{r['store_gpu_GBps'] / d2h:.0%} / {r['store_GBps'] / d2h:.0%}",
            f"{r['load_gpu_GBps'] / h2d:.0%} / {r['load_GBps'] / h2d:.0%}",
            *lat,
        )
    console.print(table)
    for b in result["store_and_load"]:
        console.print(
            f"store+load at once {b['model']} {b['layout']} bs{b['block_size']} {b['method']}: "
            f"{b['GBps']:.1f} GB/s"
        )
    if result["gemm"]:
        g = result["gemm"]
        console.print(
            f"GEMM slowdown (baseline noise {g['baseline_noise']:.1%}): "
            + ", ".join(f"{m} {v:+.1%}" for m, v in g["slowdown"].items())
        )
    for m, st in (result.get("launch_stall") or {}).items():
        console.print(
            f"launch-bound Python thread, {m} transfers every step: {st['slowdown']:+.1%} per step "
            f"(noise {st['noise']:.1%}), host CPU {st['host_cpu_us_per_transfer']:.0f} us per "
            "transfer"
        )
    if result.get("skipped_cases"):
        console.print(f"skipped (time budget): {', '.join(result['skipped_cases'])}")
    console.print(f"binding host us: {result['binding_host_us']}")
    console.print(f"target reached? (bench transfer, {result['seconds']:.0f} s)")
    for t in result["targets"]:
        mark = {True: "reached", False: "NOT reached", None: "-"}[t["reached"]]
        console.print(f"  {t['target']}: {t['measured']} -> {mark}")

"""The GPU sweep of ``kvoffload bench transfer``, as data: its cases, methods, sections and a rough
time model (torch-free: ``--dry-run`` lists the plan on a machine without a GPU).

A case is ``model:layout:block_size``; each is measured at every count of ``--gpu-blocks``,
capped at ``--max-transfer-mib`` (a capped count stands for the counts above it: the row records
both, ``blocks`` and ``asked_blocks``).
"""

from __future__ import annotations

import argparse

from kvoffload.transfer.shapes import LAYOUTS, MODELS

# Cases of the default sweep, the shapes issue 21's targets name first (a time budget cuts the
# tail): 64 KiB bf16 pages, 2 KiB fp8 K/V-split pieces, K-only latent (18 KiB), 128 KiB K/V-split
# and 256 KiB page pieces, then 4 KiB fp8 pages and the other engine shapes.
CASES = (
    "llama3-8b:page:16,llama3-70b-tp8-fp8:kv_split:16,deepseek-v2-lite-mla:page:16,"
    "llama3-8b:kv_split:64,llama3-8b:page:64,llama3-70b-tp8-fp8:page:16,qwen2.5-7b:kv_split:32,"
    "llama3-8b:kv_split:16,llama3-70b-tp8:kv_split:16,qwen2.5-7b:page:32,"
    "llama3-8b:cross_layer:16,deepseek-v2-lite-mla:page:8"
)
GPU_BLOCKS = (1, 16, 37, 64, 1000, 2048)  # the counts issue 21's targets name
# Methods side by side: ``staged`` (the native engine where it runs, else the ``dma`` fallback;
# each row records the path), ``dma`` (one descriptor per piece, as vLLM's
# cuMemcpyBatchAsync path), ``sm`` (our Triton copy with vLLM's constants), ``auto`` (the
# planner, as users get it), ``vllm-triton`` (vLLM's own Triton kernel, reproduced in
# ``kvoffload.bench.vllm_triton``; skipped with a note where that module is absent).
METHODS = ("staged", "dma", "sm", "auto", "vllm-triton")
# sweep: per case and count, store and load GB/s and 1-block latency, store+load at once, the
# first layer of a load; gemm: a GEMM and a launch-bound Python thread beside each method's
# transfers; host: GIL held per submit and an eager engine step (``kvoffload.bench.host_time``);
# calls: the host time of submit's parts and of single driver calls.
SECTIONS = ("sweep", "gemm", "host", "calls")
LATENCY_BLOCKS = 16  # transfers up to this many blocks also get a p50/p99 latency


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


def case_blocks(
    model: str, bs: int, gpu_blocks: list[int], max_transfer_mib: int
) -> dict[int, int]:
    """Blocks per transfer of one case -> the largest count of ``gpu_blocks`` it stands for:
    each count capped at ``max_transfer_mib`` (so several may land on one), sorted."""
    slot = MODELS[model].block_bytes(bs)
    cap = max(1, (max_transfer_mib << 20) // slot)
    out: dict[int, int] = {}
    for n in sorted(gpu_blocks):
        out[min(n, cap)] = n
    return out


def layout_pieces(model: str, layout: str, bs: int) -> tuple[int, int]:
    """(regions per block, bytes of one) of ``layout``: a piece is one region of one block."""
    shape = MODELS[model]
    if layout in ("kv_split", "kv_pair"):
        return shape.kv * shape.layers, shape.piece_bytes(bs)
    if layout == "page":
        return shape.layers, shape.kv * shape.piece_bytes(bs)
    return 1, shape.block_bytes(bs)


# The dry run's time model (rough; H100 VM, 2026-11-23 and -25 runs): a descriptor costs the host
# ~0.85 us in cuMemcpyBatchAsync, a transfer ~0.3 ms of Python and synchronisation; the copy
# engines move pieces of these sizes at about these GB/s when given one descriptor each, the SM
# copies (ours at 12 programs: 13 GB/s at 2 KiB, 30 at 18 KiB) about these, the staged path ~50
# GB/s; filling and pinning the arena ~2 GB/s, the byte checks ~3 GB/s, ~5 s per case besides
# (tensors, backends, kernel builds). The 2026-11-23 run took 25, 38, 16 and 18 s for the first
# four cases with three methods (the first with ~10 s of GEMM, launch-stall and submit probes).
_DESCRIPTOR_S = 0.85e-6
_TRANSFER_S = 0.3e-3
_DMA_GBPS = ((4 << 10, 2.0), (16 << 10, 5.0), (32 << 10, 25.0), (64 << 10, 40.0), (1 << 62, 52.0))
_SM_GBPS = ((2 << 10, 13.0), (8 << 10, 20.0), (32 << 10, 30.0), (1 << 62, 45.0))
_STAGED_GBPS = 50.0
_SETUP_GBPS = 2.0
_CHECK_GBPS = 3.0
_CASE_S = 5.0
FIRST_CASE_S = 15.0  # the first case also measures GEMM interference and launch stalls
TAIL_S = 15.0  # the link again, the call probes, writing the plot


def _rate(table: tuple[tuple[int, float], ...], piece: int) -> float:
    return next(g for limit, g in table if piece <= limit)


def estimate_case(
    model: str, layout: str, bs: int, blocks: list[int], args: argparse.Namespace
) -> float:
    """Rough seconds one case of the GPU sweep takes (setup, every method and count, store+load)."""
    regions, piece = layout_pieces(model, layout, bs)
    slot = MODELS[model].block_bytes(bs)

    def one(method: str, n: int, copies: int = 1) -> tuple[float, float]:
        """(host s, GPU s) of ``copies`` transfers of n blocks at once."""
        descriptors = n * regions if method == "dma" else n
        gbps = {"dma": _rate(_DMA_GBPS, piece), "sm": _rate(_SM_GBPS, piece)}.get(
            "sm" if method == "vllm-triton" else method, _STAGED_GBPS
        )
        host = _TRANSFER_S + descriptors * _DESCRIPTOR_S
        return copies * host, copies * n * slot / gbps / 1e9

    total = _CASE_S + 2 * (2 * max(blocks) + 8) * slot / _SETUP_GBPS / 1e9  # engine + arena
    for method in args.methods:
        for n in blocks:
            if method == "dma" and n * regions > args.dma_max_pieces:
                continue
            host, gpu = one(method, n)
            total += 2 * n * slot / _CHECK_GBPS / 1e9  # the byte checks
            e2e = (args.latency_reps if n <= LATENCY_BLOCKS else args.reps) + 1
            lead = min(max(2e-3, 2 * host), 0.5)
            total += 2 * (e2e * (host + gpu) + (args.reps + 1) * (max(lead, host) + gpu))
        both = min(512, max(blocks))
        if method != "dma" or both * regions <= args.dma_max_pieces:
            host, gpu = one(method, both, copies=2)
            total += 3 * (args.reps + 1) * (host + gpu / 2)
    return total


def print_plan(args: argparse.Namespace, notes: dict[str, str] | None = None) -> float:
    """The GPU sweep's cases, what each moves and a rough time; returns the estimated seconds.
    ``notes``: method -> why it will be skipped."""
    from rich.table import Table

    from kvoffload.console import console

    table = Table(title="bench transfer on a GPU: the sweep's cases (dry run, rough times)")
    for col in ("case", "slot", "pieces/block", "piece", "blocks per transfer", "~s"):
        table.add_column(col, justify="left" if col == "case" else "right", no_wrap=True)
    total = 0.0
    for model, layout, bs in parse_cases(args.cases):
        blocks = list(case_blocks(model, bs, args.gpu_blocks, args.max_transfer_mib))
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
        "case: model:layout:block size (tokens); slot: bytes of one block of every layer (one "
        "host slot); pieces/block: contiguous regions a block is made of; piece: bytes of each; "
        "blocks per transfer: the transfer sizes swept; ~s: estimated seconds for the case"
    )
    if {"gemm", "calls"} & set(args.sections):
        total += FIRST_CASE_S
    console.print(
        f"methods {','.join(args.methods)}; sections {','.join(args.sections)}; all cases "
        f"~{total:.0f} s; --time-budget-s {args.time_budget_s:.0f} s bounds the whole run (a case "
        "whose estimate no longer fits is skipped and listed)"
    )
    for method, why in (notes or {}).items():
        console.print(f"  {method}: {why}")
    return total

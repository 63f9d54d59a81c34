"""``kvoffload calibrate``: measure the copy backends on this GPU and cache the table.

Synthetic engines with one piece size each (``--pieces``: bytes of one block of one region; the
number of regions per block is chosen so a block is about 2 MiB) move ``--blocks`` blocks per
transfer, both directions, through each method, timed end to end (from ``submit`` on an idle GPU
to the copy's completion, host enqueue included: what an engine waiting on a load sees), and a
store and a load of the same size at once (direction ``both``, GB/s summed); the
median GB/s of each point goes into the calibration table (``kvoffload.transfer.calibration``),
saved per GPU model and driver. The planner (``backend="auto"``) then picks, per transfer, the
method that was fastest at the nearest point.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def _csv(kind: type) -> Any:
    return lambda s: [kind(x) for x in s.split(",") if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pieces",
        type=_csv(int),
        default=[4096, 16384, 65536, 262144, 1 << 20, 4 << 20],
        help="piece sizes in bytes",
    )
    p.add_argument("--blocks", type=_csv(int), default=[16, 128, 512], help="blocks per transfer")
    p.add_argument("--methods", type=_csv(str), default=["staged", "dma"], help="methods")
    p.add_argument("--reps", type=int, default=3, help="timed transfers per point")
    p.add_argument("--out", default=None, help="table path (default: the per-GPU cache file)")


def measure(args: argparse.Namespace) -> Any:
    import numpy as np
    import torch

    from kvoffload.console import progress
    from kvoffload.store.arena import HostArena
    from kvoffload.transfer.calibration import CalibrationTable, Measurement
    from kvoffload.transfer.cuda.driver import driver_version
    from kvoffload.transfer.layout import KVLayout
    from kvoffload.transfer.pinning import cuda_pin
    from kvoffload.transfer.registry import make_backend
    from kvoffload.transfer.spec import TransferSpec
    from kvoffload.transfer.timing import Sleeper, submitter, time_transfers

    sleeper = Sleeper()
    rng = np.random.default_rng(0)
    n_max = max(args.blocks)
    entries = []
    with progress() as bar:
        task = bar.add_task("calibrating", total=len(args.pieces))
        for piece in args.pieces:
            regions = min(64, max(1, (2 << 20) // piece))
            pool = 2 * n_max
            tensors = [
                torch.randint(0, 256, (pool, piece), dtype=torch.uint8, device="cuda")
                for _ in range(regions)
            ]
            kv = KVLayout.from_tensors(tensors, block_size=16)
            arena = HostArena(pool, kv.slot_bytes, pin=cuda_pin)
            try:
                for method in args.methods:
                    backend = make_backend(method, kv, arena)
                    try:
                        for n in args.blocks:
                            blocks, slots = rng.permutation(pool), rng.permutation(pool)
                            store = [TransferSpec.of("store", blocks[:n], slots[:n])]
                            load = [TransferSpec.of("load", blocks[n : 2 * n], slots[n : 2 * n])]
                            for direction, jobs in (
                                ("store", [store]),
                                ("load", [load]),
                                ("both", [store, load]),
                            ):
                                # lead=False: end to end. Timing the copies alone (lead=True)
                                # hid dma's host cost of ~0.8 us per descriptor, so the planner
                                # chose dma for 32 KiB pieces and the e2e benchmark's loads fell
                                # from 46 to 22 GB/s on the H100 (2026-11-22).
                                t = time_transfers(
                                    sleeper, submitter(backend, *jobs), args.reps, lead=False
                                )
                                moved = len(jobs) * n * kv.slot_bytes
                                gbps = moved / statistics.median(t["gpu_s"]) / 1e9
                                entries.append(
                                    Measurement(method, direction, piece, n * regions, gbps)
                                )
                    finally:
                        backend.close()
            finally:
                arena.close()
                del tensors
                torch.cuda.empty_cache()
            bar.advance(task)
    return CalibrationTable(torch.cuda.get_device_name(), driver_version(), tuple(entries))


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvoffload.console import console
    from kvoffload.transfer.calibration import save
    from kvoffload.transfer.pinning import cuda_available

    for m in args.methods:
        if m not in ("staged", "dma", "sm"):
            raise SystemExit(f"--methods: expected names from ['staged', 'dma', 'sm'], got {m!r}")
    if not cuda_available():
        raise SystemExit("kvoffload calibrate: expected a CUDA GPU to calibrate, got none")
    table = measure(args)
    path = save(table, Path(args.out) if args.out else None)
    for e in table.entries:
        console.print(
            f"{e.method:>7} {e.direction:>5} piece {e.piece_bytes:>8} x{e.pieces:>6}: "
            f"{e.gbps:6.1f} GB/s"
        )
    console.print(f"wrote {path}")
    return 0

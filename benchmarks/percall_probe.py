"""The host Python time of one-block jobs through the public API, per call (issue 27).

Stores and loads one block at a time, each with its own new key, through ``Offloader`` and
``TransferWorker`` over the host backend with a copy that does nothing (only our Python is timed:
no bytes move, so this is not a test of the data plane), and times each call apart, in
microseconds: ``schedule_store``, ``submit``, ``get_finished``, ``complete`` of the store, then
``lookup`` of its key, then the same four calls for a load of it. Prints and writes the median of
each phase over the rounds after the first ``--warm``.

    PYTHONPATH=. OPENBLAS_NUM_THREADS=1 python -m benchmarks.percall_probe --rounds 20000

The VM this runs on is shared and noisy: compare two trees by alternating runs of each (A, B, A,
B, ...) and comparing the medians of their runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.common import console, machine_info, write_json
from kvoffload.bench.store.api import InlineHostBackend, Landed, _keys
from kvoffload.config import OffloadConfig
from kvoffload.offload import TransferWorker, build_local
from kvoffload.transfer.backend import Pending
from kvoffload.transfer.layout import KVLayout

PHASES = (
    "schedule_store",
    "submit_store",
    "get_finished_store",
    "complete_store",
    "lookup",
    "schedule_load",
    "submit_load",
    "get_finished_load",
    "complete_load",
)


class NoCopy(InlineHostBackend):
    """The host backend whose submit copies nothing: the job is done at once."""

    def submit_checked(self, specs: Any, **kw: Any) -> Pending:
        return Landed()


def measure(rounds: int, warm: int) -> dict[str, float]:
    """Median µs of each phase (``PHASES``) over ``rounds`` store-lookup-load rounds."""
    kv = np.zeros((64, 64), np.uint8)
    layout = KVLayout.from_tensors([kv], block_size=16, block_dim=0)
    local = build_local(layout, OffloadConfig(host_capacity_blocks=2 * rounds + 16))
    off = local.offloader
    local.worker.close()
    worker = TransferWorker(NoCopy(layout, local.arena), off)
    rng = np.random.default_rng(0)
    keys = [_keys(rng, 1, "list") for _ in range(rounds)]
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    pc = time.perf_counter
    try:
        for i, k in enumerate(keys):
            t0 = pc()
            job = off.schedule_store(f"s{i}", k, [0])
            t1 = pc()
            worker.submit(job)  # type: ignore[arg-type]
            t2 = pc()
            results = worker.get_finished()
            t3 = pc()
            off.complete(results)
            t4 = pc()
            off.lookup(k)
            t5 = pc()
            load = off.schedule_load(f"l{i}", k, [1])
            t6 = pc()
            worker.submit(load)
            t7 = pc()
            results = worker.get_finished()
            t8 = pc()
            off.complete(results)
            t9 = pc()
            for name, dt in zip(
                PHASES,
                (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t8 - t7, t9 - t8),
                strict=True,
            ):
                times[name].append(dt * 1e6)
    finally:
        worker.close()
        local.close()
    return {p: round(statistics.median(v[warm:]), 3) for p, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--warm", type=int, default=100)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.warm < 0 or args.rounds <= args.warm:
        raise SystemExit(
            f"expected --warm >= 0 and --rounds > --warm, got --warm {args.warm}, "
            f"--rounds {args.rounds}"
        )
    us = measure(args.rounds, args.warm)
    store = sum(us[ph] for ph in PHASES[:4])
    load = sum(us[ph] for ph in PHASES[5:])
    console.print("  ".join(f"{k} {v:.2f}" for k, v in us.items()))
    console.print(
        f"store {store:.2f} us  load {load:.2f} us (schedule + submit + get_finished + complete)"
    )
    if args.out is not None:
        data = {"benchmark": "percall_probe", **machine_info(), "rounds": args.rounds}
        data.update({"median_us": us, "store_us": round(store, 3), "load_us": round(load, 3)})
        console.print(f"wrote {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

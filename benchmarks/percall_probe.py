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

``--sweep-mib N``: N MiB of memory read before every call (untimed), as an engine's forward runs
between two of our calls and leaves our code and data out of the CPU's caches (``bench e2e``
reads each call cold; ``benchmarks/wait_cold_probe.py`` measured what that does to one call):

    PYTHONPATH=. python -m benchmarks.percall_probe --rounds 400 --sweep-mib 64

``--layers``: instead, one key's lookup through ``Offloader``, ``BlockIndex`` and the native index,
and an empty Python call, each after the sweep: what each Python layer adds to a cold call.
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


def no_copy_local(host_blocks: int) -> tuple[Any, TransferWorker]:
    """``build_local`` for 64-byte blocks with ``host_blocks`` host slots, its worker replaced by
    one over ``NoCopy``: (the local pair, that worker); close both."""
    kv = np.zeros((64, 64), np.uint8)
    layout = KVLayout.from_tensors([kv], block_size=16, block_dim=0)
    local = build_local(layout, OffloadConfig(host_capacity_blocks=host_blocks))
    local.worker.close()
    return local, TransferWorker(NoCopy(layout, local.arena), local.offloader)


def sweeper(mib: int) -> np.ndarray | None:
    """``mib`` MiB to read before each call (None: nothing, calls back to back)."""
    return np.ones(mib << 17, dtype=np.float64) if mib > 0 else None


def after_sweep(sweep: np.ndarray | None, fn: Any, *args: Any) -> tuple[float, Any]:
    """Microseconds of ``fn(*args)`` called after ``sweep`` was read, and what it returned."""
    if sweep is not None:
        sweep.sum()  # the engine's work between two of our calls
    t0 = time.perf_counter()
    out = fn(*args)
    return (time.perf_counter() - t0) * 1e6, out


def lookup_layers(rounds: int, sweep_mib: int) -> dict[str, float]:
    """Median µs of one key's lookup through each layer down to the native index (and of an
    empty call), each after ``sweep_mib`` MiB read, the arms interleaved round by round: what each
    Python layer adds to a call when it runs cold."""
    local, worker = no_copy_local(64)
    off = local.offloader
    key = _keys(np.random.default_rng(0), 1, "list")
    job = off.schedule_store("s", key, [0])
    if job is None:
        raise RuntimeError("a new key's store was not scheduled")
    worker.submit(job)
    off.complete(worker.get_finished())
    native = off.index._ix
    arms: dict[str, Any] = {
        "Offloader.lookup": lambda: off.lookup(key),
        "BlockIndex.lookup": lambda: off.index.lookup(key),
        "native Index.lookup": lambda: native.lookup(key),
        "an empty Python call": lambda: None,
    }
    if off.lookup(key) != 1:
        raise RuntimeError("the stored key is not found")
    sweep = sweeper(sweep_mib)
    times: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for _ in range(rounds):
            for name, fn in arms.items():
                times[name].append(after_sweep(sweep, fn)[0])
    finally:
        worker.close()
        local.close()
    return {name: round(statistics.median(v), 3) for name, v in times.items()}


def measure(rounds: int, warm: int, sweep_mib: int = 0) -> dict[str, float]:
    """Median µs of each phase (``PHASES``) over ``rounds`` store-lookup-load rounds, with
    ``sweep_mib`` MiB read before each call (0: back to back)."""
    local, worker = no_copy_local(2 * rounds + 16)
    off = local.offloader
    rng = np.random.default_rng(0)
    keys = [_keys(rng, 1, "list") for _ in range(rounds)]
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    sweep = sweeper(sweep_mib)

    def timed(name: str, fn: Any, *args: Any) -> Any:
        us, out = after_sweep(sweep, fn, *args)
        times[name].append(us)
        return out

    try:
        for i, k in enumerate(keys):
            job = timed("schedule_store", off.schedule_store, f"s{i}", k, [0])
            timed("submit_store", worker.submit, job)
            results = timed("get_finished_store", worker.get_finished)
            timed("complete_store", off.complete, results)
            timed("lookup", off.lookup, k)
            load = timed("schedule_load", off.schedule_load, f"l{i}", k, [1])
            timed("submit_load", worker.submit, load)
            results = timed("get_finished_load", worker.get_finished)
            timed("complete_load", off.complete, results)
    finally:
        worker.close()
        local.close()
    return {p: round(statistics.median(v[warm:]), 3) for p, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--warm", type=int, default=100)
    p.add_argument("--sweep-mib", type=int, default=0, help="MiB read before every call")
    p.add_argument(
        "--layers",
        action="store_true",
        help="instead: one key's lookup through each layer to the native index, --rounds times",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.warm < 0 or args.rounds <= args.warm:
        raise SystemExit(
            f"expected --warm >= 0 and --rounds > --warm, got --warm {args.warm}, "
            f"--rounds {args.rounds}"
        )
    if args.sweep_mib < 0:
        raise SystemExit(f"expected --sweep-mib >= 0, got {args.sweep_mib}")
    if args.layers:
        layers = lookup_layers(args.rounds, args.sweep_mib)
        console.print("  ".join(f"{k} {v:.2f}" for k, v in layers.items()))
        if args.out is not None:
            data = {"benchmark": "percall_probe", **machine_info(), "rounds": args.rounds}
            data.update({"sweep_mib": args.sweep_mib, "layers_us": layers})
            console.print(f"wrote {write_json(args.out, data)}")
        return 0
    us = measure(args.rounds, args.warm, args.sweep_mib)
    store = sum(us[ph] for ph in PHASES[:4])
    load = sum(us[ph] for ph in PHASES[5:])
    console.print("  ".join(f"{k} {v:.2f}" for k, v in us.items()))
    console.print(
        f"store {store:.2f} us  load {load:.2f} us (schedule + submit + get_finished + complete)"
    )
    if args.out is not None:
        data = {"benchmark": "percall_probe", **machine_info(), "rounds": args.rounds}
        data["sweep_mib"] = args.sweep_mib
        data.update({"median_us": us, "store_us": round(store, 3), "load_us": round(load, 3)})
        console.print(f"wrote {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

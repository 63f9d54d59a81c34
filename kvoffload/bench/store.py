"""``kvoffload bench store``: what the scheduler pays per step for the store's bookkeeping.

For each eviction policy and each resident count it fills a ``BlockIndex`` with that many readable
blocks (16-byte keys, as engines hash them) and times, as medians over ``--reps`` runs:
- lookup of a 2,048-block prefix that is fully resident (the worst case: every key is checked);
- prepare_store + complete_store of 512 new blocks with free slots;
- the same under pressure, where each of the 512 blocks evicts one resident block;
and the Python memory per resident block (tracemalloc over the fill, keys included).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.common import console, default_out, machine_info, progress, write_json
from kvoffload.store.index import BlockIndex
from kvoffload.store.policies import POLICIES

LOOKUP_BLOCKS = 2048
STORE_BLOCKS = 512
SLOT_BYTES = 2 << 20  # Llama-3-8B, block size 16, bf16: only used for byte counters


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resident",
        type=lambda s: [int(float(x)) for x in s.split(",")],
        default=[10_000, 1_000_000],
        help="resident block counts (comma separated)",
    )
    p.add_argument("--policies", type=lambda s: s.split(","), default=sorted(POLICIES))
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per operation")
    p.add_argument("--out", type=Path, default=None, help="JSON result path")


def _keys(rng: np.random.Generator, n: int) -> list[bytes]:
    raw = rng.bytes(16 * n)
    return [raw[i : i + 16] for i in range(0, 16 * n, 16)]


def _fill(index: BlockIndex, keys: list[bytes]) -> None:
    for i in range(0, len(keys), 4096):
        plan = index.prepare_store(keys[i : i + 4096])
        index.complete_store(plan.keys)


def _median_us(fn: Callable[[int], object], reps: int) -> float:
    fn(0)  # warm-up
    times = []
    for r in range(1, reps + 1):
        t0 = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(policy: str, resident: int, reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(resident)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    spare = STORE_BLOCKS * (reps + 1)
    index = BlockIndex(resident + spare, SLOT_BYTES, policy)
    resident_keys = _keys(rng, resident)
    _fill(index, resident_keys)
    per_block = (tracemalloc.get_traced_memory()[0] - before) / resident
    tracemalloc.stop()

    prefix = resident_keys[-LOOKUP_BLOCKS:]
    if index.lookup(prefix) != len(prefix):
        raise RuntimeError("bench store: the resident prefix is not a full hit")
    lookup_us = _median_us(lambda _: index.lookup(prefix), reps)

    fresh = [_keys(rng, STORE_BLOCKS) for _ in range(reps + 1)]

    store_us = _median_us(lambda r: _store(index, fresh[r]), reps)
    pressure = [_keys(rng, STORE_BLOCKS) for _ in range(reps + 1)]
    if index.num_free:  # fill the spare so every further store must evict
        _fill(index, _keys(rng, index.num_free))
    evictions = index.stats.evictions
    evict_us = _median_us(lambda r: _store(index, pressure[r]), reps)
    if index.stats.evictions - evictions != STORE_BLOCKS * (reps + 1):
        raise RuntimeError("bench store: stores under pressure did not evict one block each")
    return {
        "policy": policy,
        "resident": resident,
        "lookup_2048_us": lookup_us,
        "store_512_us": store_us,
        "store_512_evicting_us": evict_us,
        "bytes_per_block": per_block,
    }


def _store(index: BlockIndex, keys: list[bytes]) -> None:
    plan = index.prepare_store(keys)
    index.complete_store(plan.keys)


def run(args: argparse.Namespace) -> int:
    for p in args.policies:
        if p not in POLICIES:
            raise SystemExit(f"--policies: expected names from {sorted(POLICIES)}, got {p!r}")
    configs = [(p, n) for p in args.policies for n in args.resident]
    rows = []
    with progress() as bar:
        task = bar.add_task("store", total=len(configs))
        for policy, resident in configs:
            bar.update(task, description=f"{policy} {resident:,} resident")
            rows.append(measure(policy, resident, args.reps))
            bar.advance(task)
    _print(rows)
    out = args.out or default_out("store", "cpu")
    console.print(
        f"wrote {write_json(out, {'benchmark': 'store', **machine_info(), 'rows': rows})}"
    )
    return 0


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="store control plane (median µs per call; Python bytes per block)")
    cols = ("policy", "resident", "lookup 2048", "store 512", "store 512 evicting", "B/block")
    for c in cols:
        table.add_column(c, justify="left" if c == "policy" else "right")
    for r in rows:
        table.add_row(
            r["policy"],
            f"{r['resident']:,}",
            f"{r['lookup_2048_us']:.0f}",
            f"{r['store_512_us']:.0f}",
            f"{r['store_512_evicting_us']:.0f}",
            f"{r['bytes_per_block']:.0f}",
        )
    console.print(table)

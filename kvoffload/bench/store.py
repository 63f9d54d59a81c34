"""``kvoffload bench store``: what the scheduler pays per step for the store's bookkeeping.

For each eviction policy and each resident count it fills a ``BlockIndex`` with that many readable
blocks (16-byte keys, as engines hash them) and times, as medians over ``--reps`` runs:
- lookup of a 2,048-block prefix that is fully resident (the worst case: every key is checked);
- prepare_store + complete_store of 512 new blocks with free slots;
- the same under pressure, where each of the 512 blocks evicts one resident block;
the Python memory per resident block (tracemalloc over the fill, keys included), and again after
as many evicting stores as there are resident blocks (ARC then also holds ghost keys).
Next to each timing, the same access pattern on a plain ``dict`` of the same size: growth from 10^4
to 10^6 that the dict shows too is the hash table's (cache misses), not the store's.
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
from kvoffload.cli import int_list
from kvoffload.store.index import BlockIndex
from kvoffload.store.policies import POLICIES

LOOKUP_BLOCKS = 2048
STORE_BLOCKS = 512
SLOT_BYTES = 2 << 20  # Llama-3-8B, block size 16, bf16: only used for byte counters


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resident",
        type=int_list,
        default=[10_000, 1_000_000],
        help="resident block counts (comma separated)",
    )
    p.add_argument(
        "--policies",
        type=lambda s: s.split(","),
        default=sorted(POLICIES),
        help="eviction policies (comma separated)",
    )
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
    spare = STORE_BLOCKS * (reps + 1)
    index = BlockIndex(resident + spare, SLOT_BYTES, policy)
    resident_keys = _keys(rng, resident)
    _fill(index, resident_keys)
    prefix = resident_keys[-LOOKUP_BLOCKS:]
    if index.lookup(prefix) != len(prefix):
        raise RuntimeError("bench store: the resident prefix is not a full hit")
    row: dict[str, Any] = {"policy": policy, "resident": resident}
    row["lookup_2048_us"] = _median_us(lambda _: index.lookup(prefix), reps)
    fresh = [_keys(rng, STORE_BLOCKS) for _ in range(reps + 1)]
    row["store_512_us"] = _median_us(lambda r: _store(index, fresh[r]), reps)
    if index.num_free:  # so that every further store must evict
        _fill(index, _keys(rng, index.num_free))
    pressure = [_keys(rng, STORE_BLOCKS) for _ in range(reps + 1)]
    evictions = index.stats.evictions
    row["store_512_evicting_us"] = _median_us(lambda r: _store(index, pressure[r]), reps)
    if index.stats.evictions - evictions != STORE_BLOCKS * (reps + 1):
        raise RuntimeError("bench store: stores under pressure did not evict one block each")
    row.update(_dict_baseline(rng, resident, prefix, fresh, reps))
    row.update(_memory(policy, resident, rng))
    return row


def _dict_baseline(
    rng: np.random.Generator,
    resident: int,
    prefix: list[bytes],
    fresh: list[list[bytes]],
    reps: int,
) -> dict[str, float]:
    """The same accesses on a plain dict of the same size: the hash table's own cost."""
    table = dict.fromkeys(_keys(rng, resident - len(prefix)), 0)
    table.update(dict.fromkeys(prefix, 0))

    def lookup(_: int) -> None:
        for k in prefix:
            if k not in table:
                break

    def insert(r: int) -> None:
        table.update(dict.fromkeys(fresh[r], 0))

    return {
        "dict_lookup_2048_us": _median_us(lookup, reps),
        "dict_insert_512_us": _median_us(insert, reps),
    }


def _memory(policy: str, resident: int, rng: np.random.Generator) -> dict[str, float]:
    """Python bytes per resident block after a fill, and after every block was evicted once."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = BlockIndex(resident, SLOT_BYTES, policy)
        _fill(index, _keys(rng, resident))
        filled = (tracemalloc.get_traced_memory()[0] - before) / resident
        _fill(index, _keys(rng, resident))
        churned = (tracemalloc.get_traced_memory()[0] - before) / resident
    finally:
        tracemalloc.stop()
    return {"bytes_per_block": filled, "bytes_per_block_after_churn": churned}


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
    cols = (
        "policy",
        "resident",
        "lookup 2048 (dict)",
        "store 512 (dict)",
        "store 512 evicting",
        "B/block",
        "B/block churned",
    )
    for c in cols:
        table.add_column(c, justify="left" if c == "policy" else "right")
    for r in rows:
        table.add_row(
            r["policy"],
            f"{r['resident']:,}",
            f"{r['lookup_2048_us']:.0f} ({r['dict_lookup_2048_us']:.0f})",
            f"{r['store_512_us']:.0f} ({r['dict_insert_512_us']:.0f})",
            f"{r['store_512_evicting_us']:.0f}",
            f"{r['bytes_per_block']:.0f}",
            f"{r['bytes_per_block_after_churn']:.0f}",
        )
    console.print(table)
    console.print(
        f"resident: readable blocks in the index; lookup {LOOKUP_BLOCKS}: one lookup of a fully "
        f"resident {LOOKUP_BLOCKS}-block prefix; store {STORE_BLOCKS}: prepare_store + "
        f"complete_store of {STORE_BLOCKS} new blocks into free slots; evicting: the same when "
        "each block evicts a resident one; (dict): the same accesses on a plain dict of that size; "
        "B/block: Python bytes per resident block after the fill; churned: after as many evicting "
        "stores as resident blocks (ARC also keeps ghost keys)"
    )

"""``kvoffload bench store``: what the scheduler pays per step for the store's bookkeeping (CPU).

Two parts, both timed as medians over ``--reps`` runs after a warm-up:

1. The index (``BlockIndex``, native), for each eviction policy and each resident count
   (default 10^4, 10^6, 10^7): filled with that many READABLE blocks (random 16-byte keys, as
   engines hash them), then
   - lookup of a 2,048-block prefix that is fully resident (every key is checked), with the keys
     as a list of bytes and as an (n, 16) uint8 array: per call and per block;
   - prepare_store + complete_store of 512 new blocks with free slots, and under pressure (each
     block evicts one resident block);
   - memory per resident block: the native allocator's own count (``BlockIndex.nbytes``) and the
     growth of the process's resident set over building and filling the index, and again after
     as many evicting stores as there are resident blocks (ARC then also holds ghost keys);
   - the garbage collector: collections and their longest pause (``gc.callbacks``) while the
     timed calls ran, Python objects the collector tracks added by the filled index
     (``gc.get_objects``), and a full ``gc.collect()`` with the index filled.
2. The public API (``bench/store/api.py``): ``Offloader.schedule_*`` + ``TransferWorker.submit``
   + ``Offloader.complete`` per call and per block (``--api-blocks``), over the host backend
   copying 64-byte blocks in the caller's thread (that copy timed apart), and ``lookup``: a
   per-call + per-block fit of each, against issue 27's targets (``met``).
   ``benchmarks/api_fake.py`` runs this part over the native ``staged`` core instead, its copies
   made by the CPU tests' fake CUDA driver.

``make_index`` lets a caller time another index with the same API (``benchmarks/store_compare.py``
times the Python model of ``tests/index_model.py`` in the same run, for the ratio).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.common import console, default_out, machine_info, progress, write_json
from kvoffload.bench.store.api import API_BLOCKS, measure_api
from kvoffload.cli import int_list
from kvoffload.store.index import BlockIndex
from kvoffload.store.policies import POLICIES

LOOKUP_BLOCKS = 2048
STORE_BLOCKS = 512
FILL_BATCH = 1 << 16
SLOT_BYTES = 2 << 20  # Llama-3-8B, block size 16, bf16: only used for byte counters

MakeIndex = Callable[[int, int, str], Any]


def _ints(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resident",
        type=int_list,
        default=[10_000, 1_000_000, 10_000_000],
        help="resident block counts (comma separated)",
    )
    p.add_argument(
        "--policies",
        type=lambda s: s.split(","),
        default=sorted(POLICIES),
        help="eviction policies (comma separated)",
    )
    p.add_argument("--api-blocks", type=_ints, default=list(API_BLOCKS), help="blocks per job")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per operation")
    p.add_argument("--out", type=Path, default=None, help="JSON result path")


def key_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, (n, 16), dtype=np.uint8)


def key_list(rows: np.ndarray) -> list[bytes]:
    """The rows as bytes (numpy's void scalars keep trailing zero bytes, unlike its 'S' type)."""
    out: list[bytes] = np.ascontiguousarray(rows).view("V16").ravel().tolist()
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class GCWatch:
    """Collections (count, longest and total pause) while ``active``, via ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self.active = False
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._t0)

    def summary(self) -> dict[str, float]:
        return {
            "gc_collections": len(self.pauses),
            "gc_max_pause_us": max(self.pauses, default=0.0) * 1e6,
            "gc_total_pause_us": sum(self.pauses) * 1e6,
        }


def _median_us(fn: Callable[[int], object], reps: int, cpu: list[float] | None = None) -> float:
    """Median wall time of ``fn(r)`` over ``reps`` runs (µs); the median CPU time of this
    thread goes to ``cpu`` (on a shared machine it excludes the time others had the core)."""
    fn(0)  # warm-up
    times, cpus = [], []
    for r in range(1, reps + 1):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn(r)
        c1, t1 = time.thread_time(), time.perf_counter()
        times.append(t1 - t0)
        cpus.append(c1 - c0)
    if cpu is not None:
        cpu.append(statistics.median(cpus) * 1e6)
    return statistics.median(times) * 1e6


def fill(index: Any, rows: np.ndarray) -> None:
    """Store ``rows`` (as an array where the index takes one: no bytes object per key)."""
    native = isinstance(index, BlockIndex)
    for i in range(0, len(rows), FILL_BATCH):
        batch = rows[i : i + FILL_BATCH] if native else key_list(rows[i : i + FILL_BATCH])
        plan = index.prepare_store(batch)
        index.complete_store(plan.keys)


def _store(index: Any, keys: list[bytes]) -> None:
    index.complete_store(index.prepare_store(keys).keys)


def measure(
    policy: str, resident: int, reps: int, make_index: MakeIndex = BlockIndex
) -> dict[str, Any]:
    rng = np.random.default_rng(resident)
    spare = STORE_BLOCKS * (reps + 1)
    rows = key_rows(rng, resident)
    prefix_rows = rows[-LOOKUP_BLOCKS:].copy()
    scattered_rows = rows[rng.choice(resident, LOOKUP_BLOCKS, replace=False)]
    gc.collect()
    objects, rss = len(gc.get_objects()), rss_bytes()
    index = make_index(resident + spare, SLOT_BYTES, policy)
    fill(index, rows)
    gc.collect()
    row: dict[str, Any] = {"policy": policy, "resident": resident}
    row["rss_bytes_per_block"] = (rss_bytes() - rss) / resident
    del rows
    if hasattr(index, "nbytes"):  # the native index's own count (its capacity: + spare slots)
        row["native_bytes_per_block"] = index.nbytes() / resident
        row["native_bytes_per_slot"] = index.nbytes() / (resident + spare)
    row["bytes_per_block"] = row.get("native_bytes_per_block", row["rss_bytes_per_block"])
    row["gc_tracked_objects_added"] = len(gc.get_objects()) - objects
    t0 = time.perf_counter()
    gc.collect()
    row["gc_full_collect_ms"] = (time.perf_counter() - t0) * 1e3
    prefix, scattered = key_list(prefix_rows), key_list(scattered_rows)
    if index.lookup(prefix) != len(prefix) or index.lookup(scattered) != len(scattered):
        raise RuntimeError("bench store: the resident prefix is not a full hit")
    watch = GCWatch()
    gc.callbacks.append(watch)
    watch.active = True
    cpu: list[float] = []
    try:
        row["lookup_2048_us"] = _median_us(lambda _: index.lookup(prefix), reps, cpu)
        row["lookup_2048_scattered_us"] = _median_us(lambda _: index.lookup(scattered), reps)
        if isinstance(index, BlockIndex):
            row["lookup_2048_array_us"] = _median_us(lambda _: index.lookup(prefix_rows), reps)
        fresh = [key_list(key_rows(rng, STORE_BLOCKS)) for _ in range(reps + 1)]
        row["store_512_us"] = _median_us(lambda r: _store(index, fresh[r]), reps, cpu)
        if index.num_free:  # so that every further store must evict
            fill(index, key_rows(rng, index.num_free))
        pressure = [key_list(key_rows(rng, STORE_BLOCKS)) for _ in range(reps + 1)]
        evictions = index.stats.evictions
        evicting = _median_us(lambda r: _store(index, pressure[r]), reps, cpu)
        row["store_512_evicting_us"] = evicting
        if index.stats.evictions - evictions != STORE_BLOCKS * (reps + 1):
            raise RuntimeError("bench store: stores under pressure did not evict one block each")
    finally:
        watch.active = False
        gc.callbacks.remove(watch)
    row.update(watch.summary())
    row["cpu_us"] = dict(zip(("lookup_2048", "store_512", "store_512_evicting"), cpu, strict=True))
    rss = rss_bytes()
    fill(index, key_rows(rng, resident))  # as many evicting stores as resident blocks
    gc.collect()
    row["rss_bytes_per_block_after_churn"] = (
        row["rss_bytes_per_block"] + (rss_bytes() - rss) / resident
    )
    if hasattr(index, "nbytes"):  # ARC now also remembers ~resident evicted keys (ghosts)
        row["bytes_per_block_after_churn"] = index.nbytes() / resident
    row["lookup_us_per_block"] = row["lookup_2048_us"] / LOOKUP_BLOCKS
    row["store_us_per_block"] = row["store_512_us"] / STORE_BLOCKS
    gc.collect()
    return row


def run(args: argparse.Namespace) -> int:
    for p in args.policies:
        if p not in POLICIES:
            raise SystemExit(f"--policies: expected names from {sorted(POLICIES)}, got {p!r}")
    configs = [(p, n) for p in args.policies for n in args.resident]
    rows = []
    with progress() as bar:
        task = bar.add_task("store", total=len(configs) + 1)
        for policy, resident in configs:
            bar.update(task, description=f"{policy} {resident:,} resident")
            rows.append(measure(policy, resident, args.reps))
            bar.advance(task)
        bar.update(task, description="public API")
        api = measure_api(args.api_blocks, args.reps)
        bar.advance(task)
    print_rows(rows, api)
    out = args.out or default_out("store", "cpu")
    data = {"benchmark": "store", **machine_info(), "load_average": os.getloadavg()}
    data.update({"index": "native", "rows": rows, "api": api})
    console.print(f"wrote {write_json(out, data)}")
    return 0


def print_rows(rows: list[dict[str, Any]], api: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="store index (median µs per call; bytes per resident block)")
    cols = ("policy", "resident", "lookup 2048", "µs/block", "store 512", "evicting", "bytes")
    for c in (*cols, "churned", "RSS", "GC pauses"):
        table.add_column(c, justify="left" if c == "policy" else "right")
    for r in rows:
        table.add_row(
            r["policy"],
            f"{r['resident']:,}",
            f"{r['lookup_2048_us']:.1f}",
            f"{r['lookup_us_per_block']:.4f}",
            f"{r['store_512_us']:.1f}",
            f"{r['store_512_evicting_us']:.1f}",
            f"{r['bytes_per_block']:.1f}",
            f"{r.get('bytes_per_block_after_churn', r['rss_bytes_per_block_after_churn']):.1f}",
            f"{r['rss_bytes_per_block']:.1f}",
            f"{r['gc_collections']} (max {r['gc_max_pause_us']:.0f} µs)",
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
    api_table = Table(
        title="public API: schedule + submit + complete, the copy left out (median µs per call)"
    )
    for c in ("keys", "direction", *(str(n) for n in api["blocks"]), "fit", "with copy", "met"):
        api_table.add_column(c, justify="right")
    for name, fit in api["api_fits"].items():
        kind, direction = name.split(":")
        total = api["fits"][name]
        api_table.add_row(
            kind,
            direction,
            *(f"{api['api_us'][name][str(n)]:.1f}" for n in api["blocks"]),
            f"{fit['per_call_us']:.1f} + {fit['per_block_us']:.3f}/block",
            f"{total['per_call_us']:.1f} + {total['per_block_us']:.3f}/block",
            "yes" if fit["met"] else "no",
        )
    for kind, fit in api["lookup_fits"].items():
        api_table.add_row(
            kind,
            "lookup",
            *(f"{api['lookup_us'][kind][str(n)]:.1f}" for n in api["blocks"]),
            f"{fit['per_call_us']:.1f} + {fit['per_block_us']:.4f}/block",
            "",
            "yes" if fit["met"] else "no",
        )
    console.print(api_table)
    wait = api["layer_wait"]
    console.print(
        f"layer wait (host backend, {wait['layers']} layers landed): {wait['per_call_us']:.2f} µs "
        f"per layer (target {api['targets']['layer_wait_us']:g} µs: "
        f"{'met' if wait['met'] else 'not met'})"
    )
    t = api["targets"]
    console.print(
        f"targets (issue 27): schedule + submit + complete <= {t['per_call_us']:g} µs + "
        f"{t['per_block_us']:g} µs per block; lookup <= {t['lookup_per_block_us']:g} µs per "
        "block. The copy (64-byte blocks, in the caller's thread here) is the data plane, which a "
        "real backend runs off the engine's thread."
    )

"""The public API's host cost per transfer (CPU): ``Offloader.schedule_*`` + ``TransferWorker
.submit`` + ``Offloader.complete`` (with ``get_finished``), and ``lookup`` before a load.

The worker runs the host backend copying in the caller's thread (64-byte blocks: real bytes, a
few ns each), so what is timed is the control plane, not a copy or a thread hand-off. Keys come as
a list of bytes with block ids as a list of ints (what engines pass today), and as an (n, 16)
uint8 array with an int64 array of block ids. A least-squares line over the job sizes gives the
cost per call and per block.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvoffload.config import OffloadConfig
from kvoffload.offload import TransferWorker, build_local
from kvoffload.transfer.host import FuturePending, HostBackend
from kvoffload.transfer.layout import KVLayout

API_BLOCKS = (1, 16, 256, 1024)
BLOCK_BYTES = 64
PHASES = ("schedule", "submit", "complete")


class InlineHostBackend(HostBackend):
    """The host backend, its copy run at submit in the caller's thread."""

    def submit_checked(self, specs: Sequence[Any]) -> FuturePending:
        done: Future[None] = Future()
        self.copy(specs)
        done.set_result(None)
        return FuturePending(done)


def _keys(rng: np.random.Generator, n: int, kind: str) -> Any:
    rows = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    return rows if kind == "array" else rows.view("V16").ravel().tolist()


def measure_api(
    blocks: Sequence[int],
    reps: int,
    make_index: Callable[[int, int, str], Any] | None = None,
    kinds: Sequence[str] = ("list", "array"),
) -> dict[str, Any]:
    """The costs above; ``make_index(num_slots, slot_bytes, policy)`` puts another index with
    ``BlockIndex``'s API under the Offloader (the Python model, for the ratio)."""
    biggest = max(blocks)
    kv = np.zeros((2 * biggest, BLOCK_BYTES), np.uint8)
    layout = KVLayout.from_tensors([kv], block_size=16, block_dim=0)
    capacity = 2 * (reps + 1) * sum(blocks) + biggest
    local = build_local(layout, OffloadConfig(host_capacity_blocks=capacity))
    off = local.offloader
    if make_index is not None:
        off.index = make_index(off.num_slots, off.slot_bytes, off.config.eviction_policy)
    local.worker.close()
    worker = local.worker = TransferWorker(InlineHostBackend(layout, local.arena), off)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"blocks": list(blocks), "block_bytes": BLOCK_BYTES, "phases_us": {}}
    out["total_us"], out["total_cpu_us"], out["lookup_us"], out["fits"] = {}, {}, {}, {}
    try:
        for kind in kinds:
            for n in blocks:
                ids: Any = np.arange(n, dtype=np.int64) if kind == "array" else list(range(n))
                stored = [_keys(rng, n, kind) for _ in range(reps + 1)]
                store = [_one(off, worker, "store", k, ids, r) for r, k in enumerate(stored)]
                load = [_one(off, worker, "load", k, ids, r) for r, k in enumerate(stored)]
                for direction, runs in (("store", store), ("load", load)):
                    name = f"{kind}:{direction}"
                    phases = {p: statistics.median(t[p] for t in runs[1:]) for p in PHASES}
                    out["phases_us"].setdefault(name, {})[str(n)] = phases
                    total = statistics.median(sum(t[p] for p in PHASES) for t in runs[1:])
                    out["total_us"].setdefault(name, {})[str(n)] = total
                    cpu = statistics.median(t["cpu"] for t in runs[1:])
                    out["total_cpu_us"].setdefault(name, {})[str(n)] = cpu
                lookups = [_lookup_us(off, k) for k in stored]
                out["lookup_us"].setdefault(kind, {})[str(n)] = statistics.median(lookups[1:])
        for name, by_n in out["total_us"].items():
            slope, intercept = np.polyfit(blocks, [by_n[str(n)] for n in blocks], 1)
            cpu = out["total_cpu_us"][name]
            cpu_slope, cpu_intercept = np.polyfit(blocks, [cpu[str(n)] for n in blocks], 1)
            out["fits"][name] = {
                "per_call_us": float(intercept),
                "per_block_us": float(slope),
                "cpu_per_call_us": float(cpu_intercept),
                "cpu_per_block_us": float(cpu_slope),
            }
    finally:
        local.close()
    return out


def _lookup_us(off: Any, keys: Any) -> float:
    t0 = time.perf_counter()
    off.lookup(keys)
    return (time.perf_counter() - t0) * 1e6


def _one(off: Any, worker: Any, direction: str, keys: Any, ids: Any, r: int) -> dict[str, float]:
    """One transfer through the public API, each phase timed (µs)."""
    req = f"{direction}{r}"
    c0 = time.thread_time()
    t0 = time.perf_counter()
    if direction == "store":
        job = off.schedule_store(req, keys, ids)
    else:
        job = off.schedule_load(req, keys, ids)
    t1 = time.perf_counter()
    worker.submit(job)
    t2 = time.perf_counter()
    done = off.complete(worker.get_finished())
    t3 = time.perf_counter()
    cpu = (time.thread_time() - c0) * 1e6
    if len(done) != 1 or not off.is_settled(req):
        raise RuntimeError(f"bench store: {direction} job {job.job_id} did not settle")
    phases = {"schedule": t1 - t0, "submit": t2 - t1, "complete": t3 - t2}
    return {**{p: t * 1e6 for p, t in phases.items()}, "cpu": cpu}

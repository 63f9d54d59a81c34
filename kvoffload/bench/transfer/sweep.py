# mypy: disable-error-code="no-untyped-call"
"""One point of the GPU sweep: a method's store and load of ``n`` blocks, and store+load at once.

Every transfer's bytes are checked: the stored slots against ``SyntheticKV.slot_images`` (the host
backend's layout rule, built by torch), the loaded blocks against their sources. A mismatch raises
``RuntimeError``; the sweep records it as a failure of that method, never as a row.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from kvoffload.bench.transfer.cases import LATENCY_BLOCKS
from kvoffload.bench.transfer.kv import SyntheticKV
from kvoffload.store.arena import HostArena
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.timing import Sleeper, spread, submitter, time_transfers


def measure_method(
    sleeper: Sleeper,
    kv: SyntheticKV,
    arena: HostArena,
    method: str,
    backend: Any,
    n: int,
    reps: int,
    rng: np.random.Generator,
    latency_reps: int = 30,
) -> dict[str, Any]:
    """Store then load ``n`` random blocks to random slots, timed end to end and copies alone
    (``time_transfers``); transfers of up to ``LATENCY_BLOCKS`` blocks are repeated
    ``latency_reps`` times for p50/p99. Returns the row; RuntimeError if a byte is wrong."""
    group = kv.kv.groups[0]
    perm = rng.permutation(kv.pool)
    src, dst = perm[:n], perm[n : 2 * n]
    slots = rng.permutation(arena.num_slots)[:n]
    store = [TransferSpec.of("store", src, slots)]
    load = [TransferSpec.of("load", dst, slots)]
    times = {}
    for direction, spec in (("store", store), ("load", load)):
        for lead in (False, True):
            times[direction, lead] = time_transfers(
                sleeper,
                submitter(backend, spec),
                latency_reps if n <= LATENCY_BLOCKS and not lead else reps,
                lead=lead,
            )
        if direction == "store":
            stored = torch.from_numpy(arena.slots[slots, : group.slot_bytes]).cuda()
            if not torch.equal(stored, kv.slot_images(src)):
                raise RuntimeError(f"{method}: stored slots differ from the oracle ({n} blocks)")
    if not kv.same_blocks(src, dst):
        raise RuntimeError(f"{method}: round trip corrupted bytes ({n} blocks)")
    nbytes = n * group.slot_bytes
    return transfer_row(method, n, group.regions[0].page_bytes, len(group.regions), nbytes, times)


def transfer_row(
    method: str,
    n: int,
    piece_bytes: int,
    regions: int,
    nbytes: int,
    times: dict[tuple[str, bool], dict[str, Any]],
) -> dict[str, Any]:
    """One row of the sweep from ``time_transfers`` results per (direction, lead)."""
    row: dict[str, Any] = {
        "method": method,
        "blocks": n,
        "piece_bytes": piece_bytes,
        "pieces": n * regions,
        "slot_bytes": nbytes // n,
    }
    for direction in ("store", "load"):
        e2e, gpu = times[direction, False], times[direction, True]
        # GBps: end to end, from submit on an idle GPU to the copy's completion event.
        row[f"{direction}_GBps"] = nbytes / statistics.median(e2e["gpu_s"]) / 1e9
        row[f"{direction}_GBps_spread"] = spread([nbytes / x / 1e9 for x in e2e["gpu_s"]])
        row[f"{direction}_p50_us"] = float(np.percentile(e2e["gpu_s"], 50)) * 1e6
        row[f"{direction}_p99_us"] = float(np.percentile(e2e["gpu_s"], 99)) * 1e6
        # gpu_GBps: the copies alone, the host's enqueue hidden behind a GPU sleep.
        row[f"{direction}_gpu_GBps"] = nbytes / statistics.median(gpu["gpu_s"]) / 1e9
        row[f"{direction}_submit_us"] = statistics.median(e2e["submit_s"] + gpu["submit_s"]) * 1e6
        row[f"{direction}_wake_us"] = statistics.median(e2e["wake_s"]) * 1e6
        row[f"{direction}_enqueue_us"] = (
            statistics.median(e2e["enqueue_s"] + gpu["enqueue_s"]) * 1e6
        )
    return row


def measure_both(
    sleeper: Sleeper,
    kv: SyntheticKV,
    arena: HostArena,
    backend: Any,
    n: int,
    reps: int,
    rng: np.random.Generator,
) -> float:
    """GB/s (both directions summed) of a store and a load of ``n`` blocks each, at once;
    RuntimeError if the stored slots or the loaded blocks differ from the oracle."""
    perm = rng.permutation(kv.pool)
    slots = rng.permutation(arena.num_slots)
    store = [TransferSpec.of("store", perm[:n], slots[:n])]
    load = [TransferSpec.of("load", perm[n : 2 * n], slots[n : 2 * n])]
    t = time_transfers(sleeper, submitter(backend, store, load), reps)
    slot_bytes = kv.kv.groups[0].slot_bytes
    for blocks, where in ((perm[:n], slots[:n]), (perm[n : 2 * n], slots[n : 2 * n])):
        host = torch.from_numpy(arena.slots[where, :slot_bytes]).cuda()
        if not torch.equal(host, kv.slot_images(blocks)):
            raise RuntimeError(f"store+load at once: blocks and slots differ ({n} blocks)")
    return float(2 * n * kv.kv.slot_bytes / statistics.median(t["gpu_s"]) / 1e9)

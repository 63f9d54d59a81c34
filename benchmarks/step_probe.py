"""Where the host time of one ``TransferWorker.step`` goes, on a GPU (issue 25: calls per restore).

``bench e2e --driver-times`` splits a restored request's ``worker.step`` into the CUDA driver's
share and the rest (0.24-0.49 ms of 0.60-0.88 ms per request, Llama-3-8B, H200, 2026-11-27); this
splits the rest. A 256-block Llama-3-8B load (K/V split, as ``bench e2e``'s cache) and a store of
as many new blocks go through the public API as an engine's step hands them over (``auto``
backend, each job waited for before the next), ``REPS`` times, the layers of the call path timed
by ``perf_counter`` wrappers (each adds ~0.2 us): the worker's claim of the job, the planner's
choice, the ``staged`` facade, the native core's submit (its driver calls apart, through the
driver-times table), and ``get_finished``. Also an empty step (a poll) and ``complete``. Medians
in us; the wrapped total is printed beside the same path unwrapped.

    KVOFFLOAD_DRIVER_TIMES=1 python -m benchmarks.step_probe OUT.json   # CUDA only
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks import probe_util
from kvoffload.offload.offloader import Offloader
from kvoffload.offload.worker import TransferWorker
from kvoffload.transfer.cuda import extension
from kvoffload.transfer.cuda.staged import NativeStagedBackend
from kvoffload.transfer.planner import PlannedBackend

REPS = 40
BLOCKS = 256
SPENT: dict[str, float] = defaultdict(float)


def _wrap(cls: Any, name: str, label: str) -> Callable[[], None]:
    """Time ``cls.name`` into ``SPENT[label]``; returns the undo."""
    fn = getattr(cls, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - t0

    setattr(cls, name, timed)
    return lambda: setattr(cls, name, fn)


class _TimedCore:
    """The native core with its ``submit`` timed, the driver's share apart."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def submit(self, *args: Any) -> Any:
        extension.driver_times(reset=True)
        t0 = time.perf_counter()
        try:
            return self.core.submit(*args)
        finally:
            SPENT["core.submit"] += time.perf_counter() - t0
            driver = extension.driver_times(reset=True).values()
            SPENT["core.submit: driver"] += sum(us for _, us in driver) / 1e6
            SPENT["core.submit: driver calls"] += sum(c for c, _ in driver)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)


def one(local: Any, direction: str, keys: np.ndarray, blocks: np.ndarray) -> dict[str, float]:
    off, worker = local.offloader, local.worker
    SPENT.clear()
    t0 = time.perf_counter()
    if direction == "load":
        job = off.schedule_load("r", keys, blocks)
    else:
        job = off.schedule_store("r", keys, blocks)
    t1 = time.perf_counter()
    worker.step([job])
    t2 = time.perf_counter()
    worker.wait([job.job_id], 60)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    results = worker.step([])  # the poll that finds it
    t4 = time.perf_counter()
    off.complete(results)
    t5 = time.perf_counter()
    if not all(r.ok for r in results) or len(results) != 1:
        raise RuntimeError(f"{direction} failed: {results}")
    out = {k: v * 1e6 for k, v in SPENT.items() if not k.endswith("calls")}
    out["core.submit: driver calls"] = SPENT.get("core.submit: driver calls", 0.0)
    out.update(schedule=(t1 - t0) * 1e6, step=(t2 - t1) * 1e6, poll=(t4 - t3) * 1e6)
    out["complete"] = (t5 - t4) * 1e6
    return out


def run(local: Any, keys: np.ndarray, n: int, wrapped: bool) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(3 if wrapped else 2)  # fresh keys each run: stores of new keys
    rows: dict[str, list[dict[str, float]]] = {"load": [], "store": []}
    for rep in range(REPS + 2):
        load = one(local, "load", keys, np.arange(n, 2 * n))
        fresh = rng.integers(0, 256, (n, 16), dtype=np.uint8)
        store = one(local, "store", fresh, np.arange(2 * n, 3 * n))
        if rep >= 2:
            rows["load"].append(load)
            rows["store"].append(store)
    return {
        d: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in rs[0]}
        for d, rs in rows.items()
    } | {"wrapped": {"on": float(wrapped)}}


def main() -> int:
    if not torch.cuda.is_available():
        print("step_probe: CUDA only")
        return 0
    out_path = sys.argv[1] if len(sys.argv) > 1 else "step_probe.json"
    n = BLOCKS
    tensors, _dim, kv = probe_util.engine("llama3-8b", "kv_split", 3 * n)
    local = probe_util.offload(kv, (REPS + 4) * n + n, "auto")
    keys = np.random.default_rng(1).integers(0, 256, (n, 16), dtype=np.uint8)
    probe_util.store(local, "first", keys, np.arange(n))
    plain = run(local, keys, n, False)
    undo = [
        _wrap(TransferWorker, "_take", "worker._take"),
        _wrap(TransferWorker, "_start", "worker._start"),
        _wrap(TransferWorker, "get_finished", "worker.get_finished"),
        _wrap(PlannedBackend, "submit_checked", "planner.submit_checked"),
        _wrap(PlannedBackend, "choose", "planner.choose"),
        _wrap(NativeStagedBackend, "submit", "staged.submit"),
        _wrap(Offloader, "complete", "offloader.complete"),
    ]
    planned: Any = local.worker.backend
    staged = [b for b in planned.backends.values() if hasattr(b, "_core")]
    for b in staged:
        b._core = _TimedCore(b._core)
    wrapped = run(local, keys, n, True)
    for u in undo:
        u()
    for b in staged:
        b._core = b._core.core
    for d in ("load", "store"):
        print(
            f"== {d}, {n} blocks: unwrapped step {plain[d]['step']:.1f} us, schedule "
            f"{plain[d]['schedule']:.1f}, poll {plain[d]['poll']:.1f}, complete "
            f"{plain[d]['complete']:.1f}"
        )
        for k, v in sorted(wrapped[d].items()):
            print(f"   {k:32} {v:9.1f}")
    probe_util.dump(
        out_path,
        "step_probe",
        blocks=n,
        reps=REPS,
        unwrapped=plain,
        wrapped=wrapped,
        driver_timed=extension.driver_timed(),
    )
    del tensors
    local.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

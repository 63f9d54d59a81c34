"""What a native call that releases the GIL costs the engine's thread beside another Python thread.

Every ``Py_BEGIN_ALLOW_THREADS`` hands the GIL to any other Python thread waiting for it, and the
caller then waits to take it back (up to the switch interval, 5 ms by default, where that thread
computes). An engine's process has such threads (an API server's, a progress bar's refresh). This
probe times, on the CPU with the tests' fake CUDA driver (the native core's own C code), per call:

- ``wait_on``: a layer's wait on a load that has landed (the common eager case: nothing to
  enqueue), each of a Llama-3-8B load's 32 layers in turn;
- ``error``: a job's ``error()`` (its fields read under the core's lock);

alone, and beside a thread in a busy Python loop (the worst case of a thread wanting the GIL).
Medians of ``REPS`` rounds of 32 calls. Run from the source tree:

    python -m benchmarks.gil_probe OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvoffload.bench.common import machine_info
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import faked
from tests.test_native_engine import engine_on

REPS = {"alone": 2000, "beside": 100}


def per_call_us(fn: Any, calls: int, reps: int) -> dict[str, float]:
    rounds = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        rounds.append((time.perf_counter_ns() - t0) / calls / 1000)
    return {"median_us": statistics.median(rounds), "max_us": max(rounds)}


def spin(stop: threading.Event) -> None:
    """A busy Python loop until ``stop``: a thread that always wants the GIL."""
    while not stop.is_set():
        pass


def measure(job: Any, layers: int) -> list[dict[str, Any]]:
    calls = {
        "wait_on": lambda i: job.wait_on(124, i, 5.0, None),
        "error": lambda i: job.error(),
    }
    rows = []
    for beside in ("alone", "beside"):
        stop = threading.Event()
        busy = threading.Thread(target=spin, args=(stop,))
        if beside == "beside":
            busy.start()
        try:
            for name, fn in calls.items():
                got = per_call_us(fn, layers, REPS[beside])
                rows.append({"call": name, "beside": beside, **got})
                print(f"{name:8} {beside:7} {got['median_us']:9.2f} us a call (median)")
        finally:
            stop.set()
            if busy.is_alive():
                busy.join()
    return rows


def run_on_landed_load(probe: str, measure_fn: Callable[[Any, int], dict[str, Any]]) -> int:
    """A probe's main: on the fake driver, a Llama-3-8B load that has landed (after a store of the
    same slots); ``measure_fn(pending, layers)`` gives the fields written to OUT.json (argv[1])
    beside the probe's name and the machine's."""
    if len(sys.argv) != 2:
        raise SystemExit(f"{probe}.py: expected one argument, OUT.json, got {sys.argv[1:]}")
    with (
        pytest.MonkeyPatch.context() as mp,
        faked(mp),
        engine_on("llama3-8b", "kv_split") as (pair, backend),
    ):
        store = TransferSpec.of("store", np.arange(8), np.arange(8))
        assert backend.submit([store]).wait(10)
        pending = backend.submit([TransferSpec.of("load", np.arange(8, 16), np.arange(8))])
        if not pending.wait(10) or pending.error() is not None:
            raise RuntimeError("the fake driver's load did not finish")
        fields = measure_fn(pending, pair.kv.groups[0].num_layers)
        del pending  # its job goes before the fake driver does
    with open(sys.argv[1], "w") as f:
        json.dump({"benchmark": probe, **machine_info(), **fields}, f, indent=1)
    return 0


def main() -> int:
    return run_on_landed_load(
        "gil_probe", lambda pending, layers: {"rows": measure(pending.jobs[0], layers)}
    )


if __name__ == "__main__":
    raise SystemExit(main())

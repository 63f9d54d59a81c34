"""What a landed layer wait costs when the engine's work has run between two calls (cold caches).

In ``bench e2e`` the per-layer wait read 2.4-4.1 us a call (own time, H200, 2026-11-28), while a
loop of the same native call on a landed load reads 0.22 us (``benchmarks/gil_probe.py``). Between
two layers an engine runs a layer's launches: the CPU's caches then hold the engine's data and the
driver's, not ours. This probe times one call at a time, on the CPU with the tests' fake CUDA
driver (the native core's own C code), a Llama-3-8B load (32 layers) that has landed:

- ``native``: the job's ``wait_on`` for one layer (no driver call: the slice has landed);
- ``waiter``: a ``layer_waiter``'s call per layer, as ``bench e2e`` makes them (one wait per
  layer slice, the other layers answered at once), a new waiter per round: one C call
  (``module_waiter.c``, since 2026-11-28);
- ``closure``: the same as the Python closure around ``wait_on`` it replaced (the A/B);
- ``empty``: a Python call that does nothing (what the timing itself costs).

each back to back (``hot``) and with ``MiB`` of memory swept between two calls (``cold``: the
sweep stands in for the engine's work between layers; 1 MiB stays in a core's L2, 8 MiB does not,
and a last-level cache of 300 MiB, as on the H200 hosts, holds all but 512). Medians and p90 of
every call, over 200 rounds back to back and fewer for the larger sweeps (``rounds_of``). Run
from the source tree:

    python -m benchmarks.wait_cold_probe OUT.json
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.gil_probe import run_on_landed_load
from benchmarks.percall_probe import after_sweep, sweeper
from kvoffload.transfer.backend import check_layer

SWEEP_MIB = (0, 1, 8, 64, 512)  # memory swept between two calls; 0: back to back
SWEPT_MIB = 2048  # per round at most (32 sweeps): fewer rounds for the larger sweeps


def rounds_of(mib: int) -> int:
    return max(8, min(200, SWEPT_MIB // max(1, mib)))


def timed_calls(
    make: Callable[[], Callable[[int], Any]], layers: int, sweep: np.ndarray | None
) -> list[float]:
    """Microseconds of every call of ``make()``'s function on layers 0..layers-1, round after
    round, with ``sweep`` read between two calls."""
    got = []
    for _ in range(rounds_of(0 if sweep is None else sweep.nbytes >> 20)):
        fn = make()
        got += [after_sweep(sweep, fn, layer)[0] for layer in range(layers)]
    return got


def measure(pending: Any, layers: int) -> list[dict[str, Any]]:
    job = pending.jobs[0]

    def native() -> Callable[[int], Any]:
        return lambda layer: job.wait_on(124, layer, 5.0, None)

    def waiter() -> Callable[[int], Any]:
        made: Callable[[int], Any] = pending.layer_waiter(124, layers)  # the fake's stream
        return made

    def closure() -> Callable[[int], Any]:  # staged.py's waiter before 2026-11-28
        wait_on, owner, waited = job.wait_on, job.layer_slice, [-1]

        def wait(layer: int) -> None:
            if type(layer) is not int or not 0 <= layer < layers:
                check_layer(layer, layers)
            k = owner[layer] if type(layer) is int and 0 <= layer < len(owner) else -1
            if k >= 0 and k == waited[0]:
                return
            if not wait_on(124, layer, 5.0, None):
                raise RuntimeError(job.error())
            waited[0] = k

        return wait

    def empty() -> Callable[[int], Any]:
        return lambda layer: None

    rows = []
    for mib in SWEEP_MIB:
        sweep = sweeper(mib)
        arms = (("native", native), ("waiter", waiter), ("closure", closure), ("empty", empty))
        for name, make in arms:
            calls = timed_calls(make, layers, sweep)
            row = {
                "call": name,
                "sweep_mib": mib,
                "median_us": statistics.median(calls),
                "p90_us": float(np.percentile(calls, 90)),
                "calls": len(calls),
            }
            rows.append(row)
            print(
                f"{name:7} {'hot' if mib == 0 else f'cold {mib} MiB':12} "
                f"median {row['median_us']:6.2f} us  p90 {row['p90_us']:6.2f} us"
            )
    return rows


def main() -> int:
    def fields(pending: Any, layers: int) -> dict[str, Any]:
        rows = measure(pending, layers)
        return {"slices": len(set(pending.jobs[0].layer_slice)), "rows": rows}

    return run_on_landed_load("wait_cold_probe", fields)


if __name__ == "__main__":
    raise SystemExit(main())

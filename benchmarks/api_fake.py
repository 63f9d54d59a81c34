"""``kvoffload bench store``'s public-API part over the native ``staged`` backend, its copies run by
the CPU tests' fake CUDA driver (``tests/fake_cuda.py``: real bytes, Python callbacks): the host
time of ``schedule_*`` + ``TransferWorker.submit`` (the staged facade and the core's native submit)
+ ``complete``, per call and per block, on a machine without a GPU.

Each job is enqueued in the caller's thread (the default ``native_inline_bytes``, as on a GPU) and
waited for there (``FakeTimed``): the fake driver's own Python is the data plane (on a GPU, the
driver's enqueue) and is timed apart (``copy``) with that wait, as the host backend's inline copy
is. What is left in ``submit`` is ours: the worker, the staged facade, the core's native submit and
its pipeline's enqueue logic.

    PYTHONPATH=. python -m benchmarks.api_fake --out OUT.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.common import console, machine_info, write_json
from kvoffload.bench.store.api import API_BLOCKS, MakeBackend, measure_api
from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend
from kvoffload.transfer.layout import KVLayout
from tests.fake_cuda import Calls, cuda_layout, faked, no_pin


class _Timed:
    """A core whose ``submit`` is timed (``seconds``)."""

    def __init__(self, core: Any) -> None:
        self.core, self.seconds = core, 0.0

    def submit(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.core.submit(*args)
        finally:
            self.seconds = time.perf_counter() - t0


def staged_fake(calls: Calls) -> MakeBackend:
    """The ``staged`` backend (``FakeTimed``) over a "pinned" arena of the given arena's shape
    (the fake pins nothing) for the layout as if on the GPU; the arena is closed with it."""
    from kvoffload.transfer.cuda.staged import NativeStagedBackend
    from kvoffload.transfer.cuda.staged_config import StagedConfig

    class FakeTimed(NativeStagedBackend):
        """Each submit enqueued in the caller's thread (the default ``native_inline_bytes``) and
        waited for there: ``copy_seconds`` is the fake driver's own time (the data plane; on a
        GPU, the driver's enqueue) plus the wait for the completion thread to see the job done,
        which ``kvoffload.bench.store.api`` leaves out of ``submit``."""

        copy_seconds = 0.0
        native_seconds = 0.0  # of submit: the core's (the fake's Python left out)

        def submit_checked(self, specs: Any, **kw: Any) -> Any:
            before = calls.seconds
            core, self._core = self._core, _Timed(self._core)
            try:
                pending = super().submit_checked(specs, **kw)
            finally:
                self._core, took = core, self._core.seconds
            self.native_seconds = took - (calls.seconds - before)
            t0 = time.perf_counter()
            while not pending.done():  # no sleep, no syscall: see ``api._spin``
                if time.perf_counter() - t0 > 60.0:
                    raise RuntimeError("bench store: a staged job did not finish in 60 s")
            self.copy_seconds = calls.seconds - before + time.perf_counter() - t0
            return pending

    def make(layout: KVLayout, arena: HostArena) -> CopyBackend:
        pinned = HostArena(arena.num_slots, arena.slot_bytes, pin=no_pin)
        config = StagedConfig(staging_bytes=64 * layout.slot_bytes)
        backend = FakeTimed(cuda_layout(layout), pinned, config=config)
        close = backend.close

        def close_both() -> None:
            close()
            pinned.close()

        backend.close = close_both  # type: ignore[method-assign]
        return backend

    return make


def run(blocks: list[int], reps: int) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as mp, faked(mp) as calls:
        api = measure_api(blocks, reps, make_backend=staged_fake(calls))
        if calls.errors:
            raise RuntimeError(f"the fake driver's callbacks raised: {calls.errors}")
    return api


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=API_BLOCKS)
    args = p.parse_args()
    api = run(list(args.blocks), args.reps)
    for name, fit in api["api_fits"].items():
        us = "  ".join(f"{api['api_us'][name][str(n)]:7.1f}" for n in api["blocks"])
        console.print(
            f"{name:12} {us}   fit {fit['per_call_us']:.1f} + {fit['per_block_us']:.3f}/block "
            f"met {fit['met']}"
        )
    for name, fits in api["phase_fits"].items():
        parts = (f"{ph} {f['per_call_us']:.1f}+{f['per_block_us']:.3f}" for ph, f in fits.items())
        console.print(f"{name:12} " + "  ".join(parts))
    if args.out is not None:
        data = {"benchmark": "store", "backend": "staged-fake", **machine_info()}
        data.update({"load_average": os.getloadavg(), "api": api})
        console.print(f"wrote {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

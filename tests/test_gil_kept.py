"""The native core's quick calls keep the GIL: a layer wait that has nothing to enqueue (its
slice landed) and a job's ``error()`` (and its other fields) return without releasing it. Each
release hands the GIL to any other Python thread that wants it, and the engine's thread then
waits to get it back: on the development VM, beside a thread in a busy loop, a landed wait took
480 us a call when it released the GIL, 0.22 us when it kept it (``benchmarks/gil_probe.py``).

How it is seen without timing: with a long switch interval a thread keeps the GIL until it
releases it, so a busy thread beside it counts only while the GIL was released."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda  # noqa: F401 (the fixture)
from tests.test_native_engine import engine_on, needs_core


class Busy:
    """A thread that counts while it holds the GIL, waiting for it otherwise."""

    def __init__(self) -> None:
        self.count = 0
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop:
            self.count += 1

    def released(self, fn: Callable[[], Any]) -> bool:
        """Whether ``fn()`` let the busy thread run (it released the GIL)."""
        before = self.count
        fn()
        return self.count != before


@contextlib.contextmanager
def busy_beside() -> Iterator[Busy]:
    """A ``Busy`` thread for the duration (started last: while it runs, every release of the
    GIL in this thread costs up to the switch interval)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)  # no forced switch while a call under test runs (~us)
    b = Busy()
    b.thread.start()
    try:
        while b.count == 0:  # the thread runs: it now waits for the GIL whenever we hold it
            threading.Event().wait(0.001)
        yield b
    finally:
        b.stop = True
        b.thread.join()
        sys.setswitchinterval(interval)


@needs_core
def test_a_landed_wait_and_a_jobs_fields_keep_the_gil(fake_cuda: Calls) -> None:  # noqa: F811
    with engine_on("llama3-8b", "kv_split") as (pair, backend):
        layers = pair.kv.groups[0].num_layers
        assert backend.submit([TransferSpec.of("store", np.arange(4), np.arange(4))]).wait(10)
        pending = backend.submit([TransferSpec.of("load", np.arange(8, 12), np.arange(4))])
        assert pending.wait(10) and pending.error() is None
        (job,) = pending.jobs

        def waits() -> None:
            for layer in range(layers):
                assert job.wait_on(124, layer, 5.0, None)

        with busy_beside() as busy:
            assert not busy.released(waits)  # landed: nothing enqueued, the GIL kept
            assert not busy.released(lambda: (job.error(), job.direction, job.slices, job.id))
            assert busy.released(lambda: threading.Event().wait(0.001))  # the check works


@needs_core
def test_the_gil_probe_writes_its_rows(tmp_path: Any) -> None:
    """``benchmarks/gil_probe.py`` runs on the CPU (the fake driver) and writes each call's
    medians alone and beside a busy thread; without an output path it says what it expected."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "gil_probe.py").exists():
        pytest.skip("runs the source tree's benchmarks/ (the wheel job copies only tests)")
    run = [sys.executable, "-m", "benchmarks.gil_probe"]
    refused = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=root)
    assert refused.returncode != 0 and "expected one argument, OUT.json, got []" in refused.stderr
    out = tmp_path / "gil.json"
    done = subprocess.run([*run, str(out)], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["call"], r["beside"]) for r in rows} == {
        (c, b) for c in ("wait_on", "error") for b in ("alone", "beside")
    }
    assert all(0 < r["median_us"] <= r["max_us"] for r in rows)

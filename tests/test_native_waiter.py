"""The native layer waiter (``Job.layer_waiter``, native/module_waiter.c) on the fake driver.

The staged backend's ``layer_waiter`` for one load job is one C call per layer. These tests pin
what the Python closure it replaced did: a bad layer refused with the same message and nothing
enqueued, an int subclass taken, a failed load raised as the job's error, one flag wait per
layer slice (test_native_engine.py), and the waiter keeping its job alive.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

from kvoffload.transfer.backend import check_layer
from kvoffload.transfer.cuda.driver import CudaCopyError
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda, hold_stream
from tests.test_native_engine import engine_on, fake_cuda_launch, needs_core, swap_launch

pytestmark = needs_core
__all__ = ["fake_cuda"]  # the fixture, used by name


class Layer(int):
    """An int subclass: the waiter takes it through the Python check."""


def stored_then_loading(backend: Any, fake_cuda: Calls) -> tuple[Any, Any]:
    """A load in flight (its kernels' stream held) after a store of the same slots."""
    slots = np.arange(8)
    assert backend.submit([TransferSpec.of("store", np.arange(8), slots)]).wait(10)
    release = hold_stream(fake_cuda, backend.spec.gather[1])
    return backend.submit([TransferSpec.of("load", np.arange(8, 16), slots)]), release


def test_bad_layers_are_refused_with_the_python_message_and_nothing_enqueued(
    fake_cuda: Calls,
) -> None:
    with engine_on("llama3-8b", "kv_split") as (_pair, backend):
        pending, release = stored_then_loading(backend, fake_cuda)
        waiter = pending.layer_waiter(125, 32)
        before = fake_cuda.memops
        for bad, said in ((-1, "-1"), (32, "32"), (2**70, str(2**70)), (True, "True")):
            with pytest.raises(ValueError, match=rf"layer in \[0, 32\), got {said}"):
                waiter(bad)
        odd: tuple[tuple[object, str], ...] = ((1.0, "1.0"), ("0", "'0'"), (None, "None"))
        for thing, said in odd:
            with pytest.raises(ValueError, match=rf"layer in \[0, 32\), got {said}"):
                waiter(thing)
        with pytest.raises(TypeError, match="one argument"):
            waiter(0, 1)
        with pytest.raises(TypeError, match="one argument"):
            waiter(layer=0)
        assert fake_cuda.memops == before and not fake_cuda.stream_held(125)
        waiter(Layer(3))  # an int subclass passes the check and waits
        assert fake_cuda.memops == before + 1 and fake_cuda.stream_held(125)
        release()
        assert pending.wait(10) and pending.error() is None


def test_an_unchecked_waiter_takes_any_int_and_refuses_what_is_not_one(fake_cuda: Calls) -> None:
    with engine_on("llama3-8b", "kv_split") as (_pair, backend):
        pending, release = stored_then_loading(backend, fake_cuda)
        release()
        assert pending.wait(10)
        waiter = pending.layer_waiter(125)  # layers None: no bound given
        waiter(0)
        waiter(31)
        with pytest.raises(TypeError):
            waiter("0")


def test_the_waiter_keeps_its_job_and_refuses_a_foreign_timer(fake_cuda: Calls) -> None:
    with engine_on("llama3-8b", "kv_split") as (_pair, backend):
        pending, release = stored_then_loading(backend, fake_cuda)
        job = pending.jobs[0]
        with pytest.raises(ValueError, match="Timer of this job's core"):
            job.layer_waiter(125, 32, 1.0, object(), check_layer, lambda: None)
        with pytest.raises(ValueError, match="callables"):
            job.layer_waiter(125, 32, 1.0, None, None, lambda: None)
        waiter = pending.layer_waiter(125, 32)
        del pending, job
        gc.collect()
        release()
        for layer in range(32):  # the job is alive through its waiter
            waiter(layer)
        assert not fake_cuda.stream_held(125)


def test_a_failed_load_raises_its_error_from_the_waiter(fake_cuda: Calls) -> None:
    """The load's first scatter refused by the fake driver: the job fails, and the waiter raises
    the copy's error (the engine recomputes) instead of leaving a stream waiting."""
    with engine_on("llama3-8b", "kv_split") as (_pair, backend):
        slots = np.arange(8)
        assert backend.submit([TransferSpec.of("store", np.arange(8), slots)]).wait(10)
        launch = fake_cuda_launch(fake_cuda)
        swap_launch(fake_cuda, lambda *args: 700)
        try:
            pending = backend.submit([TransferSpec.of("load", np.arange(8, 16), slots)])
            assert pending.wait(10) and pending.error() is not None
        finally:
            swap_launch(fake_cuda, launch)
        waiter = pending.layer_waiter(125, 32)
        with pytest.raises((CudaCopyError, RuntimeError), match="700"):
            waiter(0)
        assert not fake_cuda.stream_held(125)


def test_the_cold_probe_times_every_arm_and_its_waiter_waits_per_slice(
    fake_cuda: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``benchmarks/wait_cold_probe.py``'s measure, cut to two sweeps of few rounds: a row per arm
    and sweep, every call timed; its closure and the native waiter make the same flag waits."""
    probe = pytest.importorskip("benchmarks.wait_cold_probe", reason="the source tree's benchmarks")
    monkeypatch.setattr(probe, "SWEEP_MIB", (0, 1))
    monkeypatch.setattr(probe, "rounds_of", lambda mib: 2)
    with engine_on("llama3-8b", "kv_split") as (pair, backend):
        pending, release = stored_then_loading(backend, fake_cuda)
        release()
        assert pending.wait(10) and pending.error() is None
        layers = pair.kv.groups[0].num_layers
        rows = probe.measure(pending, layers)
        arms = {"native", "waiter", "closure", "empty"}
        assert {(r["call"], r["sweep_mib"]) for r in rows} == {(a, m) for a in arms for m in (0, 1)}
        assert all(r["calls"] == 2 * layers and 0 < r["median_us"] <= r["p90_us"] for r in rows)

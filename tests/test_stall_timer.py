"""``StallTimer``: per layer, how long a load's consumer stood at that layer's wait.

On the native core (its C code for real, over the fake driver, whose streams hold behind unmet
waits and whose events take the host clock when their stream reaches them) the core records the
timer's events around each wait it enqueues; on the host backend the waiter times the host's
blocking wait; on the Python CUDA backends the waiter records the events itself."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import kvoffload as kvo
from kvoffload.transfer.cuda import extension
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda, hold_stream
from tests.test_cuda_backends_on_cpu import Pair
from tests.test_layer_loads import BS, LAYERS, KVLayoutOf, held_setup, kv_split_tensors, stored_keys
from tests.test_native_engine import engine_on

__all__ = ["fake_cuda"]  # the fixture, used by name

needs_core = pytest.mark.skipif(
    extension.module() is None, reason=f"native core not built: {extension.unavailable()}"
)
HELD_S = 0.05  # how long a test holds the copy's flag writes
RECORD_S = 0.002  # how long a slowed fake event record takes


def held_native_load(calls: Calls, backend: Any, slots: np.ndarray) -> tuple[Any, Any]:
    """Store blocks 0..n-1 into ``slots``, then load them into blocks 8.. with the load's flag
    writes held: (release, the load's pending)."""
    n = len(slots)
    assert backend.submit([TransferSpec.of("store", np.arange(n), slots)]).wait(10)
    release = hold_stream(calls, backend.spec.gather[1])
    return release, backend.submit([TransferSpec.of("load", np.arange(8, 8 + n), slots)])


def records_on(calls: Calls, stream: int) -> int:
    return sum(1 for entry in calls.log if entry[0] == "record" and entry[1] == stream)


@needs_core
def test_the_core_times_each_wait_it_enqueues_and_only_those(fake_cuda: Calls) -> None:
    """A held load: the waiter enqueues one wait per slice, each between the timer's two events
    (recorded in the same native call); the stall reads None until the stream passes the wait,
    then the held time at the first slice's wait, 0 at layers that enqueued none."""
    with engine_on("llama3-8b", "kv_split") as (pair, backend):
        layers = pair.kv.groups[0].num_layers
        slots = np.arange(8)
        release, pending = held_native_load(fake_cuda, backend, slots)
        owner = list(pending.layer_slice)
        firsts = {owner.index(k) for k in set(owner)}
        timer = kvo.StallTimer(layers)
        waiter = pending.layer_waiter(124, layers, timer)
        fake_cuda.on_record = lambda stream: time.sleep(RECORD_S) if stream == 124 else None
        t0 = time.perf_counter()
        for layer in range(layers):
            waiter(layer)
        waits_s = time.perf_counter() - t0
        fake_cuda.on_record = None
        assert records_on(fake_cuda, 124) == 2 * len(firsts)  # two events per enqueued wait
        # the timer's own records, inside the waits' calls: what bench e2e keeps apart
        own = timer.own_seconds()
        assert 2 * len(firsts) * RECORD_S <= own < waits_s
        held = timer.stalls()
        assert [i for i, s in enumerate(held) if s is None] == sorted(firsts)  # not passed yet
        assert all(s == 0.0 for i, s in enumerate(held) if i not in firsts)
        time.sleep(HELD_S)
        release()
        assert pending.wait(10) and pending.error() is None
        stalls = timer.stalls()
        first = min(firsts)
        held_s = stalls[first]
        assert held_s is not None and held_s >= HELD_S * 0.9
        later = [stalls[i] for i in firsts - {first}]  # released together with the first
        assert all(s is not None and 0.0 <= s < HELD_S * 0.9 for s in later)
        assert all(stalls[i] == 0.0 for i in range(layers) if i not in firsts)
        timer.reset()  # reused: a load that landed enqueues no wait and stood 0
        assert timer.own_seconds() == 0.0
        before = records_on(fake_cuda, 124)
        reuse = pending.layer_waiter(124, layers, timer)
        for layer in range(layers):
            reuse(layer)
        assert records_on(fake_cuda, 124) == before
        assert timer.stalls() == [0.0] * layers
        assert timer.own_seconds() == 0.0  # no record, no cost
        pair.oracle.copy([TransferSpec.of("store", np.arange(8), slots)])
        pair.oracle.copy([TransferSpec.of("load", np.arange(8, 16), slots)])
        pair.check()  # the timed waits changed no byte


@needs_core
def test_a_timer_of_another_core_is_refused_before_anything_is_enqueued(fake_cuda: Calls) -> None:
    from tests.test_native_engine import staged

    other = Pair("llama3-8b", "kv_split")
    second = staged(other)
    try:
        with engine_on("llama3-8b", "kv_split") as (pair, backend):
            layers = pair.kv.groups[0].num_layers
            release, pending = held_native_load(fake_cuda, backend, np.arange(4))
            foreign = kvo.StallTimer(layers).native(second._core)
            before = fake_cuda.memops
            with pytest.raises(ValueError, match="expected a Timer of this job's core"):
                pending.jobs[0].wait_on(124, 0, 5.0, foreign)
            with pytest.raises(ValueError, match="expected a Timer of this job's core"):
                pending.jobs[0].wait_on(124, 0, 5.0, object())
            assert fake_cuda.memops == before and not fake_cuda.stream_held(124)
            release()
            assert pending.wait(10)
    finally:
        second.close()
        other.close()


def test_the_host_backend_times_its_blocking_waits() -> None:
    _, local, held, worker = held_setup()
    off = local.offloader
    try:
        load = off.schedule_load("b", stored_keys(), [5, 4, 3])
        worker.submit(load)
        assert held.reached.wait(30)  # layer 0 copied, layer 1 held back
        timer = kvo.StallTimer(LAYERS)
        waiter = worker.layer_waiter(load.job_id, timer=timer)
        waiter(0)  # arrived: stood 0
        threading.Timer(HELD_S, held.release.set).start()
        for layer in range(1, LAYERS):
            waiter(layer)
        stalls = timer.stalls()
        assert stalls[0] == 0.0
        assert stalls[1] is not None and stalls[1] >= HELD_S * 0.9  # the held layer
        assert sum(s or 0.0 for s in stalls) < stalls[1] + HELD_S  # the rest was quick
        assert timer.own_seconds() == 0.0  # the host's clock, no event recorded
        timer.reset()
        assert timer.stalls() == [0.0] * LAYERS
        assert not worker.wait([load.job_id], 30)
        off.complete(worker.get_finished())
    finally:
        held.release.set()
        worker.close()
        local.close()


def test_a_timer_is_checked_before_the_waiter_is_made() -> None:
    tensors = kv_split_tensors()
    local = kvo.build_local(KVLayoutOf(tensors, 1), kvo.OffloadConfig(host_capacity_blocks=8))
    off, worker = local.offloader, local.worker
    try:
        keys = kvo.prefix_block_keys(np.arange(2 * BS), BS)
        store = off.schedule_store("a", keys, [0, 1])
        assert store is not None
        worker.submit(store)
        with pytest.raises(ValueError, match="expected timer a StallTimer or None, got list"):
            worker.layer_waiter(store.job_id, timer=[0.0] * LAYERS)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"expected a StallTimer of >= {LAYERS} layers"):
            worker.layer_waiter(store.job_id, timer=kvo.StallTimer(LAYERS - 1))
        for bad in (0, -1, True, 2.0, "4"):
            with pytest.raises(ValueError, match="StallTimer: expected layers an int >= 1"):
                kvo.StallTimer(bad)  # type: ignore[arg-type]
        assert not worker.wait([store.job_id], 30)
        off.complete(worker.get_finished())
    finally:
        local.close()


@pytest.mark.parametrize("backend", ["dma", "sm"])
def test_the_python_cuda_backends_time_their_waits_with_events(
    fake_cuda: Calls, backend: str
) -> None:
    """Their waits are stream waits on the transfer's event (enqueued, never blocking): the
    waiter records the timer's events around each, reused after ``reset``."""
    from tests.test_cuda_backends_on_cpu import make

    pair = Pair("llama3-8b", "kv_split")
    try:
        b = make(backend, pair.kv, pair.arena)
        layers = pair.kv.groups[0].num_layers
        slots = np.arange(4)
        assert b.submit([TransferSpec.of("store", np.arange(4), slots)]).wait(10)
        pending = b.submit([TransferSpec.of("load", np.arange(8, 12), slots)])
        timer = kvo.StallTimer(layers)
        waiter = pending.layer_waiter(55, layers, timer)
        before = [e for e in fake_cuda.log if e[0] == "record" and e[1] == 55]
        for layer in range(layers):
            waiter(layer)
        recorded = [e for e in fake_cuda.log if e[0] == "record" and e[1] == 55]
        assert len(recorded) - len(before) == 2 * layers
        stalls = timer.stalls()
        assert all(s is not None and s >= 0.0 for s in stalls)
        assert timer.own_seconds() > 0.0  # its records' host time, counted in Python
        events = {e[2] for e in recorded}
        timer.reset()
        assert timer.own_seconds() == 0.0
        waiter(0)
        assert {e[2] for e in fake_cuda.log if e[0] == "record" and e[1] == 55} == events
        b.close()
    finally:
        pair.close()


@needs_core
def test_a_record_the_driver_refuses_leaves_the_layer_untimed_and_the_wait_enqueued(
    fake_cuda: Calls,
) -> None:
    """The timer is a report: where its event cannot be recorded on the engine's stream, the
    wait is still enqueued (the stream still waits for the copy) and the layer reads 0."""
    with engine_on("llama3-8b", "kv_split") as (pair, backend):
        layers = pair.kv.groups[0].num_layers
        release, pending = held_native_load(fake_cuda, backend, np.arange(8))
        timer = kvo.StallTimer(layers)
        waiter = pending.layer_waiter(124, layers, timer)
        fake_cuda.fail_record_on = 124
        try:
            before = fake_cuda.memops
            waiter(0)
            assert fake_cuda.memops == before + 1 and fake_cuda.stream_held(124)
        finally:
            fake_cuda.fail_record_on = None
        assert timer.stalls()[0] == 0.0
        release()
        assert pending.wait(10) and pending.error() is None
        assert not fake_cuda.stream_held(124)
        assert timer.stalls() == [0.0] * layers

"""The native transfer core (``kvoffload/transfer/cuda/native/``) on CPU.

The compiled extension runs for real: its worker and completion threads call the fake driver's
entry points (``tests/fake_cuda.py``: ctypes callbacks that move real bytes), so these tests check
what the C code computes (chunks, staging offsets, descriptors, kernel arguments, slice events) by
the bytes that land, against the host backend, and how it fails.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvoffload.transfer.cuda import extension
from kvoffload.transfer.cuda.driver import CudaCopyError
from kvoffload.transfer.spec import Direction, TransferSpec
from tests.fake_cuda import Calls, fake_cuda, hold_stream
from tests.test_cuda_backends_on_cpu import POOL, Pair

__all__ = ["fake_cuda"]  # the fixture, used by name

needs_core = pytest.mark.skipif(
    extension.module() is None, reason=f"native core not built: {extension.unavailable()}"
)


def staged(pair: Pair, **config: Any) -> Any:
    from kvoffload.transfer.cuda.staged import make_staged
    from kvoffload.transfer.cuda.staged_config import StagedConfig

    fields: dict[str, Any] = {
        "staging_bytes": 4 * pair.kv.slot_bytes,
        "depth": 2,
        "first_chunk_bytes": 1,
        "layer_slice_bytes": 8,
        "max_layer_slices": 4,
        "layer_slice_transfer_bytes": 1,
        "load_coupled": False,  # the split pipeline (its streams held below); coupled: asked
        "store_coupled": False,
    }
    fields.update(config)
    return make_staged(pair.kv, pair.arena, StagedConfig(**fields))


@contextlib.contextmanager
def engine_on(model: str, layout: str, **config: Any) -> Iterator[tuple[Pair, Any]]:
    """A ``Pair`` and the ``staged`` backend over it (``staged``'s test settings), both closed
    after."""
    pair = Pair(model, layout)
    try:
        backend = staged(pair, **config)
        try:
            yield pair, backend
        finally:
            backend.close()
    finally:
        pair.close()


def round_trips(pair: Pair, backend: Any, seed: int, rounds: int = 2) -> None:
    """Stores then loads of several sizes, each checked against the host backend's bytes."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        for count in (9, 1, 5, POOL):
            blocks = rng.choice(POOL, count, replace=False)
            slots = rng.choice(POOL, count, replace=False)
            for specs in (
                [TransferSpec.of("store", blocks, slots)],
                [TransferSpec.of("load", rng.choice(POOL, count, replace=False), slots)],
            ):
                pending = backend.submit(specs)
                assert pending.wait(10) and pending.error() is None
                pair.oracle.copy(specs)
                pair.check()


@needs_core
@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b-tp8-fp8", "deepseek-v2-lite-mla"])
@pytest.mark.parametrize("layout", ["kv_split", "page", "cross_layer"])
def test_the_engine_moves_the_oracles_bytes(fake_cuda: Calls, model: str, layout: str) -> None:
    with engine_on(model, layout) as (pair, backend):
        assert backend.path == "native"
        round_trips(pair, backend, seed=6)
    assert not fake_cuda.memory  # the engine's id buffers were freed at close


@needs_core
def test_a_layer_wait_is_one_flag_wait_enqueued_at_once_and_released_when_it_lands(
    fake_cuda: Calls,
) -> None:
    """The load's streams are held (a GPU still busy): wait_on returns at once, having enqueued
    one wait per call on the engine's stream, which goes on only once the copy's flag writes
    land; the job is reported done only then."""
    with engine_on("llama3-8b", "kv_split") as (pair, backend):
        slots = np.arange(8)
        assert backend.submit([TransferSpec.of("store", np.arange(8), slots)]).wait(10)
        release = hold_stream(fake_cuda, backend.spec.gather[1])
        pending = backend.submit([TransferSpec.of("load", np.arange(8, 16), slots)])
        layer_slice = pending.layer_slice
        assert layer_slice is not None and layer_slice.max() == 3  # max_layer_slices=4
        assert list(layer_slice) == sorted(layer_slice)
        before = fake_cuda.memops
        for layer in (0, len(layer_slice) - 1, None):
            pending.wait_on(123, layer)  # a raw stream handle: returns without the copy
        assert fake_cuda.memops == before + 3
        assert fake_cuda.stream_held(123) and not pending.done()
        with pytest.raises(ValueError, match="layer"):
            backend.layer_gate(0)
        waiter = pending.layer_waiter(124)  # bound once, one flag wait per call
        waiter(2)
        assert fake_cuda.memops == before + 4 and fake_cuda.stream_held(124)
        release()
        assert not fake_cuda.stream_held(123) and not fake_cuda.stream_held(124)
        assert pending.wait(10) and pending.error() is None
        before += 1
        pending.wait_on(123, 0)  # landed: nothing more to enqueue
        assert fake_cuda.memops == before + 3  # no wait enqueued for a layer that landed
        pair.oracle.copy([TransferSpec.of("store", np.arange(8), slots)])
        pair.oracle.copy([TransferSpec.of("load", np.arange(8, 16), slots)])
        pair.check()


@needs_core
@pytest.mark.parametrize("where", ["launch", "flags"])
@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("background", [False, True])
def test_a_load_that_fails_mid_way_still_writes_every_flag_and_reports_failed(
    fake_cuda: Calls, where: str, coupled: bool, background: bool
) -> None:
    """A scatter refused at the second slice (or every flag write refused on the stream that
    writes the slices' flags): the job fails, every flag word a wait could name is written
    anyway (no stream is left waiting), wait_on says so, and the next load runs; also with
    coupled loads (copy and scatter on one DMA stream), and with the load enqueued by the core's
    thread (``background``: the gate's open waits for that enqueue, failure included)."""
    config = {"load_coupled": True, "dma_streams": 2, "depth": 2} if coupled else {}
    with engine_on("llama3-8b", "kv_split", **config) as (pair, backend):
        slots = np.arange(8)
        assert backend.submit([TransferSpec.of("store", np.arange(8), slots)]).wait(10)
        gate = backend.layer_gate(4)
        launch = fake_cuda_launch(fake_cuda)
        count = [0]

        def second_fails(*args: Any) -> int:
            count[0] += 1
            return 700 if count[0] == 2 else int(launch(*args))

        if where == "launch":
            swap_launch(fake_cuda, second_fails)
        else:
            fake_cuda.fail_flags_on = backend.spec.dmas[1][1] if coupled else backend.spec.gather[1]
        try:
            load = [TransferSpec.of("load", np.arange(8, 16), slots)]
            pending = backend.submit(load, background=background)
            gate.open(77, [pending])  # before the step's replay, as an engine opens it
            gate.wait(77, 3)  # the replay's wait on the gate of a layer never loaded
        finally:
            swap_launch(fake_cuda, launch)
            fake_cuda.fail_flags_on = None
        assert pending.wait(10)
        assert "FAKE_ERROR_700" in str(pending.error()) if where == "launch" else pending.error()
        with pytest.raises(RuntimeError):
            pending.wait_on(123, 3)  # the engine recomputes: the stream does not wait
        assert not any(fake_cuda.held.values())  # the gate opened, nothing held
        again = backend.submit([TransferSpec.of("load", np.arange(8, 16), slots)])
        assert again.wait(10) and again.error() is None
        pair.oracle.copy([TransferSpec.of("store", np.arange(8), slots)])
        pair.oracle.copy([TransferSpec.of("load", np.arange(8, 16), slots)])
        pair.check()


@needs_core
def test_a_gate_opens_each_step_once_the_listed_loads_landed_and_each_open_closes_it_first(
    fake_cuda: Calls,
) -> None:
    with engine_on("llama3-8b", "kv_split") as (_pair, backend):
        slots = np.arange(8)
        assert backend.submit([TransferSpec.of("store", np.arange(8), slots)]).wait(10)
        gate = backend.layer_gate(32)
        for bad, said in ((-1, "-1"), (-5, "-5"), (32, "32"), (True, "True")):
            with pytest.raises(ValueError, match=rf"layer in \[0, 32\), got {said}"):
                gate.wait(77, bad)
        # step 1: a load in flight (its streams held); the replay waits for layers 0 and 31
        release = hold_stream(fake_cuda, backend.spec.gather[1])
        pending = backend.submit([TransferSpec.of("load", np.arange(8, 16), slots)])
        gate.open(77, [pending])
        gate.wait(77, 0)
        gate.wait(77, 31)
        assert fake_cuda.stream_held(77)
        release()
        assert not fake_cuda.stream_held(77)
        # step 2: another load; the open closes what step 1 opened before it opens anything, so
        # the replay waits for this load, not the last
        release = hold_stream(fake_cuda, backend.spec.gather[1])
        second = backend.submit([TransferSpec.of("load", np.arange(16, 24), slots)])
        gate.open(77, [second])
        gate.wait(77, 0)
        assert fake_cuda.stream_held(77)
        release()
        assert not fake_cuda.stream_held(77)
        # step 3: no load: the gate opens at once
        gate.open(77, [])
        gate.wait(77, 0)
        gate.wait(77, 31)
        assert not fake_cuda.stream_held(77)
        assert pending.wait(10) and pending.error() is None
        assert second.wait(10) and second.error() is None


@needs_core
def test_close_with_waits_enqueued_waits_for_the_copies_then_frees_the_flags(
    fake_cuda: Calls,
) -> None:
    with engine_on("llama3-8b", "kv_split") as (_pair, backend):
        slots = np.arange(4)
        assert backend.submit([TransferSpec.of("store", np.arange(4), slots)]).wait(10)
        release = hold_stream(fake_cuda, backend.spec.gather[1])
        pending = backend.submit([TransferSpec.of("load", np.arange(8, 12), slots)])
        pending.wait_on(123, 1)
        gate = backend.layer_gate(2)
        gate.wait(124, 0)  # a replay waiting on a gate nobody will open
        closer = threading.Thread(target=backend.close)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive()  # the load is still in flight
        release()
        closer.join(10)
        assert not closer.is_alive()
        assert not any(fake_cuda.held.values())  # close opened the gate, the load landed
        assert pending.done() and pending.error() is None
        pending.wait_on(123, 1)  # after close: nothing to wait for, no flag memory touched
        with pytest.raises(ValueError, match="closed"):
            backend.layer_gate(2)  # refused before the core is asked
        with pytest.raises(RuntimeError, match="closed"):
            gate.wait(124, 0)  # the words are freed: refused, nothing enqueued


@needs_core
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TransferSpec.of("store", [1, 2], [3, POOL]), r"host slot in \[0, 24\), got 24"),
        (TransferSpec.of("store", [1, -1], [3, 4]), r"engine block id in \[0, 24\), got -1"),
        (
            TransferSpec.of("store", [1, 2, 5], [3, 3, 3]),
            "distinct destination host slots in one store, got 2 duplicates",
        ),
        (TransferSpec.of("load", [1, 1], [3, 4]), "distinct destination engine blocks"),
        # distinct within the spec, but slot 8 is the other store spec's (one job: a race)
        (TransferSpec.of("store", [9], [8]), "distinct destination host slots in one store, got 1"),
        (TransferSpec.of("load", [1], [3], group=1), r"group in \[0, 1\), got 1"),
        (
            TransferSpec("sideways", np.zeros(1, np.int64), np.zeros(1, np.int64)),  # type: ignore[arg-type]
            "expected direction 'store' or 'load'",
        ),
        (
            TransferSpec("store", np.zeros(2, np.int64), np.zeros(1, np.int64)),
            "as many host slots as engine blocks",
        ),
        (TransferSpec("store", np.zeros(2, np.int32), np.zeros(2, np.int32)), "int64"),
    ],
)
def test_a_refused_submit_changes_nothing_and_says_what_was_expected(
    fake_cuda: Calls, spec: TransferSpec, message: str
) -> None:
    with engine_on("llama3-8b", "page") as (pair, backend):
        good = TransferSpec.of("store", [5, 6], [7, 8])
        before = len(fake_cuda.log)
        with pytest.raises(ValueError, match=message):
            backend.submit([good, spec])  # the good spec of the same submit is not run either
        assert len(fake_cuda.log) == before
        assert backend.stats()["submitted"] == 0
        pair.check()  # nothing moved


@needs_core
def test_close_with_jobs_in_flight_settles_every_job_and_frees_everything(
    fake_cuda: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first job's gather is held inside the fake driver: later jobs wait in the queue. close()
    cancels them (never run: their memory untouched), finishes the one in hand, frees the rest."""
    with engine_on("llama3-8b", "page", native_inline_bytes=0) as (
        pair,
        backend,
    ):  # every job to the worker thread
        gate, entered, launch = hold_launches(fake_cuda)
        first = [TransferSpec.of("store", [1, 2], [3, 4])]
        queued = [[TransferSpec.of("store", [5], [10 + k])] for k in range(3)]
        try:
            p0 = backend.submit(first)
            assert entered.wait(10)
            later = [backend.submit(s) for s in queued]
            closer = threading.Thread(target=backend.close)
            closer.start()
            closer.join(0.2)
            assert closer.is_alive()  # waits for the job in flight
            gate.set()
            closer.join(10)
            assert not closer.is_alive()
            assert p0.done() and p0.error() is None
            for p in later:
                assert p.done() and p.cancel()
                assert "did not run" in str(p.error())
            pair.oracle.copy(first)
            pair.check()  # the cancelled stores wrote nothing
            with pytest.raises(ValueError, match="closed"):
                backend.submit(first)
            del p0, later
            assert not fake_cuda.memory
        finally:
            gate.set()
            swap_launch(fake_cuda, launch)


@needs_core
def test_a_queued_job_can_be_cancelled_and_never_runs(fake_cuda: Calls) -> None:
    with engine_on("llama3-8b", "page", native_inline_bytes=0) as (pair, backend):
        gate, entered, launch = hold_launches(fake_cuda)
        try:
            running = backend.submit([TransferSpec.of("store", [1], [2])])
            assert entered.wait(10)
            assert not running.cancel()  # started: cannot be recalled
            queued = backend.submit([TransferSpec.of("store", [3], [4])])
            assert queued.cancel() and queued.done()
            gate.set()
            assert running.wait(10) and running.error() is None
            pair.oracle.copy([TransferSpec.of("store", [1], [2])])
            pair.check()
        finally:
            gate.set()
            swap_launch(fake_cuda, launch)


@needs_core
@pytest.mark.parametrize(("inline", "background"), [(0, False), (1 << 30, False), (1 << 30, True)])
def test_small_jobs_are_enqueued_by_the_caller_when_the_direction_is_idle(
    fake_cuda: Calls, inline: int, background: bool
) -> None:
    """...unless the submit asks for the background: then the core's worker thread does."""
    with engine_on("llama3-8b", "page", native_inline_bytes=inline) as (pair, backend):
        threads: set[str] = set()
        launch = fake_cuda_launch(fake_cuda)

        def named(*args: Any) -> int:
            threads.add(threading.current_thread().name)
            return int(launch(*args))

        swap_launch(fake_cuda, named)
        try:
            before = len(fake_cuda.log)
            with pytest.raises(ValueError, match="expected background True or False, got 1"):
                backend.submit([TransferSpec.of("store", [0], [0])], background=1)
            assert len(fake_cuda.log) == before  # refused: nothing enqueued
            for k in range(3):
                spec = TransferSpec.of("store", [k], [k])
                assert backend.submit([spec], background=background).wait(10)
            here = threading.current_thread().name
            caller = inline and not background
            assert threads == ({here} if caller else threads - {here}) and threads
            for k in range(3):
                pair.oracle.copy([TransferSpec.of("store", [k], [k])])
            pair.check()
        finally:
            swap_launch(fake_cuda, launch)


@needs_core
@pytest.mark.parametrize("held_slice", [0, 1])
def test_a_layer_wait_on_a_background_load_waits_on_the_host_for_its_slices_enqueue(
    fake_cuda: Calls, held_slice: int
) -> None:
    """A load handed to the core's thread (``background``) whose enqueue is held in the driver at
    a slice's scatter: a wait on a layer of that slice does not enqueue a GPU wait for copies not
    yet enqueued (a wait that could outlive a thread blocked in the driver, or hold those copies
    behind it on a hardware queue the streams share: issue 25, round 19); it returns once that
    slice is enqueued. A layer of an earlier slice returns at once (since 2026-11-27: a layer's
    wait needs its slice only, not the whole load), and the bytes land."""
    most = {"max_layer_slices": 4, "layer_slice_transfer_bytes": 1, "plan_link_GBps": 0.0}
    with engine_on("llama3-8b", "kv_split", **most) as (pair, backend):
        slots = np.arange(8)
        store = [TransferSpec.of("store", np.arange(8), slots)]
        assert backend.submit(store).wait(10)
        gate, entered, launch = hold_launches(fake_cuda, at=1 + held_slice)
        try:
            load = [TransferSpec.of("load", np.arange(8, 16), slots)]
            pending = backend.submit(load, background=True)
            owner = pending.layer_slice
            assert owner is not None and owner.max() >= 1, owner  # at least two slices
            assert entered.wait(10)  # the core's thread is at the held slice's scatter
            assert not pending.enqueued()
            if held_slice:
                pending.wait_on(123, int(np.flatnonzero(owner == 0)[0]))  # enqueued: at once
            before = fake_cuda.memops
            layer = int(np.flatnonzero(owner == held_slice)[0])
            waiter = threading.Thread(target=pending.wait_on, args=(124, layer))
            waiter.start()
            waiter.join(0.2)
            assert waiter.is_alive() and fake_cuda.memops == before  # no wait enqueued yet
            gate.set()
            waiter.join(10)
            assert not waiter.is_alive()
            assert pending.wait(10) and pending.error() is None and pending.enqueued()
            pair.oracle.copy(store)
            pair.oracle.copy(load)
            pair.check()
        finally:
            gate.set()
            swap_launch(fake_cuda, launch)


@needs_core
def test_eight_threads_submitting_at_once_each_get_their_bytes(fake_cuda: Calls) -> None:
    with engine_on("llama3-8b", "page") as (pair, backend):
        errors: list[BaseException] = []
        specs = [
            [TransferSpec.of("store", [k, (k + 8) % POOL], [3 * k, 3 * k + 1])] for k in range(8)
        ]
        start = threading.Barrier(8)

        def run(k: int) -> None:
            try:
                start.wait()
                for _ in range(5):
                    p = backend.submit(specs[k])
                    assert p.wait(10) and p.error() is None
            except BaseException as err:  # noqa: BLE001 (collected and re-raised below)
                errors.append(err)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        for s in specs:
            pair.oracle.copy(s)
        pair.check()
        assert backend.stats()["submitted"] == 40 == backend.stats()["completed"]


@needs_core
def test_a_copy_the_driver_refuses_fails_the_job_naming_its_descriptor(fake_cuda: Calls) -> None:
    with engine_on("llama3-8b", "kv_split", depth=1, first_chunk_bytes=1 << 30) as (
        _pair,
        backend,
    ):  # one chunk: one batch
        try:
            fake_cuda.fail_batch_at = 2
            pending = backend.submit([TransferSpec.of("store", [1, 2, 3, 4], [4, 9, 6, 11])])
            assert pending.wait(10)
            error = pending.error()
            assert isinstance(error, CudaCopyError)
            assert error.index == 2 and "descriptor 2" in str(error)
            assert "FAKE_ERROR_1" in str(error)  # the driver's name for the code
            fake_cuda.fail_batch_at = None
            ok = backend.submit([TransferSpec.of("store", [5], [12])])  # the engine goes on
            assert ok.wait(10) and ok.error() is None
        finally:
            fake_cuda.fail_batch_at = None


@needs_core
def test_a_completion_event_that_cannot_be_recorded_fails_the_job_without_a_hang(
    fake_cuda: Calls,
) -> None:
    """A job whose completion event cannot be recorded fails and its waits raise; that event is
    destroyed, not leaked: once the backend and its jobs are gone, every event the core created
    is destroyed."""
    with engine_on("llama3-8b", "page") as (_pair, backend):
        try:
            tail = backend.spec.dmas[0][0]
            fake_cuda.fail_record_on = tail
            pending = backend.submit([TransferSpec.of("store", [1], [2])])
            assert pending.wait(10)
            assert "cuEventRecord" in str(pending.error())
            with pytest.raises(RuntimeError, match="cuEventRecord"):
                pending.wait_on(5)
        finally:
            fake_cuda.fail_record_on = None
    del backend, pending
    gc.collect()
    assert fake_cuda.events == 0


@needs_core
def test_a_submit_racing_close_is_refused_and_enqueues_nothing(fake_cuda: Calls) -> None:
    """Another thread closes the core while a submit records its order event on the caller's
    stream (between the submit's two locked sections): the submit fails as closed, and no copy,
    kernel or flag write of it reaches the driver."""
    with engine_on("llama3-8b", "page") as (_pair, backend):
        closer = threading.Thread(target=backend._core.close)

        def close_now(stream: int) -> None:
            if stream == 99 and closer.ident is None:
                closer.start()
                closer.join(10)

        fake_cuda.on_record = close_now
        try:
            start = len(fake_cuda.log)
            with pytest.raises(RuntimeError, match="closed"):
                backend.submit([TransferSpec.of("store", [1], [2])], order_after=99)
        finally:
            fake_cuda.on_record = None
        assert closer.ident is not None and not closer.is_alive()
        moved = [e for e in fake_cuda.log[start:] if e[0] not in ("record", "wait")]
        assert moved == []


@needs_core
def test_every_copy_waits_for_the_callers_stream(fake_cuda: Calls) -> None:
    with engine_on("llama3-8b", "page") as (_pair, backend):
        start = len(fake_cuda.log)
        assert backend.submit([TransferSpec.of("store", [1], [2])], order_after=99).wait(10)
        log = fake_cuda.log[start:]
        order = log[0]
        assert order[0] == "record" and order[1] == 99
        kernels = backend.spec.gather[0]
        # the kernels' stream (the only one touching the engine's memory) starts by waiting for
        # the caller's record; the DMA streams wait for the kernels (events recorded after them)
        assert next(e for e in log if e[1] == kernels) == ("wait", kernels, order[2])
        first_launch = next(i for i, e in enumerate(log) if e[0] == "launch")
        first_copy = next(i for i, e in enumerate(log) if e[0] in ("copy", "batch"))
        assert first_launch < first_copy
        assert backend.submit([TransferSpec.of("store", [1], [3])], order_after=None).wait(10)


@needs_core
def test_a_submit_out_of_memory_reaches_the_core_with_nothing(fake_cuda: Calls) -> None:
    """Each Python allocation of a submit made to fail in turn (CPython's test hooks), while the
    core's thread is held in an earlier job (so the submits queue and make no driver call): a
    submit either returns its Pending or raises MemoryError (never another error) with no job
    handed to the core (a job running while its caller saw MemoryError could be submitted again
    under it). Every job handed out then runs, and the bytes are the oracle's."""
    testcapi = pytest.importorskip("_testcapi")
    with engine_on("llama3-8b", "page", native_inline_bytes=0) as (pair, backend):
        warm = [backend.submit([TransferSpec.of("store", [k % 20], [k % 20])]) for k in range(64)]
        assert all(p.wait(10) for p in warm)  # their events go back to the core's pool, so a
        del warm  # submit below takes pooled ones (the fake cuEventCreate is Python: it would
        gc.collect()  # fail under the hooks where a real driver's would not)
        pair.oracle.copy([TransferSpec.of("store", list(range(20)), list(range(20)))])
        gate, entered, launch = hold_launches(fake_cuda)
        first = [TransferSpec.of("store", [0], [0])]
        pendings = [backend.submit(first, order_after=None)]
        pair.oracle.copy(first)
        failed = 0
        try:
            assert entered.wait(10)
            for start in range(60):
                k = 1 + start % 20
                spec = [TransferSpec.of("store", [k], [k])]
                submitted = backend.stats()["submitted"]
                try:
                    testcapi.set_nomemory(start, start + 1)
                    try:
                        pending = backend.submit(spec, order_after=None)
                    finally:
                        testcapi.remove_mem_hooks()
                except (MemoryError, RuntimeError) as err:
                    # RuntimeError: a fake driver call (Python, so it allocates) failed under
                    # the hooks; a real driver's would not. Either way nothing was submitted.
                    assert isinstance(err, MemoryError) or "FAKE_ERROR" in str(err), err
                    failed += 1
                    assert backend.stats()["submitted"] == submitted, start
                    continue
                pendings.append(pending)
                pair.oracle.copy(spec)
        finally:
            swap_launch(fake_cuda, launch)
            gate.set()
        assert all(p.wait(10) and p.error() is None for p in pendings)
        assert failed > 2  # the sweep reached the submit's allocations
        pair.check()
        fake_cuda.errors[:] = [e for e in fake_cuda.errors if not isinstance(e, MemoryError)]


@needs_core
def test_finished_jobs_are_drained_from_the_native_queue(fake_cuda: Calls) -> None:
    with engine_on("llama3-8b", "page") as (_pair, backend):
        assert backend.drain_finished() == []  # tracking starts here
        ps = [backend.submit([TransferSpec.of("store", [k], [k])]) for k in range(4)]
        for p in ps:
            assert p.wait(10)
        ids = sorted(i for p in ps for i in p.ids)
        assert sorted(backend.drain_finished()) == ids
        assert backend.drain_finished() == []


def test_without_the_extension_staged_falls_back_to_dma_and_says_why(
    fake_cuda: Calls, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvoffload.transfer.cuda import staged as staged_module

    monkeypatch.setenv("KVOFFLOAD_NATIVE", "0")
    monkeypatch.setattr(staged_module, "_warned", set())
    extension.reset()
    pair = Pair("llama3-8b", "page")
    try:
        with caplog.at_level("WARNING", logger=staged_module.__name__):
            backend = staged(pair)
            again = staged(pair)
        again.close()
        assert backend.name == "dma"
        assert backend.path_reason == "disabled by KVOFFLOAD_NATIVE=0"
        logged = [r.getMessage() for r in caplog.records]
        reason = "disabled by KVOFFLOAD_NATIVE=0"
        assert logged == [f"kvoffload: the staged backend is unavailable, using dma: {reason}"]
        round_trips(pair, backend, seed=7, rounds=1)
        backend.close()
    finally:
        pair.close()
        monkeypatch.delenv("KVOFFLOAD_NATIVE")
        extension.reset()
    after = extension.unavailable()  # after reset: the real build again, or why not
    assert after is None or "KVOFFLOAD_NATIVE=0" not in after
    assert (extension.module() is None) == (after is not None)


def test_ci_builds_the_extension() -> None:
    """CI installs the package with a C compiler present: the extension must be there."""
    if os.environ.get("KVOFFLOAD_REQUIRE_NATIVE") != "1":
        pytest.skip("KVOFFLOAD_REQUIRE_NATIVE is not 1 here (.ci/run sets it to require the build)")
    assert extension.module() is not None, extension.unavailable()


@needs_core
def test_a_malformed_core_spec_is_refused() -> None:
    core = extension.module()
    assert core is not None
    table = np.zeros(len(extension.DRIVER_FIELDS), dtype=np.uint64)  # never called: refused first
    with pytest.raises(ValueError, match="core spec"):
        core.Core(extension.address(table), np.zeros(3, dtype=np.int64))
    bad_abi = np.zeros(40, dtype=np.int64)
    bad_abi[0] = 99
    with pytest.raises(ValueError, match=f"ABI {extension.ABI}, got 99"):
        core.Core(extension.address(table), bad_abi)


def hold_launches(calls: Calls, at: int = 1) -> tuple[threading.Event, threading.Event, Any]:
    """Make the fake cuLaunchKernel wait for ``gate`` from its ``at``-th call on; ``entered`` is
    set once one waits. Returns (gate, entered, the launch to put back with ``swap_launch``)."""
    gate, entered, count = threading.Event(), threading.Event(), [0]
    launch = fake_cuda_launch(calls)

    def held(*args: Any) -> int:
        count[0] += 1
        if count[0] >= at:
            entered.set()
            assert gate.wait(10)
        return int(launch(*args))

    swap_launch(calls, held)
    return gate, entered, launch


def fake_cuda_launch(calls: Calls) -> Any:
    return calls.launch_impl


def swap_launch(calls: Calls, fn: Any) -> None:
    calls.launch_impl = fn


class TwoGroups:
    """A layout of two layer groups (Llama-3-8B pages and MLA latents: other slot sizes and layer
    counts, the second group with fewer blocks), twice: the engine's and the oracle's."""

    def __init__(self) -> None:
        from dataclasses import replace

        from kvoffload.store.arena import HostArena
        from kvoffload.transfer.host import HostBackend
        from kvoffload.transfer.layout import KVLayout
        from kvoffload.transfer.shapes import MODELS, engine_tensors
        from tests.fake_cuda import cuda_layout, no_pin

        rng = np.random.default_rng(3)

        def fill(shape: tuple[int, ...]) -> np.ndarray:
            return rng.integers(0, 1 << 16, shape, dtype=np.uint16)

        a, dim_a = engine_tensors(MODELS["llama3-8b"], "page", POOL, 16, fill)
        b, dim_b = engine_tensors(MODELS["deepseek-v2-lite-mla"], "page", POOL // 2, 16, fill)
        self.mine, self.theirs = a + b, [t.copy() for t in a + b]

        def layout(ts: list[np.ndarray]) -> KVLayout:
            first = KVLayout.from_tensors(ts[: len(a)], block_size=16, block_dim=dim_a)
            second = KVLayout.from_tensors(ts[len(a) :], block_size=16, block_dim=dim_b)
            return replace(first, groups=first.groups + second.groups)

        self.kv = cuda_layout(layout(self.mine))
        oracle_kv = layout(self.theirs)
        self.arena = HostArena(POOL, self.kv.slot_bytes, pin=no_pin)
        self.arena_oracle = HostArena(POOL, self.kv.slot_bytes)
        noise = rng.integers(0, 256, self.arena.slots.shape, dtype=np.uint8)
        self.arena.slots[:] = noise
        self.arena_oracle.slots[:] = noise
        self.oracle = HostBackend(oracle_kv, self.arena_oracle)

    def check(self) -> None:
        assert np.array_equal(self.arena.slots, self.arena_oracle.slots), "host slots differ"
        for i, (x, y) in enumerate(zip(self.mine, self.theirs, strict=True)):
            assert np.array_equal(x, y), f"engine tensor {i} differs"


@needs_core
@pytest.mark.parametrize("coupled", [False, True])
def test_two_layer_groups_in_one_submit_move_the_oracles_bytes(
    fake_cuda: Calls, coupled: bool
) -> None:
    from kvoffload.transfer.cuda.staged import make_staged
    from kvoffload.transfer.cuda.staged_config import StagedConfig

    pair = TwoGroups()
    config = StagedConfig(
        staging_bytes=4 * pair.kv.slot_bytes,
        depth=2,
        first_chunk_bytes=1,
        layer_slice_bytes=8,
        max_layer_slices=4,
        layer_slice_transfer_bytes=1,
        load_coupled=coupled,
    )
    backend: Any = make_staged(pair.kv, pair.arena, config)
    try:
        assert backend.path == "native"
        rng = np.random.default_rng(9)
        for _ in range(3):
            slots = rng.choice(POOL, 10, replace=False)
            stores = [
                TransferSpec.of("store", rng.choice(POOL, 6, replace=False), slots[:6], group=0),
                TransferSpec.of("store", rng.choice(POOL // 2, 4, replace=False), slots[6:], 1),
            ]
            loads = [
                TransferSpec.of("load", rng.choice(POOL, 6, replace=False), slots[:6], group=0),
                TransferSpec.of("load", rng.choice(POOL // 2, 4, replace=False), slots[6:], 1),
            ]
            for specs in (stores, loads, [stores[1], loads[0]]):
                pending = backend.submit(specs)
                assert pending.wait(10) and pending.error() is None
                for spec in specs:
                    pair.oracle.copy([spec])
                pair.check()
            with pytest.raises(ValueError, match=r"engine block id in \[0, 12\), got 12"):
                backend.submit([TransferSpec.of("store", [12], [0], group=1)])
    finally:
        backend.close()
        pair.arena.close()
        pair.arena_oracle.close()


@needs_core
@pytest.mark.parametrize("layout", ["kv_split", "page", "cross_layer"])
@pytest.mark.parametrize(("dma_streams", "depth"), [(1, 2), (2, 2), (2, 4)])
@pytest.mark.parametrize(("loads", "stores"), [(True, False), (False, True), (True, True)])
def test_coupled_chunks_move_the_oracles_bytes(
    fake_cuda: Calls, layout: str, dma_streams: int, depth: int, loads: bool, stores: bool
) -> None:
    """StagedConfig(load_coupled=..., store_coupled=...): stores and loads of several sizes (one
    block to the whole pool, ids on the host and uploaded) give the host backend's bytes."""
    config = {"load_coupled": loads, "store_coupled": stores}
    with engine_on("llama3-8b", layout, dma_streams=dma_streams, depth=depth, **config) as (
        pair,
        backend,
    ):
        round_trips(pair, backend, seed=dma_streams * 10 + depth)


@needs_core
@pytest.mark.parametrize("dma_streams", [1, 2])
@pytest.mark.parametrize("n", [9, 20])
def test_a_coupled_store_gathers_and_copies_each_chunk_on_its_areas_dma_stream(
    fake_cuda: Calls, dma_streams: int, n: int
) -> None:
    """Every chunk of a coupled store is its gather's launch then its copies on the DMA stream of
    its staging area, nothing on the kernels' stream (but, with more than 16 blocks, the ids'
    upload); a stream's first gather of the job waits for the caller's stream; with two DMA
    streams each chunk's copies wait for the chunk before's (recorded on the other stream) and
    the job's done word is written after the other stream joined; fewer driver calls than the
    split store of the same blocks. With 20 blocks the ids go up on the kernels' stream and each
    DMA stream's first gather also waits for that upload."""
    calls = {}
    for coupled in (False, True):
        with engine_on(
            "llama3-8b", "page", store_coupled=coupled, dma_streams=dma_streams, depth=2
        ) as (pair, backend):
            start = len(fake_cuda.log)
            pending = backend.submit([TransferSpec.of("store", np.arange(n), np.arange(n))])
            assert pending.wait(10) and pending.error() is None
            pair.oracle.copy([TransferSpec.of("store", np.arange(n), np.arange(n))])
            pair.check()
            log = fake_cuda.log[start:]
            calls[coupled] = len(log)
            if not coupled:
                continue
            kernels, dmas = backend.spec.gather[0], list(backend.spec.dmas[0][:dma_streams])
            order = log[0]
            assert order[0] == "record" and order[1] not in {kernels, *dmas}
            on_kernels = [e for e in log if e[1] == kernels]
            if n <= 16:  # the kernels read the ids from pinned host memory
                assert on_kernels == []
            else:  # the ids' upload, marked
                assert [e[0] for e in on_kernels] == ["copy", "record"]
            firsts = [("wait", order[2])] + ([("record", on_kernels[1][2])] if n > 16 else [])
            launches = [i for i, e in enumerate(log) if e[0] == "launch"]
            assert len(launches) > 2 and {log[i][1] for i in launches} == set(dmas)
            seen: set[int] = set()
            recorded = {e[2]: e[1] for e in log if e[0] == "record"}
            for k, i in enumerate(launches):
                stream = log[i][1]
                if stream not in seen:  # its first gather waits for the caller (and the ids)
                    before = log[i - len(firsts) : i]
                    assert before == [("wait", stream, event) for _, event in firsts]
                    seen.add(stream)
                end = launches[k + 1] if k + 1 < len(launches) else len(log)
                chunk = log[i + 1 : end]
                copies = [e for e in chunk if e[0] in ("copy", "batch", "copy2d")]
                assert copies and all(e[1] == stream for e in copies)
                if dma_streams == 2 and k > 0:  # paced: waits for the chunk before's copies
                    first_copy = chunk.index(copies[0])
                    waits = [e for e in chunk[:first_copy] if e[0] == "wait"]
                    assert any(recorded.get(e[2]) == log[launches[k - 1]][1] for e in waits)
            done = [e for e in log if e[0] == "write32"]
            assert done and done[-1][1] == dmas[0]
    assert calls[True] < calls[False]


@needs_core
def test_a_coupled_store_that_fails_mid_way_writes_its_done_word_and_reports_failed(
    fake_cuda: Calls,
) -> None:
    """The second gather of a coupled store refused: the job reports failed (no slot it wrote
    becomes readable to a later load through this job), its done word is written (a wait on the
    direction never hangs), and the next store of the same blocks lands."""
    with engine_on("llama3-8b", "page", store_coupled=True, dma_streams=2, depth=2) as (
        pair,
        backend,
    ):
        launch = fake_cuda_launch(fake_cuda)
        count = [0]

        def second_fails(*args: Any) -> int:
            count[0] += 1
            return 700 if count[0] == 2 else int(launch(*args))

        swap_launch(fake_cuda, second_fails)
        try:
            pending = backend.submit([TransferSpec.of("store", np.arange(9), np.arange(9))])
        finally:
            swap_launch(fake_cuda, launch)
        assert pending.wait(10) and "FAKE_ERROR_700" in str(pending.error())
        assert not any(fake_cuda.held.values())
        again = [TransferSpec.of("store", np.arange(9), np.arange(9))]
        assert backend.submit(again).wait(10)
        pair.oracle.copy(again)
        pair.check()


@needs_core
def test_a_coupled_load_scatters_each_chunk_on_its_areas_dma_stream_without_events(
    fake_cuda: Calls,
) -> None:
    """Every chunk of a coupled load is its copies then its scatter's launch on the DMA stream
    of its staging area (areas alternate between the two streams), with no event wait between
    them (but, before a stream's first scatter, the wait for the caller's stream) and no launch
    on the kernels' stream; each slice's flag words are written on the stream of its last chunk
    after a wait for the other stream; the last slice's words and the job's done word go together
    on the stream of the job's last chunk, after the other stream joined it (nothing waits on the
    kernels' stream: the job's end needs no join there)."""
    with engine_on("llama3-8b", "page", load_coupled=True, dma_streams=2, depth=2) as (
        pair,
        backend,
    ):
        n = 12  # four slices of 12 blocks; a staging area holds 8 blocks of a slice
        slots = np.arange(n)
        assert backend.submit([TransferSpec.of("store", np.arange(n), slots)]).wait(10)
        start = len(fake_cuda.log)
        pending = backend.submit([TransferSpec.of("load", np.arange(n, 2 * n), slots)])
        assert pending.wait(10) and pending.error() is None
        pair.oracle.copy([TransferSpec.of("store", np.arange(n), slots)])
        pair.oracle.copy([TransferSpec.of("load", np.arange(n, 2 * n), slots)])
        pair.check()
        log = fake_cuda.log[start:]
        kernels, dmas = backend.spec.gather[1], set(backend.spec.dmas[1][:2])
        launches = [i for i, e in enumerate(log) if e[0] == "launch"]
        assert launches and all(log[i][1] in dmas for i in launches)
        assert {log[i][1] for i in launches} == dmas  # chunks on both streams
        order = log[0]  # the caller's stream's record: scatters wait for it, copies need not
        assert order[0] == "record" and order[1] not in dmas | {kernels}
        first_launch: dict[int, int] = {}
        for i in launches:  # the chunk's copies just before its launch, on its stream
            stream, k = log[i][1], i - 1
            first = first_launch.setdefault(stream, i) == i
            if first:  # a stream's first scatter of the job waits for the caller's record
                assert log[k] == ("wait", stream, order[2])
                k -= 1
            assert log[k][0] in ("copy", "batch", "copy2d") and log[k][1] == stream
        recorded = {e[2]: e[1] for e in log if e[0] == "record"}
        cross = [e for e in log if e[0] == "wait" and recorded.get(e[2], e[1]) != e[1]]
        waits_on = {e[1] for e in cross}
        assert kernels not in waits_on and waits_on <= dmas
        assert not [e for e in log if e[1] == kernels]
        slices = int(pending.layer_slice.max()) + 1 if pending.layer_slice is not None else 1
        assert slices > 1
        flags = [i for i, e in enumerate(log) if e[0] == "write32"]
        assert flags and all(log[i][1] in dmas for i in flags)
        firsts = [i for i in flags if log[i - 1][0] != "write32"]  # each slice's (last: the end's)
        assert len(firsts) == slices
        for i in firsts:  # after the slice's other stream joined the one that writes
            joined = log[i - 1]
            assert joined[0] == "wait" and joined[1] == log[i][1]
            assert recorded[joined[2]] in dmas - {log[i][1]}
        last = log[launches[-1]][1]
        assert log[firsts[-1]][1] == last and flags[-1] == len(log) - 1  # the job's last call


@pytest.mark.parametrize("flag", ["load_coupled", "store_coupled"])
def test_coupled_chunks_need_a_depth_that_is_a_multiple_of_the_dma_streams(flag: str) -> None:
    from kvoffload.transfer.cuda.staged_config import StagedConfig

    other = "store_coupled" if flag == "load_coupled" else "load_coupled"
    with pytest.raises(
        ValueError, match=f"multiple of dma_streams \\(2\\) for {flag}, got depth 3"
    ):
        StagedConfig(**{flag: True, other: False}, dma_streams=2, depth=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"{flag} as a bool, got 1"):
        StagedConfig(**{flag: 1})  # type: ignore[arg-type]
    assert getattr(StagedConfig(**{flag: True}, dma_streams=2, depth=4), flag)  # type: ignore[arg-type]
    assert getattr(StagedConfig(), flag)  # the default: fewer driver calls per chunk
    with pytest.raises(ValueError, match="multiple of dma_streams"):
        StagedConfig(depth=3)  # the default couples both: depth 3 of 2 streams is refused
    assert StagedConfig(depth=3, load_coupled=False, store_coupled=False).depth == 3


@needs_core
def test_jobs_beyond_the_id_buffers_first_capacity_grow_them(fake_cuda: Calls) -> None:
    """4,500 blocks in one job: more ids than the buffers hold at start (4,096)."""
    from kvoffload.store.arena import HostArena
    from kvoffload.transfer.cuda.staged import make_staged
    from kvoffload.transfer.host import HostBackend
    from kvoffload.transfer.layout import KVLayout
    from tests.fake_cuda import cuda_layout, no_pin

    n = 4600
    rng = np.random.default_rng(4)
    mine = [rng.integers(0, 1 << 16, (n, 32), dtype=np.uint16) for _ in range(2)]
    theirs = [t.copy() for t in mine]
    kv = cuda_layout(KVLayout.from_tensors(mine, block_size=16, block_dim=0))
    arena = HostArena(n, kv.slot_bytes, pin=no_pin)
    arena_oracle = HostArena(n, kv.slot_bytes)
    oracle = HostBackend(KVLayout.from_tensors(theirs, block_size=16, block_dim=0), arena_oracle)
    backend: Any = make_staged(kv, arena)
    try:
        blocks, slots = rng.permutation(n)[:4500], rng.permutation(n)[:4500]
        for specs in (
            [TransferSpec.of("store", blocks, slots)],
            [TransferSpec.of("load", rng.permutation(n)[:4500], slots)],
        ):
            assert backend.submit(specs).wait(30)
            oracle.copy(specs)
            assert np.array_equal(arena.slots, arena_oracle.slots)
            for x, y in zip(mine, theirs, strict=True):
                assert np.array_equal(x, y)
    finally:
        backend.close()
        arena.close()
        arena_oracle.close()


@needs_core
@pytest.mark.parametrize("layout", ["kv_split", "page", "cross_layer"])
def test_runs_of_consecutive_slots_load_as_one_pitched_copy_per_slice(
    fake_cuda: Calls, layout: str
) -> None:
    """Slots 2..7 ascending (a run), then 12, 0, 1 (a single and a run of two): each run of a
    layer slice moves as one 2D copy, the singles by descriptor; bytes match the oracle."""
    with engine_on("llama3-70b-tp8-fp8", layout) as (pair, backend):
        slots = [2, 3, 4, 5, 6, 7, 12, 0, 1]
        blocks = [20, 3, 9, 14, 1, 17, 8, 22, 5]
        store = [TransferSpec.of("store", blocks, slots)]
        assert backend.submit(store).wait(10)
        load = [TransferSpec.of("load", [0, 4, 6, 10, 11, 13, 15, 19, 23], slots)]
        start = len(fake_cuda.log)
        pending = backend.submit(load)
        assert pending.wait(10) and pending.error() is None
        rows = [e[2] for e in fake_cuda.log[start:] if e[0] == "copy2d"]
        assert rows and all(2 <= r <= 6 for r in rows)  # runs, cut at chunk boundaries
        pair.oracle.copy(store)
        pair.oracle.copy(load)
        pair.check()


@needs_core
@pytest.mark.parametrize("layout", ["kv_split", "page"])
def test_a_specs_pairs_move_in_slot_order_so_a_reversed_run_is_one_copy_per_slice(
    fake_cuda: Calls, layout: str
) -> None:
    """A prefix stored tail first (an engine evicting a request's last blocks first) lands on
    ascending slots in reverse block order, so its load names descending slots: 7, 6, .., 0. The
    core moves a spec's pairs in slot order: every layer slice is one 2D copy of 8 rows (no batch
    descriptor; a staging area holds a slice of 8 blocks), a shuffled spec the same, and the
    bytes are the oracle's."""
    with engine_on("llama3-8b", layout) as (pair, backend):
        store = [TransferSpec.of("store", list(range(7, -1, -1)), list(range(8)))]
        assert backend.submit(store).wait(10)
        pair.oracle.copy(store)
        rng = np.random.default_rng(3)
        for slots in (list(range(7, -1, -1)), rng.permutation(8).tolist()):
            load = [TransferSpec.of("load", rng.permutation(np.arange(8, 16)), slots)]
            start = len(fake_cuda.log)
            pending = backend.submit(load)
            assert pending.wait(10) and pending.error() is None
            assert pending.layer_slice is not None
            copies = [e for e in fake_cuda.log[start:] if e[0] in ("copy", "batch", "copy2d")]
            assert copies == [("copy2d", e[1], 8) for e in copies]
            assert len(copies) == int(pending.layer_slice.max()) + 1
            pair.oracle.copy(load)
            pair.check()


@needs_core
def test_a_loads_slice_count_weighs_its_enqueue_against_its_first_slice(fake_cuda: Calls) -> None:
    """With a copy descriptor made dear, a load from scattered host slots (a descriptor per block
    and slice) takes one slice, the same load from consecutive slots (a 2D copy per slice) takes
    the most; a link of 0 keeps the most slices whatever the slots. Either way the bytes are the
    oracle's, and each slice goes in one chunk when it fits a staging area."""
    dear = (10**9, 3000, 8000, 3000)
    for link, scattered_slices in ((50.0, 1), (0.0, 4)):
        with engine_on("llama3-8b", "kv_split", plan_link_GBps=link, enqueue_ns=dear) as (
            pair,
            backend,
        ):
            for slots, want in ((np.arange(8), 4), (np.arange(0, 16, 2), scattered_slices)):
                store = [TransferSpec.of("store", np.arange(8), slots)]
                assert backend.submit(store).wait(10)
                pair.oracle.copy(store)
                start = len(fake_cuda.log)
                load = [TransferSpec.of("load", np.arange(8, 16), slots)]
                pending = backend.submit(load)
                assert pending.wait(10) and pending.error() is None
                pair.oracle.copy(load)
                pair.check()
                assert pending.layer_slice is not None
                assert int(pending.layer_slice.max()) + 1 == want
                unit = pair.kv.slot_bytes // want  # equal slices
                per_chunk = backend.area_bytes // unit
                launches = [e for e in fake_cuda.log[start:] if e[0] == "launch"]
                assert len(launches) == want * -(-8 // per_chunk)


def test_enqueue_costs_are_checked(fake_cuda: Calls) -> None:
    from kvoffload.transfer.cuda.staged_config import StagedConfig

    for bad in ((1, 2, 3), (1, 2, 3, -1), [1, 2, 3, 4], (1, 2, 3, True)):
        with pytest.raises(ValueError, match="enqueue_ns as 4 ints"):
            StagedConfig(enqueue_ns=bad)  # type: ignore[arg-type]
    for link in (-1.0, float("nan"), 1e9, True):
        with pytest.raises(ValueError, match="plan_link_GBps"):
            StagedConfig(plan_link_GBps=link)


@needs_core
@pytest.mark.parametrize("dma_streams", [1, 2])
def test_a_stores_chunks_are_paced_one_at_a_time_with_two_dma_streams(
    fake_cuda: Calls, dma_streams: int
) -> None:
    """With two DMA streams, every chunk of a store after the first waits, on its own DMA
    stream and before its copies, for the event the chunk before recorded after its copies on
    the other stream (one chunk in the copy engine's queue at a time); with one, no DMA stream
    waits on another's event. Loads are not paced. Bytes match the oracle either way."""
    with engine_on("llama3-8b", "page", dma_streams=dma_streams) as (pair, backend):
        dmas = set(backend.spec.dmas[0][:dma_streams])
        start = len(fake_cuda.log)
        store = [TransferSpec.of("store", list(range(9)), list(range(9)))]
        assert backend.submit(store).wait(10)
        log = [e for e in fake_cuda.log[start:] if e[1] in dmas]
        copies = [i for i, e in enumerate(log) if e[0] in ("copy", "batch", "copy2d")]
        assert len(copies) > 2  # several chunks (staging holds four blocks, depth 2)
        recorded_by = {e[2]: e[1] for e in log if e[0] == "record"}
        cross = [e for e in log if e[0] == "wait" and recorded_by.get(e[2], e[1]) != e[1]]
        if dma_streams == 1:
            assert cross == []
        else:
            for c in copies[1:]:  # the chunk before recorded its event; this chunk waits on it
                before = max(i for i in range(c) if log[i][0] == "record")
                event, recorder = log[before][2], log[before][1]
                assert recorder != log[c][1]
                assert ("wait", log[c][1], event) in log[before:c]
        load_start = len(fake_cuda.log)
        load = [TransferSpec.of("load", list(range(10, 19)), list(range(9)))]
        assert backend.submit(load).wait(10)
        load_dmas = set(backend.spec.dmas[1][:dma_streams])
        load_log = [e for e in fake_cuda.log[load_start:] if e[1] in load_dmas]
        recorded = {e[2]: e[1] for e in load_log if e[0] == "record"}
        assert not [e for e in load_log if e[0] == "wait" and e[2] in recorded]
        pair.oracle.copy(store)
        pair.oracle.copy(load)
        pair.check()


@needs_core
@pytest.mark.parametrize("load_programs", [0, 3])
def test_a_loads_scatter_runs_one_program_per_sm_unless_told(
    fake_cuda: Calls, load_programs: int
) -> None:
    """load_programs 0: a load of whole pages (pieces > 16 KiB, one per program
    step) scatters with one program per SM of the device; a number is kept as given. Stores
    gather with ``programs``. Bytes as the oracle's either way. (The exposed chunk's wider
    kernel is off here: tests/test_native_exposed.py.)"""
    from tests.fake_cuda import FAKE_SMS

    config = {"load_programs": load_programs, "programs": 5, "exposed_programs": 0}
    config["load_program_bytes"] = 0  # the count alone (by bytes: the test below)
    with engine_on("llama3-8b", "page", **config) as (pair, backend):
        slots = np.arange(4)
        start = len(fake_cuda.log)
        store = [TransferSpec.of("store", np.arange(4), slots)]
        load = [TransferSpec.of("load", np.arange(4, 8), slots)]
        assert backend.submit(store).wait(10)
        stored = len(fake_cuda.log)
        assert backend.submit(load).wait(10)
        pair.oracle.copy(store)
        pair.oracle.copy(load)
        pair.check()
        grids = {e[3] for e in fake_cuda.log[start:stored] if e[0] == "launch"}
        assert grids == {5}
        grids = {e[3] for e in fake_cuda.log[stored:] if e[0] == "launch"}
        assert grids == {load_programs or FAKE_SMS}


@needs_core
@pytest.mark.parametrize("layout", ["page", "kv_split"])
def test_a_loads_scatter_runs_one_program_per_so_many_bytes(fake_cuda: Calls, layout: str) -> None:
    """load_program_bytes: each load chunk's scatter runs on ceil(its bytes / load_program_bytes)
    programs, at least load_programs and at most one per SM; stores keep ``programs``. Bytes as
    the oracle's for loads of 1 to 12 blocks."""
    from tests.fake_cuda import FAKE_SMS

    per = 512 << 10  # Llama-3-8B: 2 MiB slots, slices of 1 MiB or 512 KiB here
    config = {"load_programs": 3, "programs": 5, "exposed_programs": 0, "load_program_bytes": per}
    with engine_on("llama3-8b", layout, **config) as (pair, backend):
        units = {p.unit for p in backend.spec.groups[0].parts[1:]}  # the load slices
        for n in (1, 4, 12):
            slots = np.arange(n)
            store = [TransferSpec.of("store", np.arange(n), slots)]
            start = len(fake_cuda.log)
            assert backend.submit(store).wait(10)
            stored = len(fake_cuda.log)
            assert {e[3] for e in fake_cuda.log[start:stored] if e[0] == "launch"} == {5}
            load = [TransferSpec.of("load", np.arange(12, 12 + n), slots)]
            assert backend.submit(load).wait(10)
            pair.oracle.copy(store)
            pair.oracle.copy(load)
            pair.check()
            launches = [e for e in fake_cuda.log[stored:] if e[0] == "launch"]
            assert launches
            for e in launches:
                fits = {min(max(-(-e[2] * unit // per), 3), FAKE_SMS) for unit in units}
                assert e[3] in fits, (n, e, units)
            if n == 1:
                assert {e[3] for e in launches} == {3}  # at least load_programs
            if n == 12:
                assert max(e[3] for e in launches) == FAKE_SMS  # at most one per SM


@needs_core
def test_small_pieces_keep_programs_whatever_their_bytes(fake_cuda: Calls) -> None:
    """Pieces of a few KiB (fp8 TP8 pages: the kernel tiles several per program step) scatter on
    ``programs`` whatever ``load_program_bytes`` says; bytes as the oracle's."""
    config = {"load_programs": 3, "programs": 5, "exposed_programs": 0, "load_program_bytes": 1}
    with engine_on("llama3-70b-tp8-fp8", "page", **config) as (pair, backend):
        assert backend.spec.groups[0].load_program_bytes == 0
        slots = np.arange(12)
        store = [TransferSpec.of("store", np.arange(12), slots)]
        assert backend.submit(store).wait(10)
        start = len(fake_cuda.log)
        load = [TransferSpec.of("load", np.arange(12, 24), slots)]
        assert backend.submit(load).wait(10)
        pair.oracle.copy(store)
        pair.oracle.copy(load)
        pair.check()
        assert {e[3] for e in fake_cuda.log[start:] if e[0] == "launch"} == {5}


def test_load_programs_is_checked() -> None:
    from kvoffload.transfer.cuda.staged_config import StagedConfig

    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="load_programs"):
            StagedConfig(load_programs=bad)  # type: ignore[arg-type]
    assert StagedConfig().load_programs == 16 and StagedConfig(load_programs=0).load_programs == 0
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=r"load_program_bytes an int >= 0 \(0: off\)"):
            StagedConfig(load_program_bytes=bad)  # type: ignore[arg-type]


@needs_core
@pytest.mark.parametrize("max_slices", [1, 4])
def test_a_layer_waiter_makes_one_flag_wait_per_slice(fake_cuda: Calls, max_slices: int) -> None:
    """The load's streams held (a GPU still busy): a waiter called for every layer in order
    enqueues one flag wait per layer slice (the later layers of a slice land with its first), a
    waiter on another stream its own; the engine's streams go on only once the copy lands, and
    every layer's bytes are the host backend's."""
    with engine_on("llama3-8b", "kv_split", max_layer_slices=max_slices) as (pair, backend):
        slots = np.arange(8)
        assert backend.submit([TransferSpec.of("store", np.arange(8), slots)]).wait(10)
        release = hold_stream(fake_cuda, backend.spec.gather[1])
        pending = backend.submit([TransferSpec.of("load", np.arange(8, 16), slots)])
        layer_slice = list(pending.layer_slice)
        assert len(set(layer_slice)) == max_slices
        before = fake_cuda.memops
        waiter = pending.layer_waiter(125)
        for layer in range(len(layer_slice)):
            waiter(layer)
        assert fake_cuda.memops == before + max_slices
        waiter(0)  # another slice than the last one waited for: waited again
        assert fake_cuda.memops == before + max_slices + (max_slices > 1)
        other = pending.layer_waiter(126)
        other(len(layer_slice) - 1)
        assert fake_cuda.stream_held(125) and fake_cuda.stream_held(126)
        release()
        assert not fake_cuda.stream_held(125) and not fake_cuda.stream_held(126)
        assert pending.wait(10) and pending.error() is None
        pair.oracle.copy([TransferSpec.of("store", np.arange(8), slots)])
        pair.oracle.copy([TransferSpec.of("load", np.arange(8, 16), slots)])
        pair.check()


@needs_core
@pytest.mark.parametrize("direction", ["load", "store"])
def test_a_one_chunk_coupled_job_ends_on_its_chunks_stream_with_no_join(
    fake_cuda: Calls, direction: Direction
) -> None:
    """A job of one chunk (one block; a load in one layer slice) on two DMA streams, twice (its
    staging area, hence its stream, alternates): everything of it after the caller's record is
    on that chunk's stream, and after its copy come only its flag words (a load: every layer's
    and the done word; no join of another stream, no event: a store after one that finished is
    not paced and records no `freed`, and no job records a done event); a store is its order
    wait, its gather, its copy and its done word; a load's layer waits and the job's wait both
    pass, and the bytes are the oracle's."""
    config = {"load_coupled": True, "store_coupled": True, "dma_streams": 2, "depth": 2}
    config["max_layer_slices"] = 1
    with engine_on("llama3-8b", "page", **config) as (pair, backend):
        d = 0 if direction == "store" else 1
        dmas = set(backend.spec.dmas[d][:2])
        ours = dmas | {backend.spec.gather[d]}
        store = [TransferSpec.of("store", [1], [5])]
        assert backend.submit(store).wait(10)
        pair.oracle.copy(store)
        seen = set()
        for k in range(2):
            specs = [TransferSpec.of(direction, [2 + k], [5])]
            start = len(fake_cuda.log)
            pending = backend.submit(specs)
            assert pending.wait(10) and pending.error() is None
            log = [e for e in fake_cuda.log[start:] if e[0] != "wait32"]
            assert log[0][0] == "record" and log[0][1] not in ours  # the caller's stream
            stream = log[1][1]
            assert stream in dmas and all(e[1] == stream for e in log[1:])
            work = max(
                i for i, e in enumerate(log) if e[0] in ("launch", "copy", "batch", "copy2d")
            )
            after = [e[0] for e in log[work + 1 :]]
            words = after.count("write32")
            assert after == ["write32"] * words
            if direction == "store":
                assert [e[0] for e in log[1:]] == ["wait", "launch", "copy", "write32"]
            assert words == (32 + 1 if direction == "load" else 1)  # layers, then done
            seen.add(stream)
            pair.oracle.copy(specs)
            pair.check()
            if direction == "load":
                waiter = pending.layer_waiter(125)
                for layer in range(32):
                    waiter(layer)
                assert not fake_cuda.stream_held(125)
        assert seen == dmas


@needs_core
def test_a_coupled_load_is_done_only_once_every_dma_stream_it_used_is_past_its_work(
    fake_cuda: Calls,
) -> None:
    """Coupled loads run on both DMA streams and join the other one to the tail (the stream of
    the last chunk) with an event wait before the done word is written: with one DMA stream held
    (a GPU still busy there), the job is not done whichever stream is the tail (the fake holds a
    stream at cuStreamWaitEvent until the record it follows is reached, as a GPU does), and the
    kernels' stream is not involved; released, the job lands."""
    config = {"load_coupled": True, "dma_streams": 2, "depth": 2, "max_layer_slices": 4}
    with engine_on("llama3-8b", "kv_split", **config) as (pair, backend):
        slots = np.arange(8)
        assert backend.submit([TransferSpec.of("store", np.arange(8), slots)]).wait(10)
        release = hold_stream(fake_cuda, backend.spec.dmas[1][1])
        pending = backend.submit([TransferSpec.of("load", np.arange(8, 16), slots)])
        try:
            assert not pending.wait(0.2) and not pending.done()
            assert not fake_cuda.stream_held(backend.spec.gather[1])
        finally:
            release()
        assert pending.wait(10) and pending.error() is None
        assert not any(fake_cuda.held.values())
        pair.oracle.copy([TransferSpec.of("store", np.arange(8), slots)])
        pair.oracle.copy([TransferSpec.of("load", np.arange(8, 16), slots)])
        pair.check()

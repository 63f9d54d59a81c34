"""Fewer driver calls per job (2026-11-28): a coupled store's first chunk is paced on the done word
of the store before it, not on an event its last chunk recorded, and not at all where that store
has finished; and a job in flight long is asked about a device error through its tail stream
(``cuStreamQuery``), not through a done event of its own. What the tests hold the core to: the
pacing still orders a store behind one still in flight, every byte lands, and a copy that failed
on the device is still reported failed."""

from __future__ import annotations

import time

import numpy as np

from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda, hold_stream  # noqa: F401 (the fixture)
from tests.test_native_engine import engine_on, needs_core

COUPLED = {"store_coupled": True, "load_coupled": True, "dma_streams": 2, "depth": 2}
STEP_QUERY = 7  # native/job.h: the device error found by the core's query
ILLEGAL_ADDRESS = 700  # CUDA_ERROR_ILLEGAL_ADDRESS


def stored_paced(fake_cuda: Calls, specs: list[TransferSpec], chunks: int) -> None:  # noqa: F811
    """Store ``specs`` in one coupled submit and check its pacing: every chunk but the job's last
    records ``freed`` on its DMA stream and the next chunk waits for it; the last chunk records
    nothing on its stream (a record on the other stream after it is the job's end joining it);
    at least ``chunks`` chunks; the bytes are the oracle's."""
    with engine_on("llama3-8b", "page", **COUPLED) as (pair, backend):
        start = len(fake_cuda.log)
        pending = backend.submit(specs)
        assert pending.wait(10) and pending.error() is None
        log = fake_cuda.log[start:]
        dmas = set(backend.spec.dmas[0][:2])
        launches = [i for i, e in enumerate(log) if e[0] == "launch"]
        assert len(launches) >= chunks
        records = [e for e in log[: launches[-1]] if e[0] == "record" and e[1] in dmas]
        assert len(records) == len(launches) - 1  # one per chunk before the job's last
        last = log[launches[-1]][1]
        assert not [e for e in log[launches[-1] :] if e[0] == "record" and e[1] == last]
        for k in range(1, len(launches)):
            chunk = log[launches[k] : launches[k + 1] if k + 1 < len(launches) else len(log)]
            assert records[k - 1][2] in {e[2] for e in chunk if e[0] == "wait"}
        pair.oracle.copy(specs)
        pair.check()


@needs_core
def test_a_store_behind_one_in_flight_waits_for_its_done_word_and_both_land(
    fake_cuda: Calls,  # noqa: F811
) -> None:
    """The first store (its staging area's DMA stream held: a GPU still busy there) has not
    written its done word: the next store's first chunk waits for that word on its own stream
    (a 32-bit wait, no event) and is held behind it; released, both land with the oracle's bytes.
    A third store, after both finished, waits for nothing but the caller's stream."""
    with engine_on("llama3-8b", "page", **COUPLED) as (pair, backend):
        first_stream, second_stream = backend.spec.dmas[0][:2]  # a fresh ring: areas 0 then 1
        release = hold_stream(fake_cuda, first_stream)
        first = [TransferSpec.of("store", [1], [5])]
        second = [TransferSpec.of("store", [2], [6])]
        one = backend.submit(first)
        start = len(fake_cuda.log)
        two = backend.submit(second)
        log = fake_cuda.log[start:]
        assert ("wait32", second_stream) in [e[:2] for e in log]  # paced on the done word
        assert not [e for e in log if e[0] == "record" and e[1] == second_stream]
        assert fake_cuda.stream_held(second_stream)
        time.sleep(0.01)
        assert not one.done() and not two.done()
        release()
        assert one.wait(10) and two.wait(10)
        assert one.error() is None and two.error() is None
        pair.oracle.copy(first)
        pair.oracle.copy(second)
        pair.check()
        third = [TransferSpec.of("store", [3], [7])]
        start = len(fake_cuda.log)
        assert backend.submit(third).wait(10)
        log = fake_cuda.log[start:]
        waits = [e for e in log if e[0] in ("wait", "wait32")]
        assert len(waits) == 1 and waits[0][0] == "wait"  # the caller's stream's event only
        pair.oracle.copy(third)
        pair.check()


@needs_core
def test_a_multi_chunk_store_still_paces_its_chunks_on_each_others_copies(
    fake_cuda: Calls,  # noqa: F811
) -> None:
    """Within a job nothing changed: each chunk after the first waits for the one before's
    ``freed`` (``stored_paced``)."""
    stored_paced(fake_cuda, [TransferSpec.of("store", np.arange(9), np.arange(9))], 3)


@needs_core
def test_a_job_whose_stream_failed_on_the_device_is_reported_failed(
    fake_cuda: Calls,  # noqa: F811
) -> None:
    """A load in flight past the core's first query (50 ms; its stream held, its done word not
    written) whose stream then reports a device error: the job finishes failed with that error
    (the engine recomputes), found by the completion thread's ``cuStreamQuery``."""
    with engine_on("llama3-8b", "page", completion_poll_us=1000) as (_pair, backend):
        slots = np.arange(4)
        assert backend.submit([TransferSpec.of("store", np.arange(4), slots)]).wait(10)
        tail = backend.spec.gather[1]  # the split load's end is on the kernels' stream
        release = hold_stream(fake_cuda, tail)
        pending = backend.submit([TransferSpec.of("load", np.arange(8, 12), slots)])
        time.sleep(0.08)
        assert not pending.done()  # held and not ready: still in flight
        fake_cuda.fail_query_on = (tail, ILLEGAL_ADDRESS)
        assert pending.wait(10)
        error = pending.error()
        assert error is not None and f"FAKE_ERROR_{ILLEGAL_ADDRESS}" in str(error)
        assert pending.jobs[0].error()[1] == STEP_QUERY
        fake_cuda.fail_query_on = None
        release()


@needs_core
def test_a_store_of_two_specs_paces_across_them_and_only_its_very_last_chunk_records_nothing(
    fake_cuda: Calls,  # noqa: F811
) -> None:
    """One submit of two store specs: the first spec's last chunk is not the job's last, so it
    records ``freed`` and the second spec's first chunk waits for it (``stored_paced``); empty
    specs before and after them change nothing."""
    specs = [
        TransferSpec.of("store", np.arange(5), np.arange(5)),
        TransferSpec.of("store", np.arange(5, 9), np.arange(5, 9)),
    ]
    stored_paced(fake_cuda, specs, 4)
    empty = TransferSpec.of("store", np.arange(0), np.arange(0))  # no part of its own
    stored_paced(fake_cuda, [empty, *specs, empty], 4)

"""A job's ``done()`` and ``wait()`` read its done word and finish it themselves (waits.c,
``reap``), so the completion thread can be slow (``completion_poll_us``) without delaying the
engine that polls; jobs nobody asks about are still finished by that thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda, hold_stream  # noqa: F401 (the fixture)
from tests.test_native_engine import engine_on, needs_core

SLOW = 100_000  # us: the completion thread's longest pause, the most StagedConfig accepts


def held_load(
    fake_cuda: Calls,  # noqa: F811
    pair: Any,
    backend: Any,
) -> tuple[list[TransferSpec], Any, Callable[[], None]]:
    """Four blocks stored, then loaded back with the load's done word held: (the load, its
    pending, the release of the held stream)."""
    slots = np.arange(4)
    store = [TransferSpec.of("store", np.arange(4), slots)]
    assert backend.submit(store).wait(10)
    pair.oracle.copy(store)
    release = hold_stream(fake_cuda, backend.spec.gather[1])  # the load's done word waits
    load = [TransferSpec.of("load", np.arange(8, 12), slots)]
    return load, backend.submit(load), release


@needs_core
@pytest.mark.parametrize("asker", ["done", "wait"])
def test_an_asker_finishes_a_job_the_moment_its_done_word_lands(
    fake_cuda: Calls,  # noqa: F811
    asker: str,
) -> None:
    with engine_on("llama3-8b", "page", completion_poll_us=SLOW) as (pair, backend):
        load, pending, release = held_load(fake_cuda, pair, backend)
        time.sleep(0.05)  # the completion thread now sleeps ~1/16 of the job's age between reads
        assert not pending.done() and not pending.wait(0.001)
        completed = backend.stats()["completed"]
        release()  # the word lands now, in this thread
        assert pending.done() if asker == "done" else pending.wait(0)  # no wait for the thread
        assert backend.stats()["completed"] == completed + 1
        assert pending.error() is None
        pair.oracle.copy(load)
        pair.check()


@needs_core
def test_the_completion_thread_finishes_jobs_nobody_asks_about(fake_cuda: Calls) -> None:  # noqa: F811
    with engine_on("llama3-8b", "page", completion_poll_us=SLOW) as (pair, backend):
        release = hold_stream(fake_cuda, backend.spec.dmas[0][0])  # a store's tail stream
        spec = [TransferSpec.of("store", np.arange(3), np.arange(3))]
        pending = backend.submit(spec)
        before = backend.stats()
        release()
        deadline = time.monotonic() + 10
        while backend.stats()["completed"] == before["completed"] and time.monotonic() < deadline:
            time.sleep(0.001)
        after = backend.stats()  # stats() reads; it finishes nothing
        assert after["completed"] == before["completed"] + 1
        assert after["reaped"] == before["reaped"]
        assert after["in_flight"] == 0
        assert pending.done() and pending.error() is None
        pair.oracle.copy(spec)
        pair.check()


@needs_core
@pytest.mark.parametrize("spin_us", [0, 100_000])
def test_a_waiter_sees_the_done_word_land_whether_it_spins_or_sleeps(
    fake_cuda: Calls,  # noqa: F811
    spin_us: int,
) -> None:
    """``wait_spin_us``: 0 sleeps between reads from the start, 100 ms spins for all of the held
    copy below; either way the waiter returns True once the word lands, with the bytes in place."""
    with engine_on("llama3-8b", "page", completion_poll_us=SLOW, wait_spin_us=spin_us) as (
        pair,
        backend,
    ):
        load, pending, release = held_load(fake_cuda, pair, backend)
        got: list[bool] = []
        waiter = threading.Thread(target=lambda: got.append(pending.wait(10)))
        waiter.start()
        time.sleep(0.05)
        assert not got  # held: still waiting
        release()
        waiter.join(10)
        assert got == [True] and pending.error() is None
        pair.oracle.copy(load)
        pair.check()

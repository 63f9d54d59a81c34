"""``KVOFFLOAD_DRIVER_TIMES=1``: the native core calls the driver through a timed table, and
``extension.driver_times`` counts, in the calling thread, exactly the calls the fake driver saw
(an inline submit enqueues in the caller's thread), with the bytes unchanged."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvoffload.transfer.cuda import extension
from kvoffload.transfer.spec import Direction, TransferSpec
from tests.fake_cuda import Calls, fake_cuda  # noqa: F401 (the fixture)
from tests.test_native_engine import engine_on, needs_core

LOGGED = ("launch", "copy2d", "record", "wait", "copy")  # the fake's log names = entry points


@needs_core
@pytest.mark.parametrize("direction", ["store", "load"])
def test_driver_times_count_the_calls_of_this_thread(
    fake_cuda: Calls,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    direction: Direction,
) -> None:
    monkeypatch.setenv("KVOFFLOAD_DRIVER_TIMES", "1")
    with engine_on("llama3-8b", "page") as (pair, backend):
        rng = np.random.default_rng(3)
        extension.driver_times(reset=True)
        for count in (1, 7):
            blocks = rng.choice(16, count, replace=False)
            spec = TransferSpec.of(direction, blocks, np.arange(count))
            start = len(fake_cuda.log)
            extension.driver_times(reset=True)
            assert extension.driver_times() == {}
            pending = backend.submit([spec])
            timed = extension.driver_times()
            assert pending.wait(10) and pending.error() is None
            seen = Counter(e[0] for e in fake_cuda.log[start:] if e[0] in LOGGED)
            assert {n: c for n, (c, _) in timed.items() if n in LOGGED} == dict(seen)
            assert all(us >= 0 for _, us in timed.values())
            pair.oracle.copy([spec])
            pair.check()
        assert extension.driver_times(reset=True)  # the last submit's, then zero
        assert extension.driver_times() == {}


@needs_core
def test_untimed_by_default(fake_cuda: Calls, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.delenv("KVOFFLOAD_DRIVER_TIMES", raising=False)
    with engine_on("llama3-8b", "page") as (_, backend):
        extension.driver_times(reset=True)
        assert backend.submit([TransferSpec.of("store", [0], [0])]).wait(10)
        assert extension.driver_times() == {}


@needs_core
def test_the_e2e_clock_books_the_driver_share_apart(
    fake_cuda: Calls,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``bench e2e --driver-times``: a timed call's driver share is ``driver:<name>`` (its count
    the driver calls), inside the call's own time and left out of ``total``."""
    from kvoffload.bench.e2e.runner.calls import CallClock, total

    monkeypatch.setenv("KVOFFLOAD_DRIVER_TIMES", "1")
    with engine_on("llama3-8b", "page") as (_, backend):
        clock = CallClock()
        pending = clock.call("submit", backend.submit, [TransferSpec.of("store", [0, 1], [0, 1])])
        assert pending.wait(10) and pending.error() is None
        took = clock.take()
        (seconds, calls), (driver_s, driver_calls) = took["submit"], took["driver:submit"]
        assert calls == 1 and driver_calls > 0 and 0 < driver_s <= seconds
        assert total(took) == seconds

"""Host time inside kvoffload's public calls, per request (the e2e attribution).

``HostTier`` reaches the Offloader, the TransferWorker and the LayerGate only through ``timed``
proxies, so every public call the runner makes is wrapped with ``perf_counter`` and summed per
call name (``worker.step``, ``offloader.lookup``, ...) in one ``CallClock``. The engine takes the
sums at the end of each request (``take``). Names starting with ``probe:`` are calls the benchmark
makes only to time a load (a side stream waiting for it): reported, left out of ``total``.
``INSTRUMENT`` is the host time of the ``StallTimer``'s own event records (the benchmark's timing of
each layer's GPU wait, ``StallTimer.own_seconds``): it is inside the per-layer wait calls' time,
so ``total`` takes it out of theirs.
With ``KVOFFLOAD_DRIVER_TIMES=1`` (``bench e2e --driver-times``) the CUDA driver's share of each
call, in the engine's thread, is summed too as ``driver:<name>`` (its count: driver calls), also
left out of ``total``: it is part of the call's own time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from kvoffload.transfer.cuda import extension

T = TypeVar("T")
PROBE = "probe:"
DRIVER = "driver:"
INSTRUMENT = PROBE + "stall_timer"  # inside the per-layer waits' time (``note``, ``total``)


class CallClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.driver = extension.driver_timed()

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.driver:
            extension.driver_times(reset=True)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.counts[name] = self.counts.get(name, 0) + 1
            if self.driver:
                spent = extension.driver_times(reset=True).values()
                key = DRIVER + name
                self.seconds[key] = self.seconds.get(key, 0.0) + sum(us for _, us in spent) / 1e6
                self.counts[key] = self.counts.get(key, 0) + sum(c for c, _ in spent)

    def note(self, name: str, seconds: float, count: int = 1) -> None:
        """Add ``seconds`` measured elsewhere under ``name`` (``INSTRUMENT``)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + count

    def peek(self) -> dict[str, tuple[float, int]]:
        """Seconds and call count per name since the last ``take``."""
        return {n: (s, self.counts[n]) for n, s in self.seconds.items()}

    def take(self) -> dict[str, tuple[float, int]]:
        """Seconds and call count per name since the last ``take``, then zero."""
        out = self.peek()
        self.seconds, self.counts = {}, {}
        return out


def total(calls: dict[str, tuple[float, int]]) -> float:
    """Seconds of every call but the benchmark's own probes (driver shares are inside), less the
    benchmark's instrument inside them (``INSTRUMENT``)."""
    own = sum(s for name, (s, _) in calls.items() if not name.startswith((PROBE, DRIVER)))
    return own - calls.get(INSTRUMENT, (0.0, 0))[0]


class _Timed:
    """``obj`` with its bound methods timed in ``clock`` as ``<prefix>.<method>``."""

    def __init__(self, obj: Any, clock: CallClock, prefix: str) -> None:
        self._obj, self._clock, self._prefix = obj, clock, prefix

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        if not callable(attr) or isinstance(attr, type):
            return attr
        label, clock = f"{self._prefix}.{name}", self._clock

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            return clock.call(label, attr, *args, **kwargs)

        setattr(self, name, timed_call)  # found here from now on, without __getattr__
        return timed_call


def timed(obj: T, clock: CallClock, prefix: str) -> T:
    return cast(T, _Timed(obj, clock, prefix))

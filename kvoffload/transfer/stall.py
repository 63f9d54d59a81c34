"""``StallTimer``: how long a load's consumer stood at each layer's wait.

A restore that is fully hidden costs the engine nothing on the GPU; one that is not makes a
layer's attention wait. A timer handed to ``TransferWorker.layer_waiter`` measures that wait where
it happens, per layer:

- on the native core (``staged``): two timing events recorded on the engine's stream around each
  GPU-side wait the waiter enqueues, in the same native call (one wait per layer slice; a layer
  already landed, or in a slice the stream already waits for, enqueues none and stood 0);
- on the other CUDA backends: the same two events, recorded through the driver from Python;
- on a CPU backend, where the waiter blocks the host: the host clock around the blocking wait.

Timing on the device costs two driver calls per timed wait in the engine's thread and nothing
while the forward runs; the times are read afterwards (``stalls``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any


class StallTimer:
    """Per layer, the seconds a load's consumer (the engine's stream, or on a CPU backend its
    thread) stood at that layer's wait::

        timer = kvo.StallTimer(num_layers)                           # once, reused
        timer.reset()                                                # before a step's waits
        waiter = worker.layer_waiter(job_id, stream, timer=timer)
        waiter(i)                                                    # before layer i's attention
        ...
        timer.stalls()  # after the forward: seconds per layer, None where not passed yet
        timer.own_seconds()  # the host time its own event records took in those waits

    Several loads waited for at one layer in one step add up to one stall (on the device: from
    the first wait to the last). One thread uses a timer at a time.
    """

    def __init__(self, layers: int) -> None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"StallTimer: expected layers an int >= 1, got {layers!r}")
        self.layers = layers
        self._host = [0.0] * layers
        self._native: dict[int, tuple[Any, Any]] = {}  # id(core) -> (core, its _core.Timer)
        self._pairs: list[tuple[int, int]] = []  # free (start, end) timing events (driver.py)
        self._timed: dict[int, tuple[int, int]] = {}  # layer -> its events this round
        self._owned: list[int] = []  # every event made here (destroyed with the timer)
        self._own = 0.0  # host seconds of the event records made here since the last reset

    def reset(self) -> None:
        """Every layer at 0 again (before a step's waits; the timer's events are reused)."""
        self._host = [0.0] * self.layers
        self._own = 0.0
        for _, native in self._native.values():
            native.reset()
        self._pairs.extend(self._timed.values())
        self._timed.clear()

    def stalls(self) -> list[float | None]:
        """Per layer, seconds stood at its wait since the last ``reset``: 0.0 where nothing
        waited; None where the device has not passed that wait yet (read again later)."""
        out: list[float | None] = list(self._host)
        parts = [native.read() for _, native in self._native.values()]
        if self._timed:
            from kvoffload.transfer.cuda import driver as cu

            row: list[float | None] = [0.0] * self.layers
            for layer, (start, end) in self._timed.items():
                row[layer] = cu.event_elapsed(start, end) if cu.event_done(end) else None
            parts.append(row)
        for row in parts:
            for i, v in enumerate(row[: self.layers]):
                out[i] = None if v is None or out[i] is None else out[i] + v  # type: ignore[operator]
        return out

    def own_seconds(self) -> float:
        """Host seconds this timer's own event records took since the last ``reset``: the
        timing's cost, inside the waits' calls (two records per timed wait on a GPU; none on a
        CPU backend, whose waits are timed by the host's clock), so that a caller can tell the
        wait's own cost from its instrument's (``bench e2e``'s per-layer wait call)."""
        return self._own + sum(float(n.own_seconds()) for _, n in self._native.values())

    # -- for the backends' waiters -----------------------------------------------------------------

    def native(self, core: Any) -> Any:
        """This timer's ``_core.Timer`` on ``core`` (made at first use: its events)."""
        held = self._native.get(id(core))
        if held is None or held[0] is not core:
            held = (core, core.stall_timer(self.layers))
            self._native[id(core)] = held
        return held[1]

    def host_wait(self, layer: int, wait: Callable[[], None]) -> None:
        """Run ``wait`` (which blocks the host) and add its time to ``layer``."""
        t0 = time.perf_counter()
        try:
            wait()
        finally:
            if 0 <= layer < self.layers:
                self._host[layer] += time.perf_counter() - t0

    def device_wait(self, layer: int, stream: int, wait: Callable[[], None]) -> None:
        """Run ``wait`` (which enqueues a wait on ``stream``) between two timing events recorded
        on ``stream``: the layer's first wait this round keeps its start, the last its end. A
        wait that raises leaves the layer as it was."""
        if not 0 <= layer < self.layers:
            wait()
            return
        from kvoffload.transfer.cuda import driver as cu

        pair = self._timed.get(layer)
        fresh = pair is None
        if pair is None:
            pair = self._pairs.pop() if self._pairs else self._new_pair(cu)
            self._record(cu, pair[0], stream)
        try:
            wait()
            self._record(cu, pair[1], stream)
        except BaseException:
            if fresh:
                self._pairs.append(pair)
            raise
        self._timed[layer] = pair

    def _record(self, cu: Any, event: int, stream: int) -> None:
        """Record ``event`` on ``stream``, its host time counted in ``own_seconds``."""
        t0 = time.perf_counter()
        cu.event_record(event, stream)
        self._own += time.perf_counter() - t0

    def _new_pair(self, cu: Any) -> tuple[int, int]:
        if not self._owned:  # the events go back to the driver with the timer
            weakref.finalize(self, _destroy, cu.event_destroy, self._owned)
        pair = (cu.event_create(True), cu.event_create(True))
        self._owned.extend(pair)
        return pair


def _destroy(destroy: Callable[[int], None], events: list[int]) -> None:
    for event in events:
        destroy(event)

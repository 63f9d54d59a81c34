"""``CudaPending``: one submitted GPU transfer, finished when its event has passed.

Besides the ``Pending`` contract it offers ``wait_on(stream, layer)``: make an engine stream wait
for the copy on the GPU (the host never blocks); an engine calls it before attention reads loaded
blocks. A load is copied layer-major in slices of consecutive layers, each with its own event, so
``wait_on(stream, layer=i)`` waits only for the slice holding layer i.

Timeouts: ``wait(timeout)`` polls the event with short sleeps and returns False at the deadline; it
never blocks longer. Enqueued GPU work cannot be recalled, so a transfer that timed out may still
complete later. The rule: the memory a transfer writes (engine blocks of a load, host slots of a
store) must not be reused until ``done()`` is True, even after the job was reported failed; the
scheduler keeps such blocks quarantined until then (see docs/transfer.md).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any

import numpy as np

from kvoffload.transfer.backend import Pending
from kvoffload.transfer.cuda import driver as cu

# Poll interval of wait(): starts short (a copy that is nearly done costs little latency), doubles
# up to the cap (a long wait costs little CPU).
_FIRST_SLEEP = 20e-6
_MAX_SLEEP = 1e-3
# How long wait_on() waits for the submitter thread to enqueue the copy before it gives up.
ENQUEUE_TIMEOUT = 30.0


class EventPool:
    """CUDA events for pendings, reused once their pending is garbage (a stream that waited on an
    event keeps waiting for the record it saw, so re-recording a reused event is safe)."""

    def __init__(self) -> None:
        self._free: collections.deque[int] = collections.deque()
        self._closed = False

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            try:
                out.append(self._free.pop())
            except IndexError:
                out.append(cu.event_create())
        return out

    def give(self, events: list[int]) -> None:
        if self._closed:  # a pending outlived its backend
            _destroy(events)
        else:
            self._free.extend(events)

    def close(self) -> None:
        self._closed = True
        while self._free:
            cu.event_destroy(self._free.pop())


def _destroy(events: list[int]) -> None:
    for e in events:
        cu.event_destroy(e)


class CudaPending(Pending):
    """``layer_slice[i]``: index into ``layer_events`` of the slice holding layer i (None or empty:
    no per-layer events, a layer wait is a wait for the whole copy)."""

    def __init__(
        self, pool: EventPool | None = None, layer_slice: np.ndarray | None = None
    ) -> None:
        slices = 0 if layer_slice is None or len(layer_slice) == 0 else int(layer_slice.max()) + 1
        events = pool.take(1 + slices) if pool is not None else [cu.event_create()]
        self.event = events[0]  # recorded after the transfer's last copy
        self.layer_events = events[1:]  # recorded after each slice of layers of a load
        self.layer_slice = layer_slice if slices else None
        weakref.finalize(self, pool.give if pool is not None else _destroy, events)
        self._enqueued = threading.Event()
        self._error: BaseException | None = None
        self.enqueue_seconds = 0.0  # host time spent enqueuing the copies (submitter side)
        self.queued_at = time.perf_counter()  # when submit handed it over
        self.started_at = 0.0  # when the submitter started enqueuing it
        self.plan: dict[int, tuple[int, int]] = {}  # per group of a load: its layer slices

    # -- submitter side --------------------------------------------------------------------------
    def mark_enqueued(self, error: BaseException | None, seconds: float) -> None:
        self._error = error
        self.enqueue_seconds = seconds
        self._enqueued.set()

    # -- Pending ---------------------------------------------------------------------------------
    def done(self) -> bool:
        if not self._enqueued.is_set():
            return False
        try:
            return cu.event_done(self.event)
        except RuntimeError as err:  # the copy failed on the device
            if self._error is None:
                self._error = err
            return True

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.perf_counter() + timeout
        sleep = _FIRST_SLEEP
        while not self.done():
            now = time.perf_counter()
            if deadline is not None and now >= deadline:
                return False
            pause = sleep if deadline is None else min(sleep, deadline - now)
            time.sleep(max(pause, 0.0))
            sleep = min(sleep * 2, _MAX_SLEEP)
        return True

    def error(self) -> BaseException | None:
        return self._error

    def wait_on(self, stream: Any = None, layer: int | None = None) -> None:
        """Make ``stream`` (a torch.cuda.Stream, a raw handle, or None for the current stream) wait
        on the GPU for this transfer, or with ``layer`` for the slice of the load holding that
        layer (a layer outside the load's waits for the whole transfer). Raises TimeoutError if the
        copy was not even enqueued within ``ENQUEUE_TIMEOUT`` seconds, and the transfer's error if
        enqueuing it failed."""
        if not self._enqueued.wait(ENQUEUE_TIMEOUT):
            raise TimeoutError(f"the copy was not enqueued within {ENQUEUE_TIMEOUT} s")
        if stream is None:
            import torch

            stream = torch.cuda.current_stream()
        handle = stream if isinstance(stream, int) else int(stream.cuda_stream)
        event = self.event  # a failed enqueue: its slices' events may never have been recorded
        if (
            self._error is None
            and layer is not None
            and self.layer_slice is not None
            and 0 <= layer < len(self.layer_slice)
        ):
            event = self.layer_events[int(self.layer_slice[layer])]
        cu.stream_wait_event(handle, event)
        if self._error is not None:
            raise self._error

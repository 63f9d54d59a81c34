"""``CudaPending``: one submitted GPU transfer, finished when its event has passed.

Besides the ``Pending`` contract it offers ``wait_on(stream, layer)``: make an engine stream wait
for the copy on the GPU (the host never blocks); an engine calls it before attention reads loaded
blocks. A load is copied layer-major in slices of consecutive layers, each with its own event, so
``wait_on(stream, layer=i)`` waits only for the slice holding layer i: on the host, only until the
submitter has recorded that slice's event (``mark_slice``), not for the whole transfer's enqueue.

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
        # slices whose event is recorded (the submitter counts up; a layer wait needs no more)
        self._recorded = 0
        self._slice_cond = threading.Condition(threading.Lock()) if slices else None
        self._error: BaseException | None = None
        self.enqueue_seconds = 0.0  # host time spent enqueuing the copies (submitter side)
        self.first_slice_seconds = 0.0  # ... until the first layer slice's event was recorded
        self.queued_at = time.perf_counter()  # when submit handed it over
        self.started_at = 0.0  # when the submitter started enqueuing it
        self.plan: dict[int, tuple[int, int]] = {}  # per group of a load: its layer slices

    # -- submitter side --------------------------------------------------------------------------
    def mark_slice(self, k: int) -> None:
        """Slice ``k``'s event is recorded: layer waits up to that slice may go ahead."""
        if k == 0:
            self.first_slice_seconds = time.perf_counter() - self.started_at
        if self._slice_cond is not None:
            with self._slice_cond:
                self._recorded = k + 1
                self._slice_cond.notify_all()

    def mark_enqueued(self, error: BaseException | None, seconds: float) -> None:
        self._error = error
        self.enqueue_seconds = seconds
        self._enqueued.set()
        if self._slice_cond is not None:
            with self._slice_cond:
                self._slice_cond.notify_all()

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
        layer (a layer outside the load's waits for the whole transfer).

        On the host it waits only until the wanted event is recorded: for a layer, until its
        slice's copies are enqueued (earlier slices' too), not the whole transfer's. Raises
        TimeoutError if that takes over ``ENQUEUE_TIMEOUT`` seconds, and the transfer's error if
        enqueuing it failed before that slice was recorded (the bytes of a slice recorded before
        a failure are in place; the failure shows in ``error()`` once the transfer is done).
        """
        k = self._slice_of(layer)
        cond = self._slice_cond
        if k is not None and cond is not None and self._recorded <= k:
            with cond:
                ready = cond.wait_for(
                    lambda: self._recorded > k or self._enqueued.is_set(), ENQUEUE_TIMEOUT
                )
            if not ready:
                raise TimeoutError(f"the copy was not enqueued within {ENQUEUE_TIMEOUT} s")
        if k is None or self._recorded <= k:  # the whole transfer, or a failed enqueue
            if not self._enqueued.wait(ENQUEUE_TIMEOUT):
                raise TimeoutError(f"the copy was not enqueued within {ENQUEUE_TIMEOUT} s")
            if self._error is not None:  # its slices' events may never have been recorded
                cu.stream_wait_event(_handle(stream), self.event)
                raise self._error
        event = self.event if k is None or self._recorded <= k else self.layer_events[k]
        cu.stream_wait_event(_handle(stream), event)

    def _slice_of(self, layer: int | None) -> int | None:
        if layer is None or self.layer_slice is None or not 0 <= layer < len(self.layer_slice):
            return None
        return int(self.layer_slice[layer])


def _handle(stream: Any) -> int:
    if stream is None:
        import torch

        stream = torch.cuda.current_stream()
    return stream if isinstance(stream, int) else int(stream.cuda_stream)

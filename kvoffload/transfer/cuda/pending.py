"""``CudaPending``: one submitted GPU transfer, finished when its event has passed.

Besides the ``Pending`` contract it offers ``wait_on(stream)``: make an engine stream wait for the
copy on the GPU (the host never blocks); an engine calls it before attention reads loaded blocks.

Timeouts: ``wait(timeout)`` polls the event with short sleeps and returns False at the deadline; it
never blocks longer. Enqueued GPU work cannot be recalled, so a transfer that timed out may still
complete later. The rule: the memory a transfer writes (engine blocks of a load, host slots of a
store) must not be reused until ``done()`` is True, even after the job was reported failed; the
scheduler keeps such blocks quarantined until then (see docs/transfer.md).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from kvoffload.transfer.backend import Pending
from kvoffload.transfer.cuda import driver as cu

# Poll interval of wait(): starts short (a copy that is nearly done costs little latency), doubles
# up to the cap (a long wait costs little CPU).
_FIRST_SLEEP = 20e-6
_MAX_SLEEP = 1e-3
# How long wait_on() waits for the submitter thread to enqueue the copy before it gives up.
ENQUEUE_TIMEOUT = 30.0


class CudaPending(Pending):
    def __init__(self) -> None:
        self.event = cu.event_create()  # recorded after the transfer's last copy
        weakref.finalize(self, cu.event_destroy, self.event)
        self._enqueued = threading.Event()
        self._error: BaseException | None = None
        self.enqueue_seconds = 0.0  # host time spent enqueuing the copies (submitter side)
        self.queued_at = time.perf_counter()  # when submit handed it over
        self.started_at = 0.0  # when the submitter started enqueuing it

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
        on the GPU for this transfer. Raises TimeoutError if the copy was not even enqueued within
        ``ENQUEUE_TIMEOUT`` seconds, and the transfer's error if enqueuing it failed. ``layer`` is
        accepted for the ``Pending`` contract; the wait is for the whole transfer (every layer has
        arrived by then)."""
        if not self._enqueued.wait(ENQUEUE_TIMEOUT):
            raise TimeoutError(f"the copy was not enqueued within {ENQUEUE_TIMEOUT} s")
        if stream is None:
            import torch

            stream = torch.cuda.current_stream()
        handle = stream if isinstance(stream, int) else int(stream.cuda_stream)
        cu.stream_wait_event(handle, self.event)
        if self._error is not None:
            raise self._error

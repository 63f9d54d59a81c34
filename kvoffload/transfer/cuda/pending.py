"""``CudaPending``: one transfer of the ``dma`` / ``sm`` backends, finished when its event passed.

The copies are enqueued before ``submit`` returns, so there is nothing to wait for on the host but
the event: ``wait_on(stream)`` makes ``stream`` wait for it on the GPU (the host never blocks) and
raises the transfer's error if enqueueing it failed.

Timeouts: ``wait(timeout)`` polls the event with short sleeps and returns False at the deadline; it
never blocks longer. Enqueued GPU work cannot be recalled, so a transfer that timed out may still
complete later. The rule: the memory a transfer writes (engine blocks of a load, host slots of a
store) must not be reused until ``done()`` is True, even after the job was reported failed; the
scheduler keeps such blocks quarantined until then (see docs/transfer.md).
"""

from __future__ import annotations

import functools
import operator
import time
import weakref
from typing import Any

from kvoffload.transfer.backend import LayerWaiter, Pending
from kvoffload.transfer.cuda import driver as cu
from kvoffload.transfer.stall import StallTimer

# Poll interval of wait(): starts short (a copy that is nearly done costs little latency), doubles
# up to the cap (a long wait costs little CPU).
_FIRST_SLEEP = 20e-6
_MAX_SLEEP = 1e-3


class CudaPending(Pending):
    def __init__(self) -> None:
        self.event = cu.event_create()  # recorded after the transfer's last copy
        weakref.finalize(self, cu.event_destroy, self.event)
        self._error: BaseException | None = None
        self.keep: list[object] = []  # memory the GPU reads until the event passed
        self.queued_at = self.started_at = time.perf_counter()  # (no hand-off: the same)
        self.enqueue_seconds = 0.0  # host time of the enqueue, in the caller's thread

    def finish(self, error: BaseException | None, seconds: float) -> None:
        """The enqueue is over: ``error`` if a copy was refused, ``seconds`` it took."""
        self._error = error
        self.enqueue_seconds = seconds

    def done(self) -> bool:
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

    def wait_on(self, stream: object = None, layer: int | None = None) -> None:
        """Make ``stream`` (a torch.cuda.Stream, a raw handle, or None for the current stream) wait
        on the GPU for the whole transfer; ``layer`` (an index into the group's layers, checked
        against the layout by ``TransferWorker.wait_on``) changes nothing here: these backends do
        not cut a load into layer slices. Raises the transfer's error if enqueueing it failed
        (the stream still waits for what was enqueued)."""
        _check_layer(layer)
        cu.stream_wait_event(stream_handle(stream), self.event)
        if self._error is not None:
            raise self._error

    def layer_waiter(
        self, stream: object = None, layers: int | None = None, timer: StallTimer | None = None
    ) -> LayerWaiter:
        """``Pending.layer_waiter``; with ``timer``, the stream is resolved once, here (its
        events are recorded on it)."""
        handle = stream if timer is None else stream_handle(stream)
        return super().layer_waiter(handle, layers, timer)

    def timed_wait(self, timer: StallTimer, stream: object, layer: int) -> None:
        """The wait between two timing events on the stream: the stall is the device's (the
        host does not block here)."""
        handle = stream_handle(stream)
        timer.device_wait(layer, handle, lambda: self.wait_on(handle, layer))


def _check_layer(layer: object) -> None:
    if layer is None:
        return
    try:
        ok = not isinstance(layer, bool) and operator.index(layer) >= 0  # type: ignore[arg-type]
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"expected layer None or an int >= 0, got {layer!r}")


def current_stream(device: int | None = None) -> int:
    """The caller's current stream handle on ``device`` (None: the current device), read with
    torch's raw accessor where torch has it (measured on an H200 host, 2026-11-27: 1.0 us, where
    ``torch.cuda.current_stream()`` took ~10 us of a 22 us ``layer_waiter`` binding)."""
    raw, current = _raw_accessors()
    if device is None and current is not None:
        device = int(current())
    if raw is not None and device is not None:
        return int(raw(device))
    import torch

    return int(torch.cuda.current_stream(device).cuda_stream)


@functools.cache
def _raw_accessors() -> tuple[Any, Any]:
    """torch's raw current-stream and current-device accessors (None where this torch has
    none), looked up once: the import and the two lookups took 1.9 us a call on the 2-core CI
    VM (a CPU torch 2.13, where the lookups miss), once a submit with ``order_after="current"``."""
    import torch

    return (
        getattr(torch._C, "_cuda_getCurrentRawStream", None),
        getattr(torch._C, "_cuda_getDevice", None),
    )


def stream_handle(stream: Any) -> int:
    """``stream`` (None, a raw handle or a ``torch.cuda.Stream``) as a raw handle; None is the
    caller's current stream."""
    if stream is None:
        return current_stream()
    return stream if isinstance(stream, int) else int(stream.cuda_stream)

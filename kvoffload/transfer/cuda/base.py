"""What the CUDA copy backends share: streams per direction, ordering, submission, buffers.

Ordering: ``submit`` records an event on the caller's current CUDA stream (or on the stream or
event given as ``order_after``) and the copy's streams wait for it on the GPU, so a store reads the
blocks only after the compute enqueued before it wrote them, and a load overwrites blocks only
after the work enqueued before it stopped reading them. Completion: each transfer's ``CudaPending``
carries an event recorded after its last copy (``wait_on(stream)`` makes an engine stream wait).

Submission: by default one submitter thread per direction (``submitter.Submitter``, FIFO)
enqueues the copies, so ``submit`` costs the caller only validation, one event record and a queue
put, and a load is never queued behind the enqueuing of a large store. The thread's host time per
transfer is in ``CudaPending.enqueue_seconds``. ``submit_thread=False`` enqueues in the caller's
thread. Stores and loads run on separate streams, so they overlap; transfers of one direction run
in submission order. A submit mixing both directions goes to the store thread, which takes the
load lane's lock for its loads.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend
from kvoffload.transfer.cuda import driver as cu
from kvoffload.transfer.cuda.pending import CudaPending
from kvoffload.transfer.cuda.submitter import Submitter
from kvoffload.transfer.descriptors import region_arrays
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec


class Lane:
    """The CUDA streams of one direction; ``tail`` is the stream whose work finishes last."""

    def __init__(self, device: Any, count: int, tail: int) -> None:
        import torch

        self.streams = [
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            for _ in range(count)
        ]
        self.handles = [int(s.cuda_stream) for s in self.streams]
        self.tail = self.handles[tail]
        self.lock = threading.Lock()  # one enqueuer at a time on these streams


class CudaBackend(CopyBackend):
    """Base of ``dma``, ``sm`` and ``staged``. Subclasses implement ``_enqueue(spec, lane)``."""

    lane_streams = 1  # streams per direction
    # per direction, the stream whose work finishes last
    lane_tails: ClassVar[dict[str, int]] = {"store": 0, "load": 0}

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        *,
        driver: cu.CudaDriver | None = None,
        submit_thread: bool = True,
    ) -> None:
        if not layout.is_cuda:
            raise ValueError(
                f"expected a CUDA layout for the {self.name} backend, got device {layout.device}"
            )
        if not arena.pinned:
            raise ValueError(
                f"expected a page-locked host arena for the {self.name} backend (build it with "
                "pin=kvoffload.transfer.pinning.cuda_pin), got an unpinned one"
            )
        super().__init__(layout, arena)
        import torch

        index: int | None = torch.device(layout.device).index
        device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.device = device
        self.driver = driver or cu.CudaDriver.load()
        with torch.cuda.device(device):
            self._regions = [
                torch.from_numpy(np.ascontiguousarray(np.stack(region_arrays(g)))).to(device)
                for g in layout.groups
            ]
            self.lanes = {
                d: Lane(device, self.lane_streams, self.lane_tails[d]) for d in ("store", "load")
            }
        self._order_events: collections.deque[int] = collections.deque()
        self._closed = False
        self._submitters: dict[str, Submitter] | None = None
        if submit_thread:  # jobs arrive only after __init__ returns, so subclasses are ready
            self._submitters = {
                d: Submitter(self._run, device, f"kvoffload-{self.name}-{d}")
                for d in ("store", "load")
            }

    # -- the contract ----------------------------------------------------------------------------
    def submit(self, specs: Sequence[TransferSpec], *, order_after: Any = "current") -> CudaPending:
        """Start copying ``specs``; see the module docstring for ordering.

        ``order_after``: ``"current"`` (default) orders the copy after the work enqueued so far on
        the caller's current stream; a ``torch.cuda.Stream`` or raw stream handle after that
        stream's; None orders it after nothing.
        """
        if self._closed:
            raise ValueError(f"submit: expected an open {self.name} backend, got a closed one")
        specs = list(specs)
        self.validate(specs)
        import torch

        if torch.cuda.current_device() == self.device.index:  # the usual case: skip the switch
            order = self._order_event(order_after)
            pending = CudaPending()
        else:
            with torch.cuda.device(self.device):
                order = self._order_event(order_after)
                pending = CudaPending()
        if self._submitters is not None:
            first = specs[0].direction if specs else "store"
            mixed = any(s.direction != first for s in specs)
            self._submitters["store" if mixed else first].put((specs, order, pending))
        else:
            with torch.cuda.device(self.device):
                self._run(specs, order, pending)
        return pending

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for submitter in (self._submitters or {}).values():
            submitter.close()
        for lane in self.lanes.values():
            for s in lane.streams:
                s.synchronize()
        while self._order_events:
            cu.event_destroy(self._order_events.pop())
        self._close_buffers()

    # -- for subclasses --------------------------------------------------------------------------
    def _enqueue(self, spec: TransferSpec, lane: Lane) -> None:
        raise NotImplementedError

    def _close_buffers(self) -> None:
        return

    # -- machinery -------------------------------------------------------------------------------
    def _order_event(self, order_after: Any) -> int | None:
        if order_after is None:
            return None

        if order_after == "current":
            handle = _current_stream(self.device.index)
        elif isinstance(order_after, int):
            handle = order_after
        elif hasattr(order_after, "cuda_stream"):
            handle = int(order_after.cuda_stream)
        else:
            raise ValueError(
                "expected order_after to be 'current', None, a torch.cuda.Stream or a stream "
                f"handle, got {order_after!r}"
            )
        event = self._take_order_event()
        cu.event_record(event, handle)
        return event

    def _take_order_event(self) -> int:
        try:
            return self._order_events.pop()
        except IndexError:
            return cu.event_create()

    def _run(self, specs: list[TransferSpec], order: int | None, pending: CudaPending) -> None:
        t0 = pending.started_at = time.perf_counter()
        error: BaseException | None = None
        used: list[Lane] = []
        try:
            for spec in specs:
                lane = self.lanes[spec.direction]
                with lane.lock:
                    if lane not in used:
                        if order is not None:
                            for handle in lane.handles:
                                cu.stream_wait_event(handle, order)
                        used.append(lane)
                    self._enqueue(spec, lane)
        except Exception as err:  # noqa: BLE001 (reported through the Pending, not swallowed)
            error = err
        finally:
            self._record_done(pending.event, used)
            if order is not None:
                self._order_events.append(order)
            pending.mark_enqueued(error, time.perf_counter() - t0)

    def _record_done(self, event: int, used: list[Lane]) -> None:
        if not used:  # nothing enqueued: the event passes at once on any of our streams
            cu.event_record(event, self.lanes["store"].tail)
            return
        for earlier in used[:-1]:  # a mixed submit: the last lane waits for the others
            cu.event_record(event, earlier.tail)
            cu.stream_wait_event(used[-1].tail, event)
        cu.event_record(event, used[-1].tail)


def _current_stream(device: int) -> int:
    """The caller's current stream handle on ``device`` (torch's raw accessor: ~0.5 us, against
    ~4 us for ``torch.cuda.current_stream().cuda_stream``)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)

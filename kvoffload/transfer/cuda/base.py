"""What the CUDA copy backends share: streams per direction, ordering, submission, layer slices.

Ordering: ``submit`` records an event on the caller's current CUDA stream (or on the stream or
event given as ``order_after``) and the copy's streams wait for it on the GPU, so a store reads the
blocks only after the compute enqueued before it wrote them, and a load overwrites blocks only
after the work enqueued before it stopped reading them. Completion: each transfer's ``CudaPending``
carries an event recorded after its last copy (``wait_on(stream)`` makes an engine stream wait).

Loads are copied layer-major: a group's layers are cut into slices of consecutive layers
(``chunks.layer_slices``); every load spec's slice 0 is enqueued, then an event is recorded, then
slice 1, and so on, so ``wait_on(stream, layer=i)`` waits only for the slice holding layer i
(``CudaPending.layer_events``). Stores are copied whole. How many slices: at most
``_slice_count(group)`` (a property of the layout), and at most one per
``min_slice_transfer_bytes`` of the submit's loads, rounded down to a power of two: each slice
costs the host ~0.2 ms of Python per spec (H100 VM, cProfile of 16-block loads in 8 slices: 1.6 ms
of host time for 0.6 ms of link time), so small loads go in one piece.

Submission (``submitter.Submitter``, one per direction, FIFO): a transfer of at most
``inline_bytes`` (default 0) is enqueued in the caller's thread when its direction is idle (no
thread hand-off); a larger one, or one arriving while another is being enqueued, goes to the
direction's thread, which sleeps when idle (no polling). ``submit_thread=False`` always enqueues
in the caller's thread. The host time of each transfer's enqueue is in
``CudaPending.enqueue_seconds``. Stores and loads run on separate streams, so they overlap;
transfers of one direction run in submission order. A submit mixing both directions goes to the
store side, which takes the load lane's lock for its loads.
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
from kvoffload.transfer.cuda.chunks import layer_slices, slice_of_layer
from kvoffload.transfer.cuda.pending import CudaPending, EventPool
from kvoffload.transfer.cuda.submitter import Submitter
from kvoffload.transfer.descriptors import region_arrays
from kvoffload.transfer.layout import KVLayout, LayerGroup
from kvoffload.transfer.spec import TransferSpec

# Transfers up to this many bytes are enqueued in the caller's thread when their direction is idle;
# larger ones by the direction's thread (the caller then pays only validation and a hand-off).
# Default 0, every transfer to the thread: on the H100 VM a Python loop launching kernels and
# submitting a 2-block store and load per step ran 3,952 / 6,057 us per step with inline enqueue
# against 1,765-3,941 with a thread (two runs, benchmarks/staged_sweep.py, docs/transfer.md): the
# thread's driver calls run while the caller goes on, inline ones stall it.
INLINE_BYTES = 0
# At most this many layer slices (events) per load by default; each costs a little host time.
MAX_LAYER_SLICES = 8
# A load is cut into at most one slice per this many bytes (~0.6 ms of link time per slice against
# ~0.2 ms of host time to enqueue one, measured on the H100 VM).
SLICE_TRANSFER_BYTES = 32 << 20


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
    """Base of ``dma``, ``sm`` and ``staged``. Subclasses implement ``_enqueue(spec, lane, part)``
    and may choose ``_slice_count`` and ``lane_streams`` (set before ``__init__`` runs)."""

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
        inline_bytes: int = INLINE_BYTES,
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
        if inline_bytes < 0:
            raise ValueError(f"expected inline_bytes >= 0, got {inline_bytes}")
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
        # Layer slices of loads, per group: for each allowed slice count (powers of two up to
        # the most, and the most), where its slices start in ``load_parts`` (the regions of every
        # slice of every count, flat) and which slice holds each layer.
        self.load_parts: list[list[range]] = []
        self._plans: list[dict[int, tuple[int, np.ndarray]]] = []
        for g in layout.groups:
            most = self._slice_count(g)
            counts = sorted({1 << k for k in range(most.bit_length()) if 1 << k <= most} | {most})
            flat: list[range] = []
            plans = {}
            for c in counts:
                plans[c] = (len(flat), slice_of_layer(g.layer_starts, len(g.regions), c))
                flat.extend(layer_slices(g.layer_starts, len(g.regions), c))
            self.load_parts.append(flat)
            self._plans.append(plans)
        self.min_slice_transfer_bytes = SLICE_TRANSFER_BYTES
        self._events = EventPool()
        self._order_events: collections.deque[int] = collections.deque()
        self._closed = False
        self.inline_bytes = inline_bytes
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

        plan, layer_slice = self._load_plan(specs)
        if not cu.current_context():  # a thread that has not touched CUDA yet
            torch.cuda.set_device(self.device)  # makes the device's primary context current
        if torch.cuda.current_device() == self.device.index:  # the usual case: skip the switch
            order = self._order_event(order_after)
            pending = CudaPending(self._events, layer_slice)
        else:
            with torch.cuda.device(self.device):
                order = self._order_event(order_after)
                pending = CudaPending(self._events, layer_slice)
        pending.plan = plan
        if self._submitters is not None:
            first = specs[0].direction if specs else "store"
            mixed = any(s.direction != first for s in specs)
            nbytes = sum(len(s) for s in specs) * self.layout.slot_bytes
            self._submitters["store" if mixed else first].put(
                (specs, order, pending), inline=nbytes <= self.inline_bytes
            )
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
        self._events.close()
        self._close_buffers()

    # -- for subclasses --------------------------------------------------------------------------
    def _enqueue(self, spec: TransferSpec, lane: Lane, part: int | None) -> None:
        """Enqueue ``spec`` on ``lane``: all its regions (``part`` None: stores), or those of
        one layer slice (``self.load_parts[spec.group][part]``: loads)."""
        raise NotImplementedError

    def _slice_count(self, group: LayerGroup) -> int:
        """How many layer slices a load of ``group`` is cut into (each gets its own event)."""
        return min(group.num_layers, MAX_LAYER_SLICES)

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

    def _load_plan(
        self, specs: list[TransferSpec]
    ) -> tuple[dict[int, tuple[int, int]], np.ndarray | None]:
        """For a submit's loads: per group (first index in ``load_parts``, slice count), and each
        layer's slice index (over several groups: the latest slice holding that layer in any of
        them); None when it has no loads."""
        loads = [s for s in specs if s.direction == "load"]
        if not loads:
            return {}, None
        nbytes = sum(len(s) for s in loads) * self.layout.slot_bytes
        room = max(1, nbytes // self.min_slice_transfer_bytes)
        plan, maps = {}, []
        for g in {s.group for s in loads}:
            count = max(c for c in self._plans[g] if c <= room or c == 1)
            first, layer_slice = self._plans[g][count]
            plan[g] = (first, count)
            maps.append(layer_slice)
        if len(maps) == 1:
            return plan, maps[0]
        out = np.zeros(max(len(m) for m in maps), dtype=np.int64)
        for m in maps:
            np.maximum(out[: len(m)], m, out=out[: len(m)])
        return plan, out

    def _run(self, specs: list[TransferSpec], order: int | None, pending: CudaPending) -> None:
        t0 = pending.started_at = time.perf_counter()
        error: BaseException | None = None
        used: list[Lane] = []

        def lane_for(direction: str) -> Lane:
            lane = self.lanes[direction]
            if lane not in used:
                if order is not None:
                    for handle in lane.handles:
                        cu.stream_wait_event(handle, order)
                used.append(lane)
            return lane

        try:
            for spec in specs:
                if spec.direction == "store":
                    lane = self.lanes["store"]
                    with lane.lock:
                        self._enqueue(spec, lane_for("store"), None)
            loads = [s for s in specs if s.direction == "load"]
            if loads:
                lane = self.lanes["load"]
                with lane.lock:
                    lane_for("load")
                    for k, event in enumerate(pending.layer_events):
                        for spec in loads:  # layer-major across the specs of one submit
                            first, count = pending.plan[spec.group]
                            if k < count:
                                self._enqueue(spec, lane, first + k)
                        cu.event_record(event, lane.tail)
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

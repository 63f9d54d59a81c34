"""What the CUDA copy backends share: streams per direction, ordering, submission, layer slices.

Ordering: ``submit`` records an event on the caller's current CUDA stream (or on the stream or
event given as ``order_after``) and the copy's streams wait for it on the GPU, so a store reads the
blocks only after the compute enqueued before it wrote them, and a load overwrites blocks only
after the work enqueued before it stopped reading them. Completion: each transfer's ``CudaPending``
carries an event recorded after its last copy (``wait_on(stream)`` makes an engine stream wait).

Loads are copied layer-major: a group's layers are cut into slices of consecutive layers
(``chunks.slice_bounds``); every load spec's slice 0 is enqueued, then an event is recorded (and
the pending told, ``CudaPending.mark_slice``), then slice 1, and so on, so
``wait_on(stream, layer=i)`` waits only for the slice holding layer i, on the GPU and on the host.
Stores are copied whole. A load's schedule has ``count`` near-equal slices, ``count`` at most
``_slice_count(group)`` (a property of the layout); with ``first_slice_bytes`` > 0 it ramps
instead: the first slice holds the fewest layers that make that many bytes per block, the next
twice as many, up to the equal share. A submit takes the schedule with the most slices that keeps
one slice per ``min_slice_transfer_bytes`` of its loads: each slice costs the host ~0.2 ms of
Python per spec plus ~0.85 us per block (H100 VM), so small loads go in one piece. Which schedule
shortens an engine's wait depends on its compute per layer against the link time of a layer
(measured in docs/transfer.md, "Layer slices"); equal slices are the default.

Submission (``submitter.Submitter``, one per direction, FIFO): a transfer of at most
``inline_bytes`` (default 0; ``staged`` with its compiled loop: 32 MiB) is enqueued in the
caller's thread when its direction is idle (no
thread hand-off); a larger one, or one arriving while another is being enqueued, goes to the
direction's thread, which sleeps when idle (no polling). ``submit_thread=False`` always enqueues
in the caller's thread. The host time of each transfer's enqueue is in
``CudaPending.enqueue_seconds``. ``submit`` validates its specs; ``submit_checked`` (for a caller
that already did, e.g. a ``TransferWorker`` paired with its ``Offloader``) checks only that every
block and slot id is in range, skipping the duplicate checks (a sort per spec: 10-70 us of host
time at 64-512 blocks on the H100 VM). Stores and loads run on separate streams, so they overlap;
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
from kvoffload.transfer.cuda.chunks import first_slice_layers, load_schedules
from kvoffload.transfer.cuda.pending import CudaPending, EventPool
from kvoffload.transfer.cuda.submitter import Submitter
from kvoffload.transfer.descriptors import region_arrays
from kvoffload.transfer.layout import KVLayout, LayerGroup
from kvoffload.transfer.spec import TransferSpec

# Python path: transfers up to this many bytes are enqueued in the caller's thread when their
# direction is idle. 0: every one to the thread, whose driver calls run while the caller goes on
# (inline ones stalled a launch-bound loop; docs/transfer.md, 2026-11-23 "Host time").
INLINE_BYTES = 0
# At most this many layer slices (events) per load by default; each costs a little host time.
MAX_LAYER_SLICES = 8
# At most one layer slice per this many bytes of a load: ~0.6 ms of link time against ~0.2 ms of
# Python to enqueue a slice.
SLICE_TRANSFER_BYTES = 32 << 20
# A ramped load's first slice holds >= this many bytes per block (one Llama-3-8B layer at 16-token
# blocks); off by default (docs/transfer.md, "Layer slices").
FIRST_SLICE_BYTES = 64 << 10


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
    first_slice_bytes = 0  # > 0: ramped slices from this many bytes per block (see above)
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
        check_cuda_pair(self.name, layout, arena)
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
        self._group_blocks = tuple(g.num_blocks for g in layout.groups)
        self._slot_bytes = layout.slot_bytes
        # Layer slices of loads, per group: for each schedule (equal counts of powers of two up
        # to the most, and the most, each ramped), keyed by its number of slices: where its
        # slices start in ``load_parts`` (the regions of every slice of every schedule, flat) and
        # which slice holds each layer.
        self.load_parts: list[list[range]] = []
        self._plans: list[dict[int, tuple[int, np.ndarray]]] = []
        for g in layout.groups:
            flat, plans = load_schedules(
                g.num_layers,
                g.layer_starts,
                len(g.regions),
                self._slice_count(g),
                self._first_slice_layers(g),
            )
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
        self._check_open()
        specs = list(specs)
        self.validate(specs)
        return self._submit(specs, order_after)

    def submit_checked(
        self, specs: Sequence[TransferSpec], *, order_after: Any = "current"
    ) -> CudaPending:
        """``submit`` for specs already validated against this layout and arena (a paired
        ``TransferWorker`` passes its ``Offloader``'s jobs here): only the ranges of block and
        slot ids are checked again (so no copy can reach outside the engine's tensors or the
        arena), not their distinctness."""
        self._check_open()
        specs = list(specs)
        for spec in specs:
            check_bounds(spec, self._group_blocks, self.arena.num_slots)
        return self._submit(specs, order_after)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"submit: expected an open {self.name} backend, got a closed one")

    def _submit(self, specs: list[TransferSpec], order_after: Any) -> CudaPending:
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
            nbytes = sum(len(s) for s in specs) * self._slot_bytes
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
    def _prepare(self, spec: TransferSpec, lane: Lane) -> Any:
        """Per-spec work shared by all its ``_enqueue`` calls of one submit (e.g. uploading block
        ids once for every layer slice); given back by ``_release``. Called on ``lane``'s thread
        with its lock held."""
        return None

    def _enqueue(self, spec: TransferSpec, lane: Lane, part: int | None, prepared: Any) -> None:
        """Enqueue ``spec`` on ``lane``: all its regions (``part`` None: stores), or those of
        one layer slice (``self.load_parts[spec.group][part]``: loads)."""
        raise NotImplementedError

    def _release(self, prepared: Any, lane: Lane) -> None:
        """Give back what ``_prepare`` took, once the work enqueued on ``lane`` so far is done."""
        return

    def _slice_count(self, group: LayerGroup) -> int:
        """How many layer slices a load of ``group`` is cut into (each gets its own event)."""
        return min(group.num_layers, MAX_LAYER_SLICES)

    def _first_slice_layers(self, group: LayerGroup) -> int:
        """Layers in a ramped load's first slice (0: no ramp, equal slices)."""
        if self.first_slice_bytes <= 0:
            return 0
        pages = [r.page_bytes for r in group.regions]
        return first_slice_layers(pages, group.layer_starts, self.first_slice_bytes)

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
        nbytes = sum(len(s) for s in loads) * self._slot_bytes
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
                        lane_for("store")
                        prepared = self._prepare(spec, lane)
                        try:
                            self._enqueue(spec, lane, None, prepared)
                        finally:
                            self._release(prepared, lane)
            loads = [s for s in specs if s.direction == "load"]
            if loads:
                lane = self.lanes["load"]
                with lane.lock:
                    lane_for("load")
                    self._run_loads(loads, lane, pending)
        except Exception as err:  # noqa: BLE001 (reported through the Pending, not swallowed)
            error = err
        finally:
            self._record_done(pending.event, used)
            if order is not None:
                self._order_events.append(order)
            pending.mark_enqueued(error, time.perf_counter() - t0)

    def _run_loads(self, loads: list[TransferSpec], lane: Lane, pending: CudaPending) -> None:
        """Layer-major across the specs of one submit: slice k of every spec, then its event."""
        prepared: list[Any] = []
        try:
            for spec in loads:
                prepared.append(self._prepare(spec, lane))
            for k, event in enumerate(pending.layer_events):
                for spec, prep in zip(loads, prepared, strict=True):
                    first, count = pending.plan[spec.group]
                    if k < count:
                        self._enqueue(spec, lane, first + k, prep)
                cu.event_record(event, lane.tail)
                pending.mark_slice(k)
        finally:
            for prep in prepared:
                self._release(prep, lane)

    def _record_done(self, event: int, used: list[Lane]) -> None:
        if not used:  # nothing enqueued: the event passes at once on any of our streams
            cu.event_record(event, self.lanes["store"].tail)
            return
        for earlier in used[:-1]:  # a mixed submit: the last lane waits for the others
            cu.event_record(event, earlier.tail)
            cu.stream_wait_event(used[-1].tail, event)
        cu.event_record(event, used[-1].tail)


def check_cuda_pair(name: str, layout: KVLayout, arena: HostArena) -> None:
    """Raise ValueError unless ``layout`` is on a GPU and ``arena`` is page-locked."""
    if not layout.is_cuda:
        raise ValueError(
            f"expected a CUDA layout for the {name} backend, got device {layout.device}"
        )
    if not arena.pinned:
        raise ValueError(
            f"expected a page-locked host arena for the {name} backend (build it with "
            "pin=kvoffload.transfer.pinning.cuda_pin), got an unpinned one"
        )


def check_bounds(spec: TransferSpec, group_blocks: Sequence[int], num_slots: int) -> None:
    """Raise ValueError unless ``spec`` names a direction and a layer group, and every engine
    block and host slot id of it is in range (not that they are distinct)."""
    if spec.direction not in ("store", "load"):
        raise ValueError(f"expected direction 'store' or 'load', got {spec.direction!r}")
    if not 0 <= spec.group < len(group_blocks):
        raise ValueError(f"expected group in [0, {len(group_blocks)}), got {spec.group}")
    if spec.blocks.shape != spec.slots.shape:
        raise ValueError(
            f"expected as many host slots as engine blocks, got {len(spec.slots)} slots for "
            f"{len(spec.blocks)} blocks"
        )
    if len(spec.blocks):
        for ids, upper, what in (
            (spec.blocks, group_blocks[spec.group], "engine block id"),
            (spec.slots, num_slots, "host slot"),
        ):
            if ids.min() < 0 or ids.max() >= upper:
                bad = ids[(ids < 0) | (ids >= upper)][0]
                raise ValueError(f"expected every {what} in [0, {upper}), got {bad}")


def _current_stream(device: int) -> int:
    """The caller's current stream handle on ``device`` (torch's raw accessor: ~0.5 us, against
    ~4 us for ``torch.cuda.current_stream().cuda_stream``)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)

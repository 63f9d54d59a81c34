"""What the simple CUDA copy backends (``dma``, ``sm``) share: a stream per direction, ordering, one
completion event per transfer.

These are the fallback and comparison paths, as vLLM's batch-DMA fallback is: ``submit`` validates
its specs and enqueues every copy in the caller's thread before it returns (no thread of ours, no
layer slices, no staging). The staged pipeline lives only in the native core (``staged.py``).

Ordering: ``submit`` records an event on the caller's current CUDA stream (or on the stream given
as ``order_after``) and the copy's stream waits for it on the GPU, so a store reads the blocks only
after the compute enqueued before it wrote them, and a load overwrites blocks only after the work
enqueued before it stopped reading them. Stores and loads run on separate streams, so they overlap;
transfers of one direction run in submission order; a submit holding both directions ends with an
event recorded after both. Completion: the returned ``CudaPending`` carries that one event;
``wait_on(stream, layer)`` makes a stream wait for the whole transfer whatever the layer.

Errors: a copy the driver refuses while it is enqueued is the transfer's ``error()``, and
``wait_on`` raises it; ``submit`` then waits for what was already enqueued (a rare path) and still
records the event after it, so ``done()`` turns True only once no memory the transfer writes can
change (see ``pending.py``). ``submit`` raises ValueError, enqueueing
nothing, for specs that do not fit the layout or arena; ``submit_checked`` (for specs a paired
``TransferWorker``'s ``Offloader`` validated) checks only the ranges of block and slot ids.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend
from kvoffload.transfer.cuda import driver as cu
from kvoffload.transfer.cuda.pending import CudaPending
from kvoffload.transfer.cuda.pending import current_stream as _current_stream
from kvoffload.transfer.descriptors import region_arrays
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec

DIRECTIONS = ("store", "load")


class CudaBackend(CopyBackend):
    """Base of ``dma`` and ``sm``: subclasses implement ``_enqueue(spec, stream)``."""

    def __init__(
        self, layout: KVLayout, arena: HostArena, *, driver: cu.CudaDriver | None = None
    ) -> None:
        check_cuda_pair(self.name, layout, arena)
        super().__init__(layout, arena)
        import torch

        index: int | None = torch.device(layout.device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.driver = driver or cu.CudaDriver.load()
        with torch.cuda.device(self.device):
            # per group, the int64 [4, n_regions] region table (copy kernels read it)
            self._regions = [
                torch.from_numpy(np.ascontiguousarray(np.stack(region_arrays(g)))).to(self.device)
                for g in layout.groups
            ]
            self.streams = {d: torch.cuda.Stream(self.device) for d in DIRECTIONS}  # type: ignore[no-untyped-call]
            self._order = cu.event_create()  # re-recorded by each submit, under the lock
        self._group_blocks = tuple(g.num_blocks for g in layout.groups)
        self._lock = threading.Lock()  # one submit enqueues at a time
        # transfers whose memory the GPU may still read (uploaded ids), oldest first
        self._held: collections.deque[CudaPending] = collections.deque()
        self._closed = False

    # -- the contract ----------------------------------------------------------------------------
    def submit(
        self,
        specs: Sequence[TransferSpec],
        *,
        order_after: Any = "current",
        background: bool = False,
    ) -> CudaPending:
        """Enqueue the copies of ``specs`` and return; see the module docstring for ordering.

        ``order_after``: ``"current"`` (default) orders the copy after the work enqueued so far on
        the caller's current stream; a ``torch.cuda.Stream`` or raw stream handle after that
        stream's; None orders it after nothing. ``background`` is accepted and ignored: these
        backends enqueue in the caller's thread (the native ``staged`` core honours it).
        """
        self._check_open()
        specs = list(specs)
        self.validate(specs)
        return self._submit(specs, order_after)

    def submit_checked(
        self,
        specs: Sequence[TransferSpec],
        *,
        order_after: Any = "current",
        background: bool = False,
    ) -> CudaPending:
        """``submit`` for specs already validated against this layout and arena: only the ranges
        of block and slot ids are checked again (so no copy can reach outside the engine's
        tensors or the arena), not their distinctness."""
        self._check_open()
        specs = list(specs)
        for spec in specs:
            check_bounds(spec, self._group_blocks, self.arena.num_slots)
        return self._submit(specs, order_after)

    def close(self) -> None:
        """Wait for every transfer enqueued, then free what they held; submits refused after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for s in self.streams.values():
                s.synchronize()
            self._held.clear()
            cu.event_destroy(self._order)

    # -- for subclasses --------------------------------------------------------------------------
    def _enqueue(self, spec: TransferSpec, stream: Any) -> object:
        """Enqueue every copy of ``spec`` (at least one block) on ``stream`` (a
        ``torch.cuda.Stream``). Returns what the GPU reads until the copy is done (e.g. uploaded
        ids), kept alive until the transfer's event has passed, or None."""
        raise NotImplementedError

    # -- machinery -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"submit: expected an open {self.name} backend, got a closed one")

    def _submit(self, specs: list[TransferSpec], order_after: Any) -> CudaPending:
        import torch

        order = order_stream(order_after, self.device.index)  # ValueError before any enqueue
        if not cu.current_context():  # a thread that has not touched CUDA yet
            torch.cuda.set_device(self.device)  # makes the device's primary context current
        if torch.cuda.current_device() == self.device.index:  # the usual case: skip the switch
            return self._run(specs, order)
        with torch.cuda.device(self.device):
            return self._run(specs, order)

    def _run(self, specs: list[TransferSpec], order: int | None) -> CudaPending:
        with self._lock:
            self._check_open()
            while self._held and self._held[0].done():
                self._held.popleft()
            pending = CudaPending()
            t0 = pending.started_at = time.perf_counter()
            error: BaseException | None = None
            used: list[int] = []
            kept: list[object] = []
            try:
                if order is not None:
                    cu.event_record(self._order, order)
                for direction in DIRECTIONS:
                    work = [s for s in specs if s.direction == direction and len(s)]
                    if not work:
                        continue
                    stream = self.streams[direction]
                    handle = int(stream.cuda_stream)
                    if order is not None:
                        cu.stream_wait_event(handle, self._order)
                    used.append(handle)
                    for spec in work:
                        kept.append(self._enqueue(spec, stream))
            except Exception as err:  # noqa: BLE001 (the transfer's error, reported by its Pending)
                error = err
                for s in self.streams.values():  # what was enqueued reads nothing freed after
                    s.synchronize()
            try:
                self._record_done(pending.event, used)
            except RuntimeError as err:  # no event to wait on: wait here, then report it
                for s in self.streams.values():
                    s.synchronize()
                error = error or err
            pending.finish(error, time.perf_counter() - t0)
            pending.keep = [k for k in kept if k is not None]
            if pending.keep:
                self._held.append(pending)
            return pending

    def _record_done(self, event: int, used: list[int]) -> None:
        """Record ``event`` after the work on every stream in ``used`` (at once where none)."""
        if not used:  # nothing enqueued: the event passes at once on any of our streams
            cu.event_record(event, int(self.streams["store"].cuda_stream))
            return
        for earlier in used[:-1]:  # both directions: the last stream waits for the other
            cu.event_record(event, earlier)
            cu.stream_wait_event(used[-1], event)
        cu.event_record(event, used[-1])


def upload(driver: cu.CudaDriver, values: np.ndarray, device: Any, stream: Any) -> tuple[Any, Any]:
    """Enqueue the copy of int64 ``values`` to a new device tensor on ``stream``, from a new
    page-locked host tensor. Returns both (host, device): the caller keeps them until the stream
    has passed this point (``CudaBackend._enqueue``'s return value)."""
    import torch

    host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
    host.numpy()[:] = values
    dev = torch.empty(len(values), dtype=torch.int64, device=device)
    driver.memcpy(
        int(host.data_ptr()), int(dev.data_ptr()), 8 * len(values), int(stream.cuda_stream)
    )
    return host, dev


def order_stream(order_after: Any, device: int) -> int | None:
    """The stream handle a copy is ordered after (``submit``'s ``order_after``: ``"current"``,
    None, a ``torch.cuda.Stream`` or a raw handle); ValueError for anything else."""
    if order_after is None:
        return None
    if isinstance(order_after, str) and order_after == "current":
        return _current_stream(device)
    if isinstance(order_after, int) and not isinstance(order_after, bool):
        return order_after
    if hasattr(order_after, "cuda_stream"):
        return int(order_after.cuda_stream)
    raise ValueError(
        "expected order_after to be 'current', None, a torch.cuda.Stream or a stream "
        f"handle, got {order_after!r}"
    )


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
    if spec.direction not in DIRECTIONS:
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

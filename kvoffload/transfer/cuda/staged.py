"""The ``staged`` backend on the native transfer core: a thin facade over ``_core.Core``.

Everything that runs per transfer after ``submit`` is compiled code on native threads
(``native/``: validation, the chunk plan, descriptors, the staging ring, the copy-kernel launches
by handle, DMA, events per layer slice, completion detection): ``submit`` hands the specs over in
one call (the id arrays by pointer; the GIL is released while the core validates, copies the ids
and records the order event) and returns. The Python here runs once per backend: it builds the
device side (streams, staging ring, region tables, the compiled kernel variants) and describes it
to C as one frozen ``CoreSpec``.

``NativePending`` is the ``Pending`` of one submit (one core job per direction): ``done``,
``wait``, ``wait_on(stream, layer)`` and ``cancel`` are single native calls that never hold the
GIL while they wait. ``wait_on`` enqueues one GPU-side wait on a flag word the copy writes once
that layer has landed and returns at once: the engine's thread never waits for the copy.
``NativeGate`` is the core's ``LayerGate`` (a forward captured whole in a CUDA graph). Ordering
and the reuse rule for memory of a timed-out transfer are those of ``base.py``'s module
docstring.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend, LayerGate, LayerWaiter, Pending, check_layer
from kvoffload.transfer.cuda import extension
from kvoffload.transfer.cuda.base import check_cuda_pair, order_stream
from kvoffload.transfer.cuda.chunks import (
    first_slice_layers,
    load_schedules,
    slice_count,
    tile,
    vector_words,
)
from kvoffload.transfer.cuda.core_spec import CoreSpec, GroupSpec, Part
from kvoffload.transfer.cuda.driver import CudaCopyError
from kvoffload.transfer.cuda.pending import stream_handle
from kvoffload.transfer.cuda.sm import check_words
from kvoffload.transfer.cuda.staged_config import StagedConfig
from kvoffload.transfer.descriptors import region_arrays
from kvoffload.transfer.layout import KVLayout, LayerGroup
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.stall import StallTimer

log = logging.getLogger(__name__)
# How long wait_on() waits on the host for a transfer's enqueue before it gives up (seconds).
ENQUEUE_TIMEOUT = 30.0


class NativeUnavailable(RuntimeError):
    """The native core cannot run this layout here (the factory falls back to ``dma``)."""


def make_staged(
    layout: KVLayout, arena: HostArena, config: StagedConfig | None = None
) -> CopyBackend:
    """The ``staged`` backend on the native core where it can run. Elsewhere (the extension not
    built, ``KVOFFLOAD_NATIVE=0``, a layout or Triton it cannot drive) the ``dma`` backend, which
    says why (``path_reason``; logged once per reason): the staged pipeline exists in C only, and
    ``dma`` is a different, simpler path (one batch of descriptors per transfer, no staging), as
    vLLM falls back to batch DMA."""
    from kvoffload.transfer.cuda.dma import DmaBackend

    try:
        return NativeStagedBackend(layout, arena, config=config or StagedConfig())
    except NativeUnavailable as err:
        reason = str(err)
    if reason not in _warned:
        _warned.add(reason)
        log.warning("kvoffload: the staged backend is unavailable, using dma: %s", reason)
    backend = DmaBackend(layout, arena)
    backend.path_reason = reason
    return backend


_warned: set[str] = set()


def _driver_table() -> int:
    """The CUDA driver's entry points, resolved by the extension (RuntimeError saying why not)."""
    module = extension.module()
    if module is None:
        raise NativeUnavailable(extension.unavailable() or "the native core is unavailable")
    try:
        return int(module.cuda_driver())
    except RuntimeError as err:
        raise NativeUnavailable(str(err)) from None


class NativeStagedBackend(CopyBackend):
    name = "staged"
    path = "native"
    path_reason: str | None = None

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        *,
        config: StagedConfig | None = None,
        driver_table: int = 0,
        launcher: Any = None,
    ) -> None:
        """``driver_table``: address of a ``kvo_driver`` (tests pass fakes); 0 resolves the CUDA
        driver. ``launcher``: the copy kernel's launcher (``kernels.CopyLauncher``)."""
        core = extension.module()
        if core is None:
            raise NativeUnavailable(extension.unavailable() or "the native core is unavailable")
        check_cuda_pair(self.name, layout, arena)
        check_words(layout)
        super().__init__(layout, arena)
        import torch

        self.config = config = config or StagedConfig()
        if config.dma_streams > 4:
            raise NativeUnavailable(f"the core runs 1-4 DMA streams, got {config.dma_streams}")
        index = torch.device(layout.device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self._device_index = self.device.index
        self._sms = int(torch.cuda.get_device_properties(self.device).multi_processor_count)
        area = max(config.staging_bytes // config.depth, layout.slot_bytes)
        self.area_bytes = (area + 255) // 256 * 256
        self._closed = False
        with torch.cuda.device(self.device):
            self._keep: list[Any] = []  # device memory the core uses by address
            self._streams = {
                d: [
                    torch.cuda.Stream(self.device, priority=config.copy_priority)  # type: ignore[no-untyped-call]
                    for _ in range(1 + config.dma_streams)
                ]
                for d in ("store", "load")
            }
            self._gate_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            rings = {
                d: torch.empty(
                    config.depth * self.area_bytes, dtype=torch.uint8, device=self.device
                )
                for d in ("store", "load")
            }
            self._keep += rings.values()
            bases = {
                d: tuple(
                    int(rings[d].data_ptr()) + k * self.area_bytes for k in range(config.depth)
                )
                for d in rings
            }
            if len({extension.wide(b) for d in bases for b in bases[d]}) > 1:
                raise NativeUnavailable("staging areas on both sides of 2**31 (mixed widths)")
            if launcher is None:
                from kvoffload.transfer.cuda.kernels import CopyLauncher  # imports Triton

                launcher = CopyLauncher()
            groups = tuple(self._group(g, launcher, bases) for g in layout.groups)
            handle = {d: [int(s.cuda_stream) for s in ss] for d, ss in self._streams.items()}
            self.spec = CoreSpec(
                num_slots=arena.num_slots,
                arena_base=arena.base_address,
                arena_slot_bytes=arena.slot_bytes,
                depth=config.depth,
                area_bytes=self.area_bytes,
                first_chunk_bytes=config.first_chunk_bytes,
                min_slice_transfer_bytes=config.layer_slice_transfer_bytes,
                inline_bytes=config.native_inline_bytes,
                gather=(handle["store"][0], handle["load"][0]),
                dmas=(tuple(handle["store"][1:]), tuple(handle["load"][1:])),
                gate=int(self._gate_stream.cuda_stream),
                enqueue_ns=config.enqueue_ns,
                link_bytes_per_us=int(config.plan_link_GBps * 1000),
                load_coupled=int(config.load_coupled),
                store_coupled=int(config.store_coupled),
                exposed_programs=config.exposed_programs,
                host_ids=config.host_ids,
                poll_max_us=config.completion_poll_us,
                max_programs=self._sms,
                wait_spin_us=config.wait_spin_us,
                load_span=config.load_span,
                bases=(bases["store"], bases["load"]),
                groups=groups,
            )
            for ss in self._streams.values():  # the warm-up launches and the uploads are done
                for s in ss:
                    s.synchronize()
            table = driver_table or _driver_table()
            if extension.driver_timed():  # the calls counted and timed (extension.driver_times)
                table = int(core.timed_driver(table))
            self._core = core.Core(table, self.spec.pack())

    def _group(self, g: LayerGroup, launcher: Any, areas: dict[str, tuple[int, ...]]) -> GroupSpec:
        """The group's parts (whole slot, then every load slice of every schedule), its region
        tables on the device, and its copy-kernel variants compiled (a launch moving nothing),
        of 16-byte accesses where its pieces and the staging ``areas`` allow (``vector_words``)."""
        import torch

        config = self.config
        regions = np.stack(region_arrays(g))  # bases, strides, page bytes, offsets: int64 rows
        table = torch.from_numpy(np.ascontiguousarray(regions)).to(self.device)
        most = slice_count(
            g.slot_bytes, g.num_layers, config.layer_slice_bytes, config.max_layer_slices
        )
        first = 0
        if config.first_slice_bytes > 0:
            pages = [r.page_bytes for r in g.regions]
            first = first_slice_layers(pages, g.layer_starts, config.first_slice_bytes)
        flat, plans = load_schedules(g.num_layers, g.layer_starts, len(g.regions), most, first)
        offsets = [*g.offsets, g.slot_bytes]
        parts = [Part(0, g.slot_bytes, int(table.data_ptr()), table.shape[1])]
        self._keep.append(table)
        for p in flat:
            off = offsets[p.start]
            t = table[:, p.start : p.stop].clone()
            t[3] -= off
            t = t.contiguous()
            self._keep.append(t)
            parts.append(Part(off, offsets[p.stop] - off, int(t.data_ptr()), t.shape[1]))
        schedules = sorted(plans.items())
        jobs, words = tile(max(r.page_bytes for r in g.regions), config.chunk_bytes)
        area0 = areas["store"][0]
        addresses = [b for d in areas for b in areas[d]]
        vec = vector_words(
            [*regions.ravel().tolist(), *addresses, g.slot_bytes],
            config.access_bytes,
        )
        kernels = []
        load_programs = config.load_programs or self._sms
        for store in (True, False):
            programs = config.programs if store or jobs > 1 else load_programs
            ints = (0, 0, len(g.regions), area0, g.slot_bytes)
            stream = self._streams["store" if store else "load"][0]
            ids = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._keep.append(ids)
            launcher.launch(
                stream,
                programs,
                ids,
                ids,
                table,
                *ints,
                to_host=store,
                identity=True,
                jobs=jobs,
                words=words,
                num_warps=config.num_warps,
                vec=vec,
            )
            try:
                info = launcher.native_kernel(store, True, jobs, words, config.num_warps, ints, vec)
            except ValueError as err:  # a Triton whose kernel ABI the core does not know
                raise NativeUnavailable(f"copy kernel: {err}") from None
            if info is None:
                raise NativeUnavailable("the copy kernel's compiled variant is not available")
            kernels.append(info.pack(programs))
        return GroupSpec(
            num_blocks=g.num_blocks,
            slot_bytes=g.slot_bytes,
            num_layers=g.num_layers,
            kernels=(kernels[0], kernels[1]),
            parts=tuple(parts),
            plans=tuple((count, first_part + 1) for count, (first_part, _) in schedules),
            owners=tuple(tuple(int(v) for v in owner) for _, (_, owner) in schedules),
            # pieces > 16 KiB (the load kernel sized by load_programs): by bytes; small pieces,
            # tiled, keep ``programs`` (1,000-block fp8 loads read 0.91-0.98 of the link on
            # programs by bytes against 0.97-1.05 on 16, H100, 2026-11-27)
            load_program_bytes=config.load_program_bytes if jobs == 1 else 0,
        )

    # -- the contract ----------------------------------------------------------------------------
    def submit(
        self,
        specs: Sequence[TransferSpec],
        *,
        order_after: Any = "current",
        background: bool = False,
    ) -> Pending:
        """Start copying ``specs`` (checked by the core: ranges, distinct destinations; a
        refused submit changes nothing). ``order_after`` as in ``base.CudaBackend.submit``.
        ``background``: the core's worker thread enqueues the copies, not the caller's (for a
        caller about to wait on the device rather than launch: docs/api.md, "Background
        hand-over")."""
        if self._closed:
            raise ValueError(f"submit: expected an open {self.name} backend, got a closed one")
        if not isinstance(background, bool):
            raise ValueError(f"submit: expected background True or False, got {background!r}")
        if not specs:
            return _Nothing()
        # The Pending is made first: once the core has the jobs nothing here allocates, so no
        # MemoryError can lose a Pending whose jobs then run unseen.
        order = self._order(order_after)
        pending = NativePending((), self._core)
        pending.jobs = self._core.submit(specs, order, background)
        return pending

    def submit_checked(self, specs: Sequence[TransferSpec], *, background: bool = False) -> Pending:
        return self.submit(specs, background=background)  # the core's checks cost O(n) in C

    def layer_gate(self, layers: int) -> LayerGate:
        """A gate of flag words in the core (at most 8 per core)."""
        if self._closed:
            raise ValueError(f"layer_gate: expected an open {self.name} backend, got a closed one")
        return NativeGate(self._core, layers)

    def drain_finished(self) -> list[int]:
        """Ids of the core jobs finished since the last call (``NativePending.ids``)."""
        return list(self._core.finished())

    def stats(self) -> dict[str, int]:
        return dict(self._core.stats())

    def close(self) -> None:
        """Cancel what has not started, wait for what is in flight, stop the core's threads."""
        if self._closed:
            return
        self._closed = True
        self._core.close()
        for ss in self._streams.values():
            for s in ss:
                s.synchronize()
        self._gate_stream.synchronize()
        self._keep.clear()

    def _order(self, order_after: Any) -> int | None:
        return order_stream(order_after, self._device_index)


class NativePending(Pending):
    """One submit: one core job per direction it holds."""

    def __init__(self, jobs: Sequence[Any], core: Any = None) -> None:
        self.jobs = tuple(jobs)
        self.core = core  # the _core.Core the jobs run on (a StallTimer's events are its)

    @property
    def queued_at(self) -> float:
        """When ``submit`` handed the job over (``time.perf_counter`` clock)."""
        return min(float(j.times()[0]) for j in self.jobs)

    @property
    def started_at(self) -> float:
        """When the core started enqueueing it (0 before)."""
        return max(float(j.times()[1]) for j in self.jobs)

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(int(j.id) for j in self.jobs)

    def done(self) -> bool:
        for j in self.jobs:  # noqa: SIM110 (``all`` over a generator: 0.35 us, this loop 0.15)
            if not j.done():
                return False
        return True

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.perf_counter() + timeout
        for j in self.jobs:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not j.wait(left):
                return False
        return True

    def error(self) -> BaseException | None:
        for j in self.jobs:
            info = j.error()
            if info is not None:
                return _exception(info)
        return None

    def cancel(self) -> bool:
        return all([j.cancel() for j in self.jobs])

    def enqueued(self) -> bool:
        for j in self.jobs:
            _, _, enqueued, done = j.times()
            if not (enqueued > 0 or done > 0):  # enqueued, or ended without running
                return False
        return True

    def wait_on(self, stream: object = None, layer: int | None = None) -> None:
        """One GPU-side wait per job, enqueued at once (the host waits only for a job still
        queued behind another); raises the copy's error where it failed while being enqueued (the
        stream then does not wait for it: the engine recomputes)."""
        handle = stream_handle(stream)
        for j in self.jobs:
            at = -1 if layer is None or j.direction != "load" else int(layer)
            if not j.wait_on(handle, at, ENQUEUE_TIMEOUT):
                raise _exception(j.error())

    def layer_waiter(
        self, stream: object = None, layers: int | None = None, timer: StallTimer | None = None
    ) -> LayerWaiter:
        """At most one native wait per call (per load job: one for a submit of loads), and for
        one load job one per layer slice, the whole call in C; everything else resolved here:
        the stream's handle, the job's layers' slices, the timeout. With ``timer``, the core
        records the timer's two events around each wait it enqueues, in the same call."""
        handle, timeout = stream_handle(stream), ENQUEUE_TIMEOUT
        native = None if timer is None or self.core is None else timer.native(self.core)
        loads = [j for j in self.jobs if j.direction == "load"]
        whole = [j for j in self.jobs if j.direction != "load"]
        for j in whole:  # a store has no layers: its wait is enqueued once, here
            if not j.wait_on(handle, -1, timeout):
                raise _exception(j.error())
        if len(loads) != 1:

            def wait_each(layer: int) -> None:
                if layers is not None and (type(layer) is not int or not 0 <= layer < layers):
                    check_layer(layer, layers)
                for j in loads:
                    if not j.wait_on(handle, layer, timeout, native):
                        raise _exception(j.error())

            return wait_each
        job = loads[0]
        # One wait per layer slice is enough on one stream: a slice's flag words are written
        # together once all of its layers landed (pipeline.c, mark_slice), so the layers after
        # the first of a slice need no driver call. The waiter is one C call with the slices
        # resolved here (module_waiter.c): called between the engine's launches, where our code
        # and data are out of the CPU's caches, a Python closure around ``wait_on`` cost more.

        def fail() -> None:
            raise _exception(job.error())

        checked = -1 if layers is None else layers
        waiter: LayerWaiter = job.layer_waiter(handle, checked, timeout, native, check_layer, fail)
        return waiter

    @property
    def layer_slice(self) -> np.ndarray | None:
        for j in self.jobs:
            if j.direction == "load" and j.slices:
                return np.array(j.layer_slice, dtype=np.int64)
        return None

    @property
    def enqueue_seconds(self) -> float:
        """Host time of the core's enqueue (the caller's or a worker's), summed over
        directions."""
        times = [j.times() for j in self.jobs]
        return float(sum(float(t[2]) - float(t[1]) for t in times if t[2] >= t[1] > 0))


class NativeGate(LayerGate):
    """``LayerGate`` on the core's flag words (device memory): ``wait`` is one captured stream
    memory operation (wait until 1); ``open`` writes every layer's word 0 on the replay's stream
    in one call, then, on the core's gate stream, each 1 once its loads landed."""

    def __init__(self, core: Any, layers: int) -> None:
        super().__init__(layers)
        self._core = core
        self.index = int(core.gate(layers))

    def wait(self, stream: object, layer: int) -> None:
        self.check(layer)
        self._core.gate_wait(self.index, stream_handle(stream), layer)

    def open(self, stream: object, pendings: Sequence[Pending]) -> None:
        jobs: list[Any] = []
        for p in pendings:
            if not isinstance(p, NativePending):
                raise ValueError(f"expected this core's transfers, got {type(p).__name__}")
            jobs += p.jobs
        self._core.gate_open(self.index, stream_handle(stream), jobs, ENQUEUE_TIMEOUT)


class _Nothing(Pending):
    """The pending of an empty submit: done at once."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def error(self) -> BaseException | None:
        return None

    def wait_on(self, stream: object = None, layer: int | None = None) -> None:
        return


def _exception(info: Any) -> BaseException:
    if info is None:
        return RuntimeError("the transfer failed")
    code, step, _chunk, desc, message, cancelled = info
    if cancelled:
        return RuntimeError(f"the transfer did not run: {message}")
    if step == extension.STEP_COPY:
        return CudaCopyError(message, int(code), int(desc) if desc >= 0 else None)
    return RuntimeError(str(message))

"""The ``staged`` backend (the default on a GPU): gather on the GPU, then whole-slot DMA, pipelined.

A store copies each block's pieces (one per region: a layer's K, V or page) with a short Triton
kernel into a device staging buffer laid out exactly like host slots, then moves each block's slot
image with one copy-engine descriptor (a whole slot: 0.6-6 MiB, where the copy engines run near the
link). A load does the reverse: slot images to staging by DMA, then a scatter kernel. The transfer
is cut into chunks that go round a ring of ``depth`` staging areas, so the gather of chunk k+1
runs while chunk k is on the link; chunks double in size from ``first_chunk_bytes`` (stores; loads
shrink toward the end) so the one exposed gather (or scatter) is short.

The SMs are busy only for the gathers: HBM is ~50x faster than the link, so a few programs finish
each chunk's gather in a fraction of its link time and leave the rest of the GPU to the model.
Loads of large pieces scatter with fewer programs (``load_programs``) than stores gather with: a
load runs beside the prefill that waits for it, and fewer programs slowed a GEMM beside it less at
the same GB/s (measured, ``StagedConfig``).

Chunks are sized in bytes (``first_chunk_bytes`` up to one staging area), whatever the slot size.
With ``dma_streams`` > 1 consecutive chunks go to different DMA streams, so several copy engines
work at once and one engine's gap between descriptors does not idle the link.

Loads go layer-major (``base``): per slice of consecutive layers, one descriptor per block moves
that slice's bytes (contiguous inside the host slot, since a slot holds the regions back to back in
layer order) into a staging area laid out per slice, then the scatter of that slice; the slice's
event is recorded after its last scatter. The slice count (``_slice_count``) keeps each
descriptor at least ``layer_slice_bytes`` (one descriptor per block and slice; the driver costs
~0.85 us of host time per descriptor and the copy engines lose a little per descriptor), at most
``max_layer_slices``: measured on the H100, 16 slices of 128 KiB moved a 740-block load of 2 MiB
slots as fast as 8 (see ``StagedConfig`` and docs/transfer.md); smaller slots load in fewer.

The per-chunk loop (waits, kernel launches, batch copies, records) runs compiled (``native.c``,
``native.py``) with the GIL released, once Triton has compiled the kernel variant a transfer part
needs; the first use of a variant, and machines without a C compiler, run it in Python
(``_python_loop``, the same calls in the same order). With the compiled loop, transfers up to
``NATIVE_INLINE_BYTES`` are enqueued in the caller's thread.

Staging memory is ``2 * staging_bytes`` of device memory (one ring per direction, so stores and
loads overlap); each ring area holds at least one block.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda import driver as cu
from kvoffload.transfer.cuda import native
from kvoffload.transfer.cuda.base import (
    INLINE_BYTES,
    SLICE_TRANSFER_BYTES,
    CudaBackend,
    Lane,
)
from kvoffload.transfer.cuda.buffers import Buffer, BufferRing
from kvoffload.transfer.cuda.chunks import chunk_blocks, coalesce, slice_count, tile
from kvoffload.transfer.cuda.sm import check_kernel_shape, check_words
from kvoffload.transfer.layout import KVLayout, LayerGroup
from kvoffload.transfer.spec import TransferSpec

log = logging.getLogger(__name__)
_wide = native.wide
# With the compiled loop, transfers up to this many bytes are enqueued in the caller's thread when
# their direction is idle (``base.INLINE_BYTES`` without it: every transfer to the thread). On the
# H100 (2026-11-23, staged_sweep.py "enqueue"), a launch-bound Python loop submitting a 2-block
# store and load per step ran +128% slower per step with the compiled loop on the thread and +54%
# inline (host CPU per transfer 590 vs 192 us; +150% / 648 us with the Python loop on the
# thread), and a 1-block store took 215 vs 147 us end to end: waking the thread costs more than
# the compiled enqueue of a small transfer. Larger transfers (a 740-block load enqueues for
# ~15 ms, mostly in the driver) stay on the thread so the caller goes on at once. 32 MiB: 16
# Llama-3-8B blocks; a load this small is one layer slice (``SLICE_TRANSFER_BYTES``).
NATIVE_INLINE_BYTES = 32 << 20

GATHER, DMA = 0, 1  # a lane's streams: the gather/scatter kernels, then the DMA stream(s)


@dataclass(frozen=True)
class StagedConfig:
    # Device staging memory per direction, in bytes (cut into ``depth`` areas, each at least one
    # block).
    staging_bytes: int = 128 << 20
    # Staging areas per direction: how many chunks can be in flight (gathered, not yet sent).
    depth: int = 4
    # Bytes of the first chunk of a store (the last of a load); chunks double from there.
    first_chunk_bytes: int = 4 << 20
    # Programs of the gather/scatter kernel, and bytes each moves per loop step (a tile of
    # several pieces; see kernels.tile).
    programs: int = 16
    # Programs of a load's scatter where a loop step moves one piece (pieces > 16 KiB: Llama-3-8B,
    # Qwen2.5-7B at 32-token blocks); loads of smaller pieces use ``programs``. On the H100
    # (2026-11-23, staged_sweep.py "programs", Llama-3-8B 512 blocks, 64 KiB pieces) 4 programs
    # loaded 51.5 GB/s as 16 did (51.4), and a bf16 GEMM beside store+load (4 programs both ways)
    # ran +2.1% slower against +3.3% with 16 and +5.7% with 32 (noise 0.8%). Store GB/s at 4
    # programs and smaller pieces were not measured, so stores and those loads keep ``programs``.
    load_programs: int = 4
    chunk_bytes: int = 32768
    num_warps: int = 8
    # DMA streams per direction; consecutive chunks alternate between them. Two gained nothing on
    # the H100 (2 MiB, 320 KiB and 486 KiB slots, same probe), so one.
    dma_streams: int = 1
    # A load's layer slices: each at least this many bytes per block (one descriptor per block and
    # slice), at most ``max_layer_slices`` slices. On the H100 (2026-11-23, staged_sweep.py
    # "overlap": a Llama-3-8B load of 740 blocks beside a synthetic prefill that waits for each
    # layer and computes it in 1.1x / 2x that layer's link time) the prefill waited 2.9 / 3.2 ms
    # beyond its compute with 16 equal slices of 128 KiB, 4.8 / 4.9 ms with 8 of 256 KiB, 4.5 /
    # 2.9 ms with 8 ramped from one layer, 3.4 / 2.2 ms with 16 ramped, 31 ms with one slice per
    # layer (the host fell behind); the load moved 52.4, 52.8, 52.7, 50.8 and 47.1 GB/s.
    layer_slice_bytes: int = 128 << 10
    max_layer_slices: int = 16
    # ... and at most one slice per this many bytes of the load (see ``base``).
    layer_slice_transfer_bytes: int = SLICE_TRANSFER_BYTES
    # > 0: ramped slices, the first holding the fewest layers that make this many bytes per block
    # (``FIRST_SLICE_BYTES``: one Llama-3-8B layer), the next twice as many, up to an equal share
    # (``chunks.slice_bounds``): better where the engine computes a layer in ~2x its link time
    # (numbers above). 0: equal slices.
    first_slice_bytes: int = 0
    # Enqueue each transfer part's chunks with the compiled loop (``native.c``, built at first use
    # with the system C compiler; the GIL is released while it runs) once the copy kernel's
    # variant is compiled; False, or no compiler, or ``KVOFFLOAD_NATIVE=0``: the Python loop.
    native: bool = True

    def __post_init__(self) -> None:
        check_kernel_shape("StagedConfig", self.programs, self.chunk_bytes, self.num_warps)
        for name in (
            "staging_bytes",
            "depth",
            "first_chunk_bytes",
            "load_programs",
            "dma_streams",
            "layer_slice_bytes",
            "max_layer_slices",
            "layer_slice_transfer_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"StagedConfig: expected {name} > 0, got {value!r}")
        if not isinstance(self.first_slice_bytes, int) or self.first_slice_bytes < 0:
            raise ValueError(
                f"StagedConfig: expected first_slice_bytes >= 0, got {self.first_slice_bytes!r}"
            )


class _Ring:
    """One direction's staging areas and the events that hand them between the two streams."""

    def __init__(self, device: Any, depth: int, area_bytes: int, dma_streams: int) -> None:
        import torch

        self.memory = torch.empty(depth * area_bytes, dtype=torch.uint8, device=device)
        base = int(self.memory.data_ptr())
        self.bases = np.arange(depth, dtype=np.int64) * area_bytes + base
        self.filled = [cu.event_create() for _ in range(depth)]  # area's data is ready to move on
        self.free = [cu.event_create() for _ in range(depth)]  # area's data has left
        self.joins = [cu.event_create() for _ in range(dma_streams - 1)]  # extra DMA streams' ends
        self.position = 0  # areas are used round-robin across transfers
        # the same handles as arrays, for the compiled loop
        self.filled_array = np.array(self.filled, dtype=np.uint64).view(np.int64)
        self.free_array = np.array(self.free, dtype=np.uint64).view(np.int64)
        self.dma_array = np.zeros(0, dtype=np.int64)  # the lane's DMA streams (set by the backend)

    def close(self) -> None:
        for e in self.filled + self.free + self.joins:
            cu.event_destroy(e)


@dataclass(frozen=True)
class _Chunk:
    area: int  # staging area
    start: int  # first block (index into the transfer)
    count: int  # blocks
    regions: Any  # device region table of what moves (all regions, or a layer slice)
    unit: int  # bytes per block in the staging area (a slot, or a slice of one)


@dataclass(frozen=True)
class _Prepared:
    """A spec's block ids on the GPU and host slot addresses, shared by its layer slices."""

    index: Buffer
    host: np.ndarray  # int64: address of each block's host slot


@dataclass(frozen=True)
class _Schedule:
    """How a transfer of ``n`` blocks of ``unit`` bytes is cut into chunks (read-only arrays)."""

    sizes: list[int]  # blocks per chunk
    starts: list[int]  # first block of each chunk
    breaks: np.ndarray  # ``starts`` as int64
    chunk: np.ndarray  # chunk index of each block
    offset: np.ndarray  # byte offset of each block in its chunk's staging area
    sizes_array: np.ndarray  # ``sizes`` as int64
    starts_address: int  # of ``breaks`` (for the compiled loop)
    sizes_address: int  # of ``sizes_array``


@functools.lru_cache(maxsize=1024)
def _schedule(n: int, unit: int, first_bytes: int, area_bytes: int, store: bool) -> _Schedule:
    sizes = chunk_blocks(n, unit, first_bytes, area_bytes, "up" if store else "down")
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    chunk = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    offset = (np.arange(n, dtype=np.int64) - starts[chunk]) * unit
    for a in (starts, chunk, offset, sizes):
        a.setflags(write=False)
    return _Schedule(
        sizes.tolist(),
        starts.tolist(),
        starts,
        chunk,
        offset,
        sizes,
        native.address(starts),
        native.address(sizes),
    )


class StagedBackend(CudaBackend):
    name = "staged"
    lane_streams = 2  # GATHER (kernels) and DMA (copy engines); 1 + dma_streams per instance
    lane_tails: ClassVar[dict[str, int]] = {"store": DMA, "load": GATHER}

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        *,
        config: StagedConfig | None = None,
        driver: cu.CudaDriver | None = None,
        submit_thread: bool = True,
        inline_bytes: int | None = None,
    ) -> None:
        check_words(layout)
        self.config = config = config or StagedConfig()
        self.first_slice_bytes = config.first_slice_bytes
        self._group_slot = [g.slot_bytes for g in layout.groups]
        self.lane_streams = 1 + config.dma_streams
        from kvoffload.transfer.cuda.kernels import CopyLauncher  # imports Triton

        self._launcher = CopyLauncher()
        self._index = BufferRing(None, with_device=False)  # placeholder until the device is known
        self._tables = BufferRing(None, with_device=False)
        slot = layout.slot_bytes
        area = max(config.staging_bytes // config.depth, slot)
        self.area_bytes = (area + 255) // 256 * 256
        self._tiles = [
            tile(max(r.page_bytes for r in g.regions), config.chunk_bytes) for g in layout.groups
        ]
        super().__init__(
            layout,
            arena,
            driver=driver,
            submit_thread=submit_thread,
            inline_bytes=INLINE_BYTES if inline_bytes is None else inline_bytes,
        )
        import torch

        with torch.cuda.device(self.device):
            self._rings = {
                d: _Ring(self.device, config.depth, self.area_bytes, config.dma_streams)
                for d in ("store", "load")
            }
        # per group, per layer slice of a load: (offset in the slot, bytes) and its region table
        # with offsets counted from the slice's start (the staging area holds slices back to back)
        self._slice_spans: list[list[tuple[int, int]]] = []
        self._slice_regions: list[list[Any]] = []
        for g, table, parts in zip(layout.groups, self._regions, self.load_parts, strict=True):
            offsets = [*g.offsets, g.slot_bytes]
            spans = [(offsets[p.start], offsets[p.stop] - offsets[p.start]) for p in parts]
            self._slice_spans.append(spans)
            tables = []
            for p, (off, _) in zip(parts, spans, strict=True):
                t = table[:, p.start : p.stop].clone()
                t[3] -= off
                tables.append(t.contiguous())
            self._slice_regions.append(tables)
        self._index = BufferRing(self.device, with_device=True)
        self.min_slice_transfer_bytes = config.layer_slice_transfer_bytes
        self._setup_native()
        if inline_bytes is None and self._native is not None:
            self.inline_bytes = NATIVE_INLINE_BYTES

    # -- the compiled loop (native.c) -----------------------------------------------------------
    def _setup_native(self) -> None:
        """Use ``native.kvo_staged`` where it can run: a built library, the driver's raw entry
        points, and staging areas whose addresses all share one integer width."""
        self.native_parts = 0  # transfer parts enqueued by the compiled loop
        self.python_parts = 0  # ... by the Python loop
        self._native: Any = None
        self.native_reason: str | None = None
        entry: dict[str, int] = getattr(self.driver, "entry", {})
        bases = [int(b) for ring in self._rings.values() for b in ring.bases]
        self._area0 = bases[0]  # any area's address: they all have one width (checked below)
        if not self.config.native:
            self.native_reason = "StagedConfig(native=False)"
        elif native.library() is None:
            self.native_reason = native.unavailable()
        elif not all(entry.get(k) for k in ("launch", "copy", "record", "wait")):
            self.native_reason = "the CUDA driver lacks an entry point the compiled loop calls"
        elif len({_wide(b) for b in bases}) > 1:
            self.native_reason = "staging areas on both sides of 2**31 (mixed argument widths)"
        else:
            self._native = native.library()
        if self._native is None:
            return
        self._native_driver = native.pack_driver(entry)
        self._native_kernels: dict[tuple[Any, ...], np.ndarray] = {}
        self._native_args: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for d, ring in self._rings.items():
            args = native.new_transfer()
            lane = self.lanes[d]
            dmas = np.array(lane.handles[DMA:], dtype=np.uint64).view(np.int64)
            ring.dma_array = dmas  # kept alive with the ring
            for name, value in (
                ("store", int(d == "store")),
                ("depth", self.config.depth),
                ("bases", native.address(ring.bases)),
                ("filled", native.address(ring.filled_array)),
                ("freed", native.address(ring.free_array)),
                ("gather", lane.handles[GATHER]),
                ("dmas", native.address(dmas)),
                ("n_dmas", len(dmas)),
            ):
                args[native.field(name)] = value
            self._native_args[d] = (args, np.zeros(4, dtype=np.int64))

    def _native_kernel(self, spec: TransferSpec, ints: tuple[int, ...]) -> np.ndarray | None:
        """The packed ``kvo_kernel`` of this part's copy-kernel variant, or None (not compiled
        yet: this part goes through Python and Triton, which compiles it)."""
        jobs, words = self._tiles[spec.group]
        store = spec.direction == "store"
        programs = self._programs(spec)
        key = (store, jobs, words, programs, *(_wide(v) for v in ints))
        packed = self._native_kernels.get(key)
        if packed is not None:
            return packed
        try:
            info = self._launcher.native_kernel(
                store, True, jobs, words, self.config.num_warps, ints
            )
        except ValueError as err:  # a Triton whose kernel ABI native.c does not know
            self.native_reason = f"copy kernel: {err}"
            log.warning("kvoffload: the staged backend enqueues in Python: %s", err)
            self._native = None
            return None
        if info is None:
            return None
        packed = self._native_kernels[key] = info.pack(programs)
        return packed

    def _run_native(
        self,
        spec: TransferSpec,
        kernel: np.ndarray,
        plan: _Schedule,
        at: np.ndarray,
        table: np.ndarray,
        position: int,
        index: Buffer,
        regions: Any,
        unit: int,
    ) -> None:
        args, out = self._native_args[spec.direction]
        if table.strides[1] != 8:
            table = np.ascontiguousarray(table)
        row = table.strides[0]
        start = native.address(table)
        f = native.field
        args[f("n_chunks")] = len(plan.sizes)
        args[f("starts")] = plan.starts_address
        args[f("counts")] = plan.sizes_address
        args[f("part_at")] = native.address(at)
        args[f("src")] = start
        args[f("dst")] = start + row
        args[f("size")] = start + 2 * row
        args[f("position")] = position
        args[f("ahead")] = self.config.depth
        args[f("blocks")] = int(index.device.data_ptr())
        args[f("regions")] = int(regions.data_ptr())
        args[f("n_regions")] = regions.shape[1]
        args[f("unit")] = unit
        err = self._native.kvo_staged(
            native.address(self._native_driver),
            native.address(kernel),
            native.address(args),
            native.address(out),
        )
        self.native_parts += 1
        if err:
            code, step, chunk, desc = (int(v) for v in out)
            where = f"chunk {chunk} of {len(plan.sizes)}"
            if step == 2:
                n = table.shape[1]
                index_ = desc if 0 <= desc < n else None
                raise cu.CudaCopyError(
                    f"copy of {where} failed with {cu.error_name(code)} at descriptor "
                    f"{index_} of {n}",
                    code,
                    index_,
                )
            raise RuntimeError(
                f"{native.STEPS.get(step, step)} of {where} failed: {cu.error_name(code)}"
            )

    def _slice_count(self, group: LayerGroup) -> int:
        return slice_count(
            group.slot_bytes,
            group.num_layers,
            self.config.layer_slice_bytes,
            self.config.max_layer_slices,
        )

    @property
    def staging_bytes(self) -> int:
        """Device memory this backend holds for staging (both directions)."""
        return 2 * self.config.depth * self.area_bytes

    def _prepare(self, spec: TransferSpec, lane: Lane) -> _Prepared | None:
        n = len(spec)
        if n == 0:
            return None
        index = self._index.take(n)
        index.host[:n] = spec.blocks
        index.upload(self.driver, n, lane.handles[GATHER])
        host = spec.slots * self.arena.slot_bytes
        host += self.arena.base_address
        return _Prepared(index, host)

    def _release(self, prepared: _Prepared | None, lane: Lane) -> None:
        if prepared is not None:
            self._index.release(prepared.index, lane.tail)

    def _enqueue(
        self, spec: TransferSpec, lane: Lane, part: int | None, prepared: _Prepared | None
    ) -> None:
        if prepared is None:  # no blocks
            return
        n = len(spec)
        store = spec.direction == "store"
        if part is None:  # whole slot images
            offset, unit = 0, self._group_slot[spec.group]
            regions = self._regions[spec.group]
        else:  # one layer slice of every block: its bytes are contiguous inside each slot
            offset, unit = self._slice_spans[spec.group][part]
            regions = self._slice_regions[spec.group][part]
        ring = self._rings[spec.direction]
        depth = self.config.depth
        plan = _schedule(n, unit, self.config.first_chunk_bytes, self.area_bytes, store)
        position = ring.position  # areas are used round-robin across transfers
        ring.position = (position + len(plan.sizes)) % depth
        index = prepared.index
        tables = self._tables.take(3 * n)
        try:
            kernel = None
            if self._native is not None:
                last = len(plan.sizes) - 1
                ints = (plan.starts[last], max(plan.sizes), regions.shape[1], self._area0, unit)
                kernel = self._native_kernel(spec, ints)
            if kernel is not None:
                table, at = self._descriptors(spec, plan, prepared, tables, position, offset, unit)
                parts_at = np.array([*at, table.shape[1]], dtype=np.int64)
                self._run_native(
                    spec, kernel, plan, parts_at, table, position, index, regions, unit
                )
            else:
                self._python_loop(
                    spec, lane, plan, prepared, tables, position, offset, unit, regions
                )
            if store:  # the tail stream waits for the extra DMA streams
                for extra, join in zip(lane.handles[DMA + 1 :], ring.joins, strict=False):
                    cu.event_record(join, extra)
                    cu.stream_wait_event(lane.tail, join)
        finally:
            self._tables.release(tables, lane.tail)

    def _descriptors(
        self,
        spec: TransferSpec,
        plan: _Schedule,
        prepared: _Prepared,
        tables: Buffer,
        position: int,
        offset: int,
        unit: int,
    ) -> tuple[np.ndarray, list[int]]:
        """One descriptor per block (its staged image <-> its bytes in the host slot), whole
        slots that continue each other merged; and where each chunk's descriptors start."""
        n, depth = len(spec), self.config.depth
        ring = self._rings[spec.direction]
        table = tables.host[: 3 * n].reshape(3, n)
        staged, host = (table[0], table[1]) if spec.direction == "store" else (table[1], table[0])
        np.take(ring.bases, (plan.chunk + position) % depth, out=staged)
        staged += plan.offset
        np.add(prepared.host, offset, out=host)
        table[2] = unit
        at: list[int] = plan.starts
        if unit == self.arena.slot_bytes and n > 1:  # whole slots: consecutive ones merge
            table, breaks = coalesce(table, plan.breaks)
            at = breaks.tolist()
        return table, at

    def _python_loop(
        self,
        spec: TransferSpec,
        lane: Lane,
        plan: _Schedule,
        prepared: _Prepared,
        tables: Buffer,
        position: int,
        offset: int,
        unit: int,
        regions: Any,
    ) -> None:
        """``native.kvo_staged`` in Python: the fallback, and the first use of a kernel variant
        (Triton compiles it)."""
        self.python_parts += 1
        store = spec.direction == "store"
        ring, depth = self._rings[spec.direction], self.config.depth
        gather, dmas = lane.handles[GATHER], lane.handles[DMA:]
        index = prepared.index
        areas = [(position + k) % depth for k in range(len(plan.sizes))]
        chunks = [
            _Chunk(area, start, count, regions, unit)
            for area, start, count in zip(areas, plan.starts, plan.sizes, strict=True)
        ]
        # The host runs ``ahead`` chunks in front: a store enqueues the first gathers before it
        # builds the descriptors, a load the first DMAs before the first scatter, so the GPU has
        # queued work while the host enqueues the rest. The area events keep the order.
        ahead = min(depth, len(chunks))
        if store:
            for k in range(ahead):
                self._gather(lane, spec, index, ring, chunks[k])
        table, at = self._descriptors(spec, plan, prepared, tables, position, offset, unit)
        ends = [*at[1:], table.shape[1]]
        parts = [table[:, a:e] for a, e in zip(at, ends, strict=True)]
        if store:
            for k, chunk in enumerate(chunks):
                dma = dmas[k % len(dmas)]
                cu.stream_wait_event(dma, ring.filled[chunk.area])
                self.driver.memcpy_batch(parts[k], dma)
                cu.event_record(ring.free[chunk.area], dma)
                if k + ahead < len(chunks):
                    self._gather(lane, spec, index, ring, chunks[k + ahead])
        else:
            for k in range(ahead):
                self._send(dmas[k % len(dmas)], ring, chunks[k].area, parts[k])
            for k, chunk in enumerate(chunks):
                cu.stream_wait_event(gather, ring.filled[chunk.area])
                self._move(lane, spec, index, chunk, int(ring.bases[chunk.area]))
                cu.event_record(ring.free[chunk.area], gather)
                if k + ahead < len(chunks):
                    later = k + ahead
                    self._send(dmas[later % len(dmas)], ring, chunks[later].area, parts[later])

    def _gather(
        self, lane: Lane, spec: TransferSpec, index: Buffer, ring: _Ring, chunk: _Chunk
    ) -> None:
        """A store's chunk: wait for its staging area to be free, gather into it, mark it filled."""
        gather = lane.handles[GATHER]
        cu.stream_wait_event(gather, ring.free[chunk.area])
        self._move(lane, spec, index, chunk, int(ring.bases[chunk.area]))
        cu.event_record(ring.filled[chunk.area], gather)

    def _send(self, dma: int, ring: _Ring, area: int, part: np.ndarray) -> None:
        """A load's chunk: once its staging area is free, DMA the slots into it, mark it filled."""
        cu.stream_wait_event(dma, ring.free[area])
        self.driver.memcpy_batch(part, dma)
        cu.event_record(ring.filled[area], dma)

    def _move(
        self, lane: Lane, spec: TransferSpec, index: Buffer, chunk: _Chunk, area: int
    ) -> None:
        """Gather (store) or scatter (load) the chunk's blocks between the engine and ``area``."""
        jobs, words = self._tiles[spec.group]
        store = spec.direction == "store"
        programs = self._programs(spec)
        self._launcher.launch(
            lane.streams[GATHER],
            programs,
            index.device,
            index.device,
            chunk.regions,
            chunk.start,
            chunk.count,
            chunk.regions.shape[1],
            area,
            chunk.unit,
            to_host=store,
            identity=True,
            jobs=jobs,
            words=words,
            num_warps=self.config.num_warps,
        )

    def _programs(self, spec: TransferSpec) -> int:
        """Programs of the copy kernel for ``spec``: ``load_programs`` for loads of pieces that
        fill a loop step alone (one job per step), ``programs`` otherwise."""
        jobs = self._tiles[spec.group][0]
        store = spec.direction == "store"
        return self.config.programs if store or jobs > 1 else self.config.load_programs

    def _close_buffers(self) -> None:
        self._index.close()
        self._tables.close()
        for ring in self._rings.values():
            ring.close()

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

This is the Python path of the ``staged`` backend: the fallback where the native engine
(``engine.py``, the compiled extension built at install) is missing or disabled, and the oracle its
CPU tests compare call orders with. ``native/pipeline.c`` runs the same steps in the same order.

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
from kvoffload.transfer.cuda.base import INLINE_BYTES, CudaBackend, Lane
from kvoffload.transfer.cuda.buffers import Buffer, BufferRing
from kvoffload.transfer.cuda.chunks import chunk_blocks, coalesce, slice_count, tile
from kvoffload.transfer.cuda.sm import check_words
from kvoffload.transfer.cuda.staged_config import StagedConfig

__all__ = ["StagedBackend", "StagedConfig"]
from kvoffload.transfer.layout import KVLayout, LayerGroup
from kvoffload.transfer.spec import TransferSpec

log = logging.getLogger(__name__)
GATHER, DMA = 0, 1  # a lane's streams: the gather/scatter kernels, then the DMA stream(s)


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
        path_reason: str | None = "StagedConfig(native=False)",
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
        self.path = "python"  # which path moves this backend's transfers (doctor, benchmarks)
        self.path_reason: str | None = path_reason

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
        tables = self._tables.take(3 * n)
        try:
            self._python_loop(spec, lane, plan, prepared, tables, position, offset, unit, regions)
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
        """The chunk loop (``native/pipeline.c``'s ``enqueue_part`` in Python)."""
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

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

Staging memory is ``2 * staging_bytes`` of device memory (one ring per direction, so stores and
loads overlap); each ring area holds at least one block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda import driver as cu
from kvoffload.transfer.cuda.base import CudaBackend, Lane
from kvoffload.transfer.cuda.buffers import Buffer, BufferRing
from kvoffload.transfer.cuda.chunks import chunk_sizes, coalesce, tile
from kvoffload.transfer.cuda.sm import check_kernel_shape, check_words
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec

GATHER, DMA = 0, 1  # a lane's two streams


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
    chunk_bytes: int = 32768
    num_warps: int = 8

    def __post_init__(self) -> None:
        check_kernel_shape("StagedConfig", self.programs, self.chunk_bytes, self.num_warps)
        for name in ("staging_bytes", "depth", "first_chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"StagedConfig: expected {name} > 0, got {value!r}")


class _Ring:
    """One direction's staging areas and the events that hand them between the two streams."""

    def __init__(self, device: Any, depth: int, area_bytes: int) -> None:
        import torch

        self.memory = torch.empty(depth * area_bytes, dtype=torch.uint8, device=device)
        base = int(self.memory.data_ptr())
        self.bases = np.arange(depth, dtype=np.int64) * area_bytes + base
        self.filled = [cu.event_create() for _ in range(depth)]  # area's data is ready to move on
        self.free = [cu.event_create() for _ in range(depth)]  # area's data has left
        self.position = 0  # areas are used round-robin across transfers

    def close(self) -> None:
        for e in self.filled + self.free:
            cu.event_destroy(e)


class StagedBackend(CudaBackend):
    name = "staged"
    lane_streams = 2  # GATHER (kernels) and DMA (copy engines)
    lane_tails: ClassVar[dict[str, int]] = {"store": DMA, "load": GATHER}

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        *,
        config: StagedConfig | None = None,
        driver: cu.CudaDriver | None = None,
        submit_thread: bool = True,
    ) -> None:
        check_words(layout)
        self.config = config = config or StagedConfig()
        from kvoffload.transfer.cuda.kernels import CopyLauncher  # imports Triton

        self._launcher = CopyLauncher()
        self._index = BufferRing(None, with_device=False)  # placeholder until the device is known
        self._tables = BufferRing(None, with_device=False)
        slot = layout.slot_bytes
        area = max(config.staging_bytes // config.depth, slot)
        self.area_bytes = (area + 255) // 256 * 256
        self.area_blocks = [self.area_bytes // g.slot_bytes for g in layout.groups]
        self._tiles = [
            tile(max(r.page_bytes for r in g.regions), config.chunk_bytes) for g in layout.groups
        ]
        super().__init__(layout, arena, driver=driver, submit_thread=submit_thread)
        import torch

        with torch.cuda.device(self.device):
            self._rings = {
                d: _Ring(self.device, config.depth, self.area_bytes) for d in ("store", "load")
            }
        self._index = BufferRing(self.device, with_device=True)

    @property
    def staging_bytes(self) -> int:
        """Device memory this backend holds for staging (both directions)."""
        return 2 * self.config.depth * self.area_bytes

    def _enqueue(self, spec: TransferSpec, lane: Lane) -> None:
        store = spec.direction == "store"
        group = self.layout.groups[spec.group]
        slot = group.slot_bytes
        ring = self._rings[spec.direction]
        n = len(spec)
        if n == 0:
            return
        first = max(1, self.config.first_chunk_bytes // slot)
        sizes = chunk_sizes(n, first, self.area_blocks[spec.group], "up" if store else "down")
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        areas = (ring.position + np.arange(len(sizes))) % self.config.depth
        ring.position = int((ring.position + len(sizes)) % self.config.depth)
        bases = ring.bases[areas]
        gather, dma = lane.handles[GATHER], lane.handles[DMA]
        index = self._index.take(n)
        tables = self._tables.take(3 * n)
        try:
            index.host[:n] = spec.blocks
            index.upload(self.driver, n, gather)
            chunks = list(zip(areas.tolist(), starts.tolist(), sizes.tolist(), strict=True))
            # The host runs ``ahead`` chunks in front: a store enqueues the first gathers before it
            # builds the descriptors, a load the first DMAs before the first scatter, so the GPU
            # has queued work while the host enqueues the rest. The area events keep the order.
            ahead = min(self.config.depth, len(chunks))
            if store:
                for k in range(ahead):
                    self._gather(lane, spec, index, ring, slot, *chunks[k])
            # One descriptor per block: its staged slot image <-> its host slot.
            table = tables.host[: 3 * n].reshape(3, n)
            within = np.arange(n, dtype=np.int64) - np.repeat(starts, sizes)
            staged = np.repeat(bases, sizes) + within * slot
            host = spec.slots * self.arena.slot_bytes + self.arena.base_address
            table[0], table[1] = (staged, host) if store else (host, staged)
            table[2] = slot
            table, at = coalesce(table, starts)
            ends = np.append(at[1:], table.shape[1]).tolist()
            parts = [table[:, a:e] for a, e in zip(at.tolist(), ends, strict=True)]
            if store:
                for k, (area, _, _) in enumerate(chunks):
                    cu.stream_wait_event(dma, ring.filled[area])
                    self.driver.memcpy_batch(parts[k], dma)
                    cu.event_record(ring.free[area], dma)
                    if k + ahead < len(chunks):
                        self._gather(lane, spec, index, ring, slot, *chunks[k + ahead])
            else:
                for k in range(ahead):
                    self._send(dma, ring, chunks[k][0], parts[k])
                for k, (area, start, count) in enumerate(chunks):
                    cu.stream_wait_event(gather, ring.filled[area])
                    self._move(lane, spec, index, start, count, int(ring.bases[area]), slot)
                    cu.event_record(ring.free[area], gather)
                    if k + ahead < len(chunks):
                        self._send(dma, ring, chunks[k + ahead][0], parts[k + ahead])
        finally:
            self._index.release(index, lane.tail)
            self._tables.release(tables, lane.tail)

    def _gather(
        self,
        lane: Lane,
        spec: TransferSpec,
        index: Buffer,
        ring: _Ring,
        slot: int,
        area: int,
        start: int,
        count: int,
    ) -> None:
        """A store's chunk: wait for its staging area to be free, gather into it, mark it filled."""
        gather = lane.handles[GATHER]
        cu.stream_wait_event(gather, ring.free[area])
        self._move(lane, spec, index, start, count, int(ring.bases[area]), slot)
        cu.event_record(ring.filled[area], gather)

    def _send(self, dma: int, ring: _Ring, area: int, part: np.ndarray) -> None:
        """A load's chunk: once its staging area is free, DMA the slots into it, mark it filled."""
        cu.stream_wait_event(dma, ring.free[area])
        self.driver.memcpy_batch(part, dma)
        cu.event_record(ring.filled[area], dma)

    def _move(
        self,
        lane: Lane,
        spec: TransferSpec,
        index: Buffer,
        start: int,
        count: int,
        area: int,
        slot: int,
    ) -> None:
        """Gather (store) or scatter (load) blocks ``[start, start + count)`` of the transfer."""
        self._launcher.launch(
            lane.streams[GATHER],
            self.config.programs,
            index.device,
            index.device,
            self._regions[spec.group],
            start,
            count,
            len(self.layout.groups[spec.group].regions),
            area,
            slot,
            to_host=spec.direction == "store",
            identity=True,
            jobs=self._tiles[spec.group][0],
            words=self._tiles[spec.group][1],
            num_warps=self.config.num_warps,
        )

    def _close_buffers(self) -> None:
        self._index.close()
        self._tables.close()
        for ring in self._rings.values():
            ring.close()

"""The ``dma`` backend: one copy-engine descriptor per (block, region) piece, one batch call.

This is what vLLM's offloading does (one descriptor per layer x K/V x block). It uses no SMs, so it
never slows the model, but the copy engines pay a fixed cost per descriptor: near the link on
pieces of 1 MiB and more (e.g. the cross-layer layout, one piece per block), far below it on
4-64 KiB pieces. Descriptors that continue each other in both source and destination are merged
first (consecutive blocks stored to consecutive slots in a cross-layer layout become one copy).
A load is one batch call per layer slice (``base``), each followed by its slice's event.
"""

from __future__ import annotations

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda import driver as cu
from kvoffload.transfer.cuda.base import INLINE_BYTES, CudaBackend, Lane
from kvoffload.transfer.cuda.buffers import BufferRing
from kvoffload.transfer.cuda.chunks import coalesce
from kvoffload.transfer.descriptors import build_descriptors, region_arrays
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec


class DmaBackend(CudaBackend):
    name = "dma"

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        *,
        driver: cu.CudaDriver | None = None,
        submit_thread: bool = True,
        inline_bytes: int = INLINE_BYTES,
        merge: bool = True,
    ) -> None:
        self._merge = merge  # merge contiguous descriptors (off: exactly one per piece)
        self._tables = BufferRing(None, with_device=False)
        self._arrays = [region_arrays(g) for g in layout.groups]
        super().__init__(
            layout, arena, driver=driver, submit_thread=submit_thread, inline_bytes=inline_bytes
        )

    def _enqueue(self, spec: TransferSpec, lane: Lane, part: int | None, prepared: None) -> None:
        group = self.layout.groups[spec.group]
        regions = range(len(group.regions)) if part is None else self.load_parts[spec.group][part]
        n = len(spec) * len(regions)
        if n == 0:
            return
        buf = self._tables.take(3 * n)
        try:
            table = build_descriptors(
                spec,
                group,
                self.arena.base_address,
                self.arena.slot_bytes,
                out=buf.host[: 3 * n].reshape(3, n),
                regions=regions,
                arrays=self._arrays[spec.group],
            )
            if self._merge:
                table, _ = coalesce(table)
            self.driver.memcpy_batch(table, lane.tail)
        finally:
            self._tables.release(buf, lane.tail)

    def _close_buffers(self) -> None:
        self._tables.close()

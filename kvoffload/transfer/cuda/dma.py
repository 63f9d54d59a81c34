"""The ``dma`` backend: one copy-engine descriptor per (block, region) piece, one batch call.

This is what vLLM's offloading does (one descriptor per layer x K/V x block), and the fallback of
``staged`` where the native engine cannot run. It uses no SMs, so it never slows the model, but the
copy engines pay a fixed cost per descriptor: near the link on pieces of 1 MiB and more (e.g. the
cross-layer layout, one piece per block), far below it on 4-64 KiB pieces. Descriptors that
continue each other in both source and destination are merged first (consecutive blocks stored to
consecutive slots in a cross-layer layout become one copy). A transfer is one batch call per spec,
enqueued in the caller's thread (``base``); the driver reads the descriptor table during the call.
"""

from __future__ import annotations

from typing import Any

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda import driver as cu
from kvoffload.transfer.cuda.base import CudaBackend
from kvoffload.transfer.descriptors import build_descriptors, coalesce, region_arrays
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec


class DmaBackend(CudaBackend):
    name = "dma"
    path_reason: str | None = None  # set where ``make_staged`` fell back to this backend: why

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        *,
        driver: cu.CudaDriver | None = None,
        merge: bool = True,
    ) -> None:
        super().__init__(layout, arena, driver=driver)
        self._merge = merge  # merge contiguous descriptors (off: exactly one per piece)
        self._arrays = [region_arrays(g) for g in layout.groups]

    def _enqueue(self, spec: TransferSpec, stream: Any) -> None:
        table = build_descriptors(
            spec,
            self.layout.groups[spec.group],
            self.arena.base_address,
            self.arena.slot_bytes,
            arrays=self._arrays[spec.group],
        )
        if self._merge:
            table = coalesce(table)
        self.driver.memcpy_batch(table, int(stream.cuda_stream))

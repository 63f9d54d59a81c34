"""The ``sm`` backend: a Triton copy kernel reads and writes the host arena through UVA.

Fast on small pieces (the SMs issue many PCIe requests at once), but it occupies SMs for the whole
transfer, so it slows the model running beside it; kept for comparison and tiny transfers. One
launch per spec, enqueued in the caller's thread (``base``). The defaults are vLLM's tuned
constants (12 programs, 8 KiB per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda import driver as cu
from kvoffload.transfer.cuda.base import CudaBackend, upload
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec


@dataclass(frozen=True)
class SmConfig:
    # Programs (CTAs) of the copy kernel: each occupies one SM while the transfer runs.
    programs: int = 12
    # Bytes each program moves per loop step (a power of two, >= 64).
    chunk_bytes: int = 8192
    num_warps: int = 4

    def __post_init__(self) -> None:
        check_kernel_shape("SmConfig", self.programs, self.chunk_bytes, self.num_warps)


def check_kernel_shape(what: str, programs: int, chunk_bytes: int, num_warps: int) -> None:
    if programs <= 0:
        raise ValueError(f"{what}: expected programs > 0, got {programs}")
    if chunk_bytes < 64 or chunk_bytes & (chunk_bytes - 1):
        raise ValueError(f"{what}: expected chunk_bytes a power of two >= 64, got {chunk_bytes}")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{what}: expected num_warps in (1, 2, 4, 8, 16), got {num_warps}")


def check_words(layout: KVLayout) -> None:
    for g in layout.groups:
        for r in g.regions:
            if r.page_bytes % 8 or r.base % 8 or r.block_stride % 8:
                raise ValueError(
                    "expected 8-byte aligned regions (base, block stride, page bytes) for the "
                    f"copy kernel, got {r}"
                )


class SmBackend(CudaBackend):
    name = "sm"

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        *,
        config: SmConfig | None = None,
        driver: cu.CudaDriver | None = None,
    ) -> None:
        check_words(layout)
        if arena.slot_bytes % 8:
            raise ValueError(
                f"expected host slots of a multiple of 8 bytes, got {arena.slot_bytes}"
            )
        self.config = config or SmConfig()
        from kvoffload.transfer.cuda.kernels import CopyLauncher  # imports Triton

        self._launcher = CopyLauncher()
        super().__init__(layout, arena, driver=driver)
        import torch

        with torch.cuda.device(self.device):
            self._host_base = cu.host_device_pointer(arena.base_address)

    def _enqueue(self, spec: TransferSpec, stream: Any) -> tuple[Any, Any]:
        """One launch over every region of every block; the block and slot ids uploaded first
        (slots start 16-byte aligned, as the compiled kernel assumes)."""
        n = len(spec)
        half = (n + 1) // 2 * 2
        ids = np.zeros(2 * half, dtype=np.int64)
        ids[:n] = spec.blocks
        ids[half : half + n] = spec.slots
        host, dev = upload(self.driver, ids, self.device, stream)
        regions = self._regions[spec.group]
        self._launcher.launch(
            stream,
            self.config.programs,
            dev,
            dev[half:],
            regions,
            0,
            n,
            regions.shape[1],
            self._host_base,
            self.arena.slot_bytes,
            to_host=spec.direction == "store",
            identity=False,
            jobs=1,
            words=self.config.chunk_bytes // 8,
            num_warps=self.config.num_warps,
        )
        return host, dev

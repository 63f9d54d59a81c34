"""``vllm-triton``: vLLM's Triton copy path for KV offloading, behind our ``CopyBackend``.

The reference the issue asks for (issue 21, "What it must show"): vLLM PR #42212 ("Triton fast
path for small CPU->GPU swap_blocks_batch in the offloading connector", merged, reviewed in May
2026) published 37-48 GB/s H2D on an H100 at 4-24 KiB pages with it, above what our ``sm``
backend measured on such pieces. This backend reproduces vLLM's kernel and its settings so both
run in one benchmark, on our layouts and our arena. Source read (vllm-project/vllm):

- ``vllm/v1/kv_offload/cpu/triton_swap.py`` at commit 253f027c73676e34b6ace250221bbda5b74d619e
  (the file the PR added, as stored at that commit; later renamed ``swap_blocks_triton.py``,
  same kernel, e.g. at commit 00d8649adca4b042f0d9cd373594570a32eb8702): ``NUM_SMS = 12``, the
  kernel ``_swap_blocks_kernel`` (one program per descriptor, striding by the program count;
  each descriptor copied in ``BYTES_PER_CHUNK`` steps of 8-byte words, the last step masked),
  launched on a grid of ``min(NUM_SMS, n)`` programs with Triton's default 4 warps, its three
  int64 descriptor arrays (source address, destination address, bytes) copied to the GPU first.
- ``vllm/v1/kv_offload/cpu/gpu_worker.py``, ``_select_swap_blocks_fn``: ``BYTES_PER_CHUNK =
  min(next_power_of_2(max page bytes), 8192)``; descriptors built per KV tensor, then per block
  (tensor-major); host addresses are the pinned CPU tensor's own (UVA).

What is the same here: the kernel (rewritten in ``vllm_triton_kernel``, the same loop), grid,
warps and chunk rule, descriptor order (region-major: every block of region 0, then region 1,
...), one launch per transfer (no layer slices), a JIT launch per transfer (its host cost
included). What differs, and why:

- vLLM uses this path only for loads (H2D), only where every page is under 28 KiB and a transfer
  has at least 16 descriptors (``THRESHOLD_BYTES``, ``MIN_N``), and ``cuMemcpyBatchAsync``
  otherwise. Here the kernel runs every transfer, both directions and every piece size, so the
  benchmark shows the kernel itself where vLLM would and would not pick it (our ``dma`` backend
  with ``merge=False`` is vLLM's other path).
- The three descriptor arrays go up in one copy from a pinned buffer (vLLM: three
  ``.to("cuda", non_blocking=True)`` calls; later versions from pooled pinned buffers): the GPU
  reads the same tables.
- Ordering, streams, events and completion are our ``CudaBackend``'s (``kvoffload.transfer.cuda.
  base``), as for ``dma`` and ``sm``: enqueued in the caller's thread, a store waits for the
  caller's stream, loads and stores run on their own streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend
from kvoffload.transfer.cuda import driver as cu
from kvoffload.transfer.cuda.base import CudaBackend, upload
from kvoffload.transfer.cuda.sm import check_words
from kvoffload.transfer.descriptors import region_arrays
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec

NAME = "vllm-triton"


@dataclass(frozen=True)
class VllmTritonConfig:
    # vLLM's NUM_SMS: programs of the copy kernel (the grid is min(programs, pieces)).
    programs: int = 12
    # vLLM's cap on BYTES_PER_CHUNK; the chunk is the next power of two of the largest page, at
    # most this.
    max_chunk_bytes: int = 8192

    def __post_init__(self) -> None:
        if self.programs <= 0:
            raise ValueError(f"VllmTritonConfig: expected programs > 0, got {self.programs}")
        m = self.max_chunk_bytes
        if m < 8 or m & (m - 1):
            raise ValueError(
                f"VllmTritonConfig: expected max_chunk_bytes a power of two >= 8, got {m}"
            )


class Launcher(Protocol):
    def launch(
        self, stream: Any, src: Any, dst: Any, sizes: Any, n: int, programs: int, chunk: int
    ) -> None: ...


def chunk_bytes(page_bytes: list[int], cap: int) -> int:
    """vLLM's BYTES_PER_CHUNK: the next power of two of the largest page, at most ``cap``."""
    if not page_bytes:
        raise ValueError("expected at least one page size, got none")
    largest = max(page_bytes)
    return min(1 << max(0, largest - 1).bit_length(), cap)


def piece_table(
    spec: TransferSpec,
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    regions: range,
    host_base: int,
    slot_bytes: int,
    out: np.ndarray,
) -> int:
    """Write ``spec``'s pieces of ``regions`` into the first ``n`` columns of ``out`` (int64,
    three rows: source addresses, destination addresses, bytes), region-major as vLLM orders
    them; returns ``n``. ``arrays``: ``region_arrays(group)``; ``host_base``: the arena's
    device-visible address."""
    bases, strides, pages, offsets = (a[regions.start : regions.stop] for a in arrays)
    n = len(spec) * len(bases)
    if out.dtype != np.int64 or out.ndim != 2 or out.shape[0] != 3 or out.shape[1] < n:
        raise ValueError(f"expected an int64 (3, >= {n}) table, got {out.dtype} {out.shape}")
    table = out[:, :n].reshape(3, len(bases), len(spec))
    engine, host = (0, 1) if spec.direction == "store" else (1, 0)
    np.multiply(strides[:, None], spec.blocks[None, :], out=table[engine])
    table[engine] += bases[:, None]
    np.multiply(spec.slots[None, :], slot_bytes, out=table[host])
    table[host] += offsets[:, None] + host_base
    table[2] = pages[:, None]
    return n


class VllmTritonBackend(CudaBackend):
    """vLLM's Triton swap kernel and settings as a ``CopyBackend`` (see the module docstring)."""

    name = NAME

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        *,
        config: VllmTritonConfig | None = None,
        launcher: Launcher | None = None,
        driver: cu.CudaDriver | None = None,
    ) -> None:
        check_words(layout)
        if arena.slot_bytes % 8:
            raise ValueError(
                f"expected host slots of a multiple of 8 bytes, got {arena.slot_bytes}"
            )
        self.config = config or VllmTritonConfig()
        if launcher is None:
            from kvoffload.bench.vllm_triton_kernel import SwapLauncher  # imports Triton

            launcher = SwapLauncher()
        self._launcher = launcher
        pages = [r.page_bytes for g in layout.groups for r in g.regions]
        self.chunk_bytes = chunk_bytes(pages, self.config.max_chunk_bytes)
        self._arrays = [region_arrays(g) for g in layout.groups]
        super().__init__(layout, arena, driver=driver)
        import torch

        with torch.cuda.device(self.device):
            self._host_base = cu.host_device_pointer(arena.base_address)

    def _enqueue(self, spec: TransferSpec, stream: Any) -> tuple[Any, Any]:
        regions = range(len(self.layout.groups[spec.group].regions))
        n = len(spec) * len(regions)
        # Each row starts 16-byte aligned (an even count of int64), as vLLM's three separate
        # tensors do: Triton compiles a variant per pointer alignment.
        m = (n + 1) // 2 * 2
        table = np.zeros((3, m), dtype=np.int64)
        piece_table(
            spec, self._arrays[spec.group], regions, self._host_base, self.arena.slot_bytes, table
        )
        host, dev = upload(self.driver, table.reshape(-1), self.device, stream)
        self._launcher.launch(
            stream, dev, dev[m:], dev[2 * m :], n, self.config.programs, self.chunk_bytes
        )
        return host, dev


def make_backend(layout: KVLayout, arena: HostArena) -> CopyBackend:
    """``vllm-triton`` with vLLM's settings (12 programs, chunk up to 8 KiB); needs CUDA and
    Triton (ImportError without Triton, ValueError for a CPU layout or an unpinned arena)."""
    return VllmTritonBackend(layout, arena)

"""``StagedConfig``: the settings of the ``staged`` path (native engine and Python fallback alike).

Each constant keeps one line of reason here; the measurements that chose it are in
docs/transfer.md ("Staged settings").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.transfer.cuda.base import SLICE_TRANSFER_BYTES
from kvoffload.transfer.cuda.sm import check_kernel_shape


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
    # Run transfers on the native engine (the compiled extension, ``engine.py``) where it is
    # built; False, a missing extension or ``KVOFFLOAD_NATIVE=0``: the Python path (staged.py).
    native: bool = True
    # Native engine: a transfer up to this many bytes is enqueued in the caller's thread (the GIL
    # released) when its direction is idle, instead of waking the direction's thread; larger ones
    # go to the thread so the caller goes on at once (docs/transfer.md, "Native engine").
    native_inline_bytes: int = 32 << 20

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
        if not isinstance(self.native_inline_bytes, int) or self.native_inline_bytes < 0:
            raise ValueError(
                f"StagedConfig: expected native_inline_bytes >= 0, got {self.native_inline_bytes!r}"
            )
        if not isinstance(self.first_slice_bytes, int) or self.first_slice_bytes < 0:
            raise ValueError(
                f"StagedConfig: expected first_slice_bytes >= 0, got {self.first_slice_bytes!r}"
            )

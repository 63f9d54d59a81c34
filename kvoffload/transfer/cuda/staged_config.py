"""``StagedConfig``: the settings of the ``staged`` backend (the native core; where it cannot run,
``make_staged`` falls back to ``dma``, which takes none of these).

Each constant keeps one line of reason here; the measurements that chose it are in
docs/transfer.md ("Staged settings").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.transfer.cuda.sm import check_kernel_shape

# At most one layer slice per this many bytes of a load: ~0.6 ms of link time at 54 GB/s against
# ~0.2 ms of host time per slice that the former Python enqueue took (H100 VM, 2026-11-23); the
# native core kept the rule (its per-slice cost is lower; not re-measured).
SLICE_TRANSFER_BYTES = 32 << 20
# A ramped load's first slice holds >= this many bytes per block (one Llama-3-8B layer at 16-token
# blocks); off by default (docs/transfer.md, "Layer slices").
FIRST_SLICE_BYTES = 64 << 10


@dataclass(frozen=True)
class StagedConfig:
    # Device staging memory per direction (cut into ``depth`` areas, each at least one block).
    staging_bytes: int = 128 << 20
    # Chunks in flight per direction (gathered, not yet sent).
    depth: int = 4
    # A store's first chunk (a load's last); chunks double from there: a short exposed gather.
    first_chunk_bytes: int = 4 << 20
    # Gather/scatter programs: enough to outrun the link on small pieces, few SMs taken.
    programs: int = 16
    # Scatter programs for loads of pieces > 16 KiB; 0: one per SM of the device. A short
    # scatter on many SMs delays a GPU-bound model's kernels less than a long one on few: on an
    # H100 a CUDA graph of 100 bf16 4096^3 GEMMs ran +26% slower beside a 256-block load
    # scattered by 1 program, +16% by 4, +3% by 16 (2026-11-25); on an H200, 32 bf16 GEMMs beside
    # a 512 MiB load lost 0.43-0.56 ms with 16 programs, 0.31-0.34 with 32-64, 0.16 with 132 (one
    # per SM), and a full-graph restore's forward 1.21-1.27 -> 0.98-1.01 ms against gpu_all's.
    # But an eager step of tiny kernels beside another thread's 1-16-block loads every 2 ms ran
    # +14.3% with 16 and +21.7% / +23.1% with one per SM (same H200, A/B/A, 2026-11-26): a
    # scatter on every SM holds the engine's small kernels. 16 stays the default; 0 suits an
    # engine whose forward is one graph of large kernels (docs/transfer.md, "Scatter programs").
    load_programs: int = 16
    # > 0: a load chunk's scatter of pieces > 16 KiB (the kernel ``load_programs`` sizes) runs on
    # one program per this many bytes of the chunk, at least ``load_programs`` and at most one per
    # SM: a 32 MiB layer slice on 128 short programs, a small load on few; tiled small pieces keep
    # ``programs`` (1,000-block fp8 loads read 0.91-0.98 of the link by bytes, 0.97-1.05 on 16).
    # Beside a Llama-3-8B restore the forward's device time grew +0.78-1.36 ms with it against
    # +1.58-1.94 with 16 (H100, bench e2e, eager chat, A/B/B/A), while an
    # eager step of tiny kernels beside small loads, which one program per SM for every load
    # slowed (above), did not move (docs/transfer.md, "thirteenth round"). 0: ``load_programs``
    # for every chunk.
    load_program_bytes: int = 256 << 10
    # Bytes each program moves per loop step (a tile of several small pieces; kernels.tile).
    chunk_bytes: int = 32768
    num_warps: int = 8
    # DMA streams per direction. Two let a store's chunk wait for the chunk before it (one chunk
    # in the copy engine's queue at a time), so a device-to-host copy the engine enqueues behind
    # a store (its sampled tokens) waits for at most one chunk, not the whole store (pipeline.c,
    # ``pace_store``). One: a store's chunks queued back to back.
    dma_streams: int = 2
    # A load's layer slices keep >= this many bytes per block (one descriptor per block and
    # slice), at most ``max_layer_slices`` of them (docs/transfer.md, "Layer slices").
    layer_slice_bytes: int = 128 << 10
    max_layer_slices: int = 16
    # ... and at most one slice per this many bytes of the load (``SLICE_TRANSFER_BYTES``).
    layer_slice_transfer_bytes: int = SLICE_TRANSFER_BYTES
    # How a load's slice count is chosen among the counts the rules above allow: the fewest
    # expected microseconds of the caller's enqueue plus the first slice's time on the link
    # (more slices: a shorter first slice, but a copy descriptor per block and slice where host
    # slots are scattered). Host ns per batch descriptor, 2D copy, chunk and slice, measured on
    # an H100 with driver 580 (docs/transfer.md, "Enqueue cost"), and the link in GB/s; a link
    # of 0 takes the most slices the rules allow.
    enqueue_ns: tuple[int, int, int, int] = (1350, 3000, 8000, 3000)
    plan_link_GBps: float = 50.0
    # > 0: ramped slices from this many bytes per block (``FIRST_SLICE_BYTES``); 0: equal slices,
    # which waited less unless the engine computes a layer in ~2x its link time.
    first_slice_bytes: int = 0
    # Native core: transfers up to this size are enqueued whole by the caller (GIL released)
    # when their direction is idle, so no thread of ours makes driver calls while the engine then
    # launches its forward (such calls slowed a launch-bound step by 13-160%, docs/transfer.md,
    # "Quiet beside the forward"); larger ones go to the direction's worker thread. Default: all.
    native_inline_bytes: int = 1 << 62
    # CUDA priority of the copy streams (torch.cuda.Stream(priority=...); lower is more urgent,
    # 0 is the default and lowest): the gather/scatter kernels queue behind the model's or ahead
    # of them (docs/transfer.md, "Stream priority").
    copy_priority: int = 0
    # True: a load's chunk is copied and scattered on one DMA stream (its staging area's), with
    # no event between them: fewer driver calls per chunk (its copies and one launch, against
    # four event calls more) and at most ``dma_streams`` chunks in the copy engine's queue.
    # Needs ``depth`` a multiple of ``dma_streams``. On by default: an engine uploading its
    # inputs asynchronously waited 1.4 ms instead of 10 ms (H200, piecewise). The full-graph
    # stall the fifth round gave to the split pipeline was the ``auto`` backend's plain layer
    # gate (docs/e2e.md, "Sixth round").
    load_coupled: bool = True
    # Coupled loads: a load's chunk is staged in this many consecutive areas of its DMA stream
    # (0: all of them, ``depth // dma_streams``). A layer slice that fits is one chunk on one
    # stream: its flag words follow its scatter with no join of another stream, and it is not
    # cut into chunks of one area. With the fake driver a 176-block Llama-3-8B load in 8 slices
    # takes 33 driver calls instead of 63 (host slots in one run), 57 instead of 79 (four runs).
    # The cost: a chunk of up to ``staging_bytes / dma_streams`` in the copy engine's queue, where
    # an engine's own host-to-device copy enqueued behind the load waits (docs/transfer.md,
    # "twenty-fourth round"). 1: one area per chunk (before 2026-11-28).
    load_chunk_areas: int = 0
    # True: a store's chunk is gathered into its staging area and copied out of it on one DMA
    # stream (the area's), with no event between them: per chunk one launch, its copies and the
    # pacing wait and record, where False (the gather on a stream of its own) adds three event
    # calls. Needs ``depth`` a multiple of ``dma_streams`` (docs/transfer.md, Options).
    store_coupled: bool = True
    # > 0: the kernel of a job's exposed chunk (a store's first gather, which nothing of the job
    # overlaps yet; a load's last scatter, which nothing overlaps any more) runs on at least this
    # many programs, the pipeline's other kernels on their own count. 0: off. On an H100, 37
    # blocks through the public API with 132 against 0: Llama-3-70B fp8 TP8 stores 0.72 of the
    # link against 0.65, DeepSeek-V2-Lite latent loads 0.86 against 0.79; an eager step beside
    # another thread's 1-16-block transfers every 2 ms +12.8 / +16.7% against +14.0 / +17.9%
    # (docs/transfer.md, "ninth round").
    exposed_programs: int = 128
    # Jobs of at most this many blocks: the kernels read the block ids from pinned host memory;
    # larger ones upload them with one copy first (a copy, an event and a wait per DMA stream).
    # 4096 on an H100: 37-block latent loads 0.80 of the link against 0.87, fp8 stores 0.70
    # against 0.64 (a scatter reading ids over PCIe is slower; docs/transfer.md, "ninth round").
    host_ids: int = 16
    # The completion thread's longest pause (us) between reads of the done words (host memory,
    # no driver call), which it takes at ~1/16 of the youngest job's age. It finishes jobs
    # nobody asks about and reports copies that failed on the device: a job's done() and wait()
    # read its done word themselves, so this pace delays neither (docs/transfer.md, "eleventh
    # round"). 1000: no thread of ours wakes every few microseconds beside the engine's forward.
    completion_poll_us: int = 1000
    # A job's waiter (``TransferWorker.wait``, ``Pending.wait``) reads its done word back to back
    # this long (us), then sleeps ~1/16 of the job's age between reads. A sleep overshoots by the
    # kernel's timer slack (50 us by default on Linux): at 100 (before 2026-11-27) a waited 37-block
    # job was done 20-30 us later than a caller polling ``get_finished`` saw it (H200,
    # docs/transfer.md, "seventeenth round"). The waiter is a thread blocked in our call anyway.
    wait_spin_us: int = 2000
    # Bytes per memory access of the gather/scatter kernels: 16 where every piece's address,
    # stride and size and the slots' are multiples of 16 (else 8, whatever this says), or 8.
    # The kernel is the same either way; 16 issues half the load and store instructions
    # (docs/transfer.md, "Access width").
    access_bytes: int = 16

    def __post_init__(self) -> None:
        check_kernel_shape("StagedConfig", self.programs, self.chunk_bytes, self.num_warps)
        for name in (
            "staging_bytes",
            "depth",
            "first_chunk_bytes",
            "dma_streams",
            "layer_slice_bytes",
            "max_layer_slices",
            "layer_slice_transfer_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"StagedConfig: expected {name} > 0, got {value!r}")
        lp = self.load_programs
        if isinstance(lp, bool) or not isinstance(lp, int) or lp < 0:
            raise ValueError(
                f"StagedConfig: expected load_programs an int >= 0 (0: one per SM), got {lp!r}"
            )
        lpb = self.load_program_bytes
        if isinstance(lpb, bool) or not isinstance(lpb, int) or lpb < 0:
            raise ValueError(
                f"StagedConfig: expected load_program_bytes an int >= 0 (0: off), got {lpb!r}"
            )
        if not isinstance(self.native_inline_bytes, int) or self.native_inline_bytes < 0:
            raise ValueError(
                f"StagedConfig: expected native_inline_bytes >= 0, got {self.native_inline_bytes!r}"
            )
        for flag in ("load_coupled", "store_coupled"):
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise ValueError(f"StagedConfig: expected {flag} as a bool, got {value!r}")
            if value and self.depth % self.dma_streams:
                raise ValueError(
                    f"StagedConfig: expected depth a multiple of dma_streams "
                    f"({self.dma_streams}) for {flag}, got depth {self.depth}"
                )
        span = self.load_chunk_areas
        if isinstance(span, bool) or not isinstance(span, int) or span < 0:
            raise ValueError(f"StagedConfig: expected load_chunk_areas an int >= 0, got {span!r}")
        if self.load_coupled and span and (self.depth // self.dma_streams) % span:
            raise ValueError(
                f"StagedConfig: expected load_chunk_areas to divide depth // dma_streams "
                f"({self.depth // self.dma_streams}) or 0, got {span}"
            )
        for name, low, high in (
            ("exposed_programs", 0, 65535),
            ("host_ids", 0, 1 << 20),
            ("completion_poll_us", 1, 100_000),
            ("wait_spin_us", 0, 100_000),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(
                    f"StagedConfig: expected {name} an int in [{low}, {high}], got {v!r}"
                )
        if isinstance(self.access_bytes, bool) or self.access_bytes not in (8, 16):
            raise ValueError(
                f"StagedConfig: expected access_bytes 8 or 16, got {self.access_bytes!r}"
            )
        if isinstance(self.copy_priority, bool) or not isinstance(self.copy_priority, int):
            raise ValueError(
                f"StagedConfig: expected copy_priority as an int, got {self.copy_priority!r}"
            )
        costs = self.enqueue_ns
        if (
            not isinstance(costs, tuple)
            or len(costs) != 4
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in costs)
        ):
            raise ValueError(
                f"StagedConfig: expected enqueue_ns as 4 ints >= 0 (descriptor, 2D copy, chunk, "
                f"slice), got {costs!r}"
            )
        link = self.plan_link_GBps
        if isinstance(link, bool) or not isinstance(link, (int, float)) or not 0 <= link < 1e4:
            raise ValueError(
                f"StagedConfig: expected plan_link_GBps in [0, 10000) GB/s, got {link!r}"
            )
        if not isinstance(self.first_slice_bytes, int) or self.first_slice_bytes < 0:
            raise ValueError(
                f"StagedConfig: expected first_slice_bytes >= 0, got {self.first_slice_bytes!r}"
            )

    @property
    def load_span(self) -> int:
        """The staging areas one load chunk spans (``load_chunk_areas`` resolved; 1 for split
        loads)."""
        if not self.load_coupled:
            return 1
        return self.load_chunk_areas or self.depth // self.dma_streams

"""One frozen description of what the native core moves, packed for C (``spec.c`` parses it).

Built once per backend by ``staged.NativeStagedBackend`` from the layout, the arena, the staging
ring and the compiled copy-kernel variants; every transfer afterwards passes only its block and
slot ids. ``pack()`` writes the fields in the order ``kvo_spec_parse`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvoffload.transfer.cuda.extension import ABI

MAX_DMAS = 4


@dataclass(frozen=True)
class Part:
    """What moves of each block in one pass: the whole slot (a store) or one layer slice."""

    offset: int  # bytes into the host slot
    unit: int  # bytes per block
    regions: int  # device address of the int64 [4, n_regions] region table
    n_regions: int


@dataclass(frozen=True)
class GroupSpec:
    num_blocks: int
    slot_bytes: int
    num_layers: int
    kernels: tuple[list[int], list[int]]  # (store, load): NativeKernel.pack(programs)
    parts: tuple[Part, ...]  # parts[0]: the whole slot; load slices after it
    plans: tuple[tuple[int, int], ...]  # per load schedule: (slices, first part)
    owners: tuple[tuple[int, ...], ...]  # per schedule: the slice holding each layer
    # > 0: a load chunk's scatter on one program per this many bytes, at least its kernel's count
    # and at most the spec's max_programs (native/pipeline.c, launch_on); 0: its kernel's count
    load_program_bytes: int = 0


@dataclass(frozen=True)
class CoreSpec:
    num_slots: int
    arena_base: int
    arena_slot_bytes: int
    depth: int
    area_bytes: int
    first_chunk_bytes: int
    min_slice_transfer_bytes: int
    inline_bytes: int  # jobs up to this size are enqueued in the caller's thread when idle
    gather: tuple[int, int]  # (store, load) kernel stream handles
    dmas: tuple[tuple[int, ...], tuple[int, ...]]  # (store, load) DMA stream handles
    gate: int  # the stream that opens layer gates (LayerGate.open)
    # A load's slice count (native/job.c, plan_load): host ns per batch descriptor, per 2D copy,
    # per chunk and per slice, and the link's bytes per us (0: the byte rule alone).
    enqueue_ns: tuple[int, int, int, int]
    link_bytes_per_us: int
    # 1: a load's chunk is copied and scattered on one DMA stream (native/pipeline.c, "coupled
    # loads"); 0: scattered on the kernels' stream after an event
    load_coupled: int
    # 1: a store's chunk is gathered and copied out on one DMA stream ("coupled stores")
    store_coupled: int
    # > 0: the kernel of a job's exposed chunk (a store's first, a load's last) runs on at least
    # this many programs (native/pipeline.c, launch_on); 0: on its kernel's own count
    exposed_programs: int
    host_ids: int  # jobs of at most this many blocks: the kernels read their ids from host memory
    poll_max_us: int  # the completion thread's longest pause between reads of the done words
    max_programs: int  # the device's SMs: the most a group's load_program_bytes rule gives
    wait_spin_us: int  # a job's waiter reads its done word back to back this long, then sleeps
    load_span: int  # coupled loads: staging areas per chunk (StagedConfig.load_span)
    bases: tuple[tuple[int, ...], tuple[int, ...]]  # (store, load) staging area addresses
    groups: tuple[GroupSpec, ...]

    def pack(self) -> np.ndarray:
        n_dmas = len(self.dmas[0])
        if not 1 <= n_dmas <= MAX_DMAS or len(self.dmas[1]) != n_dmas:
            raise ValueError(f"expected 1..{MAX_DMAS} DMA streams per direction, got {n_dmas}")
        pad = [0] * (MAX_DMAS - n_dmas)
        out: list[int] = [
            ABI,
            len(self.groups),
            self.num_slots,
            self.arena_base,
            self.arena_slot_bytes,
            self.depth,
            self.area_bytes,
            self.first_chunk_bytes,
            self.min_slice_transfer_bytes,
            n_dmas,
            *self.gather,
            *self.dmas[0],
            *pad,
            *self.dmas[1],
            *pad,
            self.inline_bytes,
            self.gate,
            *self.enqueue_ns,
            self.link_bytes_per_us,
            self.load_coupled,
            self.store_coupled,
            self.exposed_programs,
            self.host_ids,
            self.poll_max_us * 1000,
            self.max_programs,
            self.wait_spin_us * 1000,
            self.load_span,
            *self.bases[0],
            *self.bases[1],
        ]
        for g in self.groups:
            out += [g.num_blocks, g.slot_bytes, g.num_layers, len(g.parts), len(g.plans)]
            out += [g.load_program_bytes]
            out += [*g.kernels[0], *g.kernels[1]]
            for p in g.parts:
                out += [p.offset, p.unit, p.regions, p.n_regions]
            out += [count for count, _ in g.plans]
            out += [first for _, first in g.plans]
            for owner in g.owners:
                out += list(owner)
        return np.array([v - (1 << 64) if v >= 1 << 63 else v for v in out], dtype=np.int64)

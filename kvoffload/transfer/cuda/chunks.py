"""What the native core's description needs from the layout, computed once per backend: the
layer-slice schedules of loads and the copy kernel's tile (``staged.NativeStagedBackend`` packs
them into its ``CoreSpec``).

Nothing here runs per transfer: the chunk plan, the staging ring and the choice of a schedule for a
load are the core's (``native/pipeline.c``). No torch, no CUDA: the CPU tests cover these
directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np


def slice_bounds(layers: int, count: int, first: int = 0) -> list[int]:
    """Layer boundaries of a load's slices of consecutive layers: ``[0, b1, ..., layers]``.

    ``first`` = 0: ``count`` near-equal runs (sizes differing by at most one layer). ``first`` >= 1:
    a ramp, as the chunk schedule: ``first`` layers, then twice as many, and so on up to the equal
    run size ``ceil(layers / count)``, then runs of that size (the last one what is left). Layer 0
    is then usable after ~``first / layers`` of the load instead of ~``1 / count``. Where the
    engine computes a layer in at least twice a layer's link time, each doubled slice lands before
    the engine reaches it, so only layer 0 waits; where compute and link per layer are close (a
    long history restored under a short prompt), the wait moves to the first doubled slices and
    only more, smaller slices shorten it (measured: docs/transfer.md, "Layer slices").
    """
    if not 1 <= count <= layers:
        raise ValueError(f"expected 1 <= slices <= {layers} (the layer count), got {count}")
    if first < 0:
        raise ValueError(f"expected first >= 0 layers, got {first}")
    if first == 0 or count == 1:
        return [layers * k // count for k in range(count + 1)]
    cap = -(-layers // count)
    bounds, size = [0], first
    while bounds[-1] < layers:
        bounds.append(min(layers, bounds[-1] + min(size, cap)))
        size *= 2
    return bounds


def bound_regions(
    layer_starts: Sequence[int], n_regions: int, bounds: Sequence[int]
) -> list[range]:
    """The regions of each slice of ``bounds`` (``slice_bounds``). ``layer_starts``: index of each
    layer's first region (``LayerGroup.layer_starts``; empty: one region per layer)."""
    edges = [*(list(layer_starts) or range(n_regions)), n_regions]
    return [range(edges[a], edges[b]) for a, b in itertools.pairwise(bounds)]


def bound_owner(bounds: Sequence[int]) -> np.ndarray:
    """For each layer, the index of the slice of ``bounds`` that holds it."""
    return np.searchsorted(np.array(bounds[1:]), np.arange(bounds[-1]), side="right").astype(
        np.int64
    )


def load_schedules(
    layers: int, layer_starts: Sequence[int], n_regions: int, most: int, first: int
) -> tuple[list[range], dict[int, tuple[int, np.ndarray]]]:
    """Every layer-slice schedule a load of one layer group may take: equal counts of powers of
    two up to ``most``, and ``most`` itself, each ramped from ``first`` layers (0: equal slices).

    Returns the regions of every slice of every schedule, flat, and per schedule (keyed by its
    number of slices; a later count's schedule has smaller slices and wins a tie) where its slices
    start in that list and which slice holds each layer."""
    counts = sorted({1 << k for k in range(most.bit_length()) if 1 << k <= most} | {most})
    flat: list[range] = []
    plans: dict[int, tuple[int, np.ndarray]] = {}
    for c in counts:
        bounds = slice_bounds(layers, c, first if c > 1 else 0)
        plans[len(bounds) - 1] = (len(flat), bound_owner(bounds))
        flat.extend(bound_regions(layer_starts, n_regions, bounds))
    return flat, plans


def first_slice_layers(page_bytes: Sequence[int], layer_starts: Sequence[int], nbytes: int) -> int:
    """The fewest leading layers whose pages add up to at least ``nbytes`` per block (at least 1,
    at most every layer): a ramp's first slice, kept large enough for the copy engines."""
    starts = list(layer_starts) or list(range(len(page_bytes)))
    total = 0
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(page_bytes)
        total += sum(page_bytes[start:end])
        if total >= nbytes:
            return k + 1
    return len(starts)


def slice_count(slot_bytes: int, layers: int, min_slice_bytes: int, most: int) -> int:
    """How many layer slices a load is cut into: as many as keep each slice's bytes per block at
    least ``min_slice_bytes`` (one copy-engine descriptor per block and slice, so each stays large
    enough to run near the link), at most ``most`` and at most one per layer, at least one."""
    if min_slice_bytes <= 0 or most <= 0:
        raise ValueError(
            f"expected min_slice_bytes > 0 and most > 0, got {min_slice_bytes}, {most}"
        )
    return max(1, min(layers, most, slot_bytes // min_slice_bytes))


def tile(max_page_bytes: int, tile_bytes: int) -> tuple[int, int]:
    """(JOBS, WORDS) of the copy kernel for pages up to ``max_page_bytes``.

    WORDS (8-byte words, a power of two) covers a page, up to the tile; JOBS fills the rest of the
    tile with other pieces, so a program keeps several small pieces in flight."""
    words = 1 << max(0, (max_page_bytes // 8) - 1).bit_length()
    words = max(16, min(words, tile_bytes // 8))
    return max(1, tile_bytes // 8 // words), words


def vector_words(values: Iterable[int], access_bytes: int = 16) -> int:
    """8-byte words per memory access of the copy kernel (its ``VEC``) over pieces at these
    addresses, strides and sizes: 2 (16-byte accesses) where ``access_bytes`` is 16 and every
    value is a multiple of 16, else 1 (8-byte accesses, which any 8-byte-aligned piece takes)."""
    if access_bytes not in (8, 16):
        raise ValueError(f"expected access_bytes 8 or 16, got {access_bytes!r}")
    if access_bytes == 8:
        return 1
    return 2 if all(int(v) % 16 == 0 for v in values) else 1

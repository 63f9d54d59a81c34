"""Pure numpy helpers of the copy pipelines: chunk schedules and descriptor coalescing.

No torch, no CUDA: the CPU tests cover these directly.
"""

from __future__ import annotations

import numpy as np

Ramp = str  # "up": small chunks first (stores); "down": small chunks last (loads)


def chunk_sizes(n_blocks: int, first: int, largest: int, ramp: Ramp = "up") -> np.ndarray:
    """Blocks per pipeline chunk for an ``n_blocks`` transfer, summing to ``n_blocks``.

    Sizes double from ``first`` up to ``largest``. A store gathers chunk k+1 while chunk k is on
    the link, so only the first gather is exposed: small first chunks shrink it. A load scatters
    chunk k while chunk k+1 is on the link, so only the last scatter is exposed: ``ramp="down"``
    puts the small chunks last.
    """
    if n_blocks < 0 or first <= 0 or largest <= 0:
        raise ValueError(
            f"expected n_blocks >= 0 and first, largest > 0, got {n_blocks}, {first}, {largest}"
        )
    if ramp not in ("up", "down"):
        raise ValueError(f"expected ramp 'up' or 'down', got {ramp!r}")
    sizes: list[int] = []
    size, left = min(first, largest), n_blocks
    while left > 0:
        take = min(size, left)
        sizes.append(take)
        left -= take
        size = min(size * 2, largest)
    out = np.array(sizes, dtype=np.int64)
    return out[::-1].copy() if ramp == "down" else out


def coalesce(table: np.ndarray, breaks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Merge descriptors that continue each other in both source and destination.

    ``table`` is (3, n) int64 rows (src, dst, bytes). ``breaks`` (sorted indices) start a new
    descriptor whatever the addresses (pipeline chunk boundaries). Returns the merged table and, per
    entry of ``breaks``, the index in it where that chunk starts.
    """
    n = table.shape[1]
    cuts = np.zeros(n, dtype=bool)
    if n:
        cuts[0] = True
        src, dst, size = table
        ends_src = src[:-1] + size[:-1]
        ends_dst = dst[:-1] + size[:-1]
        cuts[1:] = (src[1:] != ends_src) | (dst[1:] != ends_dst)
    if breaks is not None and len(breaks):
        cuts[breaks] = True
    starts = np.flatnonzero(cuts)
    if len(starts) == n:
        merged = table
    else:
        merged = (
            np.stack([table[0, starts], table[1, starts], np.add.reduceat(table[2], starts)])
            if n
            else table
        )
    where = np.searchsorted(starts, breaks) if breaks is not None else np.zeros(0, dtype=np.int64)
    return merged, where


def tile(max_page_bytes: int, tile_bytes: int) -> tuple[int, int]:
    """(JOBS, WORDS) of the copy kernel for pages up to ``max_page_bytes``.

    WORDS (8-byte words, a power of two) covers a page, up to the tile; JOBS fills the rest of the
    tile with other pieces, so a program keeps several small pieces in flight."""
    words = 1 << max(0, (max_page_bytes // 8) - 1).bit_length()
    words = max(16, min(words, tile_bytes // 8))
    return max(1, tile_bytes // 8 // words), words

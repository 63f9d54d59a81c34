"""vLLM's block-id transfer specs turned into our ``TransferSpec`` list (imports no vLLM).

A vLLM transfer names GPU blocks (ordered by group, ``group_sizes[g]`` of them for group ``g``,
the first being the request's block ``block_indices[g]``) and host *chunks*, one per offload key,
each ``blocks_per_chunk`` GPU blocks long. Host slot ``c * blocks_per_chunk + j`` holds block ``j``
of chunk ``c``. A group's run may start inside its first chunk (``block_indices[g]`` not a
multiple of ``blocks_per_chunk``) and end inside its last; both directions map the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffload.transfer.spec import Direction, TransferSpec


def chunk_slots(chunks: np.ndarray, blocks_per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Host slots of ``count`` consecutive blocks starting ``skip`` blocks into ``chunks[0]``."""
    sub = np.arange(blocks_per_chunk, dtype=np.int64)
    flat = (chunks.astype(np.int64)[:, None] * blocks_per_chunk + sub[None, :]).ravel()
    return flat[skip : skip + count]


def plan_transfers(
    direction: Direction,
    gpu_blocks: Sequence[int] | np.ndarray,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    host_chunks: Sequence[int] | np.ndarray,
    blocks_per_chunk: int,
) -> list[TransferSpec]:
    """One ``TransferSpec`` per group with blocks to move.

    Raises ValueError when the counts do not add up (a malformed spec from the engine).
    """
    if blocks_per_chunk <= 0:
        raise ValueError(f"expected blocks_per_chunk > 0, got {blocks_per_chunk}")
    if len(group_sizes) != len(block_indices):
        raise ValueError(
            f"expected one block index per group ({len(group_sizes)}), got {len(block_indices)}"
        )
    blocks = np.asarray(gpu_blocks, dtype=np.int64).reshape(-1)
    chunks = np.asarray(host_chunks, dtype=np.int64).reshape(-1)
    specs: list[TransferSpec] = []
    b_off = c_off = 0
    for group, (size, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        n_chunks = -(-(size + skip) // blocks_per_chunk)
        group_chunks = chunks[c_off : c_off + n_chunks]
        if len(group_chunks) != n_chunks or b_off + size > len(blocks):
            break
        slots = chunk_slots(group_chunks, blocks_per_chunk, skip, size)
        specs.append(TransferSpec(direction, blocks[b_off : b_off + size], slots, group))
        b_off += size
        c_off += n_chunks
    if b_off != len(blocks) or c_off != len(chunks) or sum(group_sizes) != len(blocks):
        raise ValueError(
            f"expected {len(blocks)} GPU blocks in groups of {list(group_sizes)} (starting at "
            f"{list(block_indices)}) to use all {len(chunks)} host chunks of {blocks_per_chunk} "
            f"blocks, got {b_off} blocks over {c_off} chunks"
        )
    return specs

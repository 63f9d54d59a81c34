"""Copy descriptors (src address, dst address, bytes), built with vectorized numpy.

One descriptor per (block, region), block-major, so the pieces of one host slot are adjacent.
The ``dma`` backend submits these (``coalesce`` merges those that continue each other); the host
backend does not need them.
"""

from __future__ import annotations

import numpy as np

from kvoffload.transfer.layout import LayerGroup
from kvoffload.transfer.spec import TransferSpec


def region_arrays(group: LayerGroup) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(bases, block strides, page bytes, offsets in slot) of a group's regions, int64."""
    regions = group.regions
    return (
        np.array([r.base for r in regions], dtype=np.int64),
        np.array([r.block_stride for r in regions], dtype=np.int64),
        np.array([r.page_bytes for r in regions], dtype=np.int64),
        np.array(group.offsets, dtype=np.int64),
    )


def build_descriptors(
    spec: TransferSpec,
    group: LayerGroup,
    arena_base: int,
    slot_bytes: int,
    out: np.ndarray | None = None,
    regions: range | None = None,
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """A (3, n_blocks * n_regions) int64 array of (src, dst, size) for ``spec``.

    ``out``, when given, is a reused (3, >= n) int64 buffer (pinned, for DMA); the result is a view
    of it. ``regions``: only these regions of the group (a layer slice of a load), still at their
    offsets in the host slot. ``arrays``: ``region_arrays(group)``, when the caller keeps them.
    """
    bases, strides, pages, offsets = region_arrays(group) if arrays is None else arrays
    if regions is not None:
        part = slice(regions.start, regions.stop)
        bases, strides, pages, offsets = bases[part], strides[part], pages[part], offsets[part]
    n = len(spec) * len(bases)
    if out is None:
        out = np.empty((3, n), dtype=np.int64)
    elif out.dtype != np.int64 or out.ndim != 2 or out.shape[0] != 3 or out.shape[1] < n:
        raise ValueError(
            f"expected an int64 (3, >={n}) descriptor buffer, got {out.dtype} {out.shape}"
        )
    engine = (
        out[0, :n].reshape(len(spec), -1)
        if spec.direction == "store"
        else out[1, :n].reshape(len(spec), -1)
    )
    host = (
        out[1, :n].reshape(len(spec), -1)
        if spec.direction == "store"
        else out[0, :n].reshape(len(spec), -1)
    )
    np.multiply(spec.blocks[:, None], strides[None, :], out=engine)
    engine += bases[None, :]
    np.multiply(spec.slots[:, None], slot_bytes, out=host)
    host += offsets[None, :] + arena_base
    out[2, :n].reshape(len(spec), -1)[:] = pages[None, :]
    return out[:, :n]


def coalesce(table: np.ndarray) -> np.ndarray:
    """Merge descriptors that continue each other in both source and destination.

    ``table`` is (3, n) int64 rows (src, dst, bytes); returns the merged table (``table`` itself
    when nothing merges).
    """
    n = table.shape[1]
    if n < 2:
        return table
    src, dst, size = table
    cuts = np.ones(n, dtype=bool)
    cuts[1:] = (src[1:] != src[:-1] + size[:-1]) | (dst[1:] != dst[:-1] + size[:-1])
    starts = np.flatnonzero(cuts)
    if len(starts) == n:
        return table
    return np.stack([src[starts], dst[starts], np.add.reduceat(size, starts)])

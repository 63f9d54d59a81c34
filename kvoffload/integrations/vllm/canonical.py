"""vLLM 0.33's canonical KV caches described as a ``KVLayout`` (imports no vLLM, no torch).

vLLM hands an offloading worker ``CanonicalKVCaches``: a list of tensors whose first dimension is
the block (``tensor``, ``page_size_bytes``; in practice one int8 ``(num_blocks, page)`` view per
layer, 64 KiB pages for Llama-3-8B bf16 at 16 tokens per block), and per KV-cache group a list of
references (``tensor_idx``, ``page_size_bytes`` without padding). Each reference becomes one
region of its group, so one host slot holds one block of one group: every layer of the group, K
and V, back to back. Groups that overlay the same tensors (vLLM's hybrid allocator) simply list
the same regions.

Only the attributes named above are read, so tests (and the GPU test machine, which has no vLLM)
can pass any objects that carry them.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

from kvoffload.transfer.layout import KVLayout, LayerGroup, Region


def layout_from_canonical(
    tensors: Sequence[Any], group_refs: Sequence[Sequence[Any]], block_size: int
) -> KVLayout:
    """One layer group per entry of ``group_refs``, one region per reference.

    Raises ValueError for no tensors or groups, tensors on different devices, a reference to a
    tensor that does not exist, or a page larger than its tensor's block.
    """
    if not tensors or not group_refs:
        raise ValueError(
            f"expected canonical KV caches with tensors and groups, got {len(tensors)} tensors "
            f"and {len(group_refs)} groups"
        )
    devices = {str(t.tensor.device) for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"expected every canonical KV tensor on one device, got {sorted(devices)}")
    groups = []
    for g, refs in enumerate(group_refs):
        regions = tuple(_region(tensors, ref, g) for ref in refs)
        groups.append(LayerGroup(regions, name=str(g)))
    return KVLayout(tuple(groups), "int8", block_size, devices.pop())


def _region(tensors: Sequence[Any], ref: Any, group: int) -> Region:
    if not 0 <= ref.tensor_idx < len(tensors):
        raise ValueError(
            f"expected group {group} to reference tensors in [0, {len(tensors)}), "
            f"got {ref.tensor_idx}"
        )
    t = tensors[ref.tensor_idx].tensor
    item = t.element_size()
    block_bytes = prod(t.shape[1:]) * item
    if ref.page_size_bytes > block_bytes:
        raise ValueError(
            f"expected a page of at most {block_bytes} bytes for tensor {ref.tensor_idx} "
            f"(shape {tuple(t.shape)}), got {ref.page_size_bytes}"
        )
    return Region(t.data_ptr(), t.stride(0) * item, ref.page_size_bytes, t.shape[0])

# mypy: disable-error-code="no-untyped-call"
"""A synthetic engine KV cache on the GPU for the transfer benchmark, with its byte oracle."""

from __future__ import annotations

import numpy as np
import torch

from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.shapes import MODELS, engine_tensors


class SyntheticKV:
    """One model x layout x block size: random KV tensors on the GPU (bf16, or uint8 bytes for an
    fp8 shape), ``pool`` blocks, and the oracle every benchmark transfer is checked against."""

    def __init__(self, model: str, layout: str, block_size: int, pool: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(1)
        shape = MODELS[model]

        def alloc(s: tuple[int, ...]) -> torch.Tensor:
            if shape.dtype_bytes == 1:
                return torch.randint(0, 256, s, device="cuda", generator=gen, dtype=torch.uint8)
            return torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16)

        self.tensors, block_dim = engine_tensors(shape, layout, pool, block_size, alloc)
        self.kv = KVLayout.from_tensors(self.tensors, block_size=block_size, block_dim=block_dim)
        self.block_dim = block_dim
        self.pool = pool

    def slot_images(self, blocks: np.ndarray) -> torch.Tensor:
        """The host slot image of each of ``blocks`` ([n, slot bytes] uint8 on the GPU), built
        with torch indexing by the layout's rule (a block's regions back to back in tensor
        order): the oracle a store is checked against."""
        index = torch.from_numpy(np.asarray(blocks)).cuda()
        return torch.cat(
            [
                t.index_select(self.block_dim, index)
                .movedim(self.block_dim, 0)
                .contiguous()
                .view(torch.uint8)
                .reshape(len(index), -1)
                for t in self.tensors
            ],
            dim=1,
        )

    def same_blocks(self, a: np.ndarray, b: np.ndarray) -> bool:
        """Whether blocks ``a`` hold the same bytes as blocks ``b``, pairwise."""
        ia = torch.from_numpy(a).cuda()
        ib = torch.from_numpy(b).cuda()
        return all(
            torch.equal(
                t.index_select(self.block_dim, ia).view(torch.uint8),
                t.index_select(self.block_dim, ib).view(torch.uint8),
            )
            for t in self.tensors
        )

"""The paged KV cache in vLLM's FlashAttention layout: one ``[2, num_blocks, block_size, kv_heads,
head_size]`` tensor per layer (index 0 holds K, 1 holds V), addressed through block tables."""

from __future__ import annotations

import torch

from kvoffload.bench.e2e.runner.config import ModelConfig


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"expected num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_heads = config.kv_heads
        self.head_size = config.head_size
        shape = (2, num_blocks, block_size, config.kv_heads, config.head_size)
        self.tensors = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.layers)
        ]

    @property
    def block_bytes(self) -> int:
        """One block of every layer, K and V."""
        t = self.tensors[0]
        return len(self.tensors) * t[:, 0].numel() * t.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v`` ([n, kv_heads, head]) at flat token slots ``block * block_size + i``."""
        flat = self.tensors[layer].view(2, -1, self.kv_heads, self.head_size)
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)

    def gather(
        self, layer: int, table: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``length`` tokens of a block table, contiguous: [length, kv, hd]."""
        blocks = -(-length // self.block_size)
        kv = self.tensors[layer][:, table[:blocks]]  # [2, blocks, block_size, kv, hd], a copy
        kv = kv.view(2, blocks * self.block_size, self.kv_heads, self.head_size)
        if blocks * self.block_size > length:  # the last block's unwritten tail: zeros, so a
            kv[:, length:] = 0  # kernel that reads past the end sees the same bits every run
        return kv[0, :length], kv[1, :length]

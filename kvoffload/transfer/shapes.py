"""Model shapes and engine KV layouts: the KV tensors an engine hands ``KVLayout.from_tensors``.

They live in ``transfer/`` beside ``layout.py``, whose input they describe, so the library
(calibration), the tests and ``kvoffload bench`` all reach them without importing the
benchmarks. Torch-free: ``engine_tensors`` allocates through the caller's ``alloc``.

Shapes are (layers, KV heads per GPU, head size) from the models' published configs:
Llama-3-8B (32, 8, 128), Qwen2.5-7B (28, 4, 128), Llama-3-70B at tensor parallel 8 (80, 8/8, 128),
the same with an fp8 KV cache (1 byte per element: 2 KiB pieces at 16-token blocks, 320 KiB
slots), and DeepSeek-V2-Lite's MLA cache: K only, one 576-wide latent per token and layer (512
compressed KV + 64 RoPE), 27 layers, bf16 (18 KiB per layer at 16-token blocks, 486 KiB slots).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    dtype_bytes: int = 2  # bf16
    kv: int = 2  # 2: K and V; 1: K only (a latent cache such as MLA's)

    def piece_bytes(self, block_size: int) -> int:
        """One block of one layer's K (or V)."""
        return block_size * self.kv_heads * self.head_size * self.dtype_bytes

    def block_bytes(self, block_size: int) -> int:
        """One block of every layer, K and V: one host slot."""
        return self.kv * self.layers * self.piece_bytes(block_size)


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama3-8b", 32, 8, 128),
        ModelShape("qwen2.5-7b", 28, 4, 128),
        ModelShape("llama3.2-1b", 16, 8, 64),
        ModelShape("qwen2.5-1.5b", 28, 2, 128),
        ModelShape("qwen2.5-14b", 48, 8, 128),
        ModelShape("llama3-70b-tp8", 80, 1, 128),
        ModelShape("llama3-70b-tp8-fp8", 80, 1, 128, dtype_bytes=1),
        ModelShape("deepseek-v2-lite-mla", 27, 1, 576, kv=1),
    )
}

# Engine layouts: name -> (what it is, block_dim for KVLayout.from_tensors)
LAYOUTS: dict[str, tuple[str, int]] = {
    "kv_split": ("per layer [2, blocks, bs, heads, hd] (vLLM <= 0.26, FlashAttention)", 1),
    "kv_pair": ("per layer separate K and V [blocks, bs, heads, hd]", 0),
    "page": ("per layer one page [blocks, 2, bs, heads, hd] (vLLM 0.33 LBHNC)", 0),
    "cross_layer": ("one tensor [blocks, layers, 2, bs, heads, hd] (block-outermost)", 0),
}

Alloc = Callable[[tuple[int, ...]], Any]


def engine_tensors(
    model: ModelShape, layout: str, num_blocks: int, block_size: int, alloc: Alloc
) -> tuple[list[Any], int]:
    """Allocate an engine's KV tensors in ``layout`` with ``alloc(shape)``; returns them and the
    ``block_dim`` to pass to ``KVLayout.from_tensors``."""
    if layout not in LAYOUTS:
        raise ValueError(f"expected a layout in {sorted(LAYOUTS)}, got {layout!r}")
    inner = (block_size, model.kv_heads, model.head_size)
    block_dim, kv = LAYOUTS[layout][1], model.kv
    if layout == "kv_split":
        return [alloc((kv, num_blocks, *inner)) for _ in range(model.layers)], block_dim
    if layout == "kv_pair":
        return [alloc((num_blocks, *inner)) for _ in range(kv * model.layers)], block_dim
    if layout == "page":
        return [alloc((num_blocks, kv, *inner)) for _ in range(model.layers)], block_dim
    return [alloc((num_blocks, model.layers, kv, *inner))], block_dim

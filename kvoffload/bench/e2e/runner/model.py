"""A Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) in plain torch.

Weights are seeded random numbers in the compute dtype (bf16, or float32 on CPUs without bf16
arithmetic: see ``dtype.py``; nothing is downloaded): the cost of a forward pass and the bytes of
its KV cache are those of the real model; the tokens it produces mean nothing. Attention over the
KV cache is not done here: ``forward`` calls ``attend(layer, q, k, v)``, which stores ``k, v`` in
the engine's paged cache and returns the attention output (see ``attention.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvoffload.bench.e2e.runner.config import ModelConfig

# (layer, q [n, heads, head], k [n, kv_heads, head], v) -> [n, heads, head]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head, hidden]
    qkv_bias: torch.Tensor | None
    out: torch.Tensor  # [hidden, heads * head]
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class Model:
    def __init__(
        self, config: ModelConfig, device: str = "cpu", seed: int = 0, dtype: str = "bfloat16"
    ) -> None:
        if dtype not in ("bfloat16", "float32"):
            raise ValueError(f"expected dtype 'bfloat16' or 'float32', got {dtype!r}")
        self.config = config
        self.device = torch.device(device)
        self.dtype: torch.dtype = getattr(torch, dtype)
        gen = torch.Generator(self.device).manual_seed(seed)
        c = config
        q_kv = (c.heads + 2 * c.kv_heads) * c.head_size

        def weight(rows: int, cols: int, std: float | None = None) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, device=self.device, dtype=torch.float32)
            return w.mul_(std if std is not None else cols**-0.5).to(self.dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=self.dtype)

        self.embed = weight(c.vocab, c.hidden, 1.0)
        self.layers = [
            Layer(
                ones(c.hidden),
                weight(q_kv, c.hidden),
                weight(1, q_kv, 0.02).view(-1) if c.qkv_bias else None,
                weight(c.hidden, c.heads * c.head_size),
                ones(c.hidden),
                weight(2 * c.intermediate, c.hidden),
                weight(c.hidden, c.intermediate),
            )
            for _ in range(c.layers)
        ]
        self.norm = ones(c.hidden)
        self.lm_head = weight(c.vocab, c.hidden)
        half = c.head_size // 2
        exponent = torch.arange(half, device=self.device, dtype=torch.float32) / half
        self.inv_freq = c.rope_theta**-exponent

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Logits (float32) of the last token; ``tokens`` and ``positions`` are int64 [n]."""
        x, cos, sin = self.embed_rope(tokens, positions)
        for i in range(len(self.layers)):
            q, k, v = self.pre(i, x, cos, sin)
            x = self.post(i, x, attend(i, q, k, v))
        return self.head(x[-1:])

    # The forward's parts, in order: ``embed_rope``, then per layer ``pre``, attention, ``post``,
    # then ``head``. The CUDA-graph runner (``graphs.py``) captures the same parts, so a graph
    # computes what ``forward`` computes with the same ops.

    def embed_rope(
        self, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The embeddings of ``tokens`` [n, hidden], and RoPE's cos and sin at ``positions``."""
        cos, sin = self._rope(positions)
        return self.embed[tokens], cos, sin

    def pre(
        self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i`` before attention: norm, q/k/v projection, RoPE on q and k."""
        c, layer = self.config, self.layers[i]
        h = F.rms_norm(x, (c.hidden,), layer.attn_norm, c.rms_eps)
        qkv = F.linear(h, layer.qkv, layer.qkv_bias).view(x.shape[0], -1, c.head_size)
        rotated = c.heads + c.kv_heads  # q and k heads, rotated together
        qk = rope(qkv[:, :rotated], cos, sin)
        return qk[:, : c.heads], qk[:, c.heads :], qkv[:, rotated:]

    def post(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Layer ``i`` after attention (``o``: [n, heads, head]): out projection, SwiGLU MLP."""
        c, layer = self.config, self.layers[i]
        x = x + F.linear(o.reshape(x.shape[0], -1), layer.out)
        h = F.rms_norm(x, (c.hidden,), layer.mlp_norm, c.rms_eps)
        gate, up = F.linear(h, layer.gate_up).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, layer.down)

    def head(self, last: torch.Tensor) -> torch.Tensor:
        """Logits (float32, [vocab]) of one token's hidden state ``last`` [1, hidden]."""
        c = self.config
        return (
            F.linear(F.rms_norm(last, (c.hidden,), self.norm, c.rms_eps), self.lm_head)
            .float()
            .view(-1)
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [n, 1, head]: rope(x) = x * cos + roll(x, head / 2) * sin."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (as in HF Llama) in float32: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s]."""
    x32 = x.float()
    rolled = torch.roll(x32, x.shape[-1] // 2, -1)
    return torch.addcmul(x32 * cos, rolled, sin).to(x.dtype)

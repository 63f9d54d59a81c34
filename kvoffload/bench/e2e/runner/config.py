"""Model shapes: published configs of GPU-sized models (Llama-3-8B and Qwen2.5-7B, the standard
runs; Llama-3.2-1B, Qwen2.5-1.5B and Qwen2.5-14B, the sweep beside them), and tiny ones for CPU
runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int  # query heads
    kv_heads: int
    head_size: int
    intermediate: int  # SwiGLU inner width
    vocab: int
    rope_theta: float
    qkv_bias: bool = False  # Qwen2 has biases on the q, k, v projections
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"expected heads to be a multiple of kv_heads, got {self.heads}, {self.kv_heads}"
            )

    @property
    def params(self) -> int:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_size
        attn += self.heads * self.head_size * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden


MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        # meta-llama/Meta-Llama-3-8B config.json (RoPE scaling of 3.1 left out: no effect on cost)
        ModelConfig("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 500000.0),
        # Qwen/Qwen2.5-7B config.json
        ModelConfig("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, 1e6, True, 1e-6),
        # meta-llama/Llama-3.2-1B: 16 layers, 64-wide heads (a 512 KiB block of 16 tokens)
        ModelConfig("llama3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, 500000.0),
        # Qwen/Qwen2.5-1.5B: 2 KV heads (GQA 6:1, a 448 KiB block)
        ModelConfig("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 8960, 151936, 1e6, True, 1e-6),
        # Qwen/Qwen2.5-14B: 48 layers (a 3 MiB block)
        ModelConfig("qwen2.5-14b", 48, 5120, 40, 8, 128, 13824, 152064, 1e6, True, 1e-5),
        # CPU shapes: small enough that a multi-turn run takes about a minute on two cores
        ModelConfig("tiny", 4, 512, 8, 2, 64, 1536, 4096, 10000.0),
        # unit tests: a forward pass in milliseconds
        ModelConfig("micro", 2, 128, 4, 2, 32, 256, 512, 10000.0, True),
    )
}


# the models the GPU workload shapes apply to (the rest are CPU scales)
GPU_MODELS = ("llama3-8b", "qwen2.5-7b", "llama3.2-1b", "qwen2.5-1.5b", "qwen2.5-14b")


def model_config(name: str) -> ModelConfig:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"expected a model in {sorted(MODELS)}, got {name!r}") from None

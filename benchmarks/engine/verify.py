"""The correctness check: KV restored from kvoffload's host tier gives the same first-token logits,
bit for bit, and the same greedy tokens, as the same prefix computed on the GPU.

For a sampled turn t of a fresh conversation: run turns 1..t-1 (their KV is computed, cached in
the GPU pool and stored to host), then prompt t twice without adding to any cache: once with the
prefix in the GPU pool (the reference), and once after every cached GPU block was evicted, so the
prefix comes back from host. Both prefill the same suffix from the same block boundary, so any
difference is a difference in the restored KV bytes. A full recompute of prompt t is reported
beside them (not bit-equal in general: its chunks differ), as evidence that the logits depend on
the prefix at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from benchmarks.engine.config import ModelConfig
from benchmarks.engine.engine import Engine
from benchmarks.engine.host_tier import HostTier
from benchmarks.engine.kv_cache import PagedKVCache
from benchmarks.engine.model import Model
from benchmarks.engine.workload import ChatShape, chat_turns

if TYPE_CHECKING:
    from benchmarks.engine.bench import Advance, BenchConfig

DECODE_STEPS = 16


def check_turn(
    model: Model,
    cache: PagedKVCache,
    host: HostTier,
    chat: ChatShape,
    turn: int,
    seed: int,
    chunk_tokens: int,
) -> dict[str, Any]:
    """Restore-vs-GPU check of ``turn`` (>= 2) of a fresh conversation shaped like ``chat``."""
    if not 2 <= turn <= chat.turns:
        raise ValueError(f"expected a turn in [2, {chat.turns}], got {turn}")
    one = ChatShape(1, turn, chat.system_tokens, chat.user_tokens, chat.answer_tokens)
    turns = chat_turns(one, model.config.vocab, seed)
    engine = Engine(model, cache, "kvoffload", host, chunk_tokens)
    for t in turns[:-1]:
        engine.run(t.prompt, t.answer)
    engine.idle()
    prompt = turns[-1].prompt
    on_gpu = engine.run(prompt, decode=DECODE_STEPS, cache=False)
    engine.drop_gpu_cache()
    restored = engine.run(prompt, decode=DECODE_STEPS, cache=False)
    engine.idle()
    computed = Engine(model, cache, "recompute", None, chunk_tokens).run(prompt)
    same_hit = restored.host_hit_tokens == on_gpu.gpu_hit_tokens and restored.gpu_hit_tokens == 0
    logits_equal = torch.equal(on_gpu.logits, restored.logits)
    tokens_equal = [on_gpu.first_token, *on_gpu.tokens] == [restored.first_token, *restored.tokens]
    return {
        "turn": turn,
        "seed": seed,
        "prompt_tokens": len(prompt),
        "reference_gpu_hit_tokens": on_gpu.gpu_hit_tokens,
        "restored_host_hit_tokens": restored.host_hit_tokens,
        "restored_gpu_hit_tokens": restored.gpu_hit_tokens,
        "logits_bit_equal": logits_equal,
        "greedy_tokens_equal": tokens_equal,
        "decode_steps": DECODE_STEPS,
        "max_abs_diff_vs_full_recompute": float((computed.logits - on_gpu.logits).abs().max()),
        "logits_abs_max": float(on_gpu.logits.abs().max()),
        "ok": bool(same_hit and restored.host_hit_tokens > 0 and logits_equal and tokens_equal),
    }


def verify_samples(
    model: Model,
    cache: PagedKVCache,
    host: HostTier,
    mc: ModelConfig,
    cfg: BenchConfig,
    advance: Advance,
) -> list[dict[str, Any]]:
    """``cfg.verify`` sampled turns, spread over 2..T, each on its own fresh conversation."""
    if not cfg.verify or cfg.chat.turns < 2:
        return []
    picks = np.linspace(2, cfg.chat.turns, cfg.verify).round().astype(int)
    out = []
    for i, turn in enumerate(picks):
        seed = cfg.seed + 5000 + i
        out.append(check_turn(model, cache, host, cfg.chat, int(turn), seed, cfg.chunk_tokens))
        advance("verify")
    return out

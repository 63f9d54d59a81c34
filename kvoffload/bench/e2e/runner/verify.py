"""The correctness check: KV restored from kvoffload's host tier gives the same first-token logits,
bit for bit, and the same greedy tokens, as the same prefix computed on the GPU.

For a sampled turn t of a fresh conversation: run turns 1..t-1 (their KV is computed, cached in
the GPU pool and stored to host), then prompt t twice without adding to any cache: once with the
prefix in the GPU pool (the reference), and once after every cached GPU block was evicted, so the
prefix comes back from host. Both prefill the same suffix from the same block boundary, so any
difference is a difference in the restored KV bytes. A full recompute of prompt t is reported
beside them (not bit-equal in general: its chunks differ), as evidence that the logits depend on
the prefix at all.

*Fresh* matters: if the host tier already held the conversation (the same seed checked before on
it, in another graph mode say), turns 1..t-1 would restore KV computed there, with other kernels
and other bits, and keep their own computed copies of the keys it holds on the GPU only (a store
skips held keys): the reference and the restore would then differ with every copy right.
``check_turn`` refuses such a conversation.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvoffload import prefix_block_keys
from kvoffload.bench.e2e.runner.config import ModelConfig
from kvoffload.bench.e2e.runner.engine import PagedEngine, TurnResult
from kvoffload.bench.e2e.runner.graphs import GraphRunner
from kvoffload.bench.e2e.runner.host_tier import HostTier
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Model
from kvoffload.bench.e2e.runner.offload_mode import Offload
from kvoffload.bench.e2e.runner.workload import ChatShape, chat_turns

if TYPE_CHECKING:
    from kvoffload.bench.e2e.runner.bench_config import Advance, BenchConfig

DECODE_STEPS = 16


def check_turn(
    model: Model,
    cache: PagedKVCache,
    host: HostTier,
    chat: ChatShape,
    turn: int,
    seed: int,
    chunk_tokens: int,
    offload: Offload | None = None,
    graphs: GraphRunner | None = None,
) -> dict[str, Any]:
    """Restore-vs-GPU check of ``turn`` (>= 2) of a fresh conversation shaped like ``chat``,
    restoring the way ``offload`` says (layer by layer by default; every block is admitted),
    with the forward of ``graphs`` (None: eager; its scratch block and those after it are left
    out of the pool). Both runs take the same padded shapes, so in a graph mode the same graph.
    ValueError if ``host`` holds any of the conversation already (fresh means fresh to the host
    too: give each check on one host tier its own seed).

    Besides logits and tokens it compares the KV itself, position by position: the restored
    prefix, the suffix prefilled on top of it and the KV written by the decode steps; and it runs
    the GPU reference twice, to tell a restore error from a device that does not repeat itself.
    """
    if not 2 <= turn <= chat.turns:
        raise ValueError(f"expected a turn in [2, {chat.turns}], got {turn}")
    one = ChatShape(1, turn, chat.system_tokens, chat.user_tokens, chat.answer_tokens)
    turns = chat_turns(one, model.config.vocab, seed)
    held = host.lookup(prefix_block_keys(turns[-1].prompt, cache.block_size))
    if held:
        raise ValueError(
            f"expected a conversation the host tier holds none of, got seed {seed}, whose first "
            f"{held} blocks it holds already (checked before on this host tier, in another graph "
            "mode?): its restore would bring back KV computed there, not here; use another seed"
        )
    stores = dataclasses.replace(offload or Offload(), admission="all")
    pool = graphs.scratch if graphs is not None else None
    engine = PagedEngine(model, cache, "kvoffload", host, chunk_tokens, stores, pool, 0, graphs)
    for t in turns[:-1]:
        engine.run(t.prompt, t.answer)
    engine.idle()
    prompt = turns[-1].prompt
    length = len(prompt) + DECODE_STEPS  # positions holding KV after the decode steps
    on_gpu = engine.run(prompt, decode=DECODE_STEPS, cache=False)
    reference = request_kv(cache, on_gpu.blocks, length)
    again = engine.run(prompt, decode=DECODE_STEPS, cache=False)
    repeat = _same(on_gpu, again) and _kv_equal(reference, request_kv(cache, again.blocks, length))
    engine.drop_gpu_cache()
    restored = engine.run(prompt, decode=DECODE_STEPS, cache=False)
    kv = request_kv(cache, restored.blocks, length)
    engine.idle()
    hit = on_gpu.gpu_hit_tokens
    spans = {"prefix": (0, hit), "suffix": (hit, len(prompt)), "decode": (len(prompt), length)}
    kv_equal = {name: _kv_equal(reference, kv, lo, hi) for name, (lo, hi) in spans.items()}
    del reference, kv
    recompute = PagedEngine(model, cache, "recompute", None, chunk_tokens, None, pool, 0, graphs)
    computed = recompute.run(prompt)
    same_hit = restored.host_hit_tokens == hit and restored.gpu_hit_tokens == 0
    logits_equal = torch.equal(on_gpu.logits, restored.logits)
    ids = [on_gpu.first_token, *on_gpu.tokens], [restored.first_token, *restored.tokens]
    mismatch = next((i for i, (a, b) in enumerate(zip(*ids, strict=True)) if a != b), None)
    return {
        "turn": turn,
        "graph": engine.graph,
        "seed": seed,
        "prompt_tokens": len(prompt),
        "reference_gpu_hit_tokens": hit,
        "restored_host_hit_tokens": restored.host_hit_tokens,
        "restored_gpu_hit_tokens": restored.gpu_hit_tokens,
        "restored_kv_bit_equal": kv_equal["prefix"],
        "suffix_kv_bit_equal": kv_equal["suffix"],
        "decode_kv_bit_equal": kv_equal["decode"],
        "logits_bit_equal": logits_equal,
        "greedy_tokens_equal": mismatch is None,
        "first_token_mismatch": mismatch,
        "decode_steps": DECODE_STEPS,
        "gpu_reference_repeats_bit_equal": repeat,
        "max_abs_diff_vs_full_recompute": float((computed.logits - on_gpu.logits).abs().max()),
        "logits_abs_max": float(on_gpu.logits.abs().max()),
        "ok": bool(
            same_hit
            and hit > 0
            and kv_equal["prefix"]
            and kv_equal["suffix"]
            and logits_equal
            and mismatch is None
        ),
    }


def request_kv(cache: PagedKVCache, blocks: list[int], length: int) -> list[torch.Tensor]:
    """A copy of a request's K and V, per layer ``[2, length, kv_heads, head]``."""
    device = cache.tensors[0].device
    table = torch.tensor(blocks, dtype=torch.int64, device=device)
    return [torch.stack(cache.gather(layer, table, length)) for layer in range(len(cache.tensors))]


def _kv_equal(
    a: list[torch.Tensor], b: list[torch.Tensor], lo: int = 0, hi: int | None = None
) -> bool:
    return all(torch.equal(x[:, lo:hi], y[:, lo:hi]) for x, y in zip(a, b, strict=True))


def _same(a: TurnResult, b: TurnResult) -> bool:
    return torch.equal(a.logits, b.logits) and [a.first_token, *a.tokens] == [
        b.first_token,
        *b.tokens,
    ]


def verify_samples(
    model: Model,
    cache: PagedKVCache,
    host: HostTier,
    mc: ModelConfig,
    cfg: BenchConfig,
    advance: Advance,
    graphs: GraphRunner | None = None,
) -> list[dict[str, Any]]:
    """``cfg.verify`` sampled turns, spread over 2..T, each on its own fresh conversation."""
    chat = cfg.workloads[0].workload.verify_shape()
    if not cfg.verify or chat.turns < 2:
        return []
    picks = np.linspace(2, chat.turns, cfg.verify).round().astype(int)
    out = []
    for i, turn in enumerate(picks):
        seed = cfg.seed + 5000 + i
        check = check_turn(
            model, cache, host, chat, int(turn), seed, cfg.chunk_tokens, cfg.offload, graphs
        )
        out.append(check)
        advance("verify")
    return out

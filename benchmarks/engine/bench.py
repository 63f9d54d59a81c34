"""The multi-turn TTFT benchmark behind ``kvoffload bench e2e`` (docs/e2e.md says what it measures).

Per mode it runs every turn of the chat workload on a fresh GPU pool after a warm-up, then a
zero-reuse workload (every prompt unique) alternating ``gpu`` and ``kvoffload`` rounds, then the
correctness check on fresh sampled conversations (``verify.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kvoffload as kvo
from benchmarks.engine.config import ModelConfig, model_config
from benchmarks.engine.engine import ADMISSIONS, MODES, Engine
from benchmarks.engine.host_tier import HostTier, TierStats
from benchmarks.engine.kv_cache import PagedKVCache
from benchmarks.engine.model import Model
from benchmarks.engine.timing import sync
from benchmarks.engine.verify import verify_samples
from benchmarks.engine.workload import ChatShape, Turn, chat_turns, unique_turns

Advance = Callable[[str], None]  # progress: called once per turn run, with a description


@dataclass(frozen=True)
class BenchConfig:
    model: str
    device: str  # "cpu", "cuda", "cuda:1"
    chat: ChatShape
    gpu_blocks: int  # GPU pool capacity
    host_blocks: int  # kvoffload host tier capacity
    block_size: int = 16
    chunk_tokens: int = 2048  # prefill chunk
    modes: tuple[str, ...] = MODES
    zero_reuse_rounds: int = 2  # rounds of (gpu, kvoffload) on unique prompts; 0 skips
    zero_reuse_turns: int = 16  # requests per zero-reuse round
    verify: int = 2  # sampled turns checked bit for bit; 0 skips
    backend: str = "auto"  # kvoffload copy backend
    admission: str = "reuse"  # which requests' blocks kvoffload stores (engine.ADMISSIONS)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise ValueError(f"expected admission in {ADMISSIONS}, got {self.admission!r}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"expected modes from {MODES}, got {list(self.modes)}")
        for name in ("gpu_blocks", "host_blocks", "block_size", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"expected {name} > 0, got {getattr(self, name)}")
        for name in ("zero_reuse_rounds", "zero_reuse_turns", "verify"):
            if getattr(self, name) < 0:
                raise ValueError(f"expected {name} >= 0, got {getattr(self, name)}")
        need = 2 * -(-self.chat.history_tokens // self.block_size)
        if self.gpu_blocks < need:
            raise ValueError(
                f"expected a GPU pool of at least {need} blocks (twice the longest conversation, "
                f"{self.chat.history_tokens} tokens), got {self.gpu_blocks}"
            )

    def total_history_blocks(self) -> int:
        return self.chat.conversations * -(-self.chat.history_tokens // self.block_size)


def run_bench(cfg: BenchConfig, advance: Advance) -> dict[str, Any]:
    mc = model_config(cfg.model)
    device = torch.device(cfg.device)
    t0 = time.perf_counter()
    model = Model(mc, cfg.device, cfg.seed)
    cache = PagedKVCache(mc, cfg.gpu_blocks, cfg.block_size, device)
    host = HostTier(
        cache, kvo.OffloadConfig(host_capacity_blocks=cfg.host_blocks, backend=cfg.backend)
    )
    sync(device)
    setup_s = time.perf_counter() - t0

    def engine(mode: str, admission: str = cfg.admission) -> Engine:
        tier = host if mode == "kvoffload" else None
        return Engine(model, cache, mode, tier, cfg.chunk_tokens, admission)

    used = sorted({*cfg.modes, *(("gpu", "kvoffload") if cfg.zero_reuse_rounds else ())})
    for mode in used:
        warm_up(engine(mode), mc, cfg, advance)
    turns = chat_turns(cfg.chat, mc.vocab, cfg.seed)
    modes = {
        mode: run_turns(engine(mode), host, turns, cache.block_bytes, advance) for mode in cfg.modes
    }
    zero = zero_reuse(engine, host, mc, cfg, cache.block_bytes, advance)
    checks = verify_samples(model, cache, host, mc, cfg, advance)
    host.close()
    return {
        "setup_s": setup_s,
        "block_bytes": cache.block_bytes,
        "modes": modes,
        "speedup": speedups(modes),
        "zero_reuse": zero,
        "verify": checks,
    }


def warm_up(engine: Engine, mc: ModelConfig, cfg: BenchConfig, advance: Advance) -> None:
    """Compile and allocate what the first turns would otherwise pay for: a prompt longer than
    one chunk, its extension, and (with a host tier) a store and a load."""
    rng = np.random.default_rng(cfg.seed + 99)
    prompt = rng.integers(0, mc.vocab, cfg.chunk_tokens + cfg.chat.user_tokens)
    engine.run(prompt, rng.integers(0, mc.vocab, cfg.chat.answer_tokens))
    if engine.host is not None:
        engine.drop_gpu_cache()
        engine.run(np.concatenate([prompt, rng.integers(0, mc.vocab, cfg.chat.user_tokens)]))
    engine.idle()
    advance(f"warm-up {engine.mode}")


def run_turns(
    engine: Engine, host: HostTier, turns: Sequence[Turn], block_bytes: int, advance: Advance
) -> dict[str, Any]:
    before = copy.copy(host.stats)
    device = engine.model.device
    sync(device)
    t0 = time.perf_counter()
    records = []
    for turn in turns:
        r = engine.run(turn.prompt, turn.answer)
        records.append(
            {
                "conversation": turn.conversation,
                "turn": turn.index,
                "ttft_ms": r.ttft * 1e3,
                "prompt_tokens": r.prompt_tokens,
                "gpu_hit_tokens": r.gpu_hit_tokens,
                "host_hit_tokens": r.host_hit_tokens,
                "computed_tokens": r.computed_tokens,
                "load_ms": r.load_seconds * 1e3,
                "prefill_ms": r.sections.get("prefill", 0.0) * 1e3,
                "gather_ms": r.sections.get("gather", 0.0) * 1e3,
                "sdpa_ms": r.sections.get("sdpa", 0.0) * 1e3,
            }
        )
        advance(engine.mode)
    sync(device)
    wall = time.perf_counter() - t0  # the last turn's stores run on, as they would in service
    engine.idle()
    return summarize(engine.mode, records, wall, _delta(host.stats, before), engine.pool.evictions)


def summarize(
    mode: str, records: list[dict[str, Any]], wall: float, tier: TierStats, evictions: int
) -> dict[str, Any]:
    def total(name: str, rows: list[dict[str, Any]] = records) -> float:
        return float(sum(r[name] for r in rows))

    prompt = total("prompt_tokens")
    ttft_s = total("ttft_ms") / 1e3
    returning = [r for r in records if r["turn"] >= 2]
    return {
        "mode": mode,
        "turns": len(records),
        "wall_s": wall,
        "turns_per_s": len(records) / wall,
        "ttft_ms": percentiles([r["ttft_ms"] for r in records]),
        "ttft_ms_returning": percentiles([r["ttft_ms"] for r in returning]),
        "hit_ratio": {
            "gpu": total("gpu_hit_tokens") / prompt,
            "host": total("host_hit_tokens") / prompt,
            "computed": total("computed_tokens") / prompt,
        },
        "gpu_evicted_blocks": evictions,
        "host": {
            "loaded_blocks": tier.loads,
            "loaded_bytes": tier.load_bytes,
            "load_GBps": tier.load_bytes / tier.load_seconds / 1e9 if tier.load_seconds else None,
            "load_wait_s": total("load_ms") / 1e3,
            "stored_blocks": tier.stores,
            "stored_bytes": tier.store_bytes,
            "failed_blocks": tier.failures,
        },
        "ttft_s_total": ttft_s,
        "prefill_s": total("prefill_ms") / 1e3,
        "attention_share_of_ttft": (total("gather_ms") + total("sdpa_ms")) / 1e3 / ttft_s,
        "gather_share_of_ttft": total("gather_ms") / 1e3 / ttft_s,
        "records": records,
    }


def zero_reuse(
    engine: Callable[[str, str], Engine],
    host: HostTier,
    mc: ModelConfig,
    cfg: BenchConfig,
    block_bytes: int,
    advance: Advance,
) -> dict[str, Any] | None:
    """Unique prompts as long as the chat's mean prompt: ``gpu``, ``kvoffload`` with the chosen
    admission and, if that is not ``all``, ``kvoffload`` storing everything, in rotating order."""
    if not cfg.zero_reuse_rounds:
        return None
    chat = cfg.chat
    length = round(statistics.mean(chat.prompt_tokens(t) for t in range(1, chat.turns + 1)))
    variants = {"gpu": ("gpu", cfg.admission), "kvoffload": ("kvoffload", cfg.admission)}
    if cfg.admission != "all":
        variants["kvoffload_store_all"] = ("kvoffload", "all")
    names = list(variants)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i in range(cfg.zero_reuse_rounds):
        order = names if i % 2 == 0 else names[::-1]
        for j, name in enumerate(order):
            seed = cfg.seed + 1000 + len(names) * i + j
            turns = unique_turns(cfg.zero_reuse_turns, length, chat.answer_tokens, mc.vocab, seed)
            run = run_turns(engine(*variants[name]), host, turns, block_bytes, advance)
            run.pop("records")
            runs[name].append(run)
    tps = {n: statistics.median(r["turns_per_s"] for r in runs[n]) for n in names}
    p50 = {n: statistics.median(r["ttft_ms"]["p50"] for r in runs[n]) for n in names}
    return {
        "prompt_tokens": length,
        "turns_per_round": cfg.zero_reuse_turns,
        "rounds": cfg.zero_reuse_rounds,
        "admission": cfg.admission,
        "turns_per_s": tps,
        "ttft_ms_p50": p50,
        "overhead_turns_per_s": {n: 1.0 - tps[n] / tps["gpu"] for n in names[1:]},
        "overhead_ttft_p50": {n: p50[n] / p50["gpu"] - 1.0 for n in names[1:]},
        "runs": runs,
    }


def speedups(modes: dict[str, dict[str, Any]]) -> dict[str, float]:
    """TTFT of each mode over kvoffload's, on returning turns (turn >= 2)."""
    if "kvoffload" not in modes:
        return {}
    kvo = modes["kvoffload"]["ttft_ms_returning"]
    out = {}
    for mode in ("recompute", "gpu"):
        if mode in modes and kvo:
            for q in ("p50", "p90", "p99"):
                out[f"{mode}_over_kvoffload_{q}"] = modes[mode]["ttft_ms_returning"][q] / kvo[q]
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


def _delta(after: TierStats, before: TierStats) -> TierStats:
    return TierStats(
        **{
            f.name: getattr(after, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(TierStats)
        }
    )

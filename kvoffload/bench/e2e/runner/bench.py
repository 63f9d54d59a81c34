"""The TTFT benchmark behind ``kvoffload bench e2e`` (docs/e2e.md says what it measures).

Per workload, every mode gets its own GPU pool (disjoint blocks of one KV cache) and the modes
take turns request by request (``run_paired``): every request runs on every mode, who goes first
rotating, each mode settled (its copies finished) before the next starts. So a drift in the
machine's speed hits all modes alike (on the H100 VM a host-bound mode, run whole one after
another, read 14 and 24 turns/s in two rounds), the same request is compared with itself across
modes, and a mode is charged for its own copies (they never overlap another mode's requests; in
a service they would overlap its own next request, which this does not credit). ``rounds`` repeat
that on fresh token ids. Then a zero-reuse workload (every prompt unique) the same way; then the
correctness check on fresh sampled conversations (``verify.py``); then the targets
(``targets.py``). Each request's numbers and their summaries per mode: ``results.py``.

All of that once per graph mode (``cfg.graphs``: eager, piecewise, full; ``graphs.py``), each on
fresh token ids, into ``runs[graph]``. Every graph is captured at start, before any transfer;
then the link's rate is measured (``measure_link``: a blocking load, for the targets' wire bound).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import kvoffload as kvo
from kvoffload import prefix_block_keys
from kvoffload.bench.e2e.runner.bench_config import Advance, BenchConfig, WorkloadRun
from kvoffload.bench.e2e.runner.beside import MODE as BESIDE
from kvoffload.bench.e2e.runner.beside import BesideCopy
from kvoffload.bench.e2e.runner.config import ModelConfig, model_config
from kvoffload.bench.e2e.runner.engine import PagedEngine
from kvoffload.bench.e2e.runner.graphs import GraphRunner
from kvoffload.bench.e2e.runner.host_tier import HostTier, TierStats
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Model
from kvoffload.bench.e2e.runner.offload_mode import Offload
from kvoffload.bench.e2e.runner.profile import compare, traced
from kvoffload.bench.e2e.runner.results import attribution, pool_rounds, record, summarize
from kvoffload.bench.e2e.runner.targets import targets
from kvoffload.bench.e2e.runner.timing import HostEvents, sync
from kvoffload.bench.e2e.runner.verify import verify_samples
from kvoffload.bench.e2e.runner.workload import Turn, unique_turns

GRAPH_SEED = 100_003  # graph mode g runs on seed + g * this: fresh token ids per graph mode
LINK_BLOCKS = 256  # blocks of the link probe's load (Llama-3-8B shapes: 512 MiB)
LINK_REPEATS = 3  # the probe's loads; the fastest counts


def run_bench(cfg: BenchConfig, advance: Advance) -> dict[str, Any]:
    mc = model_config(cfg.model)
    device = torch.device(cfg.device)
    t0 = time.perf_counter()
    model = Model(mc, cfg.device, cfg.seed, cfg.dtype)
    blocks = cfg.cache_blocks() + 1  # the last one: the graphs' scratch block, in no pool
    cache = PagedKVCache(mc, blocks, cfg.block_size, device, getattr(torch, cfg.dtype))
    host_blocks = max(r.host_blocks for r in cfg.workloads)
    config = kvo.OffloadConfig(
        host_capacity_blocks=host_blocks,
        backend=cfg.backend,
        eviction_window=cfg.eviction_window,
    )
    host = HostTier(cache, config)
    sync(device)
    setup_s = time.perf_counter() - t0
    runs = {}
    try:
        runners = {g: graph_runner(model, cache, host, cfg, g) for g in cfg.graphs}
        replays = {g: r.check_replays() if r is not None else [] for g, r in runners.items()}
        link = measure_link(host, cache, cfg)
        for i, graph in enumerate(cfg.graphs):
            gcfg = dataclasses.replace(cfg, seed=cfg.seed + GRAPH_SEED * i)
            runner = runners[graph]
            runs[graph] = run_graph(model, cache, host, gcfg, runner, advance)
            runs[graph]["graph_capture_s"] = runner.capture_s if runner is not None else 0.0
            runs[graph]["graph_replays"] = replays[graph]
    finally:
        host.close()
    result = {
        "setup_s": setup_s,
        "block_bytes": cache.block_bytes,
        "graphs": list(cfg.graphs),
        "link": link,
        "runs": runs,
    }
    for run in runs.values():
        run["targets"] = targets(run, link, mc.layers)
    return result


def run_graph(
    model: Model,
    cache: PagedKVCache,
    host: HostTier,
    cfg: BenchConfig,
    graphs: GraphRunner | None,
    advance: Advance,
) -> dict[str, Any]:
    """Warm-ups, every workload, zero reuse and the check, with the forward of ``graphs``."""
    mc = model.config
    first = cfg.workloads[0]
    for mode in cfg.modes:
        warm_up(_engine(model, cache, host, cfg, first, mode, graphs=graphs), mc, cfg, advance)
    freeze_heap()
    workloads = {
        run.workload.kind: run_workload(model, cache, host, cfg, run, advance, graphs)
        for run in cfg.workloads
    }
    zero = zero_reuse(model, cache, host, mc, cfg, advance, graphs)
    checks = verify_samples(model, cache, host, mc, cfg, advance, graphs)
    return {
        "graph": graphs.mode if graphs is not None else "eager",
        "workloads": workloads,
        "zero_reuse": zero,
        "verify": checks,
    }


def graph_runner(
    model: Model, cache: PagedKVCache, host: HostTier, cfg: BenchConfig, graph: str
) -> GraphRunner | None:
    """The captured runner of ``graph`` (None: eager). Scratch: the cache's last block."""
    if graph == "eager":
        return None
    full = graph == "full"
    runner = GraphRunner(
        model,
        cache,
        graph,
        cfg.chunk_tokens,
        max_context(cfg),
        cache.num_blocks - 1,
        host.layer_gate() if full else None,
        host.open_layers if full else None,
        time_waits=cfg.offload.time_waits,
    )
    runner.capture()
    return runner


def max_context(cfg: BenchConfig) -> int:
    """The longest request the run makes (tokens with KV): a workload's, the check's (its
    prompt plus decode steps) or the warm-up's."""
    from kvoffload.bench.e2e.runner.verify import DECODE_STEPS

    bs = cfg.block_size
    longest = max(r.workload.longest_request_blocks(bs) for r in cfg.workloads) * bs
    check = cfg.workloads[0].workload.verify_shape().history_tokens + DECODE_STEPS
    return max(longest, check, cfg.chunk_tokens + 8 * bs)


def measure_link(host: HostTier, cache: PagedKVCache, cfg: BenchConfig) -> dict[str, Any]:
    """The host-to-GPU rate kvoffload reaches here: blocks stored from the cache's first
    blocks (free at start), then loaded back whole (``load``, blocking) ``LINK_REPEATS`` times,
    the fastest counting. The targets' wire bound divides a restore's bytes by it."""
    n = min(LINK_BLOCKS, cfg.cache_blocks() // 2, host.capacity_blocks // 2)
    device = cache.tensors[0].device
    rng = np.random.default_rng(cfg.seed + 77)
    keys = prefix_block_keys(rng.integers(0, 1 << 30, n * cache.block_size), cache.block_size)
    blocks = list(range(n))
    host.store("link-store", keys, blocks)
    host.wait_settled("link-store")
    seconds = []
    for i in range(LINK_REPEATS):
        sync(device)
        t0 = time.perf_counter()
        ok = host.load(f"link-load{i}", keys, blocks)
        sync(device)
        seconds.append(time.perf_counter() - t0)
        host.wait_settled(f"link-load{i}")
        if not ok:
            raise RuntimeError("the link probe's load failed: kvoffload could not restore blocks")
    host.calls.take()
    nbytes = n * cache.block_bytes
    return {"blocks": n, "bytes": nbytes, "seconds": seconds, "GBps": nbytes / min(seconds) / 1e9}


def _engine(
    model: Model,
    cache: PagedKVCache,
    host: HostTier,
    cfg: BenchConfig,
    run: WorkloadRun,
    mode: str,
    offload: Offload | None = None,
    first_block: int = 0,
    graphs: GraphRunner | None = None,
) -> PagedEngine:
    pool = run.pool_blocks(mode, cfg.block_size)
    tier = host if mode == "kvoffload" else None
    off = offload or cfg.offload
    side = None
    if mode == BESIDE:  # room for the longest request's restore
        longest = run.workload.longest_request_blocks(cfg.block_size)
        side = BesideCopy(model.device, longest * cache.block_bytes)
    return PagedEngine(
        model, cache, mode, tier, cfg.chunk_tokens, off, pool, first_block, graphs, side
    )


def freeze_heap() -> None:
    """Move every object alive after start-up out of the garbage collector's reach (as vLLM does
    once its engine is up, ``gc.freeze``). Without it a full collection walks the whole start-up
    heap (torch, the workload's arrays): on the 2-core CI VM ``gc.callbacks`` timed up to 161 ms
    per collection at ``micro`` shapes, and on the H100 VM requests of every mode, ``gpu_all``
    included, had stalls of 30-40 ms at random; such a pause lands in one mode's TTFT by chance.
    Collection stays on for what the requests allocate, so garbage kvoffload makes is paid for."""
    gc.collect()
    gc.freeze()


def warm_up(engine: PagedEngine, mc: ModelConfig, cfg: BenchConfig, advance: Advance) -> None:
    """Compile and allocate what the first requests would otherwise pay for: a prompt longer
    than one chunk, its extension, and (with a host tier) a store and a load."""
    rng = np.random.default_rng(cfg.seed + 99)
    prompt = rng.integers(0, mc.vocab, cfg.chunk_tokens + 4 * cfg.block_size)
    engine.run(prompt, rng.integers(0, mc.vocab, 4 * cfg.block_size))
    if engine.host is not None:
        engine.drop_gpu_cache()
        engine.run(np.concatenate([prompt, rng.integers(0, mc.vocab, 4 * cfg.block_size)]))
    engine.idle()
    advance(f"warm-up {engine.mode}")


def run_workload(
    model: Model,
    cache: PagedKVCache,
    host: HostTier,
    cfg: BenchConfig,
    run: WorkloadRun,
    advance: Advance,
    graphs: GraphRunner | None = None,
) -> dict[str, Any]:
    """Every mode on the workload, paired request by request, ``run.rounds`` times; per mode the
    records of all rounds pooled, turns/s the median of the rounds."""
    vocab, names = model.config.vocab, list(run.modes)
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in names}
    label = run.workload.kind
    for i in range(run.rounds):
        turns = run.workload.turns(vocab, cfg.seed + 1009 * i)
        engines, first = {}, 0
        for mode in names:
            engines[mode] = _engine(model, cache, host, cfg, run, mode, None, first, graphs)
            first += run.pool_blocks(mode, cfg.block_size)
        profile = cfg.profile if i == 0 else 0
        for mode, one in run_paired(engines, host, turns, label, advance, i, profile).items():
            rounds[mode].append(one)
    modes = {m: pool_rounds(rs, model.config.layers) for m, rs in rounds.items()}
    profiled = None
    if cfg.profile and "kvoffload" in modes and "gpu_all" in modes:
        profiled = compare(modes["kvoffload"]["records"], modes["gpu_all"]["records"])
    return {
        "graph": graphs.mode if graphs is not None else "eager",
        "workload": run.workload.as_dict(),
        "rounds": run.rounds,
        "gpu_blocks": run.gpu_blocks,
        "gpu_all_blocks": run.all_blocks(cfg.block_size) if "gpu_all" in names else None,
        "host_blocks": run.host_blocks,
        "distinct_blocks": run.workload.distinct_blocks(cfg.block_size),
        "modes": modes,
        "attribution": attribution(modes),
        "profile": profiled,
    }


def run_paired(
    engines: dict[str, PagedEngine],
    host: HostTier,
    turns: Sequence[Turn],
    label: str,
    advance: Advance,
    round_: int = 0,
    profile: int = 0,
) -> dict[str, dict[str, Any]]:
    """Every request on every engine in turn (who goes first rotates), each engine settled
    (``idle``: its copies finished) before the next starts; a mode's time is the sum of its
    requests' (run + settle). The engines must use disjoint blocks of the cache. The last
    ``profile`` requests of ``gpu_all`` and ``kvoffload`` run traced (``profile.py``; CUDA only)."""
    names = [n for n in engines if n != BESIDE]  # BESIDE runs right after kvoffload
    spent = dict.fromkeys(engines, 0.0)
    tiers = {n: TierStats() for n in engines}
    records: dict[str, list[dict[str, Any]]] = {n: [] for n in engines}
    device = engines[names[0]].model.device
    for i, turn in enumerate(turns):
        k = i % len(names)
        order = names[k:] + names[:k]
        if BESIDE in engines:
            order.insert(order.index("kvoffload") + 1, BESIDE)
        for name in order:
            engine, before = engines[name], copy.copy(host.stats)
            if name == BESIDE:  # the bytes kvoffload's load of this request moved
                engine.beside_bytes = records["kvoffload"][-1]["load_bytes"]
            trace: dict[str, Any] = {}
            traced_now = (
                i >= len(turns) - profile
                and name in ("gpu_all", "kvoffload")
                and device.type == "cuda"
            )
            sync(device)
            t0 = time.perf_counter()
            with traced(trace) if traced_now else contextlib.nullcontext():
                with HostEvents(device) as events:
                    r = engine.run(turn.prompt, turn.answer)
                engine.idle()
                sync(device)
            spent[name] += time.perf_counter() - t0
            tiers[name] = _sum(tiers[name], tier_delta(host.stats, before))
            records[name].append(record(turn, r, round_))
            records[name][-1]["host_events"] = events.counts
            if traced_now:
                records[name][-1]["profile"] = trace
            advance(f"{label} {name}")
    return {
        n: {
            "wall_s": spent[n],
            "turns_per_s": len(records[n]) / spent[n],
            "tier": dataclasses.asdict(tiers[n]),
            "gpu_evicted_blocks": engines[n].pool.evictions,
            "late_stored_blocks": engines[n].late_stores,
            "records": records[n],
        }
        for n in engines
    }


def zero_reuse(
    model: Model,
    cache: PagedKVCache,
    host: HostTier,
    mc: ModelConfig,
    cfg: BenchConfig,
    advance: Advance,
    graphs: GraphRunner | None = None,
) -> dict[str, Any] | None:
    """Unique prompts as long as the first workload's mean prompt: ``gpu``, ``kvoffload`` with
    the chosen admission and, if that is not ``all``, ``kvoffload`` storing everything, paired
    request by request (``run_paired``)."""
    if not cfg.zero_reuse_rounds:
        return None
    run = cfg.workloads[0]
    length, answer = run.workload.mean_prompt_tokens(), run.workload.answer_tokens
    variants = cfg.zero_reuse_variants()
    names = list(variants)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i in range(cfg.zero_reuse_rounds):
        seed = cfg.seed + 1000 + i
        turns = unique_turns(cfg.zero_reuse_turns, length, answer, mc.vocab, seed)
        engines = {
            name: _engine(model, cache, host, cfg, run, mode, offload, j * run.gpu_blocks, graphs)
            for j, (name, (mode, offload)) in enumerate(variants.items())
        }
        for name, one in run_paired(engines, host, turns, "zero reuse", advance, i).items():
            summary = summarize(one.pop("records"), one["tier"], mc.layers)
            runs[name].append({**one, **summary})
    tps = {n: statistics.median(r["turns_per_s"] for r in runs[n]) for n in names}
    p50 = {n: statistics.median(r["ttft_ms"]["p50"] for r in runs[n]) for n in names}
    return {
        "prompt_tokens": length,
        "turns_per_round": cfg.zero_reuse_turns,
        "rounds": cfg.zero_reuse_rounds,
        "admission": cfg.offload.admission,
        "turns_per_s": tps,
        "ttft_ms_p50": p50,
        "overhead_turns_per_s": {n: 1.0 - tps[n] / tps["gpu"] for n in names[1:]},
        "overhead_ttft_p50": {n: p50[n] / p50["gpu"] - 1.0 for n in names[1:]},
        "runs": runs,
    }


def tier_delta(after: TierStats, before: TierStats) -> TierStats:
    return TierStats(
        **{
            f.name: getattr(after, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(TierStats)
        }
    )


def _sum(a: TierStats, b: TierStats) -> TierStats:
    return TierStats(
        **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(TierStats)}
    )

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
(``targets.py``).

All of that once per graph mode (``cfg.graphs``: eager, piecewise, full; ``graphs.py``), each on
fresh token ids, into ``runs[graph]``. Every graph is captured at start, before any transfer;
then the link's rate is measured (``measure_link``: a blocking load, for the targets' wire bound).
"""

from __future__ import annotations

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
from kvoffload.bench.e2e.runner import calls as kvo_calls
from kvoffload.bench.e2e.runner.bench_config import Advance, BenchConfig, WorkloadRun
from kvoffload.bench.e2e.runner.config import ModelConfig, model_config
from kvoffload.bench.e2e.runner.engine import Offload, PagedEngine, TurnResult
from kvoffload.bench.e2e.runner.graphs import GraphRunner
from kvoffload.bench.e2e.runner.host_tier import LAYER_WAIT, HostTier, TierStats
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Model
from kvoffload.bench.e2e.runner.targets import targets
from kvoffload.bench.e2e.runner.timing import sync
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
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=host_blocks, backend=cfg.backend))
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
    return PagedEngine(model, cache, mode, tier, cfg.chunk_tokens, off, pool, first_block, graphs)


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
        for mode, one in run_paired(engines, host, turns, label, advance, i).items():
            rounds[mode].append(one)
    modes = {m: pool_rounds(rs, model.config.layers) for m, rs in rounds.items()}
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
    }


def run_paired(
    engines: dict[str, PagedEngine],
    host: HostTier,
    turns: Sequence[Turn],
    label: str,
    advance: Advance,
    round_: int = 0,
) -> dict[str, dict[str, Any]]:
    """Every request on every engine in turn (who goes first rotates), each engine settled
    (``idle``: its copies finished) before the next starts; a mode's time is the sum of its
    requests' (run + settle). The engines must use disjoint blocks of the cache."""
    names = list(engines)
    spent = dict.fromkeys(names, 0.0)
    tiers = {n: TierStats() for n in names}
    records: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    device = engines[names[0]].model.device
    for i, turn in enumerate(turns):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            engine, before = engines[name], copy.copy(host.stats)
            sync(device)
            t0 = time.perf_counter()
            r = engine.run(turn.prompt, turn.answer)
            engine.idle()
            sync(device)
            spent[name] += time.perf_counter() - t0
            tiers[name] = _sum(tiers[name], tier_delta(host.stats, before))
            records[name].append(record(turn, r, round_))
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
        for n in names
    }


def record(turn: Turn, r: TurnResult, round_: int) -> dict[str, Any]:
    """One request's numbers. ``load_exposed_ms``: how long attention waited for the host-tier
    load (a blocking load: all of it, where timed; full graphs: the layer waits plus the stream's
    wait at the gate's open, ``gate_open_ms``); ``load_ms`` is None where not timed (CPU)."""
    gate_open = r.sections.get("gate_open", 0.0)  # full graphs: the stream's wait at the open
    if r.layer_waits:
        exposed: float | None = sum(r.layer_waits) + gate_open
    else:
        exposed = r.load_seconds
    waits = r.kvo_calls.get(LAYER_WAIT, (0.0, 0))
    return {
        "graph": r.graph,
        "round": round_,
        "conversation": turn.conversation,
        "turn": turn.index,
        "ttft_ms": r.ttft * 1e3,
        "prompt_tokens": r.prompt_tokens,
        "gpu_hit_tokens": r.gpu_hit_tokens,
        "host_hit_tokens": r.host_hit_tokens,
        "computed_tokens": r.computed_tokens,
        "load_ms": None if r.load_seconds is None else r.load_seconds * 1e3,
        "load_exposed_ms": None if exposed is None else exposed * 1e3,
        "layer_wait_ms": [w * 1e3 for w in r.layer_waits],
        "host_ms": {step: seconds * 1e3 for step, seconds in r.host.items()},
        "prefill_ms": r.sections.get("prefill", 0.0) * 1e3,
        "gather_ms": r.sections.get("gather", 0.0) * 1e3,
        "sdpa_ms": r.sections.get("sdpa", 0.0) * 1e3,
        "gate_open_ms": gate_open * 1e3,
        "load_bytes": r.load_bytes,
        "launch_ms": r.host.get("launch", 0.0) * 1e3,
        "kvo_ms": {name: s * 1e3 for name, (s, _) in r.kvo_calls.items()},
        "kvo_calls": {name: n for name, (_, n) in r.kvo_calls.items()},
        "kvo_ms_total": kvo_calls.total(r.kvo_calls) * 1e3,
        "kvo_ms_in_ttft": r.kvo_ttft_s * 1e3,
        "wait_call_us": waits[0] / waits[1] * 1e6 if waits[1] else None,
    }


def pool_rounds(rounds: list[dict[str, Any]], layers: int) -> dict[str, Any]:
    """One mode's rounds: records pooled, turns/s per round and their median."""
    records = [r for run in rounds for r in run["records"]]
    tier = {k: sum(run["tier"][k] for run in rounds) for k in rounds[0]["tier"]}
    out = summarize(records, tier, layers)
    tps = [run["turns_per_s"] for run in rounds]
    out["turns_per_s"] = statistics.median(tps)
    out["turns_per_s_rounds"] = tps
    out["wall_s"] = sum(run["wall_s"] for run in rounds)
    out["gpu_evicted_blocks"] = sum(run["gpu_evicted_blocks"] for run in rounds)
    out["late_stored_blocks"] = sum(run["late_stored_blocks"] for run in rounds)
    out["records"] = records
    return out


def summarize(records: list[dict[str, Any]], tier: dict[str, Any], layers: int) -> dict[str, Any]:
    def total(name: str, rows: list[dict[str, Any]] = records) -> float:
        return float(sum(r[name] for r in rows))

    prompt = total("prompt_tokens")
    ttft_s = total("ttft_ms") / 1e3
    returning = [r for r in records if r["turn"] >= 2]
    restored = [r for r in records if r["host_hit_tokens"] > 0]
    timed = all(r["load_ms"] is not None for r in restored)  # on a GPU
    load_s = sum(r["load_ms"] for r in restored) / 1e3 if timed else 0.0
    return {
        "turns": len(records),
        "ttft_ms": percentiles([r["ttft_ms"] for r in records]),
        "ttft_ms_returning": percentiles([r["ttft_ms"] for r in returning]),
        "ttft_ms_restored": percentiles([r["ttft_ms"] for r in restored]),
        "hit_ratio": {
            "gpu": total("gpu_hit_tokens") / prompt,
            "host": total("host_hit_tokens") / prompt,
            "computed": total("computed_tokens") / prompt,
        },
        "host": {
            "loaded_blocks": tier["loads"],
            "loaded_bytes": tier["load_bytes"],
            "load_GBps": tier["load_bytes"] / load_s / 1e9 if load_s else None,
            "stored_blocks": tier["stores"],
            "stored_bytes": tier["store_bytes"],
            "failed_blocks": tier["failures"],
        },
        "overlap": overlap(restored, layers),
        "host_ms_p50": {
            step: float(np.median([r["host_ms"].get(step, 0.0) for r in records]))
            for step in sorted({s for r in records for s in r["host_ms"]})
        },
        "ttft_s_total": ttft_s,
        "prefill_s": total("prefill_ms") / 1e3,
        "attention_share_of_ttft": (total("gather_ms") + total("sdpa_ms")) / 1e3 / ttft_s,
        "gather_share_of_ttft": total("gather_ms") / 1e3 / ttft_s,
    }


def overlap(restored: list[dict[str, Any]], layers: int) -> dict[str, Any] | None:
    """Where restored requests' load time went: hidden under compute or exposed (attention
    waiting for it), in total and per layer (medians over the requests). Load time is known
    only where the device timed it (a GPU); the waits are timed everywhere."""
    if not restored:
        return None
    timed = all(r["load_ms"] is not None for r in restored)
    load = sum(r["load_ms"] for r in restored) if timed else None
    exposed = sum(r["load_exposed_ms"] or 0.0 for r in restored)
    waits = [r["layer_wait_ms"] for r in restored if r["layer_wait_ms"]]
    load_med = statistics.median(r["load_ms"] for r in restored) if timed else None
    prefill_med = statistics.median(r["prefill_ms"] for r in restored)
    return {
        "requests": len(restored),
        "load_ms": load,
        "exposed_ms": exposed,
        "hidden_share": max(0.0, 1.0 - exposed / load) if load else None,
        "median_per_request_ms": {
            "load": load_med,
            "exposed": statistics.median(r["load_exposed_ms"] or 0.0 for r in restored),
            "prefill": prefill_med,
        },
        "per_layer_ms": {
            "load": None if load_med is None else load_med / layers,
            "compute": prefill_med / layers,
            "wait": [float(np.median(col)) for col in zip(*waits, strict=True)] if waits else [],
        },
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


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


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


def attribution(modes: dict[str, Any]) -> dict[str, Any] | None:
    """Where a restored request's time goes, per request and in medians: host time inside
    kvoffload's calls (per call), the per-layer wait call, the host launch phase against the same
    request's in ``gpu_all``, and the GPU's wait for the load per layer (exposed)."""
    if "kvoffload" not in modes:
        return None
    restored = [r for r in modes["kvoffload"]["records"] if r["host_hit_tokens"] > 0]
    if not restored:
        return None
    ideal = {_key(r): r for r in modes.get("gpu_all", {}).get("records", [])}

    def med(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return float(np.median(known)) if known else None

    names = sorted({n for r in restored for n in r["kvo_ms"]})
    paired = [(r, ideal[_key(r)]) for r in restored if _key(r) in ideal]
    launch = med([r["launch_ms"] for r in restored])
    ideal_launch = med([g["launch_ms"] for _, g in paired]) if paired else None
    layers = len(restored[0]["layer_wait_ms"])
    return {
        "requests": len(restored),
        "kvo_ms_total_p50": med([r["kvo_ms_total"] for r in restored]),
        "kvo_ms_total_p99": float(np.percentile([r["kvo_ms_total"] for r in restored], 99)),
        "kvo_ms_in_ttft_p50": med([r["kvo_ms_in_ttft"] for r in restored]),
        "kvo_ms_p50": {n: med([r["kvo_ms"].get(n, 0.0) for r in restored]) for n in names},
        "kvo_calls_p50": {n: med([r["kvo_calls"].get(n, 0) for r in restored]) for n in names},
        "wait_call_us_p50": med([r["wait_call_us"] for r in restored]),
        "launch_ms_p50": launch,
        "gpu_all_launch_ms_p50": ideal_launch,
        "launch_vs_gpu_all": launch / ideal_launch if launch and ideal_launch else None,
        "gpu_wait_ms_p50": med([r["load_exposed_ms"] for r in restored]),
        "gate_open_ms_p50": med([r.get("gate_open_ms", 0.0) for r in restored]),
        "gpu_wait_ms_per_layer_p50": [
            float(np.median([r["layer_wait_ms"][i] for r in restored])) for i in range(layers)
        ]
        if all(len(r["layer_wait_ms"]) == layers for r in restored)
        else [],
        "host_ms_p50": {
            step: med([r["host_ms"].get(step, 0.0) for r in restored])
            for step in sorted({s for r in restored for s in r["host_ms"]})
        },
        "gpu_all_host_ms_p50": {
            step: med([g["host_ms"].get(step, 0.0) for _, g in paired])
            for step in sorted({s for _, g in paired for s in g["host_ms"]})
        },
    }


def _key(r: dict[str, Any]) -> tuple[int, int, int]:
    return (r["round"], r["conversation"], r["turn"])

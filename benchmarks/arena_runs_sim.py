"""How does the host arena fragment as a server runs, and what does the eviction window undo?
(issue 25; CPU, under a minute per pass set)

``bench e2e`` on a GPU runs its graph modes one after the other on one host tier, and the loads
of the later modes read more runs of consecutive host slots (Llama-3-8B chat, median per load:
eager 4, piecewise 9, full 15), each run a pitched copy per layer slice on the engine's thread
(``benchmarks/runs_probe.py``). This runs the same workloads (the runner's chat and docs at a
model's token sizes, computed by the ``micro`` model on the CPU) ``PASSES`` times over one host
tier, each pass with the next graph mode's seed as on a GPU, for each eviction window
(``OffloadConfig.eviction_window``; 1 is the policy's exact order) and each host capacity (a
share of the largest workload's), and prints per pass and workload the restored requests' runs
per load (median, most), their host hit tokens and the tier's evictions so far.

    python -m benchmarks.arena_runs_sim [--models llama3-8b] [--windows 1,2,4,8]
        [--capacities 1,0.5] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvoffload as kvo
from kvoffload.bench.common import console, machine_info, write_json
from kvoffload.bench.e2e import args as e2e_args
from kvoffload.bench.e2e.runner import bench
from kvoffload.bench.e2e.runner.config import model_config
from kvoffload.bench.e2e.runner.host_tier import HostTier
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Model

PASSES = 3
ARGS = "--workloads chat,docs --modes kvoffload --conversations 8 --documents 16 --requests 48"
ARGS += " --zero-reuse-rounds 0 --verify 0 --device cpu --dtype float32"


def cpu_setup(
    args: str, compute: str | None = None, capacity_share: float = 1.0
) -> tuple[Any, Model, PagedKVCache, HostTier]:
    """``bench e2e`` parsed from ``args`` on a CPU: (config, model, KV cache, one host tier as
    large as the largest workload's). ``compute``: the model whose shapes compute (default: the
    config's), e.g. ``micro`` under a GPU model's token sizes."""
    parser = argparse.ArgumentParser()
    e2e_args.add_arguments(parser)
    cfg = e2e_args.build_config(parser.parse_args(args.split()), False, "float32")
    torch.set_num_threads(1)
    mc = model_config(compute or cfg.model)
    model = Model(mc, cfg.device, cfg.seed, cfg.dtype)
    cache = PagedKVCache(
        mc, cfg.cache_blocks() + 1, cfg.block_size, torch.device("cpu"), torch.float32
    )
    capacity = max(1, int(max(r.host_blocks for r in cfg.workloads) * capacity_share))
    config = kvo.OffloadConfig(
        host_capacity_blocks=capacity, backend=cfg.backend, eviction_window=cfg.eviction_window
    )
    host = HostTier(cache, config)
    return cfg, model, cache, host


def passes(model: str, window: int, share: float) -> list[dict[str, Any]]:
    """``PASSES`` passes of the workloads over one host tier: a row per pass and workload."""
    args = f"{ARGS} --model {model} --eviction-window {window}"
    cfg, model_, cache, host = cpu_setup(args, "micro", share)
    rows: list[dict[str, Any]] = []
    try:
        for i in range(PASSES):
            gcfg = dataclasses.replace(cfg, seed=cfg.seed + bench.GRAPH_SEED * i)
            out = bench.run_graph(model_, cache, host, gcfg, None, lambda what: None)
            evicted = host.local.offloader.snapshot()["host"].get("evictions")
            for kind, run in out["workloads"].items():
                records = run["modes"]["kvoffload"]["records"]
                runs = [r["load_runs"] for r in records if r["host_hit_tokens"] > 0]
                row = {
                    "model": model,
                    "eviction_window": window,
                    "capacity_share": share,
                    "host_slots": host.capacity_blocks,
                    "pass": i,
                    "workload": kind,
                    "restores": len(runs),
                    "runs_p50": float(np.median(runs)) if runs else None,
                    "runs_max": max(runs) if runs else None,
                    "host_hit_tokens": sum(r["host_hit_tokens"] for r in records),
                    "evictions": evicted,
                }
                rows.append(row)
                console.print(
                    f"{model} window {window} capacity x{share} pass {i} {kind:5} restores "
                    f"{len(runs):3} runs per load p50 {row['runs_p50']} most {row['runs_max']}; "
                    f"host hit tokens {row['host_hit_tokens']}; evictions so far {evicted}"
                )
    finally:
        host.close()
    return rows


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama3-8b", help="comma-separated bench e2e models")
    parser.add_argument("--windows", default="1,2,4,8", help="eviction windows to sweep")
    parser.add_argument("--capacities", default="1,0.5", help="host capacity shares to sweep")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    a = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for model in a.models.split(","):
        for share in _floats(a.capacities):
            for window in (int(w) for w in a.windows.split(",") if w):
                rows.extend(passes(model, window, share))
    if a.out:
        out = {"benchmark": "arena_runs_sim", "machine": machine_info(), "rows": rows}
        out["date"] = time.strftime("%Y-%m-%d")
        out["args"] = ARGS
        write_json(Path(a.out), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

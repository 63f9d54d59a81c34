"""How does the host arena fragment as a server runs? (issue 25; CPU, a few seconds per pass)

``bench e2e`` on a GPU runs its graph modes one after the other on one host tier, and the loads
of the later modes read more runs of consecutive host slots (Llama-3-8B chat, median per load:
eager 4, piecewise 9, full 15), each run a pitched copy per layer slice on the engine's thread
(``benchmarks/runs_probe.py``). This runs the same workloads (the CPU model, the runner's defaults
for chat and docs) ``PASSES`` times over one host tier and prints, per pass and workload, the
restored requests' runs per load (median, most) and the tier's evictions so far.

    python -m benchmarks.arena_runs_sim [OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import torch

import kvoffload as kvo
from kvoffload.bench.e2e import args as e2e_args
from kvoffload.bench.e2e.runner import bench
from kvoffload.bench.e2e.runner.config import model_config
from kvoffload.bench.e2e.runner.host_tier import HostTier
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Model

PASSES = 3
ARGS = "--workloads chat,docs --modes kvoffload --conversations 8 --documents 16 --requests 48"
ARGS += " --zero-reuse-rounds 0 --verify 0 --device cpu"


def cpu_setup(args: str, compute: str | None = None) -> tuple[Any, Model, PagedKVCache, HostTier]:
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
    capacity = max(r.host_blocks for r in cfg.workloads)
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=capacity, backend=cfg.backend))
    return cfg, model, cache, host


def main() -> int:
    cfg, model, cache, host = cpu_setup(ARGS)
    capacity = host.capacity_blocks
    rows: list[dict[str, Any]] = []
    try:
        for i in range(PASSES):
            out = bench.run_graph(model, cache, host, cfg, None, lambda what: None)
            evicted = host.local.offloader.snapshot()["host"].get("evictions")
            for kind, run in out["workloads"].items():
                records = run["modes"]["kvoffload"]["records"]
                runs = [r["load_runs"] for r in records if r["host_hit_tokens"] > 0]
                row = {
                    "pass": i,
                    "workload": kind,
                    "restores": len(runs),
                    "runs_p50": float(np.median(runs)) if runs else None,
                    "runs_max": max(runs) if runs else None,
                    "evictions": evicted,
                    "host_slots": capacity,
                }
                rows.append(row)
                print(
                    f"pass {i} {kind:5} restores {len(runs):3} runs per load p50 "
                    f"{row['runs_p50']} most {row['runs_max']}; evictions so far {evicted}"
                )
    finally:
        host.close()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            out = {"benchmark": "arena_runs_sim", "date": time.strftime("%Y-%m-%d"), "rows": rows}
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

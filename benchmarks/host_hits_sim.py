"""Where does the host tier miss what the GPU-only ideal would have? (CPU, ~45 s per pass)

``bench e2e`` compares each kvoffload turn with the same turn on ``gpu_all`` (a GPU pool that
holds everything). A turn that computes more tokens than ``gpu_all`` found part of its prefix on
neither the GPU nor the host: a hit-rate loss, not a transfer cost, and in the docs workload it
was the p99 (one turn in 14-23 restoring 1792 of 4096 tokens, or none). This runs the e2e chat and
docs workloads at the GPU models' token sizes (``--model llama3-8b``'s defaults) with the
``micro`` model's compute on a CPU, ``PASSES`` times over one host tier (``bench e2e`` runs its
graph modes one after the other on one tier, fresh token ids each), and prints per pass and
workload the turns that computed more than ``gpu_all``, the tokens they lost, and the restored
turns' runs of host slots per load.

    python -m benchmarks.host_hits_sim [OUT.json]
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
from typing import Any

import numpy as np

from benchmarks.arena_runs_sim import cpu_setup
from kvoffload.bench.e2e.runner import bench
from kvoffload.bench.e2e.runner.targets import prefix_lost

PASSES = 3
ARGS = "--model llama3-8b --workloads chat,docs --modes gpu_all,kvoffload --conversations 8"
ARGS += " --documents 16 --requests 48 --zero-reuse-rounds 0 --verify 0 --device cpu"
ARGS += " --dtype float32"


def pass_rows(i: int, out: dict[str, Any], evictions: int) -> list[dict[str, Any]]:
    rows = []
    for kind, run in out["workloads"].items():
        records = run["modes"]["kvoffload"]["records"]
        short = [(r, lost) for r, lost in prefix_lost(run["modes"]) or [] if lost > 0]
        runs = [r["load_runs"] for r in records if r["host_hit_tokens"] > 0]
        rows.append(
            {
                "pass": i,
                "workload": kind,
                "turns": len(records),
                "turns_short": len(short),
                "tokens_lost": sum(lost for _, lost in short),
                "short": [
                    {
                        "conversation": r["conversation"],
                        "turn": r["turn"],
                        "gpu_hit_tokens": r["gpu_hit_tokens"],
                        "host_hit_tokens": r["host_hit_tokens"],
                        "lost_tokens": lost,
                    }
                    for r, lost in short
                ],
                "restores": len(runs),
                "runs_p50": float(np.median(runs)) if runs else None,
                "runs_max": max(runs) if runs else None,
                "evictions": evictions,
            }
        )
    return rows


def main() -> int:
    cfg, model, cache, host = cpu_setup(ARGS, "micro")
    capacity = host.capacity_blocks
    rows: list[dict[str, Any]] = []
    try:
        for i in range(PASSES):
            gcfg = dataclasses.replace(cfg, seed=cfg.seed + bench.GRAPH_SEED * i)
            out = bench.run_graph(model, cache, host, gcfg, None, lambda what: None)
            evictions = host.local.offloader.snapshot()["host"].get("evictions", 0)
            for row in pass_rows(i, out, evictions):
                rows.append(row)
                where = ", ".join(
                    f"c{s['conversation']}t{s['turn']} host {s['host_hit_tokens']}"
                    for s in row["short"]
                )
                print(
                    f"pass {i} {row['workload']:5} turns short of gpu_all {row['turns_short']}"
                    f"/{row['turns']} ({row['tokens_lost']} tokens{': ' + where if where else ''})"
                    f"; runs per load p50 {row['runs_p50']} most {row['runs_max']};"
                    f" evictions so far {evictions}"
                )
    finally:
        host.close()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            result = {
                "benchmark": "host_hits_sim",
                "date": time.strftime("%Y-%m-%d"),
                "cpu": platform.processor() or platform.machine(),
                "args": ARGS,
                "model_compute": "micro",
                "host_blocks": capacity,
                "rows": rows,
            }
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

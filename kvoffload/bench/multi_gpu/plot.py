"""``bench multi-gpu``'s plot: per NUMA setting and workload, each process's GB/s alone and at
once, the aggregate, and the bound (min of the links and host memory) as a line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvoffload.bench.common import save_figure


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(run["numa_node"], w) for run in result["runs"] for w in run["workloads"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(groups)), 4.8))
    width = 0.8
    for g, (_, w) in enumerate(groups):
        n = len(w["alone"])
        bar = width / (2 * n + 1)
        x0 = g - width / 2
        for i, win in enumerate(w["alone"]):
            label = "alone" if not g + i else ""
            ax.bar(x0 + i * bar, win["GBps"], bar, color="tab:blue", label=label)
        for i, win in enumerate(w["together"]):
            label = "at once" if not g + i else ""
            ax.bar(x0 + (n + i) * bar, win["GBps"], bar, color="tab:orange", label=label)
        agg = w["aggregate"]["GBps"]
        ax.bar(x0 + 2 * n * bar, agg, bar, color="tab:green", label="aggregate" if not g else "")
        ax.hlines(
            w["bound"]["GBps"], x0, x0 + width, colors="black", label="bound" if not g else ""
        )
        ax.text(g, agg, f"{w['of_bound']:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"numa={numa}\n{w['workload']}" for numa, w in groups])
    ax.set_ylabel("GB/s (both ways summed)")
    host = result["host_memory"]["traffic_GBps"]
    ax.set_title(f"{result['topology']['workers'][0]['name']}: host memory {host:.0f} GB/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, 110)
    plt.close(fig)
    return path

"""The e2e plot: TTFT by turn index per mode (median and p10-p90 band), and the tail per mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

COLORS = {"recompute": "#c0392b", "gpu": "#7f8c8d", "kvoffload": "#2471a3"}


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["results"]["modes"]
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for mode, run in modes.items():
        by_turn: dict[int, list[float]] = {}
        for r in run["records"]:
            by_turn.setdefault(r["turn"], []).append(r["ttft_ms"])
        turns = sorted(by_turn)
        med = [float(np.median(by_turn[t])) for t in turns]
        lo = [float(np.percentile(by_turn[t], 10)) for t in turns]
        hi = [float(np.percentile(by_turn[t], 90)) for t in turns]
        color = COLORS.get(mode)
        ax.plot(turns, med, "o-", color=color, label=mode)
        ax.fill_between(turns, lo, hi, color=color, alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("TTFT (ms, log scale): median, p10-p90 band")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    cfg = result["config"]
    ax.set_title(
        f"{cfg['model']} on {result['device']['name']}: {cfg['conversations']} conversations, "
        f"GPU pool {cfg['gpu_blocks']} blocks",
        fontsize=10,
    )
    names = list(modes)
    x = np.arange(len(names))
    for i, q in enumerate(("p50", "p90", "p99")):
        vals = [modes[m]["ttft_ms_returning"].get(q, 0.0) for m in names]
        bars.bar(x + (i - 1) * 0.27, vals, 0.27, label=q, alpha=0.4 + 0.3 * i, color="#34495e")
    bars.set_xticks(x, names)
    bars.set_ylabel("TTFT (ms), turns >= 2")
    bars.legend()
    zero = result["results"].get("zero_reuse")
    if zero:
        bars.set_title(
            f"zero-reuse overhead of kvoffload: {100 * zero['overhead_turns_per_s']:+.1f}% turns/s",
            fontsize=10,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

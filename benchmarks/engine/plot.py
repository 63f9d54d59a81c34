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
    x = np.arange(3)
    width = 0.8 / len(names)
    for i, mode in enumerate(names):
        tail = modes[mode]["ttft_ms_returning"]
        vals = [tail.get(q, 0.0) for q in ("p50", "p90", "p99")]
        bars.bar(
            x + (i - (len(names) - 1) / 2) * width, vals, width, color=COLORS.get(mode), label=mode
        )
        bars.bar_label(bars.containers[-1], fmt="%.0f", fontsize=7)
    bars.set_xticks(x, ["p50", "p90", "p99"])
    bars.set_ylabel("TTFT (ms), turns >= 2")
    bars.legend(fontsize=8)
    title = "TTFT of returning turns"
    zero = result["results"].get("zero_reuse")
    if zero:
        over = zero["overhead_turns_per_s"]["kvoffload"]
        title += f"; zero-reuse overhead {100 * over:+.1f}% turns/s"
    bars.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

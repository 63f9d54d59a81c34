"""The e2e plot, one row per workload: TTFT by turn per mode (median and p10-p90 band); and for
requests restored from host, the load time per turn split into the part hidden under prefill and
the part exposed (attention waiting for it), beside the prefill's own time. A workload without
host hits (fits) shows TTFT p50/p99 per mode instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

COLORS = {"recompute": "#c0392b", "gpu": "#7f8c8d", "gpu_all": "#27ae60", "kvoffload": "#2471a3"}


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["results"]["workloads"]
    rows = len(workloads)
    fig, axes = plt.subplots(
        rows, 2, figsize=(12, 4.2 * rows), gridspec_kw={"width_ratios": [3, 2]}, squeeze=False
    )
    cfg = result["config"]
    for (kind, run), (left, right) in zip(workloads.items(), axes, strict=True):
        _ttft_by_turn(left, run["modes"])
        left.set_title(
            f"{kind}: {cfg['model']} on {result['device']['name']}, GPU pool {run['gpu_blocks']} "
            f"blocks (the workload's distinct blocks: {run['distinct_blocks']})",
            fontsize=9,
        )
        restored = [
            r for r in run["modes"].get("kvoffload", {}).get("records", []) if r["host_hit_tokens"]
        ]
        if restored:
            _overlap(right, restored)
        else:
            _tails(right, run["modes"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _by_turn(records: list[dict[str, Any]], field: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in records:
        out.setdefault(r["turn"], []).append(r[field])
    return dict(sorted(out.items()))


def _ttft_by_turn(ax: Any, modes: dict[str, Any]) -> None:
    for mode, run in modes.items():
        by_turn = _by_turn(run["records"], "ttft_ms")
        turns = list(by_turn)
        color = COLORS.get(mode)
        ax.plot(turns, [np.median(v) for v in by_turn.values()], "o-", color=color, label=mode)
        lo = [np.percentile(v, 10) for v in by_turn.values()]
        hi = [np.percentile(v, 90) for v in by_turn.values()]
        ax.fill_between(turns, lo, hi, color=color, alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("turn of the conversation (docs: use of the document)")
    ax.set_ylabel("TTFT ms (log): median, p10-p90")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _overlap(ax: Any, restored: list[dict[str, Any]]) -> None:
    exposed = _by_turn(restored, "load_exposed_ms")
    prefill = _by_turn(restored, "prefill_ms")
    turns = np.array(list(exposed))
    shown = np.array([np.median(exposed[t]) for t in turns])
    ax.bar(turns, shown, color="#c0392b", label="load exposed (attention waited)")
    if all(r["load_ms"] is not None for r in restored):  # timed on the device
        load = _by_turn(restored, "load_ms")
        hidden = np.maximum(np.array([np.median(load[t]) for t in turns]) - shown, 0.0)
        ax.bar(turns, hidden, bottom=shown, color="#85c1e9", label="load hidden under prefill")
    ax.plot(turns, [np.median(prefill[t]) for t in turns], "k.-", label="prefill (device)")
    ax.set_xlabel("turn")
    ax.set_ylabel("ms, median of restored requests")
    ax.set_title("kvoffload: where a host hit's load time goes", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)


def _tails(ax: Any, modes: dict[str, Any]) -> None:
    names = list(modes)
    x = np.arange(2)
    width = 0.8 / len(names)
    for i, mode in enumerate(names):
        t = modes[mode]["ttft_ms"]
        vals = [t.get("p50", 0.0), t.get("p99", 0.0)]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, vals, width, color=COLORS.get(mode))
        ax.bar_label(ax.containers[-1], fmt="%.1f", fontsize=7)
    ax.set_xticks(x, ["p50", "p99"])
    ax.set_ylabel("TTFT ms, all requests")
    ax.set_title("no host hits: TTFT per mode", fontsize=9)
    ax.legend(names, fontsize=8)

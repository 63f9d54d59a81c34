"""The e2e plot, one row per graph mode and workload: TTFT by turn per mode (median and p10-p90
band); for requests restored from host, the load time per turn split into the part hidden under
prefill and the part exposed (attention waiting for it), beside the prefill's own time; and where
each millisecond of a restored request goes against the same request in ``gpu_all`` (host steps,
of them the time inside kvoffload's calls, and the GPU's wait for the load). A workload without
host hits (fits) shows TTFT p50/p99 per mode instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.common import save_figure

COLORS = {"recompute": "#c0392b", "gpu": "#7f8c8d", "gpu_all": "#27ae60", "kvoffload": "#2471a3"}
# host steps; before 2026-11-27 "first_token" held store_ahead and token too
STEPS = (
    "match",
    "lookup",
    "allocate",
    "load_submit",
    "launch",
    "store_ahead",
    "token",
    "first_token",
)
STEP_COLORS = (
    "#d5dbdb",
    "#f5b041",
    "#aab7b8",
    "#e67e22",
    "#5dade2",
    "#a569bd",
    "#1f618d",
    "#17202a",
)


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["results"]["runs"]
    rows = [(g, kind, w) for g, run in runs.items() for kind, w in run["workloads"].items()]
    fig, axes = plt.subplots(
        len(rows),
        3,
        figsize=(17, 4.2 * len(rows)),
        gridspec_kw={"width_ratios": [3, 2, 2]},
        squeeze=False,
    )
    cfg = result["config"]
    for (graph, kind, run), (left, mid, right) in zip(rows, axes, strict=True):
        _ttft_by_turn(left, run["modes"])
        left.set_title(
            f"{kind}, {graph} graphs: {cfg['model']} on {result['device']['name']}, GPU pool "
            f"{run['gpu_blocks']} blocks (the workload's distinct blocks: "
            f"{run['distinct_blocks']})",
            fontsize=9,
        )
        restored = [
            r for r in run["modes"].get("kvoffload", {}).get("records", []) if r["host_hit_tokens"]
        ]
        if restored:
            _overlap(mid, restored)
        else:
            _tails(mid, run["modes"])
        if run.get("attribution"):
            _where_ms_go(right, run["attribution"])
        else:
            right.axis("off")
    fig.tight_layout()
    save_figure(fig, path, 100)
    plt.close(fig)
    return path


def _where_ms_go(ax: Any, att: dict[str, Any]) -> None:
    """Stacked host steps of a restored request (medians) and of the same request in gpu_all;
    beside them the part of kvoffload's bar spent inside kvoffload's calls, and the GPU's wait."""
    for x, steps in enumerate((att["gpu_all_host_ms_p50"], att["host_ms_p50"])):
        bottom = 0.0
        for step, color in zip(STEPS, STEP_COLORS, strict=True):
            value = steps.get(step) or 0.0
            label = step if x == 1 else None
            ax.bar(x, value, 0.6, bottom=bottom, color=color, label=label)
            bottom += value
        ax.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=8)
    kvo, wait = att["kvo_ms_in_ttft_p50"] or 0.0, att["gpu_wait_ms_p50"] or 0.0
    ax.bar(2, kvo, 0.6, color="#8e44ad", label="in kvoffload calls before the first token")
    ax.bar(3, wait, 0.6, color="#c0392b", label="GPU waited for the load")
    ax.set_xticks(range(4), ["gpu_all", "kvoffload", "kvo calls", "GPU wait"], fontsize=8)
    ax.set_ylabel("ms, median of restored requests")
    ax.set_title("a restored request: where each ms goes (host steps of TTFT)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)


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
    prefill = _by_turn(restored, "prefill_ms")
    turns = np.array(list(prefill))
    shown = np.zeros(len(turns))  # --untimed-waits: the waits were not timed
    if all(r["load_exposed_ms"] is not None for r in restored):
        exposed = _by_turn(restored, "load_exposed_ms")
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

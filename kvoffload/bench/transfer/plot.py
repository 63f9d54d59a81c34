"""The transfer benchmark's plot: GB/s by piece size per method, the link limit as a line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvoffload.bench.common import save_figure
from kvoffload.bench.transfer.targets import link_limit

STYLE = {
    "staged": ("tab:green", "o"),
    "staged-python": ("tab:olive", "v"),  # the former Python path: results before issue 26
    "dma": ("tab:blue", "s"),
    "sm": ("tab:red", "^"),
    "vllm-triton": ("tab:purple", "D"),
    "auto": ("tab:gray", "P"),
}


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # each case's largest transfer (transfers are capped in bytes, so counts differ by case)
    largest: dict[tuple[Any, ...], int] = {}
    for r in result["rows"]:
        case = (r["model"], r["layout"], r["block_size"], r["method"])
        largest[case] = max(largest.get(case, 0), r["blocks"])
    rows = [
        r
        for r in result["rows"]
        if r["blocks"] == largest[(r["model"], r["layout"], r["block_size"], r["method"])]
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, direction, link_key in zip(axes, ("store", "load"), ("d2h", "h2d"), strict=True):
        for method, (color, marker) in STYLE.items():
            for col, filled in ((f"{direction}_gpu_GBps", True), (f"{direction}_GBps", False)):
                pts = sorted((r["piece_bytes"], r[col]) for r in rows if r["method"] == method)
                if pts:
                    ax.scatter(
                        [p[0] / 1024 for p in pts],
                        [p[1] for p in pts],
                        marker=marker,
                        label=f"{method} ({'copies' if filled else 'end to end'})",
                        alpha=0.8,
                        **(
                            {"color": color}
                            if filled
                            else {"facecolors": "none", "edgecolors": color}
                        ),
                    )
        link = link_limit(result)[link_key]
        ax.axhline(link, color="black", linestyle="--", label=f"link {link:.1f} GB/s")
        ax.axhline(0.95 * link, color="gray", linestyle=":", label="95% of link")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("piece bytes (KiB): one block of one region")
        ax.set_ylim(0, link * 1.1)
        ax.set_title(
            f"{direction} ({'GPU->host' if direction == 'store' else 'host->GPU'}), "
            "each case's largest transfer (<= 1 GiB)"
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(loc="lower right")
    fig.suptitle(
        f"kvoffload transfer, {result['device']}, driver {result['driver']}, {result['date'][:10]}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, 110)
    plt.close(fig)
    return path

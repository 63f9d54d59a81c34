"""What every benchmark shares: machine facts, result files, the progress bar, median timing."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console()


def progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    import numpy

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform()},
        "python": platform.python_version(),
        "numpy": numpy.__version__,
    }


def results_dir() -> Path:
    """``benchmarks/results`` of the checkout this runs from, else under the working directory."""
    repo = Path(__file__).resolve().parents[2]
    if (repo / "benchmarks").is_dir():
        return repo / "benchmarks" / "results"
    return Path.cwd() / "benchmarks" / "results"


def default_out(stem: str, device: str) -> Path:
    tag = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    return results_dir() / f"{stem}_{tag}_{dt.date.today().isoformat()}.json"


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return path


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` (which must block until its work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)

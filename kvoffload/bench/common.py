"""What every benchmark shares: machine facts, result files, the progress bar, median timing.

Result files: a benchmark writes where ``--out`` says; without it, to a new file under
``./kvoffload-results/`` (``default_out``: the name carries the date and time, so a run never
replaces an earlier one, and results a user makes never touch the ones committed in the
repository's ``benchmarks/results/``, which are written only when asked for by ``--out``).

Tables: ``console`` lays out every ``rich`` table it prints to fit its width (80 columns when
the output is not a terminal, e.g. a log file): a light box, and a cell that does not fit wraps
onto a second line instead of being cut to ``1234…``.
"""

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

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

RESULTS_DIR = "kvoffload-results"


class BenchConsole(Console):
    """A ``Console`` whose tables fit its width (see the module docstring)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        for obj in objects:
            if isinstance(obj, Table):
                compact(obj)
        super().print(*objects, **kwargs)


def compact(table: Table) -> Table:
    """Lay ``table`` out to fit narrow consoles: no outer edge, no padding, one space between
    columns, and a cell that does not fit wraps rather than ending in an ellipsis."""
    table.box = box.SIMPLE_HEAD
    table.show_edge = False
    table.pad_edge = False
    table.padding = (0, 0)
    for column in table.columns:
        column.overflow = "fold"
        column.no_wrap = False
    return table


console = BenchConsole()


def progress() -> Progress:
    """A progress bar with the elapsed time and an estimate of the time left."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
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


def default_out(stem: str, device: str, directory: Path | None = None) -> Path:
    """A result path no earlier run holds: ``<directory>/<stem>_<device>_<UTC date and time>.json``
    (``directory``: ``./kvoffload-results``), with a counter added if that name is taken."""
    tag = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    folder = directory if directory is not None else Path.cwd() / RESULTS_DIR
    path = folder / f"{stem}_{tag}_{when}.json"
    n = 1
    while path.exists() or path.with_suffix(".png").exists():
        n += 1
        path = folder / f"{stem}_{tag}_{when}_{n}.json"
    return path


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

"""What every benchmark shares: machine facts, result files, the progress bar, median timing.

Result files: a benchmark writes where ``--out`` says; without it, to a new file under
``./kvoffload-results/`` (``default_out``: the name carries the date and time, so a run never
replaces an earlier one, and results a user makes never touch the ones committed in the
repository's ``benchmarks/results/``, which are written only when asked for by ``--out``).

``console`` and ``progress`` live in ``kvoffload.console`` (the library's commands print through
them too, and nothing outside ``bench/`` imports ``kvoffload.bench``); they are re-exported here
for the benchmarks.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.console import console as console
from kvoffload.console import progress as progress

RESULTS_DIR = "kvoffload-results"


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


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    """``fig`` as a PNG of at most 256 colours (the plots' flat colours: a third of the bytes of
    matplotlib's RGBA file, so results stay small in the repository)."""
    from PIL import Image  # matplotlib's own dependency

    rendered = io.BytesIO()  # quantized in memory: the file is written once
    fig.savefig(rendered, format="png", dpi=dpi)
    rendered.seek(0)
    with Image.open(rendered) as image:
        flat = image.convert("RGB").quantize(
            256, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
        )
    flat.save(path, format="PNG", optimize=True)

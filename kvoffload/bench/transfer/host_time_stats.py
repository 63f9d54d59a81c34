"""The pure parts of the host-time benchmark (``host_time``): percentiles, the order of baseline
and loaded windows and their ratios, the printable table, a deadline, and the wake-up probe (a
thread whose lateness shows how long others hold the GIL). No torch, no CUDA."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

BASELINE = "baseline"
TABLE_HEADER = ["method", "measure", "case", "median", "p99", "n", "note"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated linearly between ranks (numpy's default)."""
    if not values:
        raise ValueError("expected at least one value, got none")
    if not 0 <= q <= 100:
        raise ValueError(f"expected a percentile in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Median and p99 of ``values`` times ``scale``, and how many there were."""
    return {
        "median": statistics.median(values) * scale,
        "p99": percentile(values, 99) * scale,
        "n": len(values),
    }


def schedule(arms: Sequence[str], rounds: int) -> list[str]:
    """Window order: a baseline before and after every loaded window, the arms' order rotated by
    one each round (so no arm always follows the same one)."""
    if not arms or rounds <= 0:
        raise ValueError(f"expected arms and rounds > 0, got {list(arms)} and {rounds}")
    order = [BASELINE]
    for r in range(rounds):
        k = r % len(arms)
        for arm in [*arms[k:], *arms[:k]]:
            order += [arm, BASELINE]
    return order


def window_ratios(windows: Sequence[tuple[str, float]]) -> dict[str, list[float]]:
    """Each loaded window's value over the mean of the nearest baseline windows before and after
    it (one side where the other is missing), per arm."""
    base = [i for i, (name, _) in enumerate(windows) if name == BASELINE]
    if not base:
        raise ValueError("expected at least one baseline window, got none")
    out: dict[str, list[float]] = defaultdict(list)
    for i, (name, value) in enumerate(windows):
        if name == BASELINE:
            continue
        near = [
            windows[j][1]
            for j in (
                max((j for j in base if j < i), default=None),
                min((j for j in base if j > i), default=None),
            )
            if j is not None
        ]
        out[name].append(value / statistics.mean(near))
    return dict(out)


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Printable rows (``TABLE_HEADER`` first): ratios to 3 decimals, microseconds to 1."""
    out = [list(TABLE_HEADER)]
    for row in rows:
        digits = 3 if str(row.get("measure", "")).endswith("ratio") else 1
        cells = [str(row.get("method", "")), str(row.get("measure", "")), str(row.get("case", ""))]
        for key in ("median", "p99"):
            v = row.get(key)
            cells.append("" if v is None else f"{v:.{digits}f}")
        cells.append("" if row.get("n") is None else str(row["n"]))
        cells.append(str(row.get("note", "")))
        out.append(cells)
    return out


class Deadline:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.at = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.at - self._clock())

    def passed(self) -> bool:
        return self._clock() >= self.at


class WakeProbe:
    """A thread that sleeps ``sleep_s`` in a loop and records how late each sleep ends, under the
    label in ``phase`` (a sleep during which ``phase`` changed, or with ``phase`` None, is not
    recorded)."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s
        self.phase: str | None = None
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvoffload-wake-probe", daemon=True)

    def __enter__(self) -> WakeProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            phase = self.phase
            t0 = time.perf_counter()
            time.sleep(self.sleep_s)
            late = time.perf_counter() - t0 - self.sleep_s
            if phase is not None and phase == self.phase:
                self.samples[phase].append(late)


# A step's parts, in order: the arm's work before the kernels (an inline store's completion
# check), the kernels' launches, the arm's work after them (an inline store's submit) and the
# host sync. Each step's seconds per part go to ``phases``, so a slower step says which part grew.
PHASES = ("before", "kernels", "after", "sync")


def phase_excess_us(
    phases: dict[str, list[float]], base: dict[str, list[float]]
) -> dict[str, float]:
    """Per part of a step: its median microseconds in an arm's steps less the baseline's."""
    return {
        part: round((statistics.median(phases[part]) - statistics.median(base[part])) * 1e6, 2)
        for part in PHASES
        if phases.get(part) and base.get(part)
    }

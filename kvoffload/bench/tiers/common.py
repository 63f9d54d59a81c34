"""What the ``kvoffload bench tiers`` sections share: block sizes, random blocks and keys, MB/s
and latency summaries, the median round, and ``Fatal`` (the one-line way a run ends)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SIZES = {"slot_2MiB": 2 << 20, "page_64KiB": 64 << 10}  # Llama-3-8B, block size 16, bf16
FP = "0123456789abcdef0123456789abcdef"  # a layout fingerprint for tiers used directly
BATCH = 16  # blocks per batched op: the mover's


class Fatal(SystemExit):
    """One line on stderr and exit status 1 (SystemExit prints its message)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvoffload bench tiers: {message}")


def blocks(n: int, size: int) -> np.ndarray:
    return np.random.default_rng(size).integers(0, 256, (n, size), dtype=np.uint8)


def keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}:{i}".encode().ljust(16, b".") for i in range(n)]


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def lat(times: list[float]) -> dict[str, float]:
    """p50 / p99 in milliseconds of ``times`` in seconds (0.0 for none)."""
    if not times:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    arr = np.asarray(times) * 1e3
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99))}


def timed(fn: Callable[[int], object], n: int) -> tuple[float, list[float]]:
    """``fn(0) .. fn(n - 1)``: the total seconds and each call's."""
    each = []
    start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        each.append(time.perf_counter() - t0)
    return time.perf_counter() - start, each


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per numeric field, the median over rounds (nested dicts too)."""
    out: dict[str, Any] = {}
    for key, first in rounds[0].items():
        values = [r[key] for r in rounds]
        if isinstance(first, dict):
            out[key] = median_round(values)
        elif isinstance(first, (int, float)):
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out


def drop_cache(fd: int) -> None:
    """Put ``fd``'s dirty pages on the device, then drop its pages from the page cache."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def fs_of(path: Path) -> dict[str, str]:
    """The mount ``path`` is on, from ``/proc/mounts``: device, mount point, type, options."""
    best = ("", "", "", "")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            if str(path.resolve()).startswith(mnt) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype, opts)
    return {"device": best[0], "mount": best[1], "fstype": best[2], "options": best[3]}

"""Latency histograms the runtime keeps for ``kvoffload.metrics`` (no prometheus-client here).

A ``Histogram`` counts observations per bucket under its own lock; ``snapshot`` is what the
exporter reads. The bucket bounds are upper bounds in seconds, as Prometheus' ``le``, chosen so that
the measured range of each quantity falls across several buckets (quantiles of these files computed
over every ``kvoffload`` record with a load, 2026-11-25):

- transfer jobs: ``benchmarks/results/transfer_nvidia-h100-80gb-hbm3_2026-11-25_native{0,1,2}.json``
  (1 block of 2 MiB: 72-81 µs p50) and the per-request loads of
  ``e2e_{llama3-8b,qwen2.5-7b}_nvidia-h100-80gb-hbm3_2026-11-25_native.json`` (16.8-93.2 ms, p50
  28-33 ms); on the 2-core CPU of CI the host backend moves 2.5-7.4 GB/s
  (``transfer_cpu_2026-11-22.json``), so a 256 MiB job takes ~35-100 ms there. 50 µs to 10 s.
- layer waits: the same e2e files' ``layer_wait_ms`` (H100: p50 1-53 µs, p99 0.17-0.27 ms, max
  2.8 ms) and ``e2e_tiny_cpu-amd-epyc_2026-11-23.json`` (CPU: p50 17 µs, p99 1.0 ms, max 8 ms).
  5 µs to 100 ms.
- tier reads (one op = up to 16 blocks read, submit to completion): ``tiers_cpu_2026-11-22.json``
  (disk get of a 64 KiB block p50 19 µs / p99 0.6 ms, of a 2 MiB block 11 / 15 ms; Valkey 0.18 /
  0.83 ms and 2.0 / 8.1 ms), so 16 blocks of 2 MiB read one by one take up to ~0.2 s. 25 µs to
  2.5 s.

Elsewhere (slower disks, remote Valkey) the top bucket and ``+Inf`` still count everything; the sum
and count give the mean whatever the buckets.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Any

TRANSFER_BUCKETS = (
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
LAYER_WAIT_BUCKETS = (
    5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3,
)  # fmt: skip
TIER_READ_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
    250e-3, 0.5, 1.0, 2.5,
)  # fmt: skip


class Histogram:
    """Counts of observations at or below each bound (the last count: above every bound)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)) or bounds[0] <= 0:
            raise ValueError(f"expected increasing positive bucket bounds, got {bounds!r}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect_left(self.bounds, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """``bounds``, ``counts`` per bucket (not cumulative; one more than bounds: +Inf),
        ``sum`` and ``count``, in one consistent read."""
        with self._lock:
            counts = list(self._counts)
            return {"bounds": self.bounds, "counts": counts, "sum": self._sum, "count": sum(counts)}

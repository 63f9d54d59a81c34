"""Time sections of GPU work with CUDA events (resolved later, no sync per section) or, on a CPU,
with the wall clock (CPU ops run synchronously)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class SectionTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: list[tuple[str, Any, Any]] = []
        self._added: set[int] = set()  # ids of start events given to ``add`` since collect
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            yield
            end.record()
            self._open.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds[name] += time.perf_counter() - t0

    def add(self, name: str, start: Any, end: Any) -> None:
        """A section timed by events recorded elsewhere (inside a CUDA graph). Events given
        twice before ``collect`` (a graph replayed twice) count once: their last record."""
        if id(start) not in self._added:
            self._added.add(id(start))
            self._open.append((name, start, end))

    def collect(self) -> dict[str, float]:
        """Seconds per section since the last ``collect`` (synchronizes the device first)."""
        if self._open:
            torch.cuda.synchronize()
            for name, start, end in self._open:
                self.seconds[name] += start.elapsed_time(end) / 1e3
            self._open.clear()
            self._added.clear()
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostClock:
    """Host seconds per step of a request, from its start: ``mark(step)`` ends a step."""

    def __init__(self, start: float) -> None:
        self.last = start
        self.seconds: dict[str, float] = {}

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - self.last
        self.last = now

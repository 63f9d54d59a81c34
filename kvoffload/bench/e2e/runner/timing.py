"""Time sections of GPU work with CUDA events (resolved later, no sync per section) or, on a CPU,
with the wall clock (CPU ops run synchronously)."""

from __future__ import annotations

import gc
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
        self._pool: list[Any] = []  # events of finished sections, reused (no create per section)
        self._mine: set[int] = set()  # ids of the events ``section`` took (``add``'s are not)
        self._added: set[int] = set()  # ids of start events given to ``add`` since collect
        self.seconds: dict[str, float] = defaultdict(float)
        self.stamps: list[float] = []  # host clock at each layer's attention (``stamp``)

    def stamp(self) -> None:
        """The host clock now: the eager and piecewise forwards stamp each layer's attention as
        they launch it, so a request's launch phase splits by layer (``layer_launch_ms``)."""
        self.stamps.append(time.perf_counter())

    def take_stamps(self) -> list[float]:
        out, self.stamps = self.stamps, []
        return out

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = self._event(), self._event()
            start.record()
            yield
            end.record()
            self._open.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds[name] += time.perf_counter() - t0

    def _event(self) -> Any:
        if self._pool:
            return self._pool.pop()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._mine.add(id(event))
        return event

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
                self._pool.extend(e for e in (start, end) if id(e) in self._mine)
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


class HostEvents:
    """What may stall the host during a request besides the engine's own work, counted while
    the ``with`` block runs: garbage collections (how many, and their ms, through
    ``gc.callbacks``) and, on CUDA, the caching allocator's device allocations and frees and its
    retries (a retry frees cached blocks, and ``cudaFree`` waits for the device). ``counts`` is
    the dict a record keeps."""

    _ALLOC = ("num_alloc_retries", "num_device_alloc", "num_device_free")

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.counts: dict[str, float] = {}
        self._gc_start = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.counts["gc_ms"] += (time.perf_counter() - self._gc_start) * 1e3
            self.counts["gc_collections"] += 1

    def _alloc(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats() if self.cuda else {}
        return {k: int(stats.get(k, 0)) for k in self._ALLOC}

    def __enter__(self) -> HostEvents:
        self.counts = {"gc_ms": 0.0, "gc_collections": 0}
        self._before = self._alloc()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)
        after = self._alloc()
        for k in self._ALLOC:
            self.counts[k] = after[k] - self._before[k]

# mypy: disable-error-code="no-untyped-call"
"""Timing copy backends on a GPU: event-timed transfers and the link limit.

Used by ``kvoffload calibrate`` (the planner's table), ``kvoffload doctor`` (the link now) and
``kvoffload bench transfer``. A transfer is timed on the GPU: a timing stream records a start
event, the copies are ordered after it and the stream waits for their completion before the end
event. With a lead, the stream first sleeps long enough for the host to enqueue the copies, so the
time is the copies' own; without one, the host's enqueue counts too (end to end).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of ``values``."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


class Sleeper:
    """``sleep(seconds)`` on a stream, from the measured cycles per second of ``_sleep``."""

    def __init__(self) -> None:
        s = torch.cuda.Stream()
        cycles = 20_000_000
        rates = []
        for _ in range(3):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                a.record()
                torch.cuda._sleep(cycles)
                b.record()
            b.synchronize()
            rates.append(cycles / (a.elapsed_time(b) / 1e3))
        self.cycles_per_s = statistics.median(rates)

    def sleep(self, stream: torch.cuda.Stream, seconds: float) -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(seconds * self.cycles_per_s))


def submitter(backend: Any, *specs: list[Any]) -> Callable[[torch.cuda.Stream], list[Any]]:
    """``stream -> pendings``: submit each of ``specs`` (lists of ``TransferSpec``) to ``backend``,
    ordered after ``stream``: what ``time_transfers`` calls."""

    def submit(stream: torch.cuda.Stream) -> list[Any]:
        return [backend.submit(s, order_after=stream) for s in specs]

    return submit


def time_transfers(
    sleeper: Sleeper,
    submit: Callable[[torch.cuda.Stream], list[Any]],
    reps: int,
    warmup: int = 1,
    lead: bool = True,
) -> dict[str, Any]:
    """Time ``submit(timing_stream) -> pendings`` (copies ordered after the stream) ``reps`` times.

    ``lead=True``: the timing stream first sleeps longer than the host takes to enqueue, so the
    time is the copies' own (GPU-only). ``lead=False``: the clock starts as ``submit`` is called on
    an idle GPU, so the host's enqueue latency counts too (end to end, as an engine sees it).
    Returns seconds per repetition, and the host's submit and enqueue seconds per transfer.
    """
    stream = torch.cuda.Stream()
    gpu, submit_s, enqueue_s, wake_s = [], [], [], []
    lead_s = 2e-3
    for i in range(warmup + reps):
        if lead:
            sleeper.sleep(stream, lead_s)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        pendings = submit(stream)
        t1 = time.perf_counter()
        for p in pendings:
            p.wait_on(stream)
        end.record(stream)
        end.synchronize()
        for p in pendings:
            if not p.wait(120) or p.error() is not None:
                raise RuntimeError(f"a benchmark transfer failed: {p.error()}")
        enq = statistics.mean(p.enqueue_seconds for p in pendings)
        # The host must have enqueued every transfer before the start: twice the time from submit
        # to the last transfer enqueued, thread wake-ups included (a lead of the enqueue time
        # alone left them out; store+load pairs then measured ~53 GB/s in some runs and ~96 in
        # others on the H100, 2026-11-23, as if one copy had started before the other was queued).
        ready = max(p.started_at + p.enqueue_seconds for p in pendings) - t0
        lead_s = min(max(2e-3, 2 * ready), 0.5)
        if i >= warmup:
            gpu.append(start.elapsed_time(end) / 1e3)
            submit_s.append((t1 - t0) / len(pendings))
            enqueue_s.append(enq)
            wake_s.append(statistics.mean(p.started_at - p.queued_at for p in pendings))
    return {"gpu_s": gpu, "submit_s": submit_s, "enqueue_s": enqueue_s, "wake_s": wake_s}


def measure_link(sleeper: Sleeper, nbytes: int, reps: int, warmup: int = 2) -> dict[str, Any]:
    """Contiguous pinned copies of ``nbytes``: H2D, D2H and both at once, after ``warmup``
    copies each (the first copy after filling fresh pinned memory runs slow)."""
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for d in dev:
        d.random_(0, 256)
    for h, d in zip(host, dev, strict=True):
        h.copy_(d)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn: Callable[[], None]) -> list[float]:
        out = []
        for i in range(warmup + reps):
            torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record(s1)
            s2.wait_event(a)
            fn()
            s1.wait_stream(s2)
            b.record(s1)
            b.synchronize()
            if i >= warmup:
                out.append(a.elapsed_time(b) / 1e3)
        return out

    def h2d() -> None:
        with torch.cuda.stream(s1):
            dev[0].copy_(host[0], non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(s2):
            host[1].copy_(dev[1], non_blocking=True)

    def both() -> None:
        h2d()
        d2h()

    res = {}
    for name, fn, moved in (("h2d", h2d, nbytes), ("d2h", d2h, nbytes), ("both", both, 2 * nbytes)):
        res[name] = spread([moved / t / 1e9 for t in timed(fn)])
    return {"bytes": nbytes, "GBps": res}

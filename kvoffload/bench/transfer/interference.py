# mypy: disable-error-code="no-untyped-call"
"""What transfers cost the work beside them: a GEMM stream on the GPU (SM and memory contention)
and a launch-bound Python thread on the host (GIL and host time), per method."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from kvoffload.bench.transfer.kv import SyntheticKV
from kvoffload.store.arena import HostArena
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.timing import spread


def measure_gemm(
    kv: SyntheticKV,
    arena: HostArena,
    backends: dict[str, Any],
    n: int,
    reps: int,
    gemms: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Slowdown of a bf16 8192^3 GEMM stream while each method stores and loads continuously.

    Repetitions interleave a baseline window (GEMMs alone) with one loaded window per method; the
    slowdown is the median over repetitions of loaded / mean(adjacent baselines) - 1. The
    baseline's own spread is reported as the noise floor.
    """
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    comp = torch.cuda.Stream()
    perm = rng.permutation(kv.pool)
    slots = rng.permutation(arena.num_slots)
    store = [TransferSpec.of("store", perm[:n], slots[:n])]
    load = [TransferSpec.of("load", perm[n : 2 * n], slots[n : 2 * n])]
    transfer_s = {}

    def window(backend: Any) -> float:
        torch.cuda.synchronize()
        pend = []
        if backend is not None:
            pend = [backend.submit(store, order_after=None), backend.submit(load, order_after=None)]
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(comp):
            e0.record()
            for _ in range(gemms):
                torch.mm(a, b)
            e1.record()
        e1.synchronize()
        for p in pend:
            p.wait(120)
        return float(e0.elapsed_time(e1) / 1e3)

    for backend in [None, *backends.values()]:  # warm-up
        window(backend)
    for name, backend in backends.items():
        torch.cuda.synchronize()
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        p = [backend.submit(store, order_after=None), backend.submit(load, order_after=None)]
        for x in p:
            x.wait_on()
        e.record()
        e.synchronize()
        transfer_s[name] = s.elapsed_time(e) / 1e3
    base: list[float] = []
    loaded: dict[str, list[float]] = {m: [] for m in backends}
    ratios: dict[str, list[float]] = {m: [] for m in backends}
    prev = window(None)
    base.append(prev)
    for _ in range(reps):
        row = {m: window(bk) for m, bk in backends.items()}
        nxt = window(None)
        base.append(nxt)
        for m, t in row.items():
            loaded[m].append(t)
            ratios[m].append(t / ((prev + nxt) / 2) - 1)
        prev = nxt
    bmed = statistics.median(base)
    return {
        "gemm": "bf16 8192x8192x8192",
        "gemms_per_window": gemms,
        "window_s": spread(base),
        "baseline_noise": (max(base) - min(base)) / bmed,
        "transfer_pair_s": transfer_s,
        "blocks_per_transfer": n,
        "slowdown": {m: statistics.median(r) for m, r in ratios.items()},
        "slowdown_spread": {m: spread(r) for m, r in ratios.items()},
    }


def measure_launch_stall(
    kv: SyntheticKV, arena: HostArena, backend: Any, reps: int, steps: int = 100
) -> dict[str, Any]:
    """The launch-thread half of the slowdown: a launch-bound Python "model" (``steps`` steps of
    100 tiny kernels each, so the GPU waits on the host) timed on the host clock, alone, beside an
    idle backend, and submitting a 2-block store and a 2-block load per step (as an engine would),
    in repeated interleaved windows; the GPU itself is nearly idle, so what it shows is host time
    and GIL. Also the host CPU time the process spends per step."""
    x = torch.zeros(1024, device="cuda")
    pool = min(kv.pool, arena.num_slots) - 4

    def window(submit: bool) -> tuple[float, float]:
        pend = []
        torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(steps):
            for _ in range(100):
                x.add_(1.0)
            if submit:
                b = (4 * i) % pool
                pend.append(backend.submit([TransferSpec.of("store", [b, b + 1], [b, b + 1])]))
                pend.append(
                    backend.submit([TransferSpec.of("load", [b + 2, b + 3], [b + 2, b + 3])])
                )
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for p in pend:
            p.wait(30)
        return wall / steps * 1e6, cpu / steps * 1e6

    window(True)  # warm-up
    alone, busy, cpu_alone, cpu_busy = [], [], [], []
    for _ in range(reps):
        a, ca = window(False)
        b, cb = window(True)
        alone.append(a)
        busy.append(b)
        cpu_alone.append(ca)
        cpu_busy.append(cb)
    base = statistics.median(alone)
    return {
        "step_alone_us": spread(alone),
        "step_with_transfers_us": spread(busy),
        "noise": (max(alone) - min(alone)) / base,
        "slowdown": statistics.median(busy) / base - 1,
        "host_cpu_us_per_transfer": (statistics.median(cpu_busy) - statistics.median(cpu_alone))
        / 2,
    }

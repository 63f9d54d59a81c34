# mypy: disable-error-code="no-untyped-call"
"""Developer probe of the CUDA data plane's design choices on the GPU (not the benchmark).

Measures, in one run: whole-transfer GB/s of ``staged`` per layer-slice count and DMA stream
count (and how soon layer 0 of a load is usable); end-to-end latency of small transfers with
inline submission against a thread hand-off; the caller's submit time; and host-side costs: the
scheduling latency of a sleeping Python thread (the GIL and the CPU taken by our threads), the
step rate of a launch-bound Python "model", host CPU time per transfer, each with transfers
running or idle, with the current submitter and with the earlier polling one.

Usage: PYTHONPATH=. python3 benchmarks/staged_sweep.py OUT_JSON [--quick]
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvoffload.bench.gpu_timing import Sleeper, measure_link, time_transfers
from kvoffload.bench.transfer_gpu import Engine, submitter
from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.base import CudaBackend
from kvoffload.transfer.cuda.dma import DmaBackend
from kvoffload.transfer.cuda.staged import StagedBackend, StagedConfig
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.spec import Direction, TransferSpec

RNG = np.random.default_rng(0)
BIG = 1 << 40  # a layer_slice_bytes that gives one slice


def log(*args: Any) -> None:
    print(*args, flush=True)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


class PollingSubmitter:
    """The earlier submitter (for comparison): a thread per direction that polls its queue every
    100 us for 50 ms after each job before it blocks."""

    def __init__(self, run: Callable[..., None], device: Any) -> None:
        self._run = run
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(device,), daemon=True)
        self._thread.start()

    def put(self, job: tuple[Any, ...], inline: bool = True) -> None:
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _serve(self, device: Any) -> None:
        torch.cuda.set_device(device)
        idle_since = time.perf_counter()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                if time.perf_counter() - idle_since < 50e-3:
                    time.sleep(100e-6)
                    continue
                job = self._queue.get()
            if job is None:
                return
            self._run(*job)
            idle_since = time.perf_counter()


def with_polling(backend: CudaBackend) -> CudaBackend:
    for s in (backend._submitters or {}).values():
        s.close()
    backend._submitters = {
        d: PollingSubmitter(backend._run, backend.device)  # type: ignore[misc]
        for d in ("store", "load")
    }
    return backend


def specs(direction: Direction, n: int, pool: int, slots: int) -> list[TransferSpec]:
    return [TransferSpec.of(direction, RNG.permutation(pool)[:n], RNG.permutation(slots)[:n])]


def layer_timing(backend: CudaBackend, spec: list[TransferSpec], reps: int) -> dict[str, float]:
    """GPU ms from the load's start to layer 0 usable, and to the whole load."""
    first, whole = [], []
    s, side = torch.cuda.Stream(), torch.cuda.Stream()
    layers = backend.layout.groups[0].num_layers
    for i in range(reps + 1):
        torch.cuda.synchronize()
        a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        with torch.cuda.stream(s):
            torch.cuda._sleep(5_000_000)
        a.record(s)
        p = backend.submit(spec, order_after=s)
        p.wait_on(side, layer=0)
        b.record(side)
        p.wait_on(s, layer=layers - 1)
        c.record(s)
        c.synchronize()
        b.synchronize()
        if i:
            first.append(a.elapsed_time(b))
            whole.append(a.elapsed_time(c))
    return {"layer0_ms": statistics.median(first), "whole_ms": statistics.median(whole)}


def slices_and_streams(sleeper: Sleeper, arena: HostArena, quick: bool) -> list[dict[str, Any]]:
    variants = {
        "S1D1": StagedConfig(layer_slice_bytes=BIG),
        "S1D2": StagedConfig(layer_slice_bytes=BIG, dma_streams=2),
        "S2D1": StagedConfig(layer_slice_bytes=1 << 20),
        "S4D1": StagedConfig(layer_slice_bytes=512 << 10),
        "S8D1": StagedConfig(layer_slice_bytes=256 << 10),
        "S8D2": StagedConfig(layer_slice_bytes=256 << 10, dma_streams=2),
    }
    cases = [
        ("llama3-8b", "page", 16, 512),
        ("qwen2.5-7b", "kv_split", 32, 512),
        ("llama3-70b-tp8-fp8", "kv_split", 16, 1000),
        ("deepseek-v2-lite-mla", "page", 16, 1000),
        ("llama3-8b", "page", 16, 16),
        ("llama3-70b-tp8-fp8", "page", 16, 256),
    ]
    rows = []
    for model, layout, bs, n in cases:
        eng = Engine(model, layout, bs, 2 * n + 8)
        for name, cfg in variants.items():
            if quick and name in ("S4D1",):
                continue
            bk = StagedBackend(eng.kv, arena, config=cfg)
            try:
                row: dict[str, Any] = {"model": model, "layout": layout, "bs": bs, "blocks": n}
                row["variant"] = name
                row["slot_bytes"] = eng.kv.slot_bytes
                row["slices"] = max(bk._plans[0])
                nbytes = n * eng.kv.slot_bytes
                for d in ("store", "load"):
                    if d == "store" and name.startswith(("S2", "S4", "S8D1")):
                        continue  # stores are not sliced
                    sp = specs(d, n, eng.pool, arena.num_slots)
                    for lead in (False, True):
                        t = time_transfers(sleeper, submitter(bk, sp), 3 if quick else 5, lead=lead)
                        key = f"{d}_{'gpu' if lead else 'e2e'}_GBps"
                        row[key] = nbytes / statistics.median(t["gpu_s"]) / 1e9
                if row["slices"] > 1 or name == "S1D1":
                    row.update(layer_timing(bk, specs("load", n, eng.pool, arena.num_slots), 3))
                rows.append(row)
                log(
                    "slices",
                    json.dumps(
                        {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                    ),
                )
            finally:
                bk.close()
        del eng
        torch.cuda.empty_cache()
    return rows


def small_latency(arena: HostArena, quick: bool) -> list[dict[str, Any]]:
    """End to end (submit on an idle GPU to completion, host clock) of small transfers."""
    eng = Engine("llama3-8b", "page", 16, 64)
    out = []
    for mode, inline in (("inline", 1 << 40), ("thread", 0)):
        for method in ("staged", "dma"):
            if method == "staged":
                bk: CudaBackend = StagedBackend(eng.kv, arena, inline_bytes=inline)
            else:
                bk = DmaBackend(eng.kv, arena, inline_bytes=inline)
            try:
                for n in (1, 3, 16):
                    for d in ("store", "load"):
                        sp = specs(d, n, eng.pool, arena.num_slots)
                        ts, subs = [], []
                        for i in range(20 if quick else 60):
                            torch.cuda.synchronize()
                            time.sleep(0.002 if i % 2 else 0.0)
                            t0 = time.perf_counter()
                            p = bk.submit(sp, order_after=None)
                            t1 = time.perf_counter()
                            while not p.done():
                                pass
                            t2 = time.perf_counter()
                            if i >= 3:
                                ts.append((t2 - t0) * 1e6)
                                subs.append((t1 - t0) * 1e6)
                        row = {
                            "mode": mode,
                            "method": method,
                            "blocks": n,
                            "direction": d,
                            "p50_us": pct(ts, 50),
                            "p99_us": pct(ts, 99),
                            "submit_p50_us": pct(subs, 50),
                            "link_us": n * eng.kv.slot_bytes / 54e9 * 1e6,
                        }
                        out.append(row)
                        log(
                            "latency",
                            json.dumps(
                                {
                                    k: round(v, 1) if isinstance(v, float) else v
                                    for k, v in row.items()
                                }
                            ),
                        )
            finally:
                bk.close()
    return out


def submit_cost(arena: HostArena) -> list[dict[str, Any]]:
    eng = Engine("llama3-8b", "page", 16, 1100)
    out = []
    for mode, inline in (("default", None), ("thread", 0)):
        bk = (
            StagedBackend(eng.kv, arena)
            if inline is None
            else StagedBackend(eng.kv, arena, inline_bytes=inline)
        )
        try:
            for n in (64, 512):
                sp = specs("store", n, eng.pool, arena.num_slots)
                subs, enq, cpu = [], [], []
                for _ in range(25):
                    torch.cuda.synchronize()
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    p = bk.submit(sp)
                    subs.append((time.perf_counter() - t0) * 1e6)
                    assert p.wait(30)
                    cpu.append((time.process_time() - c0) * 1e6)
                    enq.append(p.enqueue_seconds * 1e6)
                row = {
                    "mode": mode,
                    "blocks": n,
                    "pieces": n * len(eng.kv.groups[0].regions),
                    "submit_p50_us": pct(subs[3:], 50),
                    "enqueue_p50_us": pct(enq[3:], 50),
                    "cpu_per_transfer_us": pct(cpu[3:], 50),
                }
                out.append(row)
                log("submit", json.dumps(row))
        finally:
            bk.close()
    return out


class SleepProbe:
    """A thread sleeping 200 us at a time; how late it wakes (scheduling + waiting for the GIL)."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(200e-6)
            self.late.append((time.perf_counter() - t0 - 200e-6) * 1e6)

    def __enter__(self) -> SleepProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        late = self.late[5:]
        return {
            "p50_us": pct(late, 50),
            "p99_us": pct(late, 99),
            "max_us": max(late),
            "over_1ms": sum(x > 1000 for x in late),
            "n": len(late),
        }


def host_contention(arena: HostArena, quick: bool) -> list[dict[str, Any]]:
    """A launch-bound Python "model" (many tiny kernels) and a sleeping probe thread, while
    kvoffload is absent / idle / moving data (engine-like: each step submits a small store and a
    small load from the model's thread; or a side thread streams 64-block transfers)."""
    eng = Engine("llama3-8b", "page", 16, 256)
    x = torch.zeros(1024, device="cuda")
    steps = 100 if quick else 200

    def model_steps(per_step: Callable[[int], None] | None) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            for _ in range(100):
                x.add_(1.0)
            if per_step is not None:
                per_step(i)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e6

    out = []
    for kind in ("none", "new", "thread", "polling"):
        bk = None
        if kind != "none":
            bk = StagedBackend(eng.kv, arena, inline_bytes=0 if kind == "thread" else 64 << 20)
            if kind == "polling":
                with_polling(bk)
        try:
            for load in ("idle", "engine_steps", "side_stream"):
                if bk is None and load != "idle":
                    continue
                pend: list[Any] = []

                def per_step(i: int, b: CudaBackend | None = bk, pend: list[Any] = pend) -> None:
                    assert b is not None
                    base = (i * 4) % 200
                    pend.append(
                        b.submit([TransferSpec.of("store", [base, base + 1], [base, base + 1])])
                    )
                    pend.append(
                        b.submit(
                            [TransferSpec.of("load", [base + 2, base + 3], [base + 2, base + 3])]
                        )
                    )

                stop = threading.Event()

                def side(b: CudaBackend | None = bk, stop: threading.Event = stop) -> None:
                    assert b is not None
                    torch.cuda.set_device(0)
                    while not stop.is_set():
                        ps = [
                            b.submit(specs("store", 64, eng.pool, arena.num_slots)),
                            b.submit(specs("load", 64, 128, 128)),
                        ]
                        for p in ps:
                            p.wait(30)

                side_thread = threading.Thread(target=side, daemon=True)
                if load == "side_stream":
                    side_thread.start()
                if kind == "new" and load == "idle":
                    time.sleep(0.1)  # after a job: the threads (if any) are asleep
                c0 = time.process_time()
                with SleepProbe() as probe:
                    per_step_us = model_steps(per_step if load == "engine_steps" else None)
                cpu = time.process_time() - c0
                stop.set()
                if load == "side_stream":
                    side_thread.join()
                for p in pend:
                    p.wait(30)
                row = {
                    "submitter": kind,
                    "load": load,
                    "step_us": per_step_us,
                    "cpu_s_per_step_ms": cpu / steps * 1e3,
                    **probe.summary(),
                }
                out.append(row)
                log(
                    "contention",
                    json.dumps(
                        {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
                    ),
                )
        finally:
            if bk is not None:
                bk.close()
    return out


def profile_submits(arena: HostArena) -> dict[str, str]:
    """cProfile of inline submits (the caller's host time), top functions by own time."""
    import cProfile
    import io
    import pstats

    eng = Engine("llama3-8b", "page", 16, 64)
    out = {}
    for method in ("staged", "dma"):
        bk: CudaBackend = (
            StagedBackend(eng.kv, arena) if method == "staged" else DmaBackend(eng.kv, arena)
        )
        try:
            cases: list[tuple[Direction, int]] = [("store", 1), ("load", 16)]
            for d, n in cases:
                sp = specs(d, n, eng.pool, arena.num_slots)
                for _ in range(5):
                    bk.submit(sp).wait(10)
                prof = cProfile.Profile()
                t0 = time.perf_counter()
                prof.enable()
                for _ in range(100):
                    p = bk.submit(sp, order_after=None)
                    p.wait(10)
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
                key = f"{method}_{d}_{n}"
                out[key] = buf.getvalue()
                log(f"profile {key} ({(time.perf_counter() - t0) * 1e4:.0f} us per submit+wait)")
                log(buf.getvalue()[-4500:])
        finally:
            bk.close()
    return out


def main() -> None:
    path = sys.argv[1]
    quick = "--quick" in sys.argv
    torch.cuda.init()
    sleeper = Sleeper()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    out["link"] = measure_link(sleeper, 1 << 30, 3)
    log("link", {k: round(v["median"], 1) for k, v in out["link"]["GBps"].items()})
    arena = HostArena(2100, 2 << 20, pin=cuda_pin)
    t0 = time.perf_counter()
    only = [a for a in sys.argv[2:] if not a.startswith("--")]
    try:
        if only:
            out["contention"] = host_contention(arena, quick)
            out["profile"] = profile_submits(arena)
            return
        out["contention"] = host_contention(arena, quick)
        log(f"[{time.perf_counter() - t0:.0f} s]")
        out["submit"] = submit_cost(arena)
        log(f"[{time.perf_counter() - t0:.0f} s]")
        out["latency"] = small_latency(arena, quick)
        log(f"[{time.perf_counter() - t0:.0f} s]")
        out["slices"] = slices_and_streams(sleeper, arena, quick)
        log(f"[{time.perf_counter() - t0:.0f} s]")
    finally:
        arena.close()
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

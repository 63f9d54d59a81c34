# mypy: disable-error-code="no-untyped-call"
"""Developer probe (GPU): what a load's enqueue costs the caller's thread, and why.

The native core enqueues a whole load in the caller's thread (issue 25: no driver calls of ours
during the engine's forward). bench e2e measured that enqueue at 2.2-5.6 ms for a 256-block
Llama-3-8B restore. This probe splits it:

- ``calls``: host microseconds of single driver calls from Python (cuda-bindings), a no-op call
  first as the floor: event record, stream wait on an event, a 128 KiB H2D copy, a 2D copy of 16
  rows, a flag write (cuStreamWriteValue32), a batch of 16 copies (cuMemcpyBatchAsync).
- ``contention``: host ms of a pure-Python loop and of a launch-bound loop (400 tiny kernels),
  alone and while the GPU copies (raw 2 GiB copies each way; a 1,000-block load of ours),
  interleaved: does the copy beside a forward slow the engine's thread without any call of ours?
- ``submit``: host microseconds of ``submit`` of one load, per shape, block count, slot pattern
  (one run of consecutive host slots, runs of 32 or 8, scattered) and setting (slices chosen by
  expected cost, the default; the most slices the byte rules allow; bigger staging areas), with
  the load's GPU time beside it (that no setting costs link rate).
- ``busy``: the same submit when the copy's streams are held behind 40 ms of GPU work (does the
  enqueue block on a full command queue?).

Usage: PYTHONPATH=. python3 benchmarks/enqueue_probe.py OUT_JSON
       [--sections calls,contention,submit,busy]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvoffload.bench.common import machine_info
from kvoffload.bench.transfer.kv import SyntheticKV
from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.staged import NativeStagedBackend
from kvoffload.transfer.cuda.staged_config import StagedConfig
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.timing import Sleeper

RNG = np.random.default_rng(0)
SLOTS = 2200
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},  # slices by expected cost (enqueue_ns, plan_link_GBps)
    "most": {"plan_link_GBps": 0.0},  # the most slices the byte rules allow
    "big_areas": {"staging_bytes": 512 << 20},
}
SHAPES = (
    ("llama3-8b", "page", 16),
    ("qwen2.5-7b", "kv_split", 32),
    ("llama3-70b-tp8-fp8", "kv_split", 16),
)


def log(section: str, row: dict[str, Any]) -> None:
    print(
        section,
        json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}),
        flush=True,
    )


def slots_of(pattern: str, n: int) -> np.ndarray:
    if pattern == "scattered":
        return RNG.permutation(SLOTS)[:n]
    run = {"run": n, "runs32": 32, "runs8": 8}[pattern]
    starts = RNG.permutation(SLOTS // run)[: -(-n // run)] * run
    return np.concatenate([np.arange(s, s + run) for s in starts])[:n]


def calls() -> list[dict[str, Any]]:
    from cuda.bindings import driver as cu

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    s = cu.CUstream(stream.cuda_stream)
    host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    flag = torch.zeros(16, dtype=torch.int32).pin_memory()
    _, flag_dev = cu.cuMemHostGetDevicePointer(flag.data_ptr(), 0)
    _, ev = cu.cuEventCreate(2)
    cu.cuEventRecord(ev, s)
    p2 = cu.CUDA_MEMCPY2D()
    p2.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
    p2.srcHost = host.data_ptr()
    p2.srcPitch = 2 << 20
    p2.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p2.dstDevice = dev.data_ptr()
    p2.dstPitch = 128 << 10
    p2.WidthInBytes = 128 << 10
    p2.Height = 16
    srcs = [cu.CUdeviceptr(host.data_ptr() + i * (2 << 20)) for i in range(16)]
    dsts = [cu.CUdeviceptr(dev.data_ptr() + i * (128 << 10)) for i in range(16)]
    sizes = [128 << 10] * 16
    attr = cu.CUmemcpyAttributes()
    attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    p2u = cu.CUDA_MEMCPY2D()  # as the core fills it: both sides CU_MEMORYTYPE_UNIFIED
    p2u.srcMemoryType = p2u.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_UNIFIED
    p2u.srcDevice = host.data_ptr()
    p2u.srcPitch = 2 << 20
    p2u.dstDevice = dev.data_ptr()
    p2u.dstPitch = 128 << 10
    p2u.WidthInBytes = 128 << 10
    p2u.Height = 16
    batch = getattr(cu, "cuMemcpyBatchAsync", None)
    ops: dict[str, Any] = {
        "noop (cuCtxGetCurrent)": lambda: cu.cuCtxGetCurrent(),
        "cuEventRecord": lambda: cu.cuEventRecord(ev, s),
        "cuStreamWaitEvent": lambda: cu.cuStreamWaitEvent(s, ev, 0),
        "cuMemcpyHtoDAsync 128KiB": lambda: cu.cuMemcpyHtoDAsync(
            dev.data_ptr(), host.data_ptr(), 128 << 10, s
        ),
        "cuMemcpy2DAsync 16x128KiB": lambda: cu.cuMemcpy2DAsync(p2, s),
        "cuMemcpy2DAsync 16x128KiB unified": lambda: cu.cuMemcpy2DAsync(p2u, s),
        "cuStreamWriteValue32": lambda: cu.cuStreamWriteValue32(s, flag_dev, 1, 0),
    }
    if batch is not None:
        ops["cuMemcpyBatchAsync 16x128KiB"] = lambda: batch(
            dsts, srcs, sizes, 16, [attr], [0], 1, s
        )
    if batch is not None:
        n = 256
        srcs256 = [cu.CUdeviceptr(host.data_ptr() + i * (128 << 10)) for i in range(n)]
        dsts256 = [cu.CUdeviceptr(dev.data_ptr() + i * (128 << 10)) for i in range(n)]
        any_order = cu.CUmemcpyAttributes()
        any_order.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
        for name, a in (("stream order", attr), ("any order", any_order)):
            ops[f"cuMemcpyBatchAsync 256x128KiB {name} (per call)"] = lambda a=a: batch(
                dsts256, srcs256, [128 << 10] * n, n, [a], [0], 1, s
            )
    rows = []
    for name, op in ops.items():
        for _ in range(50):
            op()
        stream.synchronize()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            for _ in range(200):
                err = op()
            times.append((time.perf_counter() - t0) / 200 * 1e6)
            stream.synchronize()
        first = err[0] if isinstance(err, tuple) else err
        row = {"call": name, "us": statistics.median(times), "result": str(first)}
        rows.append(row)
        log("calls", row)
    return rows


def submit_time(
    backend: NativeStagedBackend,
    spec: list[TransferSpec],
    stream: torch.cuda.Stream,
    reps: int,
    hold: float,
    sleeper: Sleeper,
) -> dict[str, float]:
    host, gpu = [], []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hold:
            sleeper.sleep(stream, hold)
        a.record(stream)
        t0 = time.perf_counter()
        p = backend.submit(spec, order_after=stream)
        t1 = time.perf_counter()
        p.wait_on(stream)
        b.record(stream)
        b.synchronize()
        if not p.wait(30) or p.error() is not None:
            raise RuntimeError(f"a probe load failed: {p.error()}")
        if i:
            host.append((t1 - t0) * 1e6)
            gpu.append(a.elapsed_time(b))
    return {
        "submit_us": statistics.median(host),
        "submit_us_max": max(host),
        "gpu_ms": statistics.median(gpu),
    }


def submit(sleeper: Sleeper, arena: HostArena, busy: bool) -> list[dict[str, Any]]:
    rows = []
    stream = torch.cuda.Stream()
    for model, layout, bs in SHAPES:
        engine = SyntheticKV(model, layout, bs, 1100)
        for setting, fields in SETTINGS.items():
            if busy and setting not in ("default", "most"):
                continue
            backend = NativeStagedBackend(engine.kv, arena, config=StagedConfig(**fields))
            try:
                for n in (64, 256, 1000):
                    for pattern in ("run", "runs32", "runs8", "scattered"):
                        if busy and (n != 1000 or pattern not in ("run", "scattered")):
                            continue
                        spec = [
                            TransferSpec.of(
                                "load", RNG.permutation(engine.pool)[:n], slots_of(pattern, n)
                            )
                        ]
                        row: dict[str, Any] = {
                            "model": model,
                            "layout": layout,
                            "bs": bs,
                            "setting": setting,
                            "blocks": n,
                            "slots": pattern,
                        }
                        row.update(
                            submit_time(
                                backend,
                                spec,
                                stream,
                                2 if busy else 5,
                                0.04 if busy else 0.0,
                                sleeper,
                            )
                        )
                        row["GBps"] = n * engine.kv.slot_bytes / row["gpu_ms"] / 1e6
                        rows.append(row)
                        log("busy" if busy else "submit", row)
            finally:
                backend.close()
        del engine
        torch.cuda.empty_cache()
    return rows


def py_loop() -> float:
    t0 = time.perf_counter()
    d: dict[int, int] = {}
    for i in range(150_000):
        d[i & 1023] = i
    return (time.perf_counter() - t0) * 1e3


def launch_loop(x: torch.Tensor, stream: torch.cuda.Stream) -> float:
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for _ in range(400):
            x.add_(1)
    return (time.perf_counter() - t0) * 1e3


def contention(arena: HostArena) -> list[dict[str, Any]]:
    """Host ms of a pure-Python loop and of a launch-bound loop (400 tiny kernels), alone and
    while the GPU moves data: raw 2 GiB copies each way (no thread of ours runs), and a
    1,000-block Llama-3-8B load through the core (enqueued before the loops start)."""
    engine = SyntheticKV("llama3-8b", "page", 16, 1100)
    backend = NativeStagedBackend(engine.kv, arena, config=StagedConfig())
    host = torch.empty(2 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    x = torch.zeros(16, device="cuda")
    side, main = torch.cuda.Stream(), torch.cuda.Stream()
    spec = [TransferSpec.of("load", RNG.permutation(engine.pool)[:1000], np.arange(1000))]

    def raw_h2d() -> None:
        with torch.cuda.stream(side):
            dev.copy_(host, non_blocking=True)

    def raw_d2h() -> None:
        with torch.cuda.stream(side):
            host.copy_(dev, non_blocking=True)

    def ours() -> None:
        backend.submit(spec, order_after=side)

    besides = {"alone": None, "raw H2D": raw_h2d, "raw D2H": raw_d2h, "our load": ours}
    got: dict[str, dict[str, list[float]]] = {b: {"py_ms": [], "launch_ms": []} for b in besides}
    loops = {"py_ms": py_loop, "launch_ms": lambda: launch_loop(x, main)}
    rows = []
    try:
        for i in range(9):  # interleaved: a drifting machine moves every column alike
            for name, start in besides.items():
                for key, fn in loops.items():
                    torch.cuda.synchronize()
                    if start is not None:
                        start()
                        time.sleep(0.002)  # the copy is under way
                    ms = fn()
                    torch.cuda.synchronize()
                    if i:
                        got[name][key].append(ms)
        for name in besides:
            row: dict[str, Any] = {"beside": name}
            row.update({k: statistics.median(v) for k, v in got[name].items()})
            rows.append(row)
            log("contention", row)
    finally:
        torch.cuda.synchronize()
        backend.close()
    return rows


def interference(arena: HostArena) -> list[dict[str, Any]]:
    """GPU ms of a GPU-bound forward stand-in (a CUDA graph of 100 bf16 4096^3 GEMMs) alone and
    while a 256-block Llama-3-8B load runs beside it: a raw copy of the same bytes (DMA alone),
    and the core's load (DMA + scatter kernels) as configured by default, at the highest stream
    priority, and with 1 / 4 / 16 / 32 scatter programs. Interleaved, 9 rounds, medians."""
    engine = SyntheticKV("llama3-8b", "page", 16, 600)
    n = 256
    spec = [TransferSpec.of("load", RNG.permutation(engine.pool)[:n], np.arange(n))]
    nbytes = n * engine.kv.slot_bytes
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    model, side = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(model):
        for _ in range(3):
            a @ b
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=model):
            for _ in range(100):
                a @ b
    configs: dict[str, dict[str, Any]] = {
        "default": {},
        "priority -5": {"copy_priority": -5},
        "1 program": {"load_programs": 1},
        "4 programs": {"load_programs": 4},
        "16 programs": {"load_programs": 16},
        "32 programs": {"load_programs": 32},
    }
    backends = {
        k: NativeStagedBackend(engine.kv, arena, config=StagedConfig(**v))
        for k, v in configs.items()
    }

    def raw() -> None:
        with torch.cuda.stream(side):
            dev.copy_(host, non_blocking=True)

    starts: dict[str, Any] = {"alone": None, "raw copy": raw}
    for k, backend in backends.items():
        starts[k] = lambda backend=backend: backend.submit(spec, order_after=None)
    got: dict[str, list[float]] = {k: [] for k in starts}
    try:
        for i in range(10):
            for name, start in starts.items():
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if start is not None:
                    start()
                e0.record(model)
                with torch.cuda.stream(model):
                    graph.replay()
                e1.record(model)
                torch.cuda.synchronize()
                if i:
                    got[name].append(e0.elapsed_time(e1))
        alone = statistics.median(got["alone"])
        rows = []
        for name, v in got.items():
            row = {
                "beside": name,
                "gpu_ms": statistics.median(v),
                "slowdown": statistics.median(v) / alone - 1,
            }
            rows.append(row)
            log("interference", row)
        return rows
    finally:
        torch.cuda.synchronize()
        for backend in backends.values():
            backend.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sections", default="calls,contention,submit,busy")
    args = ap.parse_args()
    sections = args.sections.split(",")
    torch.cuda.init()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
    }
    out.update(machine_info())
    began = time.perf_counter()
    try:
        if "calls" in sections:
            out["calls"] = calls()
        sleeper = Sleeper()
        arena = HostArena(SLOTS, 2 << 20, pin=cuda_pin)
        try:
            if "submit" in sections:
                out["submit"] = submit(sleeper, arena, False)
            if "interference" in sections:
                out["interference"] = interference(arena)
            if "contention" in sections:
                out["contention"] = contention(arena)
            if "busy" in sections:
                out["busy"] = submit(sleeper, arena, True)
        finally:
            arena.close()
    finally:
        out["seconds"] = time.perf_counter() - began
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"enqueue probe: {out['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()

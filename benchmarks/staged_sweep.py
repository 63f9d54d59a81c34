# mypy: disable-error-code="no-untyped-call"
"""Developer probe of the staged path's design choices on the GPU (not the benchmark).

Sections (each prints one JSON line per row, all go into OUT_JSON):

- ``whole``: the default ``staged`` backend, store and load GB/s end to end and copies alone, on
  large loads of three shapes and small transfers (p50/p99), and for large loads how soon layer 0
  is usable on the GPU and how long ``wait_on(stream, layer=0)`` kept the host.
- ``overlap``: a synthetic prefill (per layer: ``wait_on(stream, layer=i)`` then a GPU sleep of
  ``ratio`` x the layer's link time) beside a Llama-3-8B load of 740 blocks (1.5 GiB, the
  e2e chat workload's restore): the time the engine waits beyond its own compute, per slice
  schedule (``--variants``) and ratio.
- ``programs``: scatter/gather programs of the staged kernel: load GB/s and the slowdown of a
  bf16 GEMM stream beside store+load (``transfer_interference.measure_gemm``).
- ``profile``: cProfile of 1-block and 16-block transfers enqueued in the caller's thread (the
  native engine's inline submit: the Python around its one call).
- ``enqueue``: the native engine against the ``dma`` fallback, on small and large transfers of
  four shapes, with host CPU time per transfer and the launch-bound Python loop beside them (not
  in the default sections).

Only public API is used (``NativeStagedBackend``, ``submit``, ``wait_on``), so the same script
measures an older checkout that has them: run it twice in one GPU session,
``PYTHONPATH=<old checkout>`` with ``--label before`` and this one with ``--label after``
(variants other than ``default`` need a ``StagedConfig`` that has their fields).

Usage: PYTHONPATH=. python3 benchmarks/staged_sweep.py OUT_JSON [--label L]
       [--sections whole,overlap,programs,profile] [--variants default,equal8,...]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvoffload.bench.transfer_interference import measure_gemm
from kvoffload.bench.transfer_kv import SyntheticKV
from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.dma import DmaBackend
from kvoffload.transfer.cuda.engine import NativeStagedBackend
from kvoffload.transfer.cuda.staged_config import StagedConfig
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.spec import Direction, TransferSpec
from kvoffload.transfer.timing import Sleeper, measure_link, submitter, time_transfers

RNG = np.random.default_rng(0)
# Slice schedules of the overlap section: StagedConfig fields (those a checkout lacks are skipped).
VARIANTS: dict[str, dict[str, int]] = {
    "default": {},  # 16 equal slices of >= 128 KiB (2026-11-23)
    "equal8": {"layer_slice_bytes": 256 << 10, "max_layer_slices": 8, "first_slice_bytes": 0},
    "ramp8": {"layer_slice_bytes": 256 << 10, "max_layer_slices": 8, "first_slice_bytes": 64 << 10},
    "ramp16": {
        "layer_slice_bytes": 128 << 10,
        "max_layer_slices": 16,
        "first_slice_bytes": 64 << 10,
    },
    "layer32": {"layer_slice_bytes": 64 << 10, "max_layer_slices": 32, "first_slice_bytes": 0},
}


def log(section: str, row: dict[str, Any]) -> None:
    print(
        section,
        json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
        flush=True,
    )


def staged(engine: SyntheticKV, arena: HostArena, **fields: Any) -> NativeStagedBackend:
    known = {f.name for f in dataclasses.fields(StagedConfig)}
    missing = set(fields) - known
    if missing:
        raise KeyError(f"this checkout's StagedConfig lacks {sorted(missing)}")
    return NativeStagedBackend(engine.kv, arena, config=StagedConfig(**fields))


def spec(direction: Direction, n: int, pool: int, slots: int) -> list[TransferSpec]:
    return [TransferSpec.of(direction, RNG.permutation(pool)[:n], RNG.permutation(slots)[:n])]


def first_layer(
    backend: NativeStagedBackend, load: list[TransferSpec], reps: int
) -> dict[str, float]:
    """GPU ms from submit on an idle GPU to layer 0's event and to the last; host us that
    wait_on(layer=0) and wait_on() took after submit returned. (``transfer_gpu`` has the same
    probe, ``measure_first_layer``; this copy lets the script measure checkouts that predate it.)"""
    stream, side = torch.cuda.Stream(), torch.cuda.Stream()
    got: dict[str, list[float]] = {"layer0_ms": [], "whole_ms": [], "host0_us": [], "host_us": []}
    for i in range(reps + 1):
        a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        a.record(stream)
        p = backend.submit(load, order_after=stream)
        t0 = time.perf_counter()
        p.wait_on(side, layer=0)
        t1 = time.perf_counter()
        b.record(side)
        p.wait_on(stream)
        t2 = time.perf_counter()
        c.record(stream)
        c.synchronize()
        side.synchronize()
        if i:
            got["layer0_ms"].append(a.elapsed_time(b))
            got["whole_ms"].append(a.elapsed_time(c))
            got["host0_us"].append((t1 - t0) * 1e6)
            got["host_us"].append((t2 - t0) * 1e6)
    out = {k: statistics.median(v) for k, v in got.items()}
    owner = getattr(p, "layer_slice", None)  # layer -> slice of the last load
    out["slices"] = 0 if owner is None else int(owner.max()) + 1
    return out


def whole(sleeper: Sleeper, arena: HostArena) -> list[dict[str, Any]]:
    rows = []
    for model, layout, bs, sizes in (
        ("llama3-8b", "page", 16, (740, 16, 1)),
        ("qwen2.5-7b", "kv_split", 32, (585,)),
        ("llama3-70b-tp8-fp8", "kv_split", 16, (1000, 256)),
    ):
        engine = SyntheticKV(model, layout, bs, 2 * max(sizes) + 8)
        backend = staged(engine, arena)
        try:
            for n in sizes:
                row: dict[str, Any] = {"model": model, "layout": layout, "bs": bs, "blocks": n}
                nbytes = n * engine.kv.slot_bytes
                for d in ("store", "load"):
                    sp = spec(d, n, engine.pool, arena.num_slots)
                    e2e = time_transfers(
                        sleeper, submitter(backend, sp), 30 if n <= 16 else 5, lead=False
                    )
                    alone = time_transfers(sleeper, submitter(backend, sp), 5, lead=True)
                    row[f"{d}_GBps"] = nbytes / statistics.median(e2e["gpu_s"]) / 1e9
                    row[f"{d}_gpu_GBps"] = nbytes / statistics.median(alone["gpu_s"]) / 1e9
                    row[f"{d}_p50_us"] = float(np.percentile(e2e["gpu_s"], 50)) * 1e6
                    row[f"{d}_p99_us"] = float(np.percentile(e2e["gpu_s"], 99)) * 1e6
                    row[f"{d}_submit_us"] = statistics.median(e2e["submit_s"]) * 1e6
                    row[f"{d}_enqueue_us"] = statistics.median(e2e["enqueue_s"]) * 1e6
                if n >= 256:
                    row.update(
                        first_layer(backend, spec("load", n, engine.pool, arena.num_slots), 5)
                    )
                rows.append(row)
                log("whole", row)
        finally:
            backend.close()
            del engine
            torch.cuda.empty_cache()
    return rows


def overlap(sleeper: Sleeper, arena: HostArena, variants: list[str]) -> list[dict[str, Any]]:
    """Engine wait beyond its own compute: per layer, wait_on(layer=i) then a GPU sleep."""
    n = 740
    engine = SyntheticKV("llama3-8b", "page", 16, 2 * n + 8)
    layers = engine.kv.groups[0].num_layers
    compute = torch.cuda.Stream()
    rows = []

    def prefill(backend: NativeStagedBackend | None, layer_s: float) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record(compute)
        p = None
        if backend is not None:
            p = backend.submit(spec("load", n, engine.pool, arena.num_slots), order_after=compute)
        for layer in range(layers):
            if p is not None:
                p.wait_on(compute, layer=layer)
            sleeper.sleep(compute, layer_s)
        b.record(compute)
        b.synchronize()
        if p is not None and (not p.wait(30) or p.error() is not None):
            raise RuntimeError(f"an overlap probe load failed: {p.error() if p else None}")
        return float(a.elapsed_time(b))

    try:
        for name in variants:
            try:
                backend = staged(engine, arena, **VARIANTS[name])
            except KeyError as missing:
                log("overlap", {"variant": name, "skipped": str(missing)})
                continue
            try:
                sp = spec("load", n, engine.pool, arena.num_slots)
                t = time_transfers(sleeper, submitter(backend, sp), 5, lead=False)
                whole_ms = statistics.median(t["gpu_s"]) * 1e3
                row: dict[str, Any] = {"variant": name, "blocks": n, "load_ms": whole_ms}
                row["load_GBps"] = n * engine.kv.slot_bytes / whole_ms / 1e6
                row.update(first_layer(backend, sp, 3))
                for ratio in (1.1, 2.0):
                    layer_s = ratio * whole_ms / 1e3 / layers
                    prefill(backend, layer_s)  # warm-up
                    alone = statistics.median(prefill(None, layer_s) for _ in range(3))
                    beside = statistics.median(prefill(backend, layer_s) for _ in range(3))
                    row[f"exposed_ms_r{ratio}"] = beside - alone
                    row[f"compute_ms_r{ratio}"] = alone
                rows.append(row)
                log("overlap", row)
            finally:
                backend.close()
    finally:
        torch.cuda.empty_cache()
    return rows


def programs(sleeper: Sleeper, arena: HostArena) -> dict[str, Any]:
    """GB/s per program count of the gather/scatter (``programs`` and ``load_programs`` alike)
    on Llama-3-8B (64 KiB pieces) and fp8 Llama-3-70B at TP8 (2 KiB pieces), and the slowdown of
    a GEMM stream beside store+load on Llama-3-8B."""
    out: dict[str, Any] = {}
    for model, layout, n in (("llama3-8b", "page", 512), ("llama3-70b-tp8-fp8", "kv_split", 1000)):
        engine = SyntheticKV(model, layout, 16, 2 * n + 8)
        backends: dict[str, Any] = {
            f"p{p}": staged(engine, arena, programs=p, load_programs=p) for p in (4, 8, 16, 32)
        }
        try:
            for name, backend in backends.items():
                for d in ("store", "load"):
                    sp = spec(d, n, engine.pool, arena.num_slots)
                    t = time_transfers(sleeper, submitter(backend, sp), 5, lead=False)
                    seconds = statistics.median(t["gpu_s"])
                    out[f"{model}_{name}_{d}_GBps"] = n * engine.kv.slot_bytes / seconds / 1e9
            if model == "llama3-8b":
                gemm = measure_gemm(engine, arena, backends, n, 8, 8, RNG)
                out["gemm_slowdown"] = gemm["slowdown"]
                out["gemm_noise"] = gemm["baseline_noise"]
                out["gemm_transfer_pair_s"] = gemm["transfer_pair_s"]
        finally:
            for b in backends.values():
                b.close()
            torch.cuda.empty_cache()
    log("programs", out)
    return out


# The variants of the ``enqueue`` section: the native engine (its own threads for transfers above
# ``native_inline_bytes``) and the fallback where it cannot run (``dma``, the caller's thread).
ENQUEUE: dict[str, Any] = {
    "native": lambda kv, arena: NativeStagedBackend(kv, arena),
    "dma": lambda kv, arena: DmaBackend(kv, arena),
}


def enqueue(sleeper: Sleeper, arena: HostArena) -> dict[str, Any]:
    """The native engine against the ``dma`` fallback, side by side in one process: GB/s and
    latency end to end (from ``submit`` on an idle GPU), the caller's submit time and the
    enqueue time per transfer, the host CPU time per transfer, and the launch-bound
    Python loop beside 2-block transfers (``transfer_interference.measure_launch_stall``)."""
    from kvoffload.bench.transfer_interference import measure_launch_stall

    rows: list[dict[str, Any]] = []
    stalls: dict[str, Any] = {}
    for model, layout, bs, sizes in (
        ("llama3-8b", "page", 16, (1, 16, 740)),
        ("llama3-70b-tp8-fp8", "kv_split", 16, (256, 1000)),
        ("llama3-70b-tp8-fp8", "page", 16, (256,)),
        ("deepseek-v2-lite-mla", "kv_split", 16, (1000,)),
    ):
        engine = SyntheticKV(model, layout, bs, 2 * max(sizes) + 8)
        for name, build in ENQUEUE.items():
            backend: Any = build(engine.kv, arena)
            try:
                for n in sizes:
                    row: dict[str, Any] = {
                        "variant": name,
                        "model": model,
                        "layout": layout,
                        "blocks": n,
                    }
                    nbytes = n * engine.kv.slot_bytes
                    for d in ("store", "load"):
                        sp = spec(d, n, engine.pool, arena.num_slots)
                        time_transfers(sleeper, submitter(backend, sp), 3, lead=False)  # warm
                        c0 = time.process_time()
                        reps = 40 if n <= 16 else 8
                        e2e = time_transfers(sleeper, submitter(backend, sp), reps, lead=False)
                        cpu = (time.process_time() - c0) / reps
                        row[f"{d}_GBps"] = nbytes / statistics.median(e2e["gpu_s"]) / 1e9
                        row[f"{d}_p50_us"] = float(np.percentile(e2e["gpu_s"], 50)) * 1e6
                        row[f"{d}_p99_us"] = float(np.percentile(e2e["gpu_s"], 99)) * 1e6
                        row[f"{d}_submit_us"] = statistics.median(e2e["submit_s"]) * 1e6
                        row[f"{d}_enqueue_us"] = statistics.median(e2e["enqueue_s"]) * 1e6
                        row[f"{d}_cpu_us"] = cpu * 1e6
                    row["path"] = getattr(backend, "path", backend.name)
                    row["path_reason"] = getattr(backend, "path_reason", None)
                    rows.append(row)
                    log("enqueue", row)
                if model == "llama3-8b":
                    stalls[name] = measure_launch_stall(engine, arena, backend, reps=5)
                    log("enqueue-stall", {"variant": name, **stalls[name]})
            finally:
                backend.close()
        del engine
        torch.cuda.empty_cache()
    return {"rows": rows, "launch_stall": stalls}


def profile(arena: HostArena) -> dict[str, str]:
    """cProfile of submits the native engine enqueues in the caller's thread (every one:
    ``native_inline_bytes`` unbounded)."""
    engine = SyntheticKV("llama3-8b", "page", 16, 64)
    backend = staged(engine, arena, native_inline_bytes=1 << 62)
    out = {}
    try:
        cases: list[tuple[Direction, int]] = [("store", 1), ("load", 1), ("load", 16)]
        for d, n in cases:
            sp = spec(d, n, engine.pool, arena.num_slots)
            for _ in range(10):
                backend.submit(sp).wait(10)
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(200):
                backend.submit(sp, order_after=None).wait(10)
            prof.disable()
            per = (time.perf_counter() - t0) / 200 * 1e6
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(16)
            out[f"{d}_{n}"] = f"{per:.0f} us per submit+wait (profiled)\n" + buf.getvalue()
            print(f"profile {d} x{n}: {per:.0f} us per submit+wait (profiled)")
            print(buf.getvalue()[-3500:], flush=True)
    finally:
        backend.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--label", default="")
    ap.add_argument("--sections", default="whole,overlap,programs,profile")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    sections = args.sections.split(",")
    torch.cuda.init()
    sleeper = Sleeper()
    out: dict[str, Any] = {"label": args.label, "device": torch.cuda.get_device_name()}
    out["link"] = measure_link(sleeper, 1 << 30, 3)
    log("link", {k: v["median"] for k, v in out["link"]["GBps"].items()})
    arena = HostArena(1500, 2 << 20, pin=cuda_pin)
    began = time.perf_counter()
    try:
        if "whole" in sections:
            out["whole"] = whole(sleeper, arena)
        if "overlap" in sections:
            out["overlap"] = overlap(sleeper, arena, args.variants.split(","))
        if "programs" in sections:
            out["programs"] = programs(sleeper, arena)
        if "profile" in sections:
            out["profile"] = profile(arena)
        if "enqueue" in sections:
            out["enqueue"] = enqueue(sleeper, arena)
    finally:
        out["seconds"] = time.perf_counter() - began
        arena.close()
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"probe {args.label}: {out['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()

"""Tuning sweep of the staged backend's knobs on the GPU (a developer tool, not the benchmark).

Usage: PYTHONPATH=. python3 benchmarks/staged_sweep.py OUT_JSON
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvoffload.bench.gpu_timing import Sleeper, measure_link, time_transfers
from kvoffload.bench.transfer_gpu import Engine
from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.driver import CudaDriver
from kvoffload.transfer.cuda.pending import CudaPending
from kvoffload.transfer.cuda.staged import StagedBackend, StagedConfig
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.spec import TransferSpec

VARIANTS = {
    "default": StagedConfig(),
    "g8": StagedConfig(programs=8),
    "g32": StagedConfig(programs=32),
    "tile8k_w4": StagedConfig(chunk_bytes=8192, num_warps=4),
    "first1M": StagedConfig(first_chunk_bytes=1 << 20),
    "stage128M": StagedConfig(staging_bytes=128 << 20),
}


def us(fn: Callable[[], object], n: int = 200) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e6, 1)


def _submitter(
    backend: StagedBackend, *transfers: list[TransferSpec]
) -> Callable[[Any], list[CudaPending]]:
    """A ``time_transfers`` body: submit each transfer, ordered after the timing stream."""

    def submit(stream: Any) -> list[CudaPending]:
        return [backend.submit(t, order_after=stream) for t in transfers]

    return submit


def _submit_parts(backend: StagedBackend, spec: list[TransferSpec]) -> dict[str, float]:
    """Host time of the pieces of one submit, in µs (medians)."""

    def order_event() -> None:
        event = backend._order_event("current")
        if event is not None:
            backend._order_events.append(event)

    return {
        "validate": us(lambda: backend.validate(spec)),
        "order_event": us(order_event),
        "pending": us(lambda: CudaPending()),
        "device_ctx": us(lambda: torch.cuda.device(backend.device).__enter__()),  # type: ignore[no-untyped-call]
    }


def main() -> None:
    sleeper = Sleeper()
    link = measure_link(sleeper, 1 << 30, 4)
    print("link", {k: round(v["median"], 1) for k, v in link["GBps"].items()}, flush=True)
    rng = np.random.default_rng(0)
    arena = HostArena(1100, 2 << 20, pin=cuda_pin)
    out: dict[str, Any] = {"link": link, "rows": [], "both": [], "submit_parts": {}}
    for model in ("llama3-8b", "qwen2.5-7b", "llama3-70b-tp8"):
        for layout in ("page", "kv_split"):
            eng = Engine(model, layout, 16, 1090)
            for name, cfg in VARIANTS.items():
                if layout == "kv_split" and name not in ("default", "g32"):
                    continue
                bk = StagedBackend(eng.kv, arena, config=cfg)
                for n in (64, 512):
                    res = {}
                    for d in ("store", "load"):
                        spec = [
                            TransferSpec.of(d, rng.permutation(1090)[:n], rng.permutation(1100)[:n])
                        ]
                        for lead in (False, True):
                            t = time_transfers(
                                sleeper,
                                _submitter(bk, spec),
                                5,
                                lead=lead,
                            )
                            key = d + ("_gpu" if lead else "")
                            res[key] = n * eng.kv.slot_bytes / statistics.median(t["gpu_s"]) / 1e9
                            res[key + "_submit_us"] = statistics.median(t["submit_s"]) * 1e6
                            res[key + "_enqueue_us"] = statistics.median(t["enqueue_s"]) * 1e6
                    row = {"model": model, "layout": layout, "variant": name, "blocks": n, **res}
                    out["rows"].append(row)
                    d2h, h2d = link["GBps"]["d2h"]["median"], link["GBps"]["h2d"]["median"]
                    print(
                        f"{model:15} {layout:9} {name:10} n{n:4} store {res['store'] / d2h:.3f} "
                        f"gpu {res['store_gpu'] / d2h:.3f} load {res['load'] / h2d:.3f} gpu "
                        f"{res['load_gpu'] / h2d:.3f} submit {res['store_submit_us']:.0f}/"
                        f"{res['store_enqueue_us']:.0f} us",
                        flush=True,
                    )
                if name == "default" and layout == "page":
                    for variant, b2 in (
                        ("same", bk),
                        (
                            "fallback",
                            StagedBackend(eng.kv, arena, driver=CudaDriver.load(use_batch=False)),
                        ),
                    ):
                        for rep in range(3):
                            perm = rng.permutation(1090)
                            slots = rng.permutation(1100)
                            st = [TransferSpec.of("store", perm[:512], slots[:512])]
                            ld = [TransferSpec.of("load", perm[512:1024], slots[512:1024])]
                            t = time_transfers(
                                sleeper,
                                _submitter(b2, st, ld),
                                3,
                            )
                            gbps = 2 * 512 * eng.kv.slot_bytes / statistics.median(t["gpu_s"]) / 1e9
                            out["both"].append(
                                {"model": model, "variant": variant, "rep": rep, "GBps": gbps}
                            )
                            print(f"both {model} {variant} rep{rep}: {gbps:.1f} GB/s", flush=True)
                    # submit cost breakdown at 64 blocks (2048 pieces for llama3-8b page)
                    spec = [
                        TransferSpec.of(
                            "store", rng.permutation(1090)[:64], rng.permutation(1100)[:64]
                        )
                    ]
                    parts = _submit_parts(bk, spec)
                    sync = StagedBackend(eng.kv, arena, submit_thread=False)

                    ts = []
                    for b in (bk, sync):
                        tt = []
                        for _ in range(50):
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            p = b.submit(spec)
                            tt.append(time.perf_counter() - t0)
                            p.wait(10)
                        ts.append(round(statistics.median(tt) * 1e6, 1))
                    parts["submit_thread"], parts["submit_sync"] = ts
                    out["submit_parts"][f"{model}-{layout}"] = parts
                    print("submit parts us", parts, flush=True)
                    sync.close()
                bk.close()
            del eng
            torch.cuda.empty_cache()
    arena.close()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

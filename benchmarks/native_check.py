"""Developer probe of the native engine on a GPU: latency, GB/s and host time of ``staged``
(native) beside ``dma`` (its fallback) on a few shapes, bytes checked. The product's
benchmark is ``kvoffload bench transfer``; this is the quick look used while building the engine.

    python benchmarks/native_check.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from kvoffload.store.arena import HostArena
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.registry import make_backend
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec


def lateness(stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        time.sleep(200e-6)
        out.append(time.perf_counter() - t0 - 200e-6)


def probe(model: str, layout: str, method: str, pool: int, counts: tuple[int, ...]) -> list[Any]:
    gen = torch.Generator().manual_seed(1)
    tensors, block_dim = engine_tensors(
        MODELS[model],
        layout,
        pool,
        16,
        lambda s: torch.randint(-(2**15), 2**15, s, dtype=torch.int16, generator=gen),
    )
    gpu = [t.cuda() for t in tensors]
    kv = KVLayout.from_tensors(gpu, block_size=16, block_dim=block_dim)
    arena = HostArena(pool, kv.slot_bytes, pin=cuda_pin)
    if method in VARIANTS:  # the native engine with other settings
        from kvoffload.transfer.cuda.engine import make_staged
        from kvoffload.transfer.cuda.staged_config import StagedConfig

        backend: Any = make_staged(kv, arena, StagedConfig(**VARIANTS[method]))
    else:
        backend = make_backend(method, kv, arena)
    rows = []
    rng = np.random.default_rng(0)
    try:
        for n in counts:
            blocks = rng.choice(pool, n, replace=False)
            slots = rng.choice(pool, n, replace=False)
            for d in ("store", "load"):
                spec = [TransferSpec.of(d, blocks, slots)]
                for _ in range(3):
                    assert backend.submit(spec).wait(60)
                torch.cuda.synchronize()
                reps = 50 if n <= 64 else 10
                e2e, call, parts = [], [], []
                late: list[float] = []
                stop = threading.Event()
                th = threading.Thread(target=lateness, args=(stop, late))
                base: list[float] = []
                stop0 = threading.Event()
                th0 = threading.Thread(target=lateness, args=(stop0, base))
                th0.start()
                time.sleep(0.05)
                stop0.set()
                th0.join()
                th.start()
                for _ in range(reps):
                    t0 = time.perf_counter()
                    p = backend.submit(spec)
                    t1 = time.perf_counter()
                    assert p.wait(60) and p.error() is None
                    t2 = time.perf_counter()
                    call.append(t1 - t0)
                    e2e.append(t2 - t0)
                    for j in getattr(p, "jobs", ()):
                        sub, start, enq, _, done = j.times()
                        parts.append((start - sub, enq - start, done - enq, t2 - done))
                stop.set()
                th.join()
                nbytes = n * kv.slot_bytes
                med = statistics.median(e2e)
                rows.append(
                    {
                        "model": model,
                        "layout": layout,
                        "method": method,
                        "path": getattr(backend, "path", "-"),
                        "blocks": n,
                        "direction": d,
                        "p50_us": med * 1e6,
                        "GBps": nbytes / med / 1e9,
                        "submit_call_us": statistics.median(call) * 1e6,
                        "late_p50_us": statistics.median(late) * 1e6 if late else None,
                        "late_base_p50_us": statistics.median(base) * 1e6 if base else None,
                        # native: submit->start, enqueue, enqueued->seen done, done->wait returned
                        "phases_p50_us": [
                            statistics.median(x) * 1e6 for x in zip(*parts, strict=True)
                        ]
                        if parts
                        else None,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        # bytes: store then load into other blocks, compare
        n = min(64, pool // 2)
        src, dst, slots = np.arange(n), np.arange(n, 2 * n), np.arange(n)
        assert backend.submit([TransferSpec.of("store", src, slots)]).wait(60)
        assert backend.submit([TransferSpec.of("load", dst, slots)]).wait(60)
        torch.cuda.synchronize()
        for t in gpu:
            dim = block_dim
            a = t.index_select(dim, torch.as_tensor(src, device=t.device))
            b = t.index_select(dim, torch.as_tensor(dst, device=t.device))
            assert torch.equal(a, b), f"{method} round trip differs"
        rows.append({"model": model, "layout": layout, "method": method, "bytes_ok": True})
    finally:
        backend.close()
        arena.close()
    return rows


VARIANTS: dict[str, dict[str, Any]] = {
    "staged-p32": {"programs": 32, "load_programs": 32},
    # small first chunks and layer slices from 1 MiB of load: the exposed gather / scatter shrinks
    "staged-small": {"first_chunk_bytes": 1 << 20, "layer_slice_transfer_bytes": 1 << 20},
    "staged-small-p32": {
        "first_chunk_bytes": 1 << 20,
        "layer_slice_transfer_bytes": 1 << 20,
        "programs": 32,
        "load_programs": 16,
    },
}
METHODS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["staged", "dma"]


def main() -> None:
    out: list[Any] = []
    cases = [
        ("llama3-8b", "page", 1100),
        ("llama3-70b-tp8-fp8", "kv_split", 2100),
        ("deepseek-v2-lite-mla", "page", 2100),
    ]
    if len(sys.argv) > 3:
        cases = [c for c in cases if c[0] in sys.argv[3].split(",")]
    for model, layout, pool in cases:
        for method in METHODS:
            out += probe(model, layout, method, pool, (1, 16, 64, 1000))
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()

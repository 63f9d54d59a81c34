"""What does a load from scattered host slots cost the caller's thread? (issue 25)

A prefix stored at several times comes back from several runs of consecutive host slots. Each
layer slice of a run is one pitched copy (``cuMemcpy2DAsync``); single slots go as descriptors of
one ``cuMemcpyBatchAsync`` per chunk. This loads ``N`` blocks from slots cut into ``R`` equal runs
(R = 1 .. N, the last all single slots) through the ``staged`` backend, timing ``submit`` on the
host (the caller's thread enqueues the whole load) and submit to done, medians of ``REPS``; each
pattern's bytes are checked against the stored blocks once. Its first run (commit 8862e28,
``runs_probe_nvidia-h200_2026-11-26_3d.json``) also tried every chunk's copies in one
``cuMemcpy3DBatchAsync``: no host time saved, single slots 2.2-2.7x dearer (docs/transfer.md).

    python -m benchmarks.runs_probe OUT.json   # CUDA only
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from benchmarks import probe_util
from kvoffload.bench.transfer.kv import SyntheticKV
from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.staged import make_staged
from kvoffload.transfer.cuda.staged_config import StagedConfig
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.spec import TransferSpec

REPS = 9
CASES: tuple[tuple[str, str, int, int], ...] = (
    ("llama3-8b", "page", 16, 256),
    ("llama3-8b", "kv_split", 16, 256),
    ("qwen2.5-7b", "kv_split", 32, 128),
    ("llama3-8b", "kv_split", 16, 32),
    ("llama3-70b-tp8-fp8", "kv_split", 16, 1000),
)


def slots_in_runs(n: int, runs: int) -> np.ndarray:
    """``n`` slots in ``runs`` runs of consecutive slots, one free slot between runs."""
    sizes = [n // runs + (i < n % runs) for i in range(runs)]
    out: list[int] = []
    at = 0
    for size in sizes:
        out.extend(range(at, at + size))
        at += size + 1
    return np.array(out, dtype=np.int64)


def measure(backend: Any, kv: SyntheticKV, n: int, slots: np.ndarray) -> dict[str, float]:
    src, dst = np.arange(n), np.arange(n, 2 * n)
    assert backend.submit([TransferSpec.of("store", src, slots)]).wait(60)
    submit, done, slices = [], [], 0
    for rep in range(REPS + 1):
        if rep == 0:  # the destination blocks zeroed: the first load's bytes are checked
            index = torch.from_numpy(dst).cuda()
            for t in kv.tensors:
                t.index_fill_(kv.block_dim, index, 0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = backend.submit([TransferSpec.of("load", dst, slots)])
        t1 = time.perf_counter()
        if not pending.wait(60) or pending.error() is not None:
            raise RuntimeError(f"load failed: {pending.error()!r}")
        t2 = time.perf_counter()
        if rep == 0:
            if not kv.same_blocks(src, dst):
                raise RuntimeError(f"loaded bytes differ ({n} blocks, {len(slots)} slots)")
            ls = pending.layer_slice
            slices = int(ls.max()) + 1 if ls is not None else 1
            continue
        submit.append((t1 - t0) * 1e6)
        done.append((t2 - t0) * 1e6)
    return {
        "submit_us": statistics.median(submit),
        "submit_us_min": min(submit),
        "done_us": statistics.median(done),
        "slices": slices,
    }


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("runs_probe.py: expected a CUDA device, got none")
    rows: list[dict[str, Any]] = []
    for model, layout, block_size, n in CASES:
        kv = SyntheticKV(model, layout, block_size, 2 * n + 8)
        arena = HostArena(2 * n + 2, kv.kv.slot_bytes, pin=cuda_pin)
        try:
            backend = make_staged(kv.kv, arena, StagedConfig())
            for runs in sorted({1, 2, 4, 8, 16, n // 4, n}):
                got = measure(backend, kv, n, slots_in_runs(n, runs))
                row = {"model": model, "layout": layout, "blocks": n, "runs": runs, **got}
                rows.append(row)
                print(
                    f"{model:10} {layout:8} {n:4} blocks {runs:4} runs slices {got['slices']:2} "
                    f"submit {got['submit_us']:7.1f} us done {got['done_us']:8.1f} us"
                )
            backend.close()
        finally:
            arena.close()
    probe_util.dump(sys.argv[1], "runs_probe", reps=REPS, results=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

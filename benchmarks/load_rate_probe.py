"""How fast does one load land, by engine layout, host arena size and slot position? (issue 25)

``bench e2e`` (Llama-3-8B and Qwen2.5-7B shapes, H200) timed its loads at ~24 GB/s (a 256 MiB
restore in 10-11 ms), where ``replay_hold_probe.py`` moved the same bytes through the same backend
in 5.3 ms (51 GB/s). The runner's cache is ``kv_split`` (per layer [2, blocks, ...]) and its host
arena holds 2,560 blocks; the probe's was ``page`` and 264 blocks. This loads ``BLOCKS`` blocks
through the public API (``staged``), submit to done on the host, for each layout x arena size x
the slots' place in the arena (its first or its last blocks), beside a pinned torch copy of the
same bytes (the link), medians of ``REPS``.

    python -m benchmarks.load_rate_probe OUT.json   # CUDA only
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from benchmarks import probe_util
from kvoffload import KVLayout
from kvoffload.transfer.shapes import MODELS, engine_tensors

BLOCKS = 128
REPS = 7


def timed_load(local: Any, keys: np.ndarray, dst: np.ndarray, tag: str) -> float:
    off, worker = local.offloader, local.worker
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    job = off.schedule_load(tag, keys, dst)
    assert job is not None
    worker.submit(job)
    worker.wait([job.job_id], 60)
    dt = time.perf_counter() - t0
    results = worker.get_finished()
    off.complete(results)
    if not all(r.ok for r in results):
        raise RuntimeError(f"load failed: {results}")
    return dt


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("load_rate_probe.py: expected a CUDA device, got none")
    rows: list[dict[str, Any]] = []
    for model in ("llama3-8b", "qwen2.5-7b"):
        for layout in ("page", "kv_split"):
            pool = 2 * BLOCKS + 8
            bs = 32 if model.startswith("qwen") else 16  # as bench e2e runs them
            tensors, block_dim = engine_tensors(
                MODELS[model],
                layout,
                pool,
                bs,
                lambda s: torch.zeros(s, dtype=torch.int16, device="cuda"),
            )
            kv = KVLayout.from_tensors(tensors, block_size=bs, block_dim=block_dim)
            nbytes = BLOCKS * kv.slot_bytes
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            link = []
            for _ in range(REPS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dev.copy_(pinned, non_blocking=True)
                torch.cuda.synchronize()
                link.append(time.perf_counter() - t0)
            link_gbps = nbytes / statistics.median(link) / 1e9
            del dev, pinned
            for arena_blocks in (2 * BLOCKS, 2560):
                local = probe_util.offload(kv, arena_blocks, "staged")
                rng = np.random.default_rng(0)
                try:
                    # fill the arena: the last BLOCKS stores hold the arena's last slots
                    stored = []
                    for i in range(arena_blocks // BLOCKS):
                        keys = rng.integers(0, 256, (BLOCKS, 16), dtype=np.uint8)
                        probe_util.store(local, f"s{i}", keys, np.arange(BLOCKS))
                        stored.append(keys)
                    for place, keys in (("first", stored[0]), ("last", stored[-1])):
                        dst = np.arange(pool - BLOCKS, pool)
                        times = [
                            timed_load(local, keys, dst, f"l{place}{r}") for r in range(REPS + 1)
                        ]
                        gbps = nbytes / statistics.median(times[1:]) / 1e9
                        row = {
                            "model": model,
                            "layout": layout,
                            "arena_blocks": arena_blocks,
                            "slots": place,
                            "bytes": nbytes,
                            "load_ms": statistics.median(times[1:]) * 1e3,
                            "load_gbps": gbps,
                            "link_gbps": link_gbps,
                            "fraction": gbps / link_gbps,
                        }
                        rows.append(row)
                        print(
                            f"{model:11} {layout:8} arena {arena_blocks:5} slots {place:5} "
                            f"{row['load_ms']:7.2f} ms {gbps:6.1f} GB/s link {link_gbps:5.1f} "
                            f"({row['fraction']:.2f})"
                        )
                finally:
                    local.close()
    probe_util.dump(sys.argv[1], "load_rate_probe", blocks=BLOCKS, results=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

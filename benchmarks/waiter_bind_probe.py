"""Where does binding a load's layer waiter go on the engine's thread? (issue 25)

``bench e2e`` read ``worker.layer_waiter`` (the binding, once per restored request) at 30-70 us.
This loads 256 Llama-3-8B blocks through the public API ``REPS`` times and times, per load (us,
medians after the first ``WARM``): ``schedule_load``, ``submit``, the binding with a
``StallTimer`` and without, and the binding's parts: the current stream's handle, the timer's
native half, the job's layer slices; then the first layer's wait and the mean of the others.

    python -m benchmarks.waiter_bind_probe   # CUDA only; prints one line
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from benchmarks import probe_util
from kvoffload import StallTimer
from kvoffload.transfer.cuda.pending import stream_handle

REPS = 60
WARM = 10


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("waiter_bind_probe.py: expected a CUDA device, got none")
    _tensors, _dim, kv = probe_util.engine("llama3-8b", "page", 512)
    local = probe_util.offload(kv, 256, "staged")
    keys = np.random.default_rng(1).integers(0, 256, (256, 16), dtype=np.uint8)
    probe_util.store(local, "s", keys, np.arange(256))
    off, worker = local.offloader, local.worker
    timer = StallTimer(32)
    names = ("schedule", "submit", "bind_timed", "bind_untimed", "handle", "native")
    parts: dict[str, list[float]] = {k: [] for k in (*names, "layer_slice", "first", "others")}
    for r in range(REPS):
        t = [time.perf_counter()]
        job = off.schedule_load(f"l{r}", keys, np.arange(256, 512))
        t.append(time.perf_counter())
        worker.submit(job)
        t.append(time.perf_counter())
        timer.reset()
        t.append(time.perf_counter())
        waiter = worker.layer_waiter(job.job_id, timer=timer)
        t.append(time.perf_counter())
        worker.layer_waiter(job.job_id)
        t.append(time.perf_counter())
        stream_handle(None)
        t.append(time.perf_counter())
        pending: Any = worker._running[job.job_id].pending  # the probe looks inside
        timer.native(pending.core)
        t.append(time.perf_counter())
        [j.layer_slice for j in pending.jobs]
        t.append(time.perf_counter())
        waiter(0)
        t.append(time.perf_counter())
        for layer in range(1, 32):
            waiter(layer)
        t.append(time.perf_counter())
        spans = [t[1] - t[0], t[2] - t[1], t[4] - t[3], t[5] - t[4], t[6] - t[5], t[7] - t[6]]
        spans += [t[8] - t[7], t[9] - t[8], (t[10] - t[9]) / 31]
        for name, s in zip(parts, spans, strict=True):
            parts[name].append(s * 1e6)
        probe_util.finish(local, job.job_id, "load")
        torch.cuda.synchronize()
    print({k: round(statistics.median(v[WARM:]), 1) for k, v in parts.items()})
    local.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

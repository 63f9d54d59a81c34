"""What slows an engine's host launch loop while a restore's copy runs beside it? (issue 25)

``bench e2e`` (eager and piecewise graphs) shows the restored request's host launch phase 6-25%
longer than ``gpu_all``'s, while kvoffload's own calls inside it (the per-layer waits) are ~0.1 ms.
This probe times a launch-bound loop (``KERNELS`` tiny kernels on the engine's stream, host time
from the first launch to the last) alone and beside one copy of ``MIB`` MiB started just before it,
made in turn by:

- ``htod_torch``: torch's ``copy_`` from pinned host memory on a side stream (one driver call,
  no thread of ours, no kvoffload);
- ``dtoh_torch``: the same the other way;
- ``dtod_torch``: device to device (no PCIe, no host memory);
- ``host_memcpy``: no GPU copy; numpy copies ``MIB`` MiB between two host buffers in a thread
  (the host memory traffic of a copy without the GPU, the GIL released);
- ``kvoffload_load``: kvoffload's load of the same bytes through the public API (``staged``,
  schedule + submit before the loop, its per-layer waits left out);
- ``kvoffload_dma``: the same through backend ``dma`` (copy engines only, no kernels of ours);
- ``sleep_only``: a one-block spin kernel on a side stream for longer than the loop;
- ``kvoffload_held``: ``kvoffload_load`` ordered after that spin, so it is in flight (our
  threads watching it) through the whole loop, but no byte moves and no kernel of ours runs.

Each case runs beside two loops: ``eager`` (the kernels launched one by one) and ``graph``
(``REPLAYS`` replays of a CUDA graph of ``GRAPH_KERNELS`` of them, as a piecewise engine launches
its layers' dense parts). The loop is run ``REPS`` times per case, alternating with the loop
alone; reported: the median host launch time of each and their ratio.

    python -m benchmarks.launch_beside_copy_probe OUT.json   # CUDA only
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks import probe_util

KERNELS = 2000
GRAPH_KERNELS = 10
REPLAYS = 400
MIB = 512
REPS = 9


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("launch_beside_copy_probe.py: expected a CUDA device, got none")
    out_path = sys.argv[1]
    nbytes = MIB << 20
    x = torch.zeros(256, device="cuda")
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_a = np.ones(nbytes, dtype=np.uint8)
    host_b = np.empty(nbytes, dtype=np.uint8)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    _tensors, keys, dst, locals_ = probe_util.stored_llama(nbytes)  # tensors kept alive
    step = [0]
    sleep: Any = torch.cuda._sleep
    torch.cuda.synchronize()
    spin = int(probe_util.sleep_cycles_per_ms() * 30)  # ~30 ms: longer than the loop

    def eager_loop() -> float:
        t0 = time.perf_counter()
        for _ in range(KERNELS):
            x.add_(1)
        return (time.perf_counter() - t0) * 1e3

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_KERNELS):
            x.add_(1)

    def graph_loop() -> float:
        t0 = time.perf_counter()
        for _ in range(REPLAYS):
            graph.replay()
        return (time.perf_counter() - t0) * 1e3

    loops = {"eager": eager_loop, "graph": graph_loop}

    def htod() -> Callable[[], None]:
        with torch.cuda.stream(side):
            dev_a.copy_(pinned, non_blocking=True)
        return lambda: None

    def dtoh() -> Callable[[], None]:
        with torch.cuda.stream(side):
            pinned.copy_(dev_a, non_blocking=True)
        return lambda: None

    def dtod() -> Callable[[], None]:
        with torch.cuda.stream(side):
            dev_b.copy_(dev_a, non_blocking=True)
        return lambda: None

    def host_memcpy() -> Callable[[], None]:
        t = threading.Thread(target=np.copyto, args=(host_b, host_a))
        t.start()
        return t.join

    def kvo_load(backend: str = "staged", held: bool = False) -> Callable[[], None]:
        step[0] += 1
        off, worker = locals_[backend].offloader, locals_[backend].worker
        job = off.schedule_load(f"l{step[0]}", keys, dst)
        assert job is not None
        if held:  # ordered after the spin: the submit orders the load after the current stream
            with torch.cuda.stream(side):
                sleep(spin)
                worker.submit(job)
        else:
            worker.submit(job)

        return lambda: probe_util.finish(locals_[backend], job.job_id, "load")

    def sleep_only() -> Callable[[], None]:
        with torch.cuda.stream(side):
            sleep(spin)
        return lambda: None

    cases: dict[str, Callable[[], Callable[[], None]]] = {
        "htod_torch": htod,
        "dtoh_torch": dtoh,
        "dtod_torch": dtod,
        "host_memcpy": host_memcpy,
        "kvoffload_load": kvo_load,
        "kvoffload_dma": lambda: kvo_load("dma"),
        "sleep_only": sleep_only,
        "kvoffload_held": lambda: kvo_load(held=True),
    }
    for make in cases.values():  # every kernel and path once
        make()()
    for loop in loops.values():
        loop()
    torch.cuda.synchronize()
    rows: list[dict[str, Any]] = []
    for loop_name, loop in loops.items():
        for name, make in cases.items():
            alone, beside, copy_ms = [], [], []
            for _ in range(REPS):
                torch.cuda.synchronize()
                alone.append(loop())
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                end = make()
                beside.append(loop())
                end()
                torch.cuda.synchronize()
                copy_ms.append((time.perf_counter() - t0) * 1e3)
            row = {
                "loop": loop_name,
                "case": name,
                "alone_ms": statistics.median(alone),
                "beside_ms": statistics.median(beside),
                "ratio": statistics.median(beside) / statistics.median(alone),
                "copy_and_loop_ms": statistics.median(copy_ms),
            }
            rows.append(row)
            print(
                f"{loop_name:5} {name:15} loop alone {row['alone_ms']:7.3f} ms  beside "
                f"{row['beside_ms']:7.3f} ms  x{row['ratio']:.3f}  (copy + loop "
                f"{row['copy_and_loop_ms']:.2f} ms)"
            )
    for local in locals_.values():
        local.close()
    probe_util.dump(
        out_path,
        "launch_beside_copy_probe",
        kernels=KERNELS,
        graph_kernels=GRAPH_KERNELS,
        replays=REPLAYS,
        mib=MIB,
        results=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

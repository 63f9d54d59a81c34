"""Does an engine's small host-to-device copy wait behind a large load's copies? (issue 25)

A restored forward in ``bench e2e --graph full`` started its first kernel only when the load's
last host-to-device copy ended (``--profile``: model_start 10.6 ms after the load's first copy,
for a 10.5 ms load), though its layers wait for the load one by one. The forward's first kernel
needs its inputs, uploaded by one small host-to-device copy on the engine's stream. This probe
enqueues a large load on a stream of ours, then on the engine's stream a tiny kernel and a small
pinned copy (the engine's inputs), and times from the load's start when each of them is done:

- ``raw``: 16 copies of 32 MiB (``copy_(non_blocking=True)``) on one torch stream;
- ``api``: kvoffload's own load of the same bytes (``build_local``, the native engine);
- each also with the small copy enqueued *before* the load (as vLLM's runner does: inputs
  prepared, then ``start_load_kv``, then the forward), and with a device-to-device small copy;
- ``default stream engine``: the engine on torch's default (the legacy NULL) stream, as the
  e2e runner and most engines run, against a load on our streams (their flags are listed),
  also through the backend from consecutive host slots (2D copies) and from scattered ones
  (a ``cuMemcpyBatchAsync`` descriptor per block and slice), and the latter beside a side
  stream engine; and the engine's work as a CUDA graph's replay (``graph replay``);
- ``paced raw``: the same chunks, each held back (a cross-stream event wait) until the one
  before it is done, so one chunk at a time sits in the copy engine's queue.

    python benchmarks/copy_queue_probe.py OUT.json [staged-FLAG-...]    # CUDA only

The optional second argument builds kvoffload's loads on a variant of the native core
(``bench e2e --backend``'s flags, e.g. ``staged-la1``: a load chunk in one staging area).
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

CHUNK = 32 << 20
CHUNKS = 16
REPS = 5


def timed(
    load: Callable[[], Any],
    small_first: bool,
    engine: Any,
    src: Any,
    dst: Any,
    work: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """ms from before the load until the engine's work (a tiny kernel, or ``work``: a CUDA
    graph's replay) and then its small copy are done, and until the load is."""
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    kernel_done = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    copy_done = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    load_done = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    t0.record()
    engine.wait_stream(torch.cuda.current_stream())
    if small_first:
        with torch.cuda.stream(engine):
            dst.copy_(src, non_blocking=True)
    side = load()
    with torch.cuda.stream(engine):
        x = torch.ones(16, device="cuda") * 2 if work is None else work()
        kernel_done.record()
        if not small_first:
            dst.copy_(src, non_blocking=True)
        copy_done.record()
    torch.cuda.current_stream().wait_stream(side)
    load_done.record()
    torch.cuda.synchronize()
    del x
    return {
        "kernel_ms": t0.elapsed_time(kernel_done),
        "small_copy_ms": t0.elapsed_time(copy_done),
        "load_ms": t0.elapsed_time(load_done),
    }


def stream_flags(handle: int) -> int:
    """cuStreamGetFlags of a stream handle (CU_STREAM_NON_BLOCKING = 1)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    flags = ctypes.c_uint(0)
    rc = cuda.cuStreamGetFlags(ctypes.c_void_p(handle), ctypes.byref(flags))
    if rc != 0:
        raise RuntimeError(f"cuStreamGetFlags failed with {rc}")
    return int(flags.value)


def main() -> int:
    out = sys.argv[1]
    from kvoffload import KVLayout, OffloadConfig, build_local
    from kvoffload.bench.e2e.runner.core_flags import configured

    backend_name = sys.argv[2] if len(sys.argv) > 2 else "staged"
    if backend_name != "staged":
        base, *flags = backend_name.split("-")
        backend_name = configured(base, flags)
    from kvoffload.transfer.shapes import MODELS, engine_tensors

    host = torch.empty(CHUNKS * CHUNK, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(CHUNKS * CHUNK, dtype=torch.uint8, device="cuda")
    small_src = torch.arange(4096, dtype=torch.int64).pin_memory()
    small_dst = torch.empty(4096, dtype=torch.int64, device="cuda")
    ours = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    engine = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def raw() -> Any:
        ours.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ours):
            for i in range(CHUNKS):
                dev[i * CHUNK : (i + 1) * CHUNK].copy_(host[i * CHUNK : (i + 1) * CHUNK], True)
        return ours

    pair = (ours, torch.cuda.Stream())  # type: ignore[no-untyped-call]

    def paced() -> Any:
        """Each chunk on the other stream of a pair, after an event of the one before: a wait
        that holds the next copy back until the previous one is done (one chunk queued)."""
        for s in pair:
            s.wait_stream(torch.cuda.current_stream())
        prev = None
        for i in range(CHUNKS):
            s = pair[i % 2]
            if prev is not None:
                s.wait_event(prev)
            with torch.cuda.stream(s):
                dev[i * CHUNK : (i + 1) * CHUNK].copy_(host[i * CHUNK : (i + 1) * CHUNK], True)
            prev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            prev.record(s)
        pair[0].wait_stream(pair[1])
        return pair[0]

    blocks = 256  # 512 MiB of Llama-3-8B pages
    tensors, block_dim = engine_tensors(
        MODELS["llama3-8b"],
        "page",
        2 * blocks,
        16,
        lambda s: torch.ones(s, dtype=torch.bfloat16, device="cuda"),
    )
    layout = KVLayout.from_tensors(tensors, block_size=16, block_dim=block_dim)
    local = build_local(
        layout, OffloadConfig(host_capacity_blocks=2 * blocks + 8, backend=backend_name)
    )
    off, worker = local.offloader, local.worker
    keys = [i.to_bytes(16, "little") for i in range(1, blocks + 1)]
    job = off.schedule_store("probe-store", keys, list(range(blocks)))
    if job is None:
        raise RuntimeError("expected a store job for the probe's blocks, got none")
    worker.submit(job)
    worker.wait([job.job_id], timeout=60)
    off.complete(worker.get_finished())
    loads = [0]
    probe = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def api() -> Any:
        loads[0] += 1
        job = off.schedule_load(f"probe-load{loads[0]}", keys, list(range(blocks, 2 * blocks)))
        if job is None:
            raise RuntimeError("expected the probe's blocks held on host, got a miss")
        worker.submit(job)
        probe.wait_stream(torch.cuda.current_stream())
        worker.wait_on(job.job_id, probe.cuda_stream)
        api.job = job  # type: ignore[attr-defined]
        return probe

    default = torch.cuda.default_stream()
    backend: Any = worker.backend  # the native staged backend: its streams, its submit
    streams = [(f"{d}[{i}]", st) for d, ss in backend._streams.items() for i, st in enumerate(ss)]
    from kvoffload.transfer.spec import TransferSpec

    direct: list[Any] = []

    def backend_load(step: int) -> Callable[[], Any]:
        """The backend's load of every ``step``-th host slot: 1, runs of consecutive slots (one
        2D copy per slice); 2, no two consecutive (a batch descriptor per block and slice)."""

        def load() -> Any:
            slots = np.arange(0, step * blocks, step)
            spec = TransferSpec.of("load", np.arange(blocks, 2 * blocks), slots)
            pending = backend.submit([spec])
            probe.wait_stream(torch.cuda.current_stream())
            pending.wait_on(probe)
            direct.append(pending)
            return probe

        return load

    result_flags = {name: stream_flags(st.cuda_stream) for name, st in streams}
    result_flags["engine (a torch.cuda.Stream)"] = stream_flags(engine.cuda_stream)
    print("stream flags (1: non-blocking):", result_flags)
    result: dict[str, Any] = {
        "stream_flags": result_flags,
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "load_bytes": CHUNKS * CHUNK,
        "backend": backend_name,
        "rows": {},
    }
    d2d_src = torch.ones(4096, dtype=torch.int64, device="cuda")
    with torch.cuda.stream(engine):  # a CUDA graph of a few kernels, as a graph-mode engine
        a = torch.ones(1 << 20, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b = a * 2 + 1
        graph.replay()
    torch.cuda.synchronize()

    def replay() -> Any:
        graph.replay()
        return b

    Case = tuple[str, Callable[[], Any], bool, Any, Any]
    cases: list[Case] = [
        ("default stream engine, raw", raw, False, small_src, default),
        ("default stream engine, api", api, False, small_src, default),
        ("default stream engine, api", api, True, small_src, default),
        ("default stream engine, consecutive slots", backend_load(1), False, small_src, default),
        ("default stream engine, scattered slots", backend_load(2), False, small_src, default),
        ("side stream engine, scattered slots", backend_load(2), False, small_src, engine),
        ("default stream engine, graph replay, api", api, False, small_src, default),
        ("side stream engine, graph replay, api", api, False, small_src, engine),
        ("raw", raw, False, small_src, engine),
        ("raw", raw, True, small_src, engine),
        ("raw, device-to-device small copy", raw, False, d2d_src, engine),
        ("paced raw", paced, False, small_src, engine),
        ("paced raw, device-to-device small copy", paced, False, d2d_src, engine),
        ("api", api, False, small_src, engine),
        ("api", api, True, small_src, engine),
        ("api, device-to-device small copy", api, False, d2d_src, engine),
    ]
    for name, load, small_first, src, on in cases:
        reps = []
        for _ in range(REPS + 1):
            work = replay if "graph replay" in name else None
            reps.append(timed(load, small_first, on, src, small_dst, work))
            while direct:
                if not direct.pop().wait(60):
                    raise RuntimeError("expected the probe's load done in 60 s, got it running")
            if load is api:
                worker.wait([api.job.job_id], timeout=60)  # type: ignore[attr-defined]
                off.complete(worker.get_finished())
        key = f"{name}, small copy {'before' if small_first else 'after'} the load"
        result["rows"][key] = {k: statistics.median(r[k] for r in reps[1:]) for k in reps[0]}
        print(key, {k: round(v, 3) for k, v in result["rows"][key].items()})
    worker.close()
    off.close()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

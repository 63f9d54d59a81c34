"""Is an engine's forward held until a layered load has landed, and by what? (issue 25)

In ``bench e2e --graph full`` a restored request's graph replay began only after its whole load
had landed (Qwen2.5-7B docs: 4.3-4.5 ms of device time on the engine's stream between two event
records with nothing of ours between them, also with no layer gate at all, and with
``CUDA_DEVICE_MAX_CONNECTIONS`` 32 or 1). This probe reproduces the step outside the runner and
switches its parts one at a time. A step: ``schedule_load`` + ``TransferWorker.submit`` of
``BLOCKS`` stored blocks, then on the engine's stream event A, [the gate's open], event B, the
engine's work (``WORK`` matmuls, eager or one CUDA graph, with or without the gate's waits
captured between them), event C. Reported per case, medians over ``REPS`` steps: ``held_ms``
(A to B: what the engine's stream waited before its work could start), ``work_ms`` (B to C),
``load_ms`` (submit to the job's end, host), and the same work with no load beside it.

Cases (engine stream x work x gate): the engine on torch's default (legacy) stream or a
non-blocking stream of its own; its work eager or one graph; ``gate`` none, ``open`` (the gate
opened for the load, no waits captured) or ``waits`` (waits captured, the gate opened for the
load). Bytes are checked after each case (the loaded blocks equal the stored ones).

    python -m benchmarks.replay_hold_probe OUT.json [BLOCKS] [--quick] [--backend staged-lp64]

``--quick``: the engine on the default stream, one graph, no gate (load or not): the model's
work beside a load, for a sweep of the core's settings (``--backend staged-FLAG-...``, the flags
of ``bench e2e --backend``: ``lpN`` scatter programs, ``wN`` warps, ``prio``, ...).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from benchmarks import probe_util

MODEL, LAYOUT = "llama3-8b", "page"
WORK = 32  # matmul groups (one per "layer")
REPS = 8


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("replay_hold_probe.py: expected a CUDA device, got none")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    quick = "--quick" in sys.argv
    backend = "staged"
    if "--backend" in sys.argv:
        backend = sys.argv[sys.argv.index("--backend") + 1]
        args.remove(backend)
    if backend.startswith("staged-"):
        from kvoffload.bench.e2e.runner.core_flags import configured

        backend = configured("staged", backend.split("-")[1:])
    out_path = args[0]
    blocks = int(args[1]) if len(args) > 1 else 128
    pool = 2 * blocks + 8
    tensors, block_dim, kv = probe_util.engine(MODEL, LAYOUT, pool)
    local = probe_util.offload(kv, 2 * blocks, backend)
    off, worker = local.offloader, local.worker
    keys = np.random.default_rng(1).integers(0, 256, (blocks, 16), dtype=np.uint8)
    dst = np.arange(pool - blocks, pool, dtype=np.int64)
    probe_util.store(local, "store", keys, np.arange(blocks, dtype=np.int64))

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    gate = worker.layer_gate(WORK)

    def work(with_waits: bool, stream: Any) -> None:
        for i in range(WORK):
            if with_waits:
                gate.wait(stream, i)
            torch.mm(x, a, out=y)

    results: list[dict[str, Any]] = []
    step = 0
    for engine_kind in ("default",) if quick else ("default", "own"):
        engine = (
            torch.cuda.default_stream() if engine_kind == "default" else torch.cuda.Stream()  # type: ignore[no-untyped-call]
        )
        with torch.cuda.stream(engine):
            work(False, engine)  # every kernel loaded before any wait is pending
            torch.cuda.synchronize()
            graphs: dict[bool, torch.cuda.CUDAGraph] = {}
            for with_waits in (False, True):
                g = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                side.wait_stream(engine)
                with torch.cuda.graph(g, stream=side):
                    work(with_waits, side)
                graphs[with_waits] = g
            torch.cuda.synchronize()
            for kind in ("graph",) if quick else ("eager", "graph"):
                for gate_mode in ("none",) if quick else ("none", "open", "waits"):
                    if kind == "eager" and gate_mode == "waits":
                        continue
                    for loaded in (False, True):
                        held, spent, loads = [], [], []
                        for _ in range(REPS + 1):
                            step += 1
                            torch.cuda.synchronize()
                            req = f"l{step}"
                            ids: list[int] = []
                            t0 = time.perf_counter()
                            if loaded:
                                job = off.schedule_load(req, keys, dst)
                                assert job is not None
                                worker.submit(job)
                                ids = [job.job_id]
                            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]  # type: ignore[no-untyped-call]
                            ev[0].record(engine)
                            if gate_mode != "none":
                                gate.open(engine, ids)
                            ev[1].record(engine)
                            if kind == "eager":
                                work(False, engine)
                            else:
                                graphs[gate_mode == "waits"].replay()
                            ev[2].record(engine)
                            if loaded:
                                worker.wait(ids, 60)
                                loads.append((time.perf_counter() - t0) * 1e3)
                                results_ = worker.get_finished()
                                off.complete(results_)
                                if not all(r.ok for r in results_):
                                    raise RuntimeError(f"load failed: {results_}")
                            torch.cuda.synchronize()
                            held.append(ev[0].elapsed_time(ev[1]))
                            spent.append(ev[1].elapsed_time(ev[2]))
                        for t in tensors:
                            s_, d_ = (
                                (t[:blocks], t[pool - blocks :])
                                if block_dim == 0
                                else (t[:, :blocks], t[:, pool - blocks :])
                            )
                            if loaded and not torch.equal(s_, d_):
                                raise RuntimeError("loaded bytes differ from the stored ones")
                        row = {
                            "engine": engine_kind,
                            "work": kind,
                            "gate": gate_mode,
                            "load": loaded,
                            "held_ms": statistics.median(held[1:]),
                            "work_ms": statistics.median(spent[1:]),
                            "load_ms": statistics.median(loads[1:]) if loads else None,
                        }
                        results.append(row)
                        print(
                            f"{backend:16} engine {engine_kind:7} {kind:5} gate {gate_mode:5} "
                            f"load {loaded!s:5}"
                            f" held {row['held_ms']:7.3f} ms  work {row['work_ms']:7.3f} ms"
                            + (f"  load {row['load_ms']:7.3f} ms" if loads else "")
                        )
    local.close()
    probe_util.dump(
        out_path,
        "replay_hold_probe",
        model=MODEL,
        backend=backend,
        layout=LAYOUT,
        blocks=blocks,
        block_bytes=kv.slot_bytes,
        results=results,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

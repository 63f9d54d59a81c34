"""What a full graph's per-layer gate costs the device, and what of it the words' place explains
(issue 25: a full-graph restore's "GPU waited" read ~20 us on every layer, also where the load had
long landed, `bench e2e` Llama-3-8B docs, H200, 2026-11-27).

A GPU-bound loop of ``LAYERS`` short spin kernels on one stream, captured in a CUDA graph and
replayed (as a full-graph forward), with before each layer:

- ``none``: nothing;
- ``gate``: the native core's gate (``TransferWorker.layer_gate``: one captured batch of stream
  memory operations per layer, wait until the word is 1 then write 0, on words in pinned,
  device-mapped host memory), opened before each replay with no load (``open(stream, [])``);
- ``gate_timed``: the same between two captured timing events, as ``bench e2e`` times a full
  graph's waits (``wait{i}``);
- ``host_wait`` / ``device_wait``: a captured ``cuStreamWaitValue32`` on a word already satisfied,
  in pinned host memory / in device memory;
- ``host_wait_write`` / ``device_wait_write``: a wait until 1 then a write of 0 (two captured
  operations), words set to 1 before each replay (host: a store; device: a fill on the stream).

Each alone and beside a ``MIB`` MiB host-to-device copy started just before the replay (the link
busy for the whole loop), ``REPS`` times alternated. Reported: the replay's device time by CUDA
events and, per layer, what each adds against ``none`` in the same setting.

    python -m benchmarks.gate_graph_probe OUT.json   # CUDA only (needs cuda-bindings)
"""

from __future__ import annotations

import ctypes
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks import probe_util

LAYERS = 32
SLEEP_US = 40
MIB = 1024
REPS = 15
KINDS = (
    "none",
    "gate",
    "gate_timed",
    "host_wait",
    "device_wait",
    "host_wait_write",
    "device_wait_write",
)


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("gate_graph_probe.py: expected a CUDA device, got none")
    from cuda.bindings import driver as cu

    out_path = sys.argv[1]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    run = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    dev_a = torch.empty(MIB << 20, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(MIB << 20, dtype=torch.uint8, pin_memory=True)
    err, host = cu.cuMemHostAlloc(4 * LAYERS, cu.CU_MEMHOSTALLOC_DEVICEMAP)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, hptr = cu.cuMemHostGetDevicePointer(host, 0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    hwords = np.ctypeslib.as_array((ctypes.c_uint32 * LAYERS).from_address(int(host)))
    dwords = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
    host_addr = [cu.CUdeviceptr(int(hptr) + 4 * i) for i in range(LAYERS)]
    dev_addr = [cu.CUdeviceptr(dwords.data_ptr() + 4 * i) for i in range(LAYERS)]
    eq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    tensors, _dim, kv = probe_util.engine("llama3-8b", "page", 8)
    local = probe_util.offload(kv, 8, "staged")
    gate = local.worker.layer_gate(LAYERS)
    sleep: Any = torch.cuda._sleep
    cycles = int(probe_util.sleep_cycles_per_ms() * SLEEP_US / 1e3)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2 * LAYERS)]  # type: ignore[no-untyped-call]

    def before(kind: str) -> Callable[[Any, int], None] | None:
        if kind == "gate":
            return lambda s, i: gate.wait(run, i)
        if kind == "gate_timed":

            def timed(s: Any, i: int) -> None:
                marks[2 * i].record(run)
                gate.wait(run, i)
                marks[2 * i + 1].record(run)

            return timed
        if kind == "host_wait":
            return lambda s, i: cu.cuStreamWaitValue32(s, host_addr[i], 0, geq)
        if kind == "device_wait":
            return lambda s, i: cu.cuStreamWaitValue32(s, dev_addr[i], 0, geq)
        if kind in ("host_wait_write", "device_wait_write"):
            addr = host_addr if kind.startswith("host") else dev_addr

            def wait_write(s: Any, i: int) -> None:
                cu.cuStreamWaitValue32(s, addr[i], 1, eq)
                cu.cuStreamWriteValue32(s, addr[i], 0, 0)

            return wait_write
        return None

    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for kind in KINDS:
        arm(kind, gate, run, hwords, dwords)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        hook = before(kind)
        with torch.cuda.graph(g, stream=run):
            s = cu.CUstream(run.cuda_stream)
            for i in range(LAYERS):
                if hook is not None:
                    hook(s, i)
                sleep(cycles)
        graphs[kind] = g
        torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def replay(kind: str, beside: bool) -> float:
        torch.cuda.synchronize()
        arm(kind, gate, run, hwords, dwords)
        if beside:
            with torch.cuda.stream(side):
                dev_a.copy_(pinned, non_blocking=True)
        with torch.cuda.stream(run):
            start.record()
            graphs[kind].replay()
            end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end))

    for kind in KINDS:
        replay(kind, True)
    rows: list[dict[str, Any]] = []
    for beside in (False, True):
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        for r in range(REPS):
            for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
                times[kind].append(replay(kind, beside))
        base = statistics.median(times["none"])
        for kind in KINDS:
            ms = statistics.median(times[kind])
            row = {
                "before_layer": kind,
                "beside_copy": beside,
                "replay_ms": ms,
                "us_per_layer": (ms - base) / LAYERS * 1e3 if kind != "none" else 0.0,
            }
            rows.append(row)
            print(
                f"{'beside copy' if beside else 'alone':11} {kind:18} replay {ms:7.3f} ms  "
                f"{row['us_per_layer']:+6.2f} us per layer"
            )
    probe_util.dump(
        out_path,
        "gate_graph_probe",
        cuda_driver_api=cu.cuDriverGetVersion()[1],
        layers=LAYERS,
        sleep_us=SLEEP_US,
        mib=MIB,
        reps=REPS,
        results=rows,
    )
    del tensors
    local.close()
    return 0


def arm(kind: str, gate: Any, run: Any, hwords: np.ndarray, dwords: torch.Tensor) -> None:
    """Before a replay: the words its waits want (1) where the graph writes them back to 0."""
    if kind in ("gate", "gate_timed"):
        with torch.cuda.stream(run):
            gate.open(run, [])
    elif kind == "host_wait_write":
        hwords[:] = 1
    elif kind == "device_wait_write":
        with torch.cuda.stream(run):
            dwords.fill_(1)


if __name__ == "__main__":
    raise SystemExit(main())

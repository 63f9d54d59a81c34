"""What a full graph's per-layer gate costs the device, and what of it the words' place explains
(issue 25: a full-graph restore's "GPU waited" read ~20 us on every layer, also where the load had
long landed, `bench e2e` Llama-3-8B docs, H200, 2026-11-27).

A GPU-bound loop of ``LAYERS`` short spin kernels on one stream, captured in a CUDA graph and
replayed (as a full-graph forward), with before each layer:

- ``none``: nothing;
- ``gate``: the native core's gate (``TransferWorker.layer_gate``: since 2026-11-27 one captured
  wait until the word is 1, on a word in device memory; before, a wait and a write of 0 in one
  batch, on words in pinned host memory), opened before each replay with no load
  (``open(stream, [])``);
- ``gate_timed``: the same between two timing events recorded inside the graph (``external``
  events: timestamp nodes), as ``bench e2e`` times a full graph's waits (``wait{i}``; before
  this was a plain event, which a capture records as no timestamp);
- ``host_wait`` / ``device_wait``: a captured ``cuStreamWaitValue32`` on a word already satisfied,
  in pinned host memory / in device memory;
- ``host_wait_write`` / ``device_wait_write``: a wait until 1 then a write of 0 (two captured
  operations), words set to 1 before each replay (host: a store; device: a fill on the stream).

Each alone, beside a ``MIB`` MiB host-to-device copy started just before the replay (a plain
``copy_``: the link busy for the whole loop), and beside a restore of as many bytes through
kvoffload's public API (``schedule_load`` + ``submit`` on the same worker as the gate, its copies,
scatter kernels and flag writes; the gate is opened for no load, so no layer waits for it),
``REPS`` times alternated. Reported: the replay's device time by CUDA events and, per layer, what
each adds against ``none`` in the same setting.

    python -m benchmarks.gate_graph_probe OUT.json   # CUDA only (needs cuda-bindings)
    python -m benchmarks.gate_graph_probe OUT.json staged-ds1 alone,load   # a core variant
                                                                          # (core_flags), settings
    python -m benchmarks.gate_graph_probe OUT.json staged alone,copy,load gemm  # layers of GEMMs

A layer is a spin kernel of ``SLEEP_US`` on one program (``spin``, default) or a bf16 GEMM of
``GEMM`` x ``GEMM`` x ``GEMM`` on every SM (``gemm``, as a model's dense layers).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks import probe_util
from kvoffload.bench.e2e.runner.core_flags import configured

LAYERS = 32
SLEEP_US = 40
GEMM = 4096
MIB = 1024
REPS = 15
# beside nothing, a plain copy, a restore through kvoffload, and the plain copy in 32 MiB chunks
# each followed by a stream write of a word in pinned host memory / in device memory (as the
# restore writes its layer slices' flag words)
# each followed by ...; the plain copy's chunks alternating over two streams (as the restore's
# two DMA streams); the plain copy beside device-to-device copies on a third stream (HBM traffic
# and SM work, as the restore's scatter kernels); the same bytes as 16 pitched copies of 512 rows
# of 128 KiB out of 2 MiB host slots (as a restore's layer slices of a run of slots)
SETTINGS = (
    "alone",
    "copy",
    "load",
    "copy_host_writes",
    "copy_device_writes",
    "copy_two_streams",
    "copy_beside_d2d",
    "copy_pitched",
)
CHUNK_MIB = 32
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
    backend = sys.argv[2] if len(sys.argv) > 2 else "staged"
    settings = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else SETTINGS
    layer = sys.argv[4] if len(sys.argv) > 4 else "spin"
    if layer not in ("spin", "gemm"):
        raise SystemExit(f"expected a layer 'spin' or 'gemm', got {layer!r}")
    if "alone" not in settings or not set(settings) <= set(SETTINGS):
        raise SystemExit(f"expected settings from {SETTINGS} with 'alone', got {settings}")
    if backend != "staged":
        name, *flags = backend.split("-")
        configured(name, flags)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    run = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side2 = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    dev_a = torch.empty(MIB << 20, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(MIB << 20, dtype=torch.uint8, pin_memory=True)
    dev_b = torch.empty(MIB << 20, dtype=torch.uint8, device="cuda")
    err, host = cu.cuMemHostAlloc(4 * LAYERS, cu.CU_MEMHOSTALLOC_DEVICEMAP)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, hptr = cu.cuMemHostGetDevicePointer(host, 0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    hwords = np.ctypeslib.as_array((ctypes.c_uint32 * LAYERS).from_address(int(host)))
    dwords = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
    host_addr = [cu.CUdeviceptr(int(hptr) + 4 * i) for i in range(LAYERS)]
    dev_addr = [cu.CUdeviceptr(dwords.data_ptr() + 4 * i) for i in range(LAYERS)]
    # the side stream's own words (the graphs' are armed and reset by the graphs)
    err, side_host = cu.cuMemHostAlloc(4 * LAYERS, cu.CU_MEMHOSTALLOC_DEVICEMAP)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, side_hptr = cu.cuMemHostGetDevicePointer(side_host, 0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    side_dwords = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
    side_words = {
        "copy_host_writes": [cu.CUdeviceptr(int(side_hptr) + 4 * i) for i in range(LAYERS)],
        "copy_device_writes": [
            cu.CUdeviceptr(side_dwords.data_ptr() + 4 * i) for i in range(LAYERS)
        ],
    }
    eq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    tensors, keys, dest, offloads = probe_util.stored_llama(MIB << 20, (backend,))
    local = offloads[backend]
    gate = local.worker.layer_gate(LAYERS)
    sleep: Any = torch.cuda._sleep
    cycles = int(probe_util.sleep_cycles_per_ms() * SLEEP_US / 1e3)
    mats = [torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def compute() -> None:
        if layer == "spin":
            sleep(cycles)
        else:
            torch.mm(mats[0], mats[1], out=mats[2])

    with torch.cuda.stream(run):  # the GEMM's library state made before any capture on it
        compute()
    torch.cuda.synchronize()
    marks = [  # recorded inside the graph as timestamp nodes, as bench e2e times a full graph
        torch.cuda.Event(enable_timing=True, external=True)  # type: ignore[no-untyped-call]
        for _ in range(2 * LAYERS)
    ]

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
                compute()
        graphs[kind] = g
        torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    loads = iter(range(1 << 30))

    def replay(kind: str, beside: str) -> float:
        torch.cuda.synchronize()
        arm(kind, gate, run, hwords, dwords)
        job = None
        if beside == "copy":
            with torch.cuda.stream(side):
                dev_a.copy_(pinned, non_blocking=True)
        elif beside == "copy_two_streams":
            for k, at in enumerate(range(0, MIB << 20, CHUNK_MIB << 20)):
                with torch.cuda.stream(side if k % 2 == 0 else side2):
                    dev_a[at : at + (CHUNK_MIB << 20)].copy_(
                        pinned[at : at + (CHUNK_MIB << 20)], non_blocking=True
                    )
        elif beside == "copy_beside_d2d":
            with torch.cuda.stream(side):
                dev_a.copy_(pinned, non_blocking=True)
            with torch.cuda.stream(side2):
                for _ in range(4):
                    dev_b.copy_(dev_a, non_blocking=True)
        elif beside == "copy_pitched":
            rows, width = 512, (MIB << 20) // 512 // 16
            for k in range(16):
                m = cu.CUDA_MEMCPY2D()
                m.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
                m.srcHost = pinned.data_ptr() + k * width
                m.srcPitch = (MIB << 20) // 512
                m.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
                m.dstDevice = dev_a.data_ptr() + k * rows * width
                m.dstPitch = width
                m.WidthInBytes = width
                m.Height = rows
                (err,) = cu.cuMemcpy2DAsync(m, cu.CUstream(side.cuda_stream))
                assert err == cu.CUresult.CUDA_SUCCESS, err
        elif beside.startswith("copy_"):
            words = side_words[beside]
            with torch.cuda.stream(side):
                for k, at in enumerate(range(0, MIB << 20, CHUNK_MIB << 20)):
                    dev_a[at : at + (CHUNK_MIB << 20)].copy_(
                        pinned[at : at + (CHUNK_MIB << 20)], non_blocking=True
                    )
                    cu.cuStreamWriteValue32(cu.CUstream(side.cuda_stream), words[k % LAYERS], 0, 0)
        elif beside == "load":
            job = local.offloader.schedule_load(f"load{next(loads)}", keys, dest)
            local.worker.submit(job)
        with torch.cuda.stream(run):
            start.record()
            graphs[kind].replay()
            end.record()
        torch.cuda.synchronize()
        if job is not None:
            probe_util.finish(local, job.job_id, "the load beside")
        return float(start.elapsed_time(end))

    for kind in KINDS:
        for beside in settings:
            replay(kind, beside)
    rows: list[dict[str, Any]] = []
    for beside in settings:
        medians = probe_util.rotated_medians(KINDS, REPS, functools.partial(replay, beside=beside))
        added = {k: (ms - medians["none"]) / LAYERS * 1e3 for k, ms in medians.items()}
        for kind in KINDS:
            rows.append(
                {
                    "before_layer": kind,
                    "beside": beside,
                    "replay_ms": medians[kind],
                    "us_per_layer": added[kind],
                }
            )
            print(
                f"{beside:5} {kind:18} replay {medians[kind]:7.3f} ms  "
                f"{added[kind]:+6.2f} us per layer"
            )
    probe_util.dump(
        out_path,
        "gate_graph_probe",
        backend=backend,
        cuda_driver_api=cu.cuDriverGetVersion()[1],
        layers=LAYERS,
        sleep_us=SLEEP_US,
        layer=layer,
        gemm=GEMM,
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

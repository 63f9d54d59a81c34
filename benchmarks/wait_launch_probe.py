"""Do the per-layer GPU waits slow the engine's launches after them? (issue 25)

``bench e2e``'s eager restored forward launches ~1 ms slower than ``gpu_all``'s, of which the
per-layer waits' own host time is ~0.1-0.4 ms, and a load beside the loop without waits costs
what a plain copy costs (``launch_beside_copy_probe``). This times a launch-bound loop
(``KERNELS`` tiny kernels, a wait every ``KERNELS / LAYERS`` of them, as a forward waits once per
layer) alone and with waits of each kind, alternating, ``REPS`` times:

- ``pycall``: a Python no-op per layer (the loop's own cost of a call);
- ``kvo_nowait`` / ``kvo_wait``: kvoffload's load of ``MIB`` MiB submitted just before the loop,
  without and with ``TransferWorker.layer_waiter`` per layer (the real path);
- ``kvo_landed``: the same waits for a load that landed before the loop (no driver call);
- ``value_done`` / ``value_paced``: ``cuStreamWaitValue32`` per layer on a host-mapped word,
  satisfied already / written by a side stream paced behind sleeps (the GPU barely waits);
- ``event_done`` / ``event_paced``: ``cuStreamWaitEvent`` per layer, on an event recorded
  already / recorded by the side stream paced the same way;
- what the load without waits is made of: ``htod_torch`` (torch's copy of the same bytes from
  pinned memory on a side stream: the link's traffic alone), ``dtod_torch`` (a device-to-device
  copy: the GPU busy, no PCIe), ``kvo_dma`` (the load through backend ``dma``: copy engines only,
  no kernels of ours), ``kvo_held`` (the load ordered behind a GPU sleep: in flight, our threads
  watching it, no byte moving).

Reported per case: the loop's host time against the loop alone (median of ``REPS`` alternated
pairs), the host time inside the per-layer calls, and what is left (loop - alone - calls).

    python -m benchmarks.wait_launch_probe OUT.json   # CUDA only (needs cuda-bindings)
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks import probe_util

KERNELS = 2048
LAYERS = 32
MIB = 512
REPS = 21


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("wait_launch_probe.py: expected a CUDA device, got none")
    from cuda.bindings import driver as cu

    out_path = sys.argv[1]
    per = KERNELS // LAYERS
    x = torch.zeros(256, device="cuda")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side_h = cu.CUstream(side.cuda_stream)
    _tensors, keys, dst, locals_ = probe_util.stored_llama(MIB << 20)
    dev_a = torch.empty(MIB << 20, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(MIB << 20, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(MIB << 20, dtype=torch.uint8, pin_memory=True)
    err, host = cu.cuMemHostAlloc(4 * LAYERS, cu.CU_MEMHOSTALLOC_DEVICEMAP)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    words = np.ctypeslib.as_array((ctypes.c_uint32 * LAYERS).from_address(int(host)))
    words[:] = 0
    err, dptr = cu.cuMemHostGetDevicePointer(host, 0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    addr = [cu.CUdeviceptr(int(dptr) + 4 * layer) for layer in range(LAYERS)]
    events = [cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1] for _ in range(LAYERS)]
    seq = [0]
    sleep: Any = torch.cuda._sleep

    def eager(wait: Callable[[int], None] | None) -> tuple[float, float]:
        """The loop's host time and the time inside ``wait`` calls (ms)."""
        inside = 0.0
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            if wait is not None:
                tw = time.perf_counter()
                wait(layer)
                inside += time.perf_counter() - tw
            for _ in range(per):
                x.add_(1)
        return (time.perf_counter() - t0) * 1e3, inside * 1e3

    torch.cuda.synchronize()
    alone_once = eager(None)[0]
    cycles_per_ms = probe_util.sleep_cycles_per_ms()
    pace = int(cycles_per_ms * alone_once / LAYERS * 0.8)  # lands ahead of the GPU's need
    spin = int(cycles_per_ms * alone_once * 2)  # longer than the loop

    def stream_now() -> Any:
        return cu.CUstream(torch.cuda.current_stream().cuda_stream)

    def noop(layer: int) -> None:
        return None

    def kvo(
        wait: bool, landed: bool = False, backend: str = "staged", held: bool = False
    ) -> Callable[[int], None] | None:
        seq[0] += 1
        off, worker = locals_[backend].offloader, locals_[backend].worker
        job = off.schedule_load(f"l{seq[0]}", keys, dst)
        assert job is not None
        if held:  # ordered after the sleep: the submit orders the load after the current stream
            with torch.cuda.stream(side):
                sleep(spin)
                worker.submit(job)
        else:
            worker.submit(job)
        done.append((backend, job))
        if landed:
            worker.wait([job.job_id], 60)
        return worker.layer_waiter(job.job_id) if wait else None

    def copy(dst_t: torch.Tensor, src_t: torch.Tensor) -> None:
        with torch.cuda.stream(side):
            dst_t.copy_(src_t, non_blocking=True)

    def value(paced: bool) -> Callable[[int], None]:
        seq[0] += 1
        target = seq[0] & 0x7FFFFFFF
        if not paced:
            words[:] = target
        else:
            for layer in range(LAYERS):
                with torch.cuda.stream(side):
                    sleep(pace)
                cu.cuStreamWriteValue32(side_h, addr[layer], target, 0)
        s = stream_now()

        def wait(layer: int) -> None:
            cu.cuStreamWaitValue32(s, addr[layer], target, 0)  # GEQ

        return wait

    def event(paced: bool) -> Callable[[int], None]:
        for layer in range(LAYERS):
            if paced:
                with torch.cuda.stream(side):
                    sleep(pace)
            cu.cuEventRecord(events[layer], side_h)
        if not paced:
            torch.cuda.synchronize()
        s = stream_now()

        def wait(layer: int) -> None:
            cu.cuStreamWaitEvent(s, events[layer], 0)

        return wait

    done: list[Any] = []
    cases: dict[str, Callable[[], Callable[[int], None] | None]] = {
        "pycall": lambda: noop,
        "kvo_nowait": lambda: kvo(False),
        "kvo_wait": lambda: kvo(True),
        "kvo_landed": lambda: kvo(True, landed=True),
        "value_done": lambda: value(False),
        "value_paced": lambda: value(True),
        "event_done": lambda: event(False),
        "event_paced": lambda: event(True),
        "htod_torch": lambda: copy(dev_a, pinned),
        "dtod_torch": lambda: copy(dev_b, dev_a),
        "kvo_dma": lambda: kvo(False, backend="dma"),
        "kvo_held": lambda: kvo(False, held=True),
    }

    def settle() -> None:
        torch.cuda.synchronize()
        for backend, job in done:
            probe_util.finish(locals_[backend], job.job_id, "load")
        done.clear()

    for make in cases.values():  # every path once
        eager(make())
        settle()
    rows: list[dict[str, Any]] = []
    for name, make in cases.items():
        alone, beside, inside = [], [], []
        for _ in range(REPS):
            settle()
            alone.append(eager(None)[0])
            settle()
            wait = make()
            loop_ms, in_ms = eager(wait)
            beside.append(loop_ms)
            inside.append(in_ms)
        settle()
        a, b, i = statistics.median(alone), statistics.median(beside), statistics.median(inside)
        row = {
            "case": name,
            "alone_ms": a,
            "with_ms": b,
            "ratio": b / a,
            "calls_ms": i,
            "rest_ms": b - a - i,
            "us_per_call": i / LAYERS * 1e3,
        }
        rows.append(row)
        print(
            f"{name:12} alone {a:7.3f} ms  with {b:7.3f} ms  x{b / a:.3f}  calls {i:.3f} ms "
            f"({row['us_per_call']:.1f} us each)  rest {row['rest_ms']:+.3f} ms"
        )
    for each in locals_.values():
        each.close()
    probe_util.dump(
        out_path,
        "wait_launch_probe",
        kernels=KERNELS,
        layers=LAYERS,
        mib=MIB,
        reps=REPS,
        cuda_driver_api=cu.cuDriverGetVersion()[1],
        results=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

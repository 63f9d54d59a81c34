"""What does a GPU-side layer wait cost the device, by where its flag word lives? (issue 25)

The native core's layer flag words are in pinned, device-mapped host memory (the host reads
them without a driver call), so each ``cuStreamWaitValue32`` an engine's stream runs is a read
across PCIe, while a restore's copy fills the host-to-device direction. This times a GPU-bound
loop on one stream (``LAYERS`` sleeps of ``SLEEP_US`` each, a wait before each, as a forward's
layers wait before attention) by CUDA events, with the waits' words (already satisfied):

- ``none``: no waits;
- ``host_word``: in pinned, device-mapped host memory (what the core does);
- ``device_word``: in device memory;
- ``event``: ``cuStreamWaitEvent`` on an event another stream recorded already;

each alone and beside a ``MIB`` MiB host-to-device copy started just before it (a plain
``copy_`` on a side stream, the link saturated for the whole loop), ``REPS`` times alternated.
Reported: the loop's device time, and per wait, the device time added against ``none`` in the
same setting.

    python -m benchmarks.wait_latency_probe OUT.json   # CUDA only (needs cuda-bindings)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import probe_util

LAYERS = 32
SLEEP_US = 40
MIB = 1024
REPS = 15


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("wait_latency_probe.py: expected a CUDA device, got none")
    from cuda.bindings import driver as cu

    out_path = sys.argv[1]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    dev_a = torch.empty(MIB << 20, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(MIB << 20, dtype=torch.uint8, pin_memory=True)
    err, host = cu.cuMemHostAlloc(4 * LAYERS, cu.CU_MEMHOSTALLOC_DEVICEMAP)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, hptr = cu.cuMemHostGetDevicePointer(host, 0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    dwords = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
    host_addr = [cu.CUdeviceptr(int(hptr) + 4 * i) for i in range(LAYERS)]
    dev_addr = [cu.CUdeviceptr(dwords.data_ptr() + 4 * i) for i in range(LAYERS)]
    event = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]
    cu.cuEventRecord(event, cu.CUstream(side.cuda_stream))
    torch.cuda.synchronize()
    sleep: Any = torch.cuda._sleep
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    cycles = int(probe_util.sleep_cycles_per_ms() * SLEEP_US / 1e3)

    def waits(kind: str) -> Callable[[Any, int], None] | None:
        if kind == "host_word":
            return lambda s, i: cu.cuStreamWaitValue32(s, host_addr[i], 0, 0)
        if kind == "device_word":
            return lambda s, i: cu.cuStreamWaitValue32(s, dev_addr[i], 0, 0)
        if kind == "event":
            return lambda s, i: cu.cuStreamWaitEvent(s, event, 0)
        return None

    def loop(kind: str, beside: bool) -> float:
        torch.cuda.synchronize()
        wait = waits(kind)
        s = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        if beside:
            with torch.cuda.stream(side):
                dev_a.copy_(pinned, non_blocking=True)
        start.record()
        for i in range(LAYERS):
            if wait is not None:
                wait(s, i)
            sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end))

    kinds = ("none", "host_word", "device_word", "event")
    for kind in kinds:
        loop(kind, True)
    rows: list[dict[str, Any]] = []
    for beside in (False, True):
        medians = probe_util.rotated_medians(kinds, REPS, functools.partial(loop, beside=beside))
        base = medians["none"]
        for kind in kinds:
            ms = medians[kind]
            row = {
                "wait": kind,
                "beside_copy": beside,
                "loop_ms": ms,
                "us_per_wait": (ms - base) / LAYERS * 1e3 if kind != "none" else 0.0,
            }
            rows.append(row)
            print(
                f"{'beside copy' if beside else 'alone':11} {kind:12} loop {ms:7.3f} ms  "
                f"{row['us_per_wait']:+6.2f} us per wait"
            )
    probe_util.dump(
        out_path,
        "wait_latency_probe",
        cuda_driver_api=cu.cuDriverGetVersion()[1],
        layers=LAYERS,
        sleep_us=SLEEP_US,
        mib=MIB,
        reps=REPS,
        results=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

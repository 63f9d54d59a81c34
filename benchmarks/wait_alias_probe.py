"""Does a stream blocked in a GPU-side wait hold up another stream's work? (issue 25)

In ``bench e2e --graph full`` a restored request's forward began only once its whole load had
landed: the engine's stream waited ~10 ms in the ``gate_open`` section, where the only thing
enqueued on it is an event record, while the gate's opener (a stream of ours) sat in
``cuStreamWaitValue32`` waits, one per layer, until each layer landed. Streams share a few
hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default); a stream waiting on a flag
word may block every stream mapped to its queue. This probe blocks ``waiters`` torch streams on
a host flag word nobody writes for ``HOLD_MS``, then times when a tiny kernel and an event on the
engine's stream are done (host-observed, polling ``query``), with the engine on the legacy
default stream and on a torch stream; then writes the flag. Run it under several
``CUDA_DEVICE_MAX_CONNECTIONS`` values (the variable is read when CUDA starts).

    CUDA_DEVICE_MAX_CONNECTIONS=8 python benchmarks/wait_alias_probe.py OUT.json   # CUDA only
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

HOLD_MS = 20.0
WAITERS = (0, 1, 2, 4, 8, 16, 40)
REPS = 5


def _check(result: tuple[Any, ...]) -> Any:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return result[1] if len(result) > 1 else None


def main() -> int:
    if len(sys.argv) != 2:
        raise SystemExit("usage: wait_alias_probe.py OUT.json")
    if not torch.cuda.is_available():
        raise SystemExit("wait_alias_probe.py: expected a CUDA device, got none")
    from cuda.bindings import driver as cu

    torch.cuda.init()  # type: ignore[no-untyped-call]
    x = torch.zeros(1 << 10, device="cuda")
    torch.cuda.synchronize()
    host = _check(cu.cuMemHostAlloc(4096, cu.CU_MEMHOSTALLOC_DEVICEMAP))
    dptr = _check(cu.cuMemHostGetDevicePointer(host, 0))
    word = ctypes.c_uint32.from_address(int(host))
    GEQ = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    # streams of their own (cuStreamCreate, non-blocking): torch.cuda.Stream() hands out a pool
    # of streams round robin, so two of its streams may be one CUDA stream
    pool = len({torch.cuda.Stream().cuda_stream for _ in range(64)})  # type: ignore[no-untyped-call]
    print(f"torch.cuda.Stream(): {pool} distinct CUDA streams in 64 calls")

    def new_stream() -> torch.cuda.ExternalStream:
        handle = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        return torch.cuda.ExternalStream(int(handle))  # type: ignore[no-untyped-call]

    waiting = [new_stream() for _ in range(max(WAITERS))]
    results = []
    seq = 0
    for engine_kind in ("default", "own_stream"):
        engine = torch.cuda.default_stream() if engine_kind == "default" else new_stream()
        for waiters in WAITERS:
            done_ms = []
            for _ in range(REPS):
                seq += 1
                for s in waiting[:waiters]:
                    _check(cu.cuStreamWaitValue32(s.cuda_stream, dptr, seq, GEQ))
                    with torch.cuda.stream(s):
                        x.add_(0)  # work behind the wait, as the gate's writes are
                t0 = time.perf_counter()
                with torch.cuda.stream(engine):
                    x.mul_(1)
                    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ev.record()
                done = None
                while time.perf_counter() - t0 < HOLD_MS / 1e3:
                    if ev.query():  # type: ignore[no-untyped-call]
                        done = (time.perf_counter() - t0) * 1e3
                        break
                word.value = seq  # release the waiters
                ev.synchronize()
                if done is None:
                    done = (time.perf_counter() - t0) * 1e3
                torch.cuda.synchronize()
                done_ms.append(done)
            row = {
                "engine": engine_kind,
                "waiters": waiters,
                "engine_done_ms_median": statistics.median(done_ms),
                "engine_done_ms": done_ms,
                "held_past_release": sum(d >= HOLD_MS for d in done_ms),
            }
            results.append(row)
            print(
                f"engine {engine_kind:12s} waiters {waiters:3d}: engine's kernel done after "
                f"{row['engine_done_ms_median']:.3f} ms (median of {REPS}; "
                f"{row['held_past_release']} held until the flag was written at {HOLD_MS} ms)"
            )
    out = {
        "benchmark": "wait_alias_probe",
        "device": torch.cuda.get_device_name(),
        "driver": torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None,
        "date": time.strftime("%Y-%m-%d"),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "hold_ms": HOLD_MS,
        "torch_stream_pool_distinct_of_64": pool,
        "results": results,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    _check(cu.cuMemFreeHost(host))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

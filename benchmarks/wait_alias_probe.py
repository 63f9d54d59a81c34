"""Does a stream blocked in a GPU-side wait hold up the engine's stream? (issue 25)

In ``bench e2e --graph full`` a restored request's graph replay began only once its whole load
had landed: ~10.5 ms of device time on the engine's stream inside ``gate_open``, where the
engine's stream gets one event record, while the gate's opener (a stream of the native core)
sat in ``cuStreamWaitValue32`` waits on flag words in host memory, one per layer, until each
layer landed. An opener of its own (``gate_stream_bisect.py own``) changed nothing. This probe
blocks ``n`` streams of its own for ``HOLD_MS`` one way, then times when a tiny kernel and an
event on the engine's stream are done (host-observed, polling ``query``):

- ``none``: nothing blocked (the baseline);
- ``busy``: one stream runs a one-block spin kernel (``torch.cuda._sleep``) for the hold, nothing
  waits (a busy neighbour, not a blocked one);
- ``host_flag``: ``n`` streams wait (``cuStreamWaitValue32``, GEQ) on a word in pinned host
  memory (as the core's flag words), written by the host after the hold;
- ``dev_flag``: the same on a word in device memory, written (``cuStreamWriteValue32``) by a
  stream that first spins for the hold;
- ``event``: ``n`` streams wait (``cuStreamWaitEvent``) on an event recorded after that spin.

The engine runs on torch's default (legacy) stream and on a non-blocking stream of its own.

``per_stream`` rows then take ``PER_STREAM`` more streams one at a time, in creation order, as
the only waiter (``host_flag``) or the only busy neighbour (``busy``): the streams that hold the
engine are those sharing its hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default), and
a busy one on the same queue shows whether a running kernel holds it as a pending wait does.
Every kernel is run once before any wait is pending: a kernel's first launch loads its module
lazily, which waits for the device to go idle and would hang behind a pending wait.

    python benchmarks/wait_alias_probe.py OUT.json   # CUDA only
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

from benchmarks import probe_util

HOLD_MS = 20.0
CASES = ("none", "busy", "host_flag", "dev_flag", "event")
WAITERS = (1, 8)
REPS = 5
PER_STREAM = 16


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

    geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    sleep: Any = torch.cuda._sleep  # a one-block spin kernel of so many clock cycles
    x = torch.zeros(1 << 10, device="cuda")
    dev_word = torch.zeros(1, dtype=torch.int32, device="cuda")
    host = _check(cu.cuMemHostAlloc(4096, cu.CU_MEMHOSTALLOC_DEVICEMAP))
    host_dptr = _check(cu.cuMemHostGetDevicePointer(host, 0))
    host_word = ctypes.c_uint32.from_address(int(host))

    def new_stream() -> Any:
        handle = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        return torch.cuda.ExternalStream(int(handle))  # type: ignore[no-untyped-call]

    # every kernel once (lazy module loading), and the spin kernel's clock rate
    x.add_(0)
    x.mul_(1)
    hold_cycles = int(probe_util.sleep_cycles_per_ms() * HOLD_MS)

    def engine_done(engine: Any, seq: int, release: bool) -> float:
        """ms until a kernel and an event on ``engine`` are done (host-observed); the host flag
        word takes ``seq`` after the hold (before that only if ``release``)."""
        t0 = time.perf_counter()
        with torch.cuda.stream(engine):
            x.mul_(1)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record()
        done = None
        while time.perf_counter() - t0 < 2 * HOLD_MS / 1e3:
            if ev.query():  # type: ignore[no-untyped-call]
                done = (time.perf_counter() - t0) * 1e3
                break
            if release and time.perf_counter() - t0 >= HOLD_MS / 1e3:
                host_word.value = seq
        host_word.value = seq
        torch.cuda.synchronize()
        return done if done is not None else (time.perf_counter() - t0) * 1e3

    waiting = [new_stream() for _ in range(max(WAITERS))]
    sleeper = new_stream()
    results = []
    seq = 0
    for engine_kind in ("default", "own_stream"):
        engine = torch.cuda.default_stream() if engine_kind == "default" else new_stream()
        for case in CASES:
            for n in (0,) if case in ("none", "busy") else WAITERS:
                done_ms = []
                for _ in range(REPS):
                    seq += 1
                    if case in ("busy", "dev_flag", "event"):
                        with torch.cuda.stream(sleeper):
                            sleep(hold_cycles)
                    if case == "dev_flag":
                        _check(
                            cu.cuStreamWriteValue32(
                                sleeper.cuda_stream, dev_word.data_ptr(), seq, 0
                            )
                        )
                    ev_release = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ev_release.record(sleeper)
                    for s in waiting[:n]:
                        if case == "host_flag":
                            _check(cu.cuStreamWaitValue32(s.cuda_stream, host_dptr, seq, geq))
                        elif case == "dev_flag":
                            _check(
                                cu.cuStreamWaitValue32(s.cuda_stream, dev_word.data_ptr(), seq, geq)
                            )
                        else:
                            s.wait_event(ev_release)
                        with torch.cuda.stream(s):
                            x.add_(0)  # work behind the wait, as the gate's writes are
                    done_ms.append(engine_done(engine, seq, case == "host_flag"))
                row = {
                    "engine": engine_kind,
                    "case": case,
                    "waiters": n,
                    "engine_done_ms_median": statistics.median(done_ms),
                    "engine_done_ms": done_ms,
                }
                results.append(row)
                print(
                    f"engine {engine_kind:10s} {case:9s} waiters {n}: the engine's kernel done "
                    f"after {row['engine_done_ms_median']:.3f} ms (median of {REPS}; hold "
                    f"{HOLD_MS} ms)"
                )
    extra = [new_stream() for _ in range(PER_STREAM)]
    per_stream = []
    for engine_kind in ("default", "own_stream"):
        engine = torch.cuda.default_stream() if engine_kind == "default" else new_stream()
        for case in ("host_flag", "busy"):
            held = []
            for s in extra:
                done_ms = []
                for _ in range(3):
                    seq += 1
                    if case == "busy":
                        with torch.cuda.stream(s):
                            sleep(hold_cycles)
                    else:
                        _check(cu.cuStreamWaitValue32(s.cuda_stream, host_dptr, seq, geq))
                        with torch.cuda.stream(s):
                            x.add_(0)
                    done_ms.append(engine_done(engine, seq, True))
                held.append(round(statistics.median(done_ms), 3))
            per_stream.append({"engine": engine_kind, "case": case, "engine_done_ms": held})
            print(f"per stream: engine {engine_kind:10s} {case:9s} done ms by stream: {held}")
    out = {
        "benchmark": "wait_alias_probe",
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "hold_ms": HOLD_MS,
        "results": results,
        "per_stream": per_stream,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    _check(cu.cuMemFreeHost(host))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

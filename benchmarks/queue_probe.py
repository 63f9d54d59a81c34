"""Does one stream's unmet wait hold other streams' later work? (issue 25, nineteenth round)

The nineteenth round enqueued a load's layer waits on the engine's stream before kvoffload's
thread had enqueued the load's copies on its own streams, and ``bench e2e`` hung in 3 of 7 runs
with a job fully enqueued that never finished (docs/transfer.md, "nineteenth round"). The
explanation held there: streams share the device's hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``,
8 by default), and a wait at the head of one holds the work queued behind it. This probe tests it.
Per connection count (a child process each, the variable set before CUDA starts) and per number
of other streams S and per kind of work: stream 0 waits on a word in host memory that is 0; then
each of S other streams gets a 1 MiB host-to-device copy (``copy``) or a small kernel
(``kernel``, loaded and run once on every stream before the wait, so no module loads while it is
pending) and an event. After ``HOLD_S`` the child counts the events not yet reached (work held
behind the wait), then writes the word on the host (the wait passes) and synchronizes; a child
that does not end within ``CHILD_TIMEOUT_S`` counts as hung. Measured on an H100 (2026-11-28,
docs/transfer.md, "twentieth round"): no copy held at 1, 8 or 32 connections; every kernel held
at 1, none at 8 or 32.

    python -m benchmarks.queue_probe OUT.json   # CUDA only (needs cuda-bindings)
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import subprocess
import sys
import time
from typing import Any

CONNECTIONS = (1, 8, 32)
OTHER_STREAMS = (4, 16, 31)
KINDS = ("copy", "kernel")
HOLD_S = 0.5
CHILD_TIMEOUT_S = 60


def child(others: int, kind: str) -> dict[str, Any]:
    """One measurement in this process (its CUDA_DEVICE_MAX_CONNECTIONS set by the parent)."""
    import torch
    from cuda.bindings import driver as cu

    torch.empty(1, device="cuda")  # the primary context, current in this thread for cu* calls
    err, host = cu.cuMemHostAlloc(4, cu.CU_MEMHOSTALLOC_DEVICEMAP)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemHostAlloc: expected success, got {err}")
    word = ctypes.c_uint32.from_address(int(host))
    word.value = 0
    err, dptr = cu.cuMemHostGetDevicePointer(host, 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemHostGetDevicePointer: expected success, got {err}")
    waiter = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    streams = [torch.cuda.Stream() for _ in range(others)]  # type: ignore[no-untyped-call]
    src = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    dsts = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in streams]
    for stream, dst in zip(streams, dsts, strict=True):  # the kernel loaded before the wait
        with torch.cuda.stream(stream):
            dst.add_(1)
    torch.cuda.synchronize()
    (err,) = cu.cuStreamWaitValue32(
        cu.CUstream(waiter.cuda_stream),
        cu.CUdeviceptr(int(dptr)),
        1,
        cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
    )
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamWaitValue32: expected success, got {err}")
    events = []
    for stream, dst in zip(streams, dsts, strict=True):
        with torch.cuda.stream(stream):
            if kind == "copy":
                dst.copy_(src, non_blocking=True)
            else:
                dst.add_(1)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            events.append(event)
    time.sleep(HOLD_S)
    held = len([e for e in events if not e.query()])  # type: ignore[no-untyped-call]
    word.value = 1  # the wait passes: everything held behind it goes on
    torch.cuda.synchronize()
    cu.cuMemFreeHost(host)
    return {"other_streams": others, "kind": kind, "held": held}


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]), sys.argv[3])))
        return 0
    if len(sys.argv) != 2:
        raise SystemExit(f"queue_probe.py: expected one argument, OUT.json, got {sys.argv[1:]}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("queue_probe.py: expected a CUDA device, got none")
    from benchmarks import probe_util

    rows: list[dict[str, Any]] = []
    for connections in CONNECTIONS:
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS=str(connections))
        for others, kind in itertools.product(OTHER_STREAMS, KINDS):
            argv = [sys.executable, "-m", "benchmarks.queue_probe", "--child", str(others), kind]
            row: dict[str, Any] = {
                "connections": connections,
                "other_streams": others,
                "kind": kind,
            }
            try:
                done = subprocess.run(
                    argv, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
                )
            except subprocess.TimeoutExpired:
                row["hung"] = True
            else:
                if done.returncode != 0:
                    raise SystemExit(f"queue_probe.py: a child failed:\n{done.stderr}")
                row.update(json.loads(done.stdout.strip().splitlines()[-1]), hung=False)
            rows.append(row)
            print(
                f"connections {connections:2} other streams {others:2} {kind:6}: "
                + ("hung" if row["hung"] else f"{row['held']} of {others} held behind the wait")
            )
    probe_util.dump(sys.argv[1], "queue_probe", hold_s=HOLD_S, results=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does a stream of ours, blocked on the GPU, hold up the engine's stream? (issue 25)

CUDA multiplexes streams onto ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (default 8); two
streams on one queue are ordered as one, so a wait at the head of one stream (a stream memory
wait on a flag, or a copy ordered after another stream's work) also stops the other stream's
work queued behind it. For each of ``STREAMS`` torch streams created after the engine's, in
turn: the stream waits (``cuStreamWaitValue32``) on a flag in pinned host memory that nothing
has written, the engine's stream (the legacy default stream, then a torch stream, then a high
priority torch stream of ours) launches one small kernel, and the probe looks whether that
kernel finished within ``WINDOW_S``; then the host writes the flag (so nothing can hang) and
everything drains. Prints and writes JSON: per engine stream, which of our streams blocked it.

    python benchmarks/connection_probe.py OUT.json    # CUDA only; run it also with
    CUDA_DEVICE_MAX_CONNECTIONS=32 python benchmarks/connection_probe.py OUT32.json
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from typing import Any

import torch

STREAMS = 16
WINDOW_S = 0.02
GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ


def main() -> int:
    out = sys.argv[1]
    cuda = ctypes.CDLL("libcuda.so.1")
    wait = cuda.cuStreamWaitValue32_v2
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    x = torch.ones(1 << 16, device="cuda")
    torch.cuda.synchronize()
    engines: dict[str, Any] = {
        "legacy default": torch.cuda.default_stream(),
        "torch stream": torch.cuda.Stream(),
    }
    ours = [torch.cuda.Stream() for _ in range(STREAMS)]
    ours_high = [torch.cuda.Stream(priority=-1) for _ in range(4)]
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    value = 0
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "connections_env": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "date": time.strftime("%Y-%m-%d"),
        "window_s": WINDOW_S,
        "engines": {},
    }
    for ename, engine in engines.items():
        rows = []
        for label, group in (("low", ours), ("high", ours_high)):
            for j, s in enumerate(group):
                value += 1
                rc = wait(s.cuda_stream, flag.data_ptr(), value, GEQ)
                if rc != 0:
                    raise RuntimeError(f"cuStreamWaitValue32 failed: {rc}")
                with torch.cuda.stream(engine):
                    y = x * 2
                    done = torch.cuda.Event()
                    done.record()
                t0 = time.perf_counter()
                while not done.query() and time.perf_counter() - t0 < WINDOW_S:
                    time.sleep(50e-6)
                blocked = not done.query()
                flag[0] = value  # release: nothing waits past this
                torch.cuda.synchronize()
                rows.append({"priority": label, "stream": j, "blocked": blocked})
                del y
        result["engines"][ename] = {
            "blocked_by": [f"{r['priority']}{r['stream']}" for r in rows if r["blocked"]],
            "rows": rows,
        }
        print(ename, "blocked by", result["engines"][ename]["blocked_by"])
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

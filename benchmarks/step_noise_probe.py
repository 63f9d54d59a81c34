"""Why a launch-bound step's host time differs from one process to the next (GPU).

In the twenty-third round `bench transfer`'s baseline step (200 tiny kernels launched from Python,
then a sync; nothing of kvoffload's) read 1353-1500 us in some processes and 1946-2185 us in
others on one H200 host, whichever tree ran (docs/transfer.md, "twenty-third round"). This probe
starts fresh processes, one at a time, each timing the same step: unpinned, and pinned to one CPU
(``os.sched_setaffinity`` before torch starts, so CUDA's and torch's threads inherit it), over
CPUs on either side of the machine. Each process reports the median step and the CPUs its thread
was seen on; the machine's CPU siblings are recorded beside. Whether the two states follow the
CPU a process lands on says whether a benchmark (or an engine) should pin its thread.

    python -m benchmarks.step_noise_probe OUT.json
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvoffload.bench.common import machine_info

KERNELS = 200  # per step, as bench transfer's host-time step
STEPS = 40  # per window
WINDOWS = 6
WARM = 50


def child(cpu: int | None) -> dict[str, Any]:
    """One process's steps (``cpu``: pinned there first)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    import torch

    libc = ctypes.CDLL(None)
    x = torch.zeros(1024, device="cuda")

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(KERNELS):
            x.add_(1.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(WARM):
        step()
    windows, seen = [], set()
    for _ in range(WINDOWS):
        seen.add(int(libc.sched_getcpu()))
        windows.append(statistics.median(step() for _ in range(STEPS)) * 1e6)
    return {
        "pinned": cpu,
        "step_us": statistics.median(windows),
        "windows_us": windows,
        "cpus_seen": sorted(seen),
        "affinity": len(os.sched_getaffinity(0)),
    }


def siblings() -> dict[str, str]:
    out = {}
    for d in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*")):
        f = d / "topology" / "thread_siblings_list"
        if f.exists():
            out[d.name] = f.read_text().strip()
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        arg = sys.argv[2]
        print(json.dumps(child(None if arg == "free" else int(arg))))
        return 0
    if len(sys.argv) != 2:
        raise SystemExit(
            f"step_noise_probe.py: expected one argument, OUT.json, got {sys.argv[1:]}"
        )
    import torch

    if not torch.cuda.is_available():
        print("step_noise_probe: CUDA only")
        return 0
    device = torch.cuda.get_device_name()
    cpus = sorted(os.sched_getaffinity(0))
    picks = [cpus[0], cpus[len(cpus) // 2], cpus[-1]]
    plan: list[str] = []
    for pick in picks:  # free and pinned alternating: neither always first
        plan += ["free", str(pick), "free", str(pick)]
    rows = []
    for arg in plan:
        run = subprocess.run(
            [sys.executable, "-m", "benchmarks.step_noise_probe", "--child", arg],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if run.returncode != 0:
            raise RuntimeError(f"child {arg} failed: {run.stderr[-2000:]}")
        row = json.loads(run.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{'pinned ' + arg if arg != 'free' else 'free':10} step {row['step_us']:8.1f} us"
            f"  windows {[round(w) for w in row['windows_us']]}  on cpus {row['cpus_seen']}"
        )
    with open(sys.argv[1], "w") as f:
        json.dump(
            {
                "benchmark": "step_noise_probe",
                "device": device,
                **machine_info(),
                "kernels": KERNELS,
                "siblings": siblings(),
                "rows": rows,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Why another thread's transfers every 2 ms slow an eager engine step: the GIL or the driver.

``bench transfer``'s step part (kvoffload/bench/transfer/host_time.py) runs an eager step of 200
tiny kernels beside a Python thread that stores and loads 1-16 blocks every 2 ms, each waited
for; the step's kernel launches grow (its ``kernels`` part). That thread makes driver calls (the
copies' enqueue) and takes the GIL back after each of our calls that releases it. This probe
runs, on one GPU, interleaved windows (a baseline between any two loaded ones, as the bench
does) of these arms beside the same step:

- ``transfers``: the bench's arm (``Beside``, the ``staged`` backend);
- ``python only``: a thread that every 2 ms releases and takes back the GIL as often as the
  transfers' thread does (four short sleeps, each followed by a little Python), and makes no
  driver call;

each under CPython's default switch interval (5 ms) and under 0.5 ms. A cost that the python-only
thread shares, or that moves with the switch interval, is the GIL's; what the transfers' thread
adds beyond it is its driver calls and the copies. Run from the source tree on a GPU machine:

    python -m benchmarks.beside_probe OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

from kvoffload.bench.common import machine_info
from kvoffload.bench.transfer.host_time import (
    Arm,
    Beside,
    ThreadArm,
    build,
    step_window,
    warmup_steps,
)
from kvoffload.bench.transfer.host_time_rig import HostTimeConfig, gpu_rig
from kvoffload.bench.transfer.host_time_stats import (
    BASELINE,
    phase_excess_us,
    schedule,
    window_ratios,
)

PERIOD_S = 2e-3
SWITCH_S = (0.005, 0.0005)  # CPython's default switch interval, and a tenth of it


class PythonOnly(ThreadArm):
    """Every ``PERIOD_S``: four sleeps of 20 us (each releases the GIL and takes it back), each
    followed by ~100 Python operations; no driver call."""

    name = "beside-python"

    def __init__(self) -> None:
        super().__init__(PERIOD_S)
        self.rounds = 0

    def _round(self) -> None:
        for _ in range(4):
            time.sleep(20e-6)
            sum(i * i for i in range(100))
        self.rounds += 1


def measure(
    rig: Any, cfg: HostTimeConfig, switch_s: float, method: str = "staged"
) -> list[dict[str, Any]]:
    backend = build(method, rig.layout, rig.arena)
    arms: dict[str, Arm] = {
        BASELINE: Arm(),
        "transfers": Beside(backend, rig, cfg.periodic_max_blocks, PERIOD_S, cfg.wait_s),
        "python only": PythonOnly(),
    }
    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    try:
        for arm in arms.values():
            step_window(rig, arm, cfg, warmup_steps(cfg))
        windows: list[tuple[str, float]] = []
        parts: dict[str, dict[str, list[float]]] = defaultdict(dict)
        for name in schedule([a for a in arms if a != BASELINE], cfg.step_rounds):
            times = step_window(rig, arms[name], cfg, cfg.steps_per_window, parts[name])
            windows.append((name, statistics.median(times)))
    finally:
        sys.setswitchinterval(before)
        backend.close()
    rows = []
    for name, ratios in window_ratios(windows).items():
        parted = phase_excess_us(parts[name], parts[BASELINE])
        row = {
            "switch_interval_s": switch_s,
            "arm": name,
            "step_ratio": statistics.median(ratios),
            "ratios": ratios,
            "phase_excess_us": parted,
        }
        rows.append(row)
        excess = " ".join(f"{p} {v:+.1f}" for p, v in parted.items())
        print(f"switch {switch_s * 1e3:g} ms  {name:12} {row['step_ratio']:.3f}  us: {excess}")
    return rows


def main() -> int:
    if len(sys.argv) != 2:
        raise SystemExit(f"beside_probe.py: expected one argument, OUT.json, got {sys.argv[1:]}")
    import torch

    cfg = HostTimeConfig(step_rounds=6)
    rig = gpu_rig(torch.cuda.current_device(), cfg)
    try:
        rows = [row for s in SWITCH_S for row in measure(rig, cfg, s)]
    finally:
        rig.arena.close()
    out = {"benchmark": "beside_probe", **machine_info(), "device": torch.cuda.get_device_name()}
    with open(sys.argv[1], "w") as f:
        json.dump({**out, "period_s": PERIOD_S, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

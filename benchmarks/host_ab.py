"""``kvoffload bench transfer``'s host section for native-core variants side by side (issue 25).

``bench transfer --sections host`` measures the registry's backends; this also runs ``staged-FLAGS``
variants (``kvoffload/bench/e2e/runner/core_flags.py``: e.g. ``staged-ssplit``, stores gathered on
the kernels' stream as before 2026-11-26) in the same process, on the same engine tensors, in the
order given, so an A/B/A/B order shows the run's own drift. Each method's rows are the host
section's: submit and submit-to-done times, a sleeping thread's GIL lateness, and an eager step of
200 small kernels alone, storing 1/4/16 blocks inline, and beside another thread's transfers.

    python -m benchmarks.host_ab OUT.json staged,staged-ssplit,staged,vllm-triton [BUDGET_S]
"""

from __future__ import annotations

import sys

import torch

from benchmarks import probe_util
from kvoffload.bench.e2e.runner.core_flags import configured
from kvoffload.bench.transfer import host_time


def main() -> int:
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    if not torch.cuda.is_available():
        raise SystemExit("host_ab.py: expected a CUDA device, got none")
    methods = [m for m in sys.argv[2].split(",") if m]
    for m in methods:
        base, *flags = m.split("-")
        if base == "staged" and flags:
            configured(base, flags)  # registers staged-FLAGS (ValueError for an unknown flag)
    budget = float(sys.argv[3]) if len(sys.argv) == 4 else 40.0 * len(methods)
    out = host_time.run(torch.cuda.current_device(), methods, budget)
    for line in out["table"]:
        print(line)
    skip = ("device", "benchmark")
    probe_util.dump(sys.argv[1], "host_ab", **{k: v for k, v in out.items() if k not in skip})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvoffload bench store`` for the committed result, with the Python index it replaced timed
in the same run (``tests/index_model.py``, the test oracle) for the ratio.

    PYTHONPATH=. python -m benchmarks.store_compare \
        --out benchmarks/results/store_cpu_<date>_native.json

Native: every policy at 10^4, 10^6 and 10^7 resident blocks, and the public API. The Python model:
the same at 10^4 and 10^6 (10^7 Python blocks would need ~3 GB and minutes to fill), and the
public API with it under the Offloader. Lists of bytes are the model's only key form.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from kvoffload.bench.common import console, machine_info, write_json
from kvoffload.bench.store.api import API_BLOCKS, measure_api
from kvoffload.bench.store.command import measure, print_rows
from tests.index_model import ModelIndex


def python_loop_ms() -> float:
    """A reference for this machine's speed now: 10^6 iterations of ``s += i`` (CPU ms)."""
    c0, s = time.thread_time(), 0
    for i in range(10**6):
        s += i
    return (time.thread_time() - c0) * 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument(
        "--resident",
        type=lambda s: [int(float(x)) for x in s.split(",")],
        default=[10_000, 1_000_000, 10_000_000],
    )
    p.add_argument(
        "--model-resident",
        type=lambda s: [int(float(x)) for x in s.split(",")],
        default=[10_000, 1_000_000],
    )
    args = p.parse_args()
    data: dict[str, Any] = {"benchmark": "store", **machine_info()}
    data["reference"] = {
        "load_average_before": os.getloadavg(),
        "python_loop_1e6_ms": python_loop_ms(),
    }
    rows = [measure(pol, n, args.reps) for pol in ("lru", "arc") for n in args.resident]
    api = measure_api(API_BLOCKS, args.reps)
    console.print("native index")
    print_rows(rows, api)
    model_rows = [
        measure(pol, n, args.reps, ModelIndex)
        for pol in ("lru", "arc")
        for n in args.model_resident
    ]
    model_api = measure_api(API_BLOCKS, args.reps, ModelIndex, kinds=("list",))
    console.print("Python model (the index before this change)")
    print_rows(model_rows, model_api)
    data["reference"]["load_average_after"] = os.getloadavg()
    data["reference"]["python_loop_1e6_ms_after"] = python_loop_ms()
    data.update({"index": "native", "rows": rows, "api": api})
    data["python_model"] = {"rows": model_rows, "api": model_api}
    console.print(f"wrote {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

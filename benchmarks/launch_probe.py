"""What one ``cuLaunchKernel`` of the copy kernel costs the host, and what makes it cost that.

The native core's driver times (``KVOFFLOAD_DRIVER_TIMES=1``, ``benchmarks/api_gpu.py
--driver-times``) read 4.6-5.9 us per launch of the copy kernel on an H200 (2026-11-27), the
largest driver item of every job (a 1,000-block load: 364 of its 630 us of driver time). This
probe times ``cuLaunchKernel`` through ctypes (the same entry point the core calls; ctypes adds
the same overhead to every row, so compare rows, and ``empty`` is the floor) for:

- ``copy``: the staged path's copy kernel as the core launches it (8 warps, no work: zero
  blocks), ``empty``: a Triton kernel of one pointer parameter doing nothing, with 4 and 8 warps;
- each at grids of 1 to 256 programs (a load's scatter takes a program per 256 KiB of its chunk,
  so an e2e slice launches tens to a hundred and more);
- on one stream back to back, and alternating between two streams (the coupled pipeline's).

    PYTHONPATH=. python benchmarks/launch_probe.py OUT.json
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from typing import Any

import torch
import triton

from kvoffload.bench.common import machine_info
from kvoffload.transfer.cuda.chunks import tile
from kvoffload.transfer.cuda.driver import driver_version
from kvoffload.transfer.cuda.kernels import CopyLauncher, launch_shape
from kvoffload.transfer.cuda.staged_config import StagedConfig

N = 1000
REPS = 5
GRIDS = (1, 16, 64, 256)
# CUfunction_attribute: what the driver sizes per launch
ATTRIBUTES = {"regs": 4, "local_bytes": 3, "shared_bytes": 1, "max_threads": 0}


@triton.jit
def empty(x):  # type: ignore[no-untyped-def]
    pass


def _attributes(cu: Any, f: int) -> dict[str, int]:
    out = {}
    for name, attr in ATTRIBUTES.items():
        v = ctypes.c_int(0)
        if cu.cuFuncGetAttribute(ctypes.byref(v), attr, ctypes.c_void_p(f)) == 0:
            out[name] = v.value
    return out


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else None
    cu = ctypes.CDLL("libcuda.so.1")
    dev = torch.device("cuda")
    x = torch.zeros(64, dtype=torch.int64, device=dev)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()  # type: ignore[no-untyped-call]
    launcher = CopyLauncher()
    regions = torch.zeros(4, dtype=torch.int64, device=dev)
    args = (0, 0, 1, int(x.data_ptr()), 64)
    jobs, words = tile(64 << 10, StagedConfig().chunk_bytes)  # Llama-3-8B's 64 KiB pages
    warps = StagedConfig().num_warps
    launcher.launch(s1, 16, x, x, regions, *args, False, True, jobs, words, warps)
    info = launcher.native_kernel(False, True, jobs, words, warps, args)
    assert info is not None
    e4 = empty[(1,)](x, num_warps=4)
    e8 = empty[(1,)](x, num_warps=8)
    torch.cuda.synchronize()

    ptr = ctypes.c_uint64
    copy_args: list[Any] = [ptr(x.data_ptr()), ptr(x.data_ptr()), ptr(regions.data_ptr())]
    for j, v in enumerate(args):  # i64 where the compiled variant types it so (``wide``)
        copy_args.append(ctypes.c_int64(v) if info.wide >> j & 1 else ctypes.c_int32(v))
    copy_args += [ptr(0)] * info.hidden
    kernels: dict[str, tuple[int, int, int, list[Any]]] = {
        "copy_w8": (info.function, info.block, info.shared, copy_args),
    }
    for name, compiled in (("empty_w4", e4), ("empty_w8", e8)):
        f, block, shared, hidden = launch_shape(compiled)
        kernels[name] = (f, block, shared, [ptr(x.data_ptr())] + [ptr(0)] * hidden)
    attrs = {name: _attributes(cu, k[0]) for name, k in kernels.items()}
    print(attrs, flush=True)

    cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    rows: dict[str, dict[str, float]] = {}
    for name, (f, block, shared, kargs) in kernels.items():
        params = (ctypes.c_void_p * len(kargs))(*[ctypes.addressof(a) for a in kargs])
        for grid in GRIDS:
            row = rows[f"{name}_grid{grid}"] = {}
            for shape in ("back_to_back", "two_streams"):
                per = []
                for _ in range(REPS):
                    torch.cuda.synchronize()
                    t_total = 0.0
                    for i in range(N):
                        st = s2 if shape == "two_streams" and i % 2 else s1
                        t0 = time.perf_counter()
                        err = cu.cuLaunchKernel(
                            f, grid, 1, 1, block, 1, 1, shared, st.cuda_stream, params, None
                        )
                        t_total += time.perf_counter() - t0
                        if err:
                            raise RuntimeError(f"cuLaunchKernel({name}) returned {err}")
                    per.append(t_total / N * 1e6)
                row[shape] = statistics.median(per)
            print(name, grid, {k: round(v, 2) for k, v in row.items()}, flush=True)
    torch.cuda.synchronize()
    if out:
        data = {"benchmark": "launch_probe", **machine_info(), "launches": N, "reps": REPS}
        data["device"] = torch.cuda.get_device_name()
        data["driver"] = driver_version()
        data["us_per_launch"] = rows
        data["attributes"] = attrs
        with open(out, "w") as fh:
            json.dump(data, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

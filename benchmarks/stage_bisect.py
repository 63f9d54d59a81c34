"""Where the graph modes' restored forward stalled: the engine's input upload (issue 25).

In ``bench e2e --graph piecewise|full`` a restored request's first kernel started only when the
load's last byte landed (10.6 ms of device time around ``start_load`` against a 10.5 ms load, H200,
docs), not in ``eager``. This probe runs ``bench e2e`` with the graph runner's input upload done
one of three ways, and with events on the engine's stream around the load's submit into the
native core, then prints the median device time of each bracket and the restored TTFT:

- ``sync``: a synchronous copy from pageable memory (the runner's way since this finding);
- ``pin-per-step``: ``pin_memory()`` (torch's caching host allocator) and a non-blocking copy,
  the runner's way before it (the stall);
- ``persistent-pinned``: one pinned buffer allocated once, refilled each step (an event keeps
  it until the copy ran) and copied non-blocking: vLLM's way of uploading its inputs.

    python benchmarks/stage_bisect.py MODE [bench e2e arguments]    # CUDA only
    e.g. python benchmarks/stage_bisect.py pin-per-step --workloads docs --graph piecewise \\
        --modes kvoffload --documents 16 --requests 48 --zero-reuse-rounds 0 --verify 0 --out x.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from typing import Any

import numpy as np
import torch

import kvoffload.transfer.cuda.staged as staged
from kvoffload.bench.e2e.runner import graphs

MODES = ("sync", "pin-per-step", "persistent-pinned")
_brackets: list[tuple[str, Any, Any]] = []  # (name, event before, event after)


def _event() -> Any:
    e = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    e.record()
    return e


def patch_submit() -> None:
    """Events on the caller's stream around the native core's submit, by direction."""
    submit = staged.NativeStagedBackend.submit

    def timed_submit(
        self: Any, specs: Any, *, order_after: Any = "current", background: bool = False
    ) -> Any:
        before = _event()
        out = submit(self, specs, order_after=order_after, background=background)
        direction = specs[0].direction if specs else "none"
        _brackets.append((f"core submit ({direction})", before, _event()))
        return out

    staged.NativeStagedBackend.submit = timed_submit  # type: ignore[method-assign]


def patch_upload(mode: str) -> None:
    """The graph runner's input upload done the ``mode`` way (its host buffer filled as ever)."""
    runner = graphs.GraphRunner
    fill = runner._load

    def upload(self: Any, tokens: Any, start: int, blocks: Any, b: int, table: int) -> None:
        ints = self._ints
        self._ints = _Capture()
        try:
            fill(self, tokens, start, blocks, b, table)  # fills self._host, copies into _Capture
        finally:
            self._ints = ints
        src = torch.from_numpy(self._host)
        with torch.inference_mode():
            if mode == "pin-per-step":
                ints.copy_(src.pin_memory(), non_blocking=True)
            elif mode == "persistent-pinned":
                state = self.__dict__.setdefault("_bisect", {})
                if "buffer" not in state:
                    state["buffer"] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                if "done" in state:
                    state["done"].synchronize()  # the last copy from the buffer has run
                state["buffer"].copy_(src)
                ints.copy_(state["buffer"], non_blocking=True)
                state["done"] = _event()
            else:
                ints.copy_(src)

    runner._load = upload  # type: ignore[method-assign]


class _Capture:
    """Stands in for the device buffer while the runner's own ``_load`` fills its host buffer."""

    is_cuda = False

    def copy_(self, src: Any, non_blocking: bool = False) -> None:
        return None


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in MODES or "--out" not in sys.argv:
        raise SystemExit(f"usage: stage_bisect.py {{{','.join(MODES)}}} [bench e2e args] --out F")
    if not torch.cuda.is_available():
        raise SystemExit("stage_bisect.py: expected a CUDA device, got none")
    mode, args = sys.argv[1], sys.argv[2:]
    patch_submit()
    patch_upload(mode)
    from kvoffload.cli import main as cli

    cli(args if args[:2] == ["bench", "e2e"] else ["bench", "e2e", *args])
    torch.cuda.synchronize()
    device: dict[str, list[float]] = defaultdict(list)
    for name, before, after in _brackets:
        device[name].append(before.elapsed_time(after))
    out = args[args.index("--out") + 1]
    with open(out) as f:
        result = json.load(f)
    print(f"{mode}: device ms on the engine's stream around the core's submit, medians:")
    for name, values in sorted(device.items()):
        print(f"  {name}: {statistics.median(values):.3f} (n={len(values)})")
    for graph, run in result["results"]["runs"].items():
        for workload, w in run["workloads"].items():
            records = [r for r in w["modes"]["kvoffload"]["records"] if r["host_hit_tokens"] > 0]
            if not records:
                continue
            keys = sorted({k for r in records for k in r.get("device_ms", {})})
            sections = {
                k: round(float(np.median([r["device_ms"].get(k, 0.0) for r in records])), 3)
                for k in keys
            }
            ttft = statistics.median(r["ttft_ms"] for r in records)
            print(
                f"  {graph} {workload}: {len(records)} restored, device ms {sections}, "
                f"TTFT p50 {ttft:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

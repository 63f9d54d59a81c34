# mypy: disable-error-code="no-untyped-call"
"""``kvoffload bench transfer`` on a GPU: every method side by side, next to the link limit.

One run, bounded by ``--time-budget-s``, measures (``--sections``): the link limit (1 GiB
contiguous H2D, D2H and both at once, warmed up, repeated, with the spread; again at the end);
``sweep``: per case (model x layout x block size) and blocks per transfer, each method's store and
load GB/s and p50/p99 latency, store+load at once, and how soon layer 0 of a load is usable;
``gemm``: a GEMM stream and a launch-bound Python thread beside each method's transfers (first
case); ``host``: GIL held per submit and an eager engine step (``transfer.host_time``);
``calls``: where submit's host time goes and single driver calls. Every transfer's bytes are
checked; a method that fails to build or moves a wrong byte is recorded under ``failures`` and
measured no further in that case, so one broken method never costs the others their rows.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvoffload.bench.transfer.cases import (
    TAIL_S,
    case_blocks,
    estimate_case,
    parse_cases,
)
from kvoffload.bench.transfer.interference import measure_gemm, measure_launch_stall
from kvoffload.bench.transfer.kv import SyntheticKV
from kvoffload.bench.transfer.methods import make, path_of, unavailable
from kvoffload.bench.transfer.probes import (
    measure_binding,
    measure_first_layer,
    measure_host_costs,
    measure_submit_parts,
)
from kvoffload.bench.transfer.sweep import measure_both, measure_method
from kvoffload.console import console, progress
from kvoffload.store.arena import HostArena
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.timing import Sleeper, measure_link

HOST_TIME = "kvoffload.bench.transfer.host_time"
HOST_SHARE = 0.2  # of --time-budget-s, given to the host section (GIL, engine step)
BOTH_BLOCKS = 512  # store+load at once: this many blocks each way (fewer where a case has less)
SUBMIT_METHODS = ("staged", "dma")  # the calls section times these submits


def gpu_info() -> dict[str, Any]:
    """GPU, driver (release and CUDA API version), CUDA, torch, Triton of this machine."""
    import triton

    from kvoffload.doctor import staged_enqueue
    from kvoffload.transfer.cuda.driver import CudaDriver

    drv = CudaDriver.load()
    props = torch.cuda.get_device_properties(0)
    try:
        from cuda import bindings

        cuda_python = str(bindings.__version__)
    except ImportError:
        cuda_python = None
    return {
        "device": torch.cuda.get_device_name(),
        "sms": props.multi_processor_count,
        "driver": drv.version,
        "driver_release": driver_release(),
        "batch_entry_resolved": drv.batch_resolved,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "cuda_python": cuda_python,
        "staged_enqueue": staged_enqueue(),
    }


def driver_release(path: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel driver's release (e.g. ``580.95.05``) from ``path``, or None where it
    is absent."""
    try:
        with open(path) as f:
            words = f.readline().split()
    except OSError:
        return None
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


def run_gpu(
    args: Any, checkpoint: Callable[[dict[str, Any]], object] | None = None
) -> dict[str, Any]:
    """The whole GPU benchmark; returns the JSON-ready result (``wall_s``: its seconds).
    ``checkpoint(result so far)`` is called after each case, so a run cut short keeps them."""
    began = time.perf_counter()
    torch.cuda.init()
    result: dict[str, Any] = {"benchmark": "transfer", **gpu_info()}
    result["sections"] = list(args.sections)
    notes = {m: why for m in args.methods if (why := unavailable(m)) is not None}
    result["method_notes"] = notes
    methods = [m for m in args.methods if m not in notes]
    sleeper = Sleeper()
    result["link"] = measure_link(sleeper, args.link_bytes, args.link_reps)
    host_s = HOST_SHARE * args.time_budget_s if "host" in args.sections else 0.0
    if list(args.sections) == ["host"]:  # the host section alone: the whole budget is its
        host_s = max(5.0, args.time_budget_s - TAIL_S)
    deadline = began + args.time_budget_s - host_s - TAIL_S

    def after_case(out: dict[str, Any]) -> None:
        if checkpoint is not None:
            checkpoint({**result, **out, "wall_s": time.perf_counter() - began})

    result.update(Cases(args, sleeper, methods, deadline, after_case).run())
    if "host" in args.sections:
        result["host_time"] = host_time(methods, max(5.0, host_s), torch.cuda.current_device())
    result["link_after"] = measure_link(sleeper, args.link_bytes, args.link_reps)
    if "calls" in args.sections:
        result["binding_host_us"] = measure_binding(tuple(args.binding_counts))
        result["host_call_us"] = measure_host_costs()
    result["wall_s"] = time.perf_counter() - began
    return result


def host_time(methods: list[str], budget_s: float, device: int) -> dict[str, Any]:
    """The host section from ``transfer.host_time`` (the methods it builds by name: the
    registry's, ``auto`` and ``vllm-triton``), or a note saying why it was skipped or failed
    (the sweep's results are kept either way)."""
    from kvoffload.transfer.registry import BACKENDS

    try:
        module: Any = importlib.import_module(HOST_TIME)
    except ModuleNotFoundError as missing:
        if missing.name != HOST_TIME:
            raise
        return {"skipped": f"{HOST_TIME} is absent from this checkout"}
    names = [m for m in methods if m in BACKENDS or m in ("auto", "vllm-triton")]
    try:
        out: dict[str, Any] = dict(module.run(device, names, budget_s))
    except (ImportError, RuntimeError, ValueError) as err:
        return {"skipped": f"{HOST_TIME}.run failed: {type(err).__name__}: {err}"}
    out["methods_left_out"] = [m for m in methods if m not in names]
    return out


class Cases:
    """The case loop: per case, its synthetic KV cache, arena and one backend per method."""

    def __init__(
        self,
        args: Any,
        sleeper: Sleeper,
        methods: list[str],
        deadline: float,
        after_case: Callable[[dict[str, Any]], None] = lambda out: None,
    ) -> None:
        self.args, self.sleeper, self.methods, self.deadline = args, sleeper, methods, deadline
        self.after_case = after_case
        self.rng = np.random.default_rng(0)
        self.out: dict[str, Any] = {
            "rows": [],
            "store_and_load": [],
            "first_layer": [],
            "paths": {},
            "failures": [],
            "dma_skipped": [],
            "skipped_cases": [],
            "case_seconds": [],
        }
        self.fill: np.ndarray | None = None  # random bytes the arenas are filled with

    def run(self) -> dict[str, Any]:
        args, sections = self.args, self.args.sections
        cases = parse_cases(args.cases)
        if "sweep" not in sections:
            cases = cases[:1] if {"gemm", "calls"} & set(sections) else []
        with progress() as bar:
            task = bar.add_task("GPU transfers", total=len(cases))
            for i, (model, layout, bs) in enumerate(cases):
                counts = case_blocks(model, bs, args.gpu_blocks, args.max_transfer_mib)
                need = estimate_case(model, layout, bs, list(counts), args)
                if i and time.perf_counter() + need > self.deadline:
                    self.out["skipped_cases"].append(f"{model}:{layout}:{bs} (~{need:.0f} s)")
                else:
                    bar.update(task, description=f"{model} {layout} bs{bs}")
                    t0 = time.perf_counter()
                    self.case(model, layout, bs, counts, first=i == 0)
                    took = time.perf_counter() - t0  # beside the estimate: to correct its model
                    self.out["case_seconds"].append(
                        {"case": f"{model}:{layout}:{bs}", "s": took, "estimate_s": need}
                    )
                    self.after_case(self.out)
                    left = self.deadline - time.perf_counter()
                    console.print(f"{model} {layout} bs{bs} done; sweep budget left {left:.0f} s")
                bar.advance(task)
        return self.out

    def make_arena(self, slots: int, slot: int) -> HostArena:
        if self.fill is None:
            fill = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
            self.fill = fill.cpu().numpy()
        arena = HostArena(slots, slot, pin=cuda_pin)
        flat = arena.slots.reshape(-1)
        for off in range(0, len(flat), len(self.fill)):
            part = flat[off : off + len(self.fill)]
            part[:] = self.fill[: len(part)]
        return arena

    def fail(self, case: dict[str, Any], method: str, what: str, err: BaseException) -> None:
        self.out["failures"].append(
            {**case, "method": method, "during": what, "error": f"{type(err).__name__}: {err}"}
        )

    def case(self, model: str, layout: str, bs: int, counts: dict[int, int], first: bool) -> None:
        args, sections = self.args, self.args.sections
        tag = {"model": model, "layout": layout, "block_size": bs}
        pool = 2 * max(counts) + 8
        kv = SyntheticKV(model, layout, bs, pool)
        arena = self.make_arena(pool, kv.kv.slot_bytes)
        backends: dict[str, Any] = {}
        try:
            for m in self.methods:
                try:
                    backends[m] = make(m, kv.kv, arena)
                except (RuntimeError, ValueError, ImportError, OSError) as err:  # keep the others
                    self.fail(tag, m, "build", err)
            working = backends  # the methods that moved every byte right so far
            if "sweep" in sections:
                working = self.sweep(tag, kv, arena, backends, counts)
            if first and "gemm" in sections and args.gemm_reps > 0:
                n = min(BOTH_BLOCKS, max(counts))
                self.out["gemm"] = measure_gemm(
                    kv, arena, working, n, args.gemm_reps, args.gemms, self.rng
                )
                reps = max(3, args.gemm_reps // 2)
                self.out["launch_stall"] = {
                    m: measure_launch_stall(kv, arena, b, reps) for m, b in working.items()
                }
            if first and "calls" in sections:
                chosen = {m: b for m, b in working.items() if m in SUBMIT_METHODS}
                self.out["submit_parts"] = measure_submit_parts(kv, chosen)
            for m, b in backends.items():  # after transfers ran: the path each one took
                self.out["paths"].setdefault(m, path_of(b))
        finally:
            for b in backends.values():
                b.close()
            arena.close()
            del kv
            torch.cuda.empty_cache()

    def sweep(
        self,
        tag: dict[str, Any],
        kv: SyntheticKV,
        arena: HostArena,
        backends: dict[str, Any],
        counts: dict[int, int],
    ) -> dict[str, Any]:
        """Every method at every count, then store+load at once and the first layer; returns
        the methods that did not fail."""
        args = self.args
        regions = len(kv.kv.groups[0].regions)
        live = dict(backends)
        for n, asked in counts.items():
            for m, b in list(live.items()):
                if m == "dma" and n * regions > args.dma_max_pieces:
                    self.out["dma_skipped"].append(
                        f"{tag['model']}:{tag['layout']}:{tag['block_size']} x{n}"
                    )
                    continue
                try:
                    row = measure_method(
                        self.sleeper, kv, arena, m, b, n, args.reps, self.rng, args.latency_reps
                    )
                except (RuntimeError, ValueError) as err:  # wrong bytes, a failed or refused copy
                    self.fail({**tag, "blocks": n}, m, "sweep", err)
                    del live[m]
                    continue
                path = path_of(b)["path"]
                self.out["rows"].append({**tag, **row, "asked_blocks": asked, "path": path})
        n_both = min(BOTH_BLOCKS, max(counts))
        for m, b in list(live.items()):
            if m == "dma" and n_both * regions > args.dma_max_pieces:
                continue
            try:
                runs = [
                    measure_both(self.sleeper, kv, arena, b, n_both, args.reps, self.rng)
                    for _ in range(3)
                ]
            except (RuntimeError, ValueError) as err:
                self.fail({**tag, "blocks": n_both}, m, "store+load", err)
                del live[m]
                continue
            self.out["store_and_load"].append(
                {
                    **tag,
                    "blocks": n_both,
                    "method": m,
                    "GBps": statistics.median(runs),
                    "runs_GBps": runs,
                }
            )
        if "staged" in live:
            try:
                first = measure_first_layer(kv, arena, live["staged"], max(counts), args.reps)
                self.out["first_layer"].append({**tag, **first})
            except RuntimeError as err:  # a failed load: listed, the other sections go on
                self.fail({**tag, "blocks": max(counts)}, "staged", "first layer", err)
        return live

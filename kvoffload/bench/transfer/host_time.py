"""Host time of a copy backend as an engine feels it: the GIL per ``submit``, and an eager step.

Issue 21 ("What it must show") asks for two things beside bandwidth, measured here per method
(a backend by name, Llama-3-8B page layout at 16-token blocks by default):

a. **GIL held per submit**, at 1 to 2,048 blocks: (i) the time inside the ``submit`` call, and
   submit to done; (ii) how late a Python thread that sleeps 200 us in a loop wakes while this
   thread submits transfers back to back (a store then a load, each waited for), against the same
   thread's lateness in windows with no transfers. Baseline and loaded windows alternate; medians
   and p99 of each, and the difference ("excess").
b. **An eager, launch-bound engine step**: ``kernels_per_step`` tiny kernels launched from Python
   (~2.5 ms on an H100 for 200), then a host sync, as an engine samples. Arms: storing 1, 4 or 16
   new blocks per step through the backend in the same thread (submitted after the step's
   kernels, completion checked at the next step, as an engine worker does); another Python thread
   storing and loading 1-16 blocks every 2 ms; another thread moving 1 or 16 blocks back to back.
   Windows of ``steps_per_window`` steps; a baseline window (no transfers) sits between any two
   loaded ones, the arms' order rotates by round, and each loaded window is divided by the mean
   of the baselines on either side of it; the ratio reported is the median over rounds.

Before any timing, every block count a method will move is checked once: a store of distinct
blocks then a load into other blocks (whose bytes were scrambled first) must give back the
source, and on the GPU the stored slots must equal the slot images torch builds by the layout's
rule; a method that fails is reported with its error and not timed, so a fast wrong path cannot
look good. A method whose backend does not build is reported with its error. ``budget_s`` bounds
the run: each method gets an equal share of what is left, half to each part; rounds stop once
its share is spent (a block count or the step part not started in time is listed as skipped).

``run`` needs CUDA (RuntimeError without it). The statistics, the window schedule and the table
are pure (``host_time_stats``), and the measuring loops take the engine as plain callables
(``Rig``), so the tests run them on CPU with the ``host`` backend.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from kvoffload.bench.transfer.host_time_rig import (
    BLOCK_SIZE,
    LAYOUT,
    MODEL,
    HostTimeConfig,
    Rig,
    gpu_rig,
)
from kvoffload.bench.transfer.host_time_stats import (
    BASELINE,
    PHASES,
    Deadline,
    WakeProbe,
    phase_excess_us,
    schedule,
    summary,
    table_rows,
    window_ratios,
)
from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend, Pending
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import Direction, TransferSpec


# -- the measuring loops (any backend, any rig) -------------------------------------------------
def transfer(backend: CopyBackend, direction: Direction, blocks: Any, slots: Any) -> Pending:
    return backend.submit([TransferSpec.of(direction, blocks, slots)])


def finish(pending: Pending, wait_s: float, what: str) -> None:
    """Wait for ``pending``; RuntimeError if it did not finish in time or failed."""
    if not pending.wait(wait_s):
        raise RuntimeError(f"{what}: not done within {wait_s} s")
    if pending.error() is not None:
        raise RuntimeError(f"{what} failed: {pending.error()!r}")


def check_bytes(backend: CopyBackend, rig: Rig, n: int, wait_s: float) -> None:
    """Store blocks [0, n) to slots [0, n), load them into blocks [n, 2n) (scrambled first);
    RuntimeError unless the loaded blocks equal the sources (and the slots the oracle's)."""
    src, dst, slots = np.arange(n), np.arange(n, 2 * n), np.arange(n)
    rig.scramble(dst)
    finish(transfer(backend, "store", src, slots), wait_s, f"a {n}-block check store")
    if rig.stored_ok is not None and not rig.stored_ok(src, slots):
        raise RuntimeError(f"{backend.name}: {n} stored blocks differ from the layout's oracle")
    finish(transfer(backend, "load", dst, slots), wait_s, f"a {n}-block check load")
    if not rig.same_blocks(src, dst):
        raise RuntimeError(f"{backend.name}: {n} blocks differ after a store and a load")


def gil_part(
    method: str, backend: CopyBackend, rig: Rig, cfg: HostTimeConfig, deadline: Deadline
) -> list[dict[str, Any]]:
    """Part a: rounds over every block count (so a short budget still covers each once), each a
    baseline window then a loaded one; rows per block count measured, ``skipped`` for the rest."""
    submit_s: dict[tuple[int, str], list[float]] = defaultdict(list)
    done_s: dict[tuple[int, str], list[float]] = defaultdict(list)
    with WakeProbe(cfg.sleep_s) as probe:
        for _ in range(cfg.gil_rounds):
            for n in cfg.gil_blocks:
                if deadline.passed():
                    break
                slots = np.arange(n)
                pair: tuple[tuple[Direction, np.ndarray], ...] = (
                    ("store", slots),
                    ("load", slots + n),
                )
                probe.phase = f"base {n}"
                time.sleep(cfg.window_s)
                probe.phase = f"loaded {n}"
                end = time.perf_counter() + cfg.window_s
                while time.perf_counter() < end:
                    for d, ids in pair:
                        t0 = time.perf_counter()
                        p = transfer(backend, d, ids, slots)
                        t1 = time.perf_counter()
                        finish(p, cfg.wait_s, f"a {n}-block {d}")
                        submit_s[n, d].append(t1 - t0)
                        done_s[n, d].append(time.perf_counter() - t0)
                probe.phase = None
    rows: list[dict[str, Any]] = []
    for n in cfg.gil_blocks:
        common = {"method": method, "case": f"{n} blocks", "blocks": n}
        base, loaded = probe.samples[f"base {n}"], probe.samples[f"loaded {n}"]
        if not submit_s[n, "load"]:
            rows.append({**common, "measure": "gil", "note": "skipped"})
            continue
        for d in ("store", "load"):
            rows.append({**common, "measure": f"submit_us:{d}", **summary(submit_s[n, d], 1e6)})
            rows.append({**common, "measure": f"done_us:{d}", **summary(done_s[n, d], 1e6)})
        if base and loaded:
            b, lo = summary(base, 1e6), summary(loaded, 1e6)
            rows.append({**common, "measure": "wake_late_us:baseline", **b})
            rows.append({**common, "measure": "wake_late_us:loaded", **lo})
            excess = {"median": lo["median"] - b["median"], "p99": lo["p99"] - b["p99"]}
            rows.append({**common, "measure": "wake_late_us:excess", "n": lo["n"], **excess})
    return rows


def warmup_steps(cfg: HostTimeConfig) -> int:
    return max(2, cfg.steps_per_window // 4)


class Arm:
    """One way of running beside the engine step; the baseline does nothing."""

    def start(self) -> None:
        return

    def before_step(self) -> None:
        return

    def after_kernels(self) -> None:
        return

    def stop(self) -> None:
        return


class InlineStores(Arm):
    """Stores ``n`` new blocks per step from the step's thread; completion checked next step."""

    def __init__(self, backend: CopyBackend, rig: Rig, n: int, wait_s: float) -> None:
        self.backend, self.n, self.wait_s = backend, n, wait_s
        self.span = min(rig.pool // 2, rig.arena.num_slots) // n * n
        self.next = 0
        self.outstanding: list[Pending] = []
        self.late = 0  # stores not done by the next step

    def before_step(self) -> None:
        self.late += sum(not p.done() for p in self.outstanding)
        for p in [p for p in self.outstanding if p.done()]:
            finish(p, 0.0, f"a {self.n}-block step store")
            self.outstanding.remove(p)

    def after_kernels(self) -> None:
        ids = np.arange(self.next, self.next + self.n)
        self.next = (self.next + self.n) % self.span
        self.outstanding.append(transfer(self.backend, "store", ids, ids))

    def stop(self) -> None:
        for p in self.outstanding:
            finish(p, self.wait_s, f"a {self.n}-block step store")
        self.outstanding.clear()


class ThreadArm(Arm):
    """A thread beside the step: ``_round()`` every ``period_s`` (0: back to back) until
    ``stop``, which raises the first error a round raised."""

    name = "kvoffload-beside"

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.errors:
            raise RuntimeError(f"the thread beside the step failed: {self.errors[0]!r}")

    def _round(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                self._round()
                rest = self.period_s - (time.perf_counter() - t0)
                if rest > 0:
                    self._stop.wait(rest)
        except (RuntimeError, ValueError, TimeoutError) as err:
            self.errors.append(err)


class Beside(ThreadArm):
    """Another Python thread moving blocks: every ``period_s`` a store and a load of 1..``most``
    blocks (random), or (``period_s`` 0) ``most`` blocks back to back; each waited for."""

    def __init__(
        self, backend: CopyBackend, rig: Rig, most: int, period_s: float, wait_s: float
    ) -> None:
        super().__init__(period_s)
        self.backend, self.most, self.wait_s = backend, most, wait_s
        self.half = rig.pool // 2
        self.rng = np.random.default_rng(most)
        self.moved = 0

    def _round(self) -> None:
        n = self.most if self.period_s == 0 else int(self.rng.integers(1, self.most + 1))
        ids = np.arange(n)
        finish(transfer(self.backend, "store", ids, ids), self.wait_s, "a store beside")
        finish(transfer(self.backend, "load", ids + self.half, ids), self.wait_s, "a load beside")
        self.moved += 2 * n


def step_window(
    rig: Rig,
    arm: Arm,
    cfg: HostTimeConfig,
    steps: int,
    phases: dict[str, list[float]] | None = None,
) -> list[float]:
    """Seconds of each of ``steps`` engine steps with ``arm`` running; with ``phases``, each
    step's seconds per part (``PHASES``) are appended to it too."""
    times = []
    arm.start()
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            arm.before_step()
            t1 = time.perf_counter()
            for _ in range(cfg.kernels_per_step):
                rig.kernel()
            t2 = time.perf_counter()
            arm.after_kernels()
            t3 = time.perf_counter()
            rig.end_step()
            t4 = time.perf_counter()
            times.append(t4 - t0)
            if phases is not None:
                for part, a, b in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
                    phases.setdefault(part, []).append(b - a)
    finally:
        arm.stop()
    return times


def step_part(
    method: str, backend: CopyBackend, rig: Rig, cfg: HostTimeConfig, deadline: Deadline
) -> list[dict[str, Any]]:
    arms: dict[str, Arm] = {BASELINE: Arm()}
    for n in cfg.inline_blocks:
        arms[f"inline store {n}"] = InlineStores(backend, rig, n, cfg.wait_s)
    ms = f"{cfg.periodic_s * 1e3:g} ms"
    arms[f"thread 1-{cfg.periodic_max_blocks} every {ms}"] = Beside(
        backend, rig, cfg.periodic_max_blocks, cfg.periodic_s, cfg.wait_s
    )
    for n in cfg.back_to_back_blocks:
        arms[f"thread {n} back to back"] = Beside(backend, rig, n, 0.0, cfg.wait_s)
    if deadline.passed():
        return [{"method": method, "measure": "step_ratio", "case": "all", "note": "skipped"}]
    for arm in arms.values():  # warm-up: threads started once, first launches, caches
        step_window(rig, arm, cfg, warmup_steps(cfg))
    windows: list[tuple[str, float]] = []
    steps: dict[str, list[float]] = defaultdict(list)
    parts: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for name in schedule([a for a in arms if a != BASELINE], cfg.step_rounds):
        times = step_window(rig, arms[name], cfg, cfg.steps_per_window, parts[name])
        windows.append((name, statistics.median(times)))
        steps[name] += times
        if name == BASELINE and deadline.passed() and len(windows) > 1:
            break
    ratios = window_ratios(windows)
    base = [v for name, v in windows if name == BASELINE]
    rows = [
        {
            "method": method,
            "measure": "step_us",
            "case": BASELINE,
            **summary(steps[BASELINE], 1e6),
            "phases_us": {
                p: round(statistics.median(v) * 1e6, 2) for p, v in parts[BASELINE].items()
            },
            "note": f"window medians {min(base) * 1e6:.0f}-{max(base) * 1e6:.0f} us",
        }
    ]
    for name, r in ratios.items():
        arm = arms[name]
        note = f"step {statistics.median(steps[name]) * 1e6:.0f} us"
        if isinstance(arm, InlineStores):
            note += f", {arm.late} stores not done by the next step"
        excess = phase_excess_us(parts[name], parts[BASELINE])
        note += ", us over baseline: " + " ".join(f"{p} {v:+.1f}" for p, v in excess.items())
        rows.append(
            {
                "method": method,
                "measure": "step_ratio",
                "case": name,
                "median": statistics.median(r),
                "p99": None,
                "n": len(r),
                "ratios": r,
                "phase_excess_us": excess,
                "note": note,
            }
        )
    rows += [
        {"method": method, "measure": "step_ratio", "case": name, "note": "skipped"}
        for name in arms
        if name != BASELINE and name not in ratios
    ]
    return rows


Build = Callable[[str, KVLayout, HostArena], CopyBackend]


def build(name: str, layout: KVLayout, arena: HostArena) -> CopyBackend:
    """A backend by name: ``vllm-triton`` (bench.transfer.vllm_triton) or the registry's."""
    if name == "vllm-triton":
        from kvoffload.bench.transfer.vllm_triton import make_backend as make_vllm

        return make_vllm(layout, arena)
    from kvoffload.transfer.registry import make_backend

    return make_backend(name, layout, arena)


def measure_method(
    method: str, rig: Rig, cfg: HostTimeConfig, seconds: float, make: Build = build
) -> list[dict[str, Any]]:
    """Every row of one method, or one ``error`` row (its backend did not build, a transfer failed
    or moved wrong bytes)."""
    try:
        backend = make(method, rig.layout, rig.arena)
    except Exception as err:  # noqa: BLE001 (reported in the result, not swallowed)
        return [{"method": method, "measure": "error", "note": f"build: {err!r}"}]
    deadline = Deadline(seconds)
    try:
        for n in cfg.checked_blocks:
            check_bytes(backend, rig, n, cfg.wait_s)
        rows = gil_part(method, backend, rig, cfg, Deadline(deadline.left() / 2))
        return rows + step_part(method, backend, rig, cfg, Deadline(deadline.left()))
    except (RuntimeError, ValueError, TimeoutError) as err:
        return [{"method": method, "measure": "error", "note": repr(err)}]
    finally:
        backend.close()


# -- the GPU run ---------------------------------------------------------------------------------
def check_args(device: int, methods: list[str], budget_s: float) -> None:
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"expected a CUDA device index >= 0, got {device!r}")
    if not methods or not all(isinstance(m, str) and m for m in methods):
        raise ValueError(f"expected a non-empty list of method names, got {methods!r}")
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(f"expected budget_s > 0 seconds, got {budget_s!r}")


def run(
    device: int, methods: list[str], budget_s: float, config: HostTimeConfig | None = None
) -> dict[str, Any]:
    """Parts a and b (module docstring) for each of ``methods`` on CUDA device ``device``, within
    about ``budget_s`` seconds after setup. Returns JSON-able ``rows`` (one dict per measurement:
    method, measure, case, median, p99, n, note), ``table`` (the rows as strings, a header
    first), the device, the shape and the config. ValueError for bad arguments, RuntimeError
    without CUDA."""
    check_args(device, methods, budget_s)
    cfg = config or HostTimeConfig()
    try:
        import torch
    except ImportError:
        raise RuntimeError(
            "the host-time benchmark needs torch with CUDA; torch is not installed"
        ) from None
    if not torch.cuda.is_available():
        raise RuntimeError("the host-time benchmark needs a CUDA GPU; torch sees none")
    if device >= torch.cuda.device_count():
        raise ValueError(f"expected a device index < {torch.cuda.device_count()}, got {device}")
    began = time.perf_counter()
    rig = gpu_rig(device, cfg)
    slot_bytes = rig.layout.slot_bytes
    rows: list[dict[str, Any]] = []
    deadline = Deadline(budget_s)
    try:
        for i, method in enumerate(methods):
            rows += measure_method(method, rig, cfg, deadline.left() / (len(methods) - i))
    finally:
        rig.arena.close()
        del rig  # the engine's tensors (8 GiB at 2,048 blocks) go before the caller's next run
        torch.cuda.empty_cache()
    return {
        "benchmark": "host_time",
        "device": torch.cuda.get_device_name(device),
        "device_index": device,
        "torch": torch.__version__,
        "model": MODEL,
        "layout": LAYOUT,
        "block_size": BLOCK_SIZE,
        "slot_bytes": slot_bytes,
        "methods": list(methods),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
        "rows": rows,
        "table": table_rows(rows),
        "seconds": time.perf_counter() - began,
    }

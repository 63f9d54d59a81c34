"""The host-time benchmark (bench/transfer/host_time.py) on CPU: its statistics, window schedule
and table on synthetic numbers, and its measuring loops end to end with the ``host`` backend on a
CPU rig moving real bytes (no timing is asserted, only what was measured and checked)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from kvoffload.bench.transfer import host_time
from kvoffload.bench.transfer.host_time import check_args, measure_method
from kvoffload.bench.transfer.host_time_rig import HostTimeConfig, Rig
from kvoffload.bench.transfer.host_time_stats import (
    BASELINE,
    PHASES,
    TABLE_HEADER,
    Deadline,
    WakeProbe,
    percentile,
    phase_excess_us,
    schedule,
    summary,
    table_rows,
    window_ratios,
)
from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend, Pending
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec

B = BASELINE


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("q", [0, 1, 50, 99, 100])
def test_percentile_matches_numpys_linear_interpolation(seed, q):
    values = np.random.default_rng(seed).exponential(1.0, seed * 7 + 1).tolist()
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.parametrize(
    ("values", "q", "match"),
    [([], 50, "at least one value, got none"), ([1.0], 101, r"in \[0, 100\], got 101")],
)
def test_percentile_refuses_bad_input(values, q, match):
    with pytest.raises(ValueError, match=match):
        percentile(values, q)


def test_summary_scales_median_and_p99():
    got = summary([1e-6 * v for v in range(1, 101)], 1e6)
    assert got["median"] == pytest.approx(50.5)
    assert got["p99"] == pytest.approx(99.01)
    assert got["n"] == 100


def test_schedule_puts_a_baseline_beside_every_loaded_window_and_rotates_arms():
    order = schedule(["a", "b", "c"], 2)
    assert order == [B, "a", B, "b", B, "c", B, "b", B, "c", B, "a", B]
    for i, name in enumerate(order):
        if name != B:
            assert order[i - 1] == B and order[i + 1] == B
    assert {a: order.count(a) for a in "abc"} == {"a": 2, "b": 2, "c": 2}


@pytest.mark.parametrize(("arms", "rounds"), [([], 3), (["a"], 0)])
def test_schedule_refuses_nothing_to_do(arms, rounds):
    with pytest.raises(ValueError, match="expected arms and rounds > 0"):
        schedule(arms, rounds)


def test_window_ratios_divide_by_the_adjacent_baselines():
    windows = [(B, 10.0), ("a", 15.0), (B, 20.0), ("b", 30.0), (B, 10.0), ("a", 20.0)]
    ratios = window_ratios(windows)
    # a: 15 / mean(10, 20); b: 30 / mean(20, 10); the last a has a baseline on one side only
    assert ratios == {"a": [1.0, 2.0], "b": [2.0]}


def test_window_ratios_need_a_baseline():
    with pytest.raises(ValueError, match="at least one baseline window"):
        window_ratios([("a", 1.0)])


def test_table_formats_ratios_microseconds_and_blanks():
    rows: list[dict[str, Any]] = [
        {"method": "staged", "measure": "step_ratio", "case": "inline store 4", "median": 1.23456,
         "p99": None, "n": 5, "note": "step 2500 us"},
        {"method": "dma", "measure": "submit_us:store", "case": "16 blocks", "median": 41.26,
         "p99": 80.04, "n": 200},
        {"method": "sm", "measure": "error", "note": "build: ImportError('triton')"},
    ]  # fmt: skip
    table = table_rows(rows)
    assert table[0] == TABLE_HEADER
    assert table[1] == ["staged", "step_ratio", "inline store 4", "1.235", "", "5", "step 2500 us"]
    assert table[2] == ["dma", "submit_us:store", "16 blocks", "41.3", "80.0", "200", ""]
    assert table[3] == ["sm", "error", "", "", "", "", "build: ImportError('triton')"]
    assert all(len(r) == len(TABLE_HEADER) for r in table)


def test_deadline_counts_down_on_its_clock():
    now = [100.0]
    d = Deadline(5.0, clock=lambda: now[0])
    assert d.left() == 5.0 and not d.passed()
    now[0] = 104.0
    assert d.left() == pytest.approx(1.0)
    now[0] = 106.0
    assert d.left() == 0.0 and d.passed()


def test_wake_probe_records_only_under_a_steady_phase():
    with WakeProbe(200e-6) as probe:
        time.sleep(0.02)  # phase None: nothing recorded
        probe.phase = "x"
        time.sleep(0.05)
        probe.phase = None
        time.sleep(0.01)
    assert set(probe.samples) == {"x"}
    assert len(probe.samples["x"]) >= 3
    assert all(math.isfinite(v) for v in probe.samples["x"])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"gil_blocks": (1, 0)}, "block counts > 0"),
        ({"window_s": 0.0}, "window_s > 0, got 0.0"),
        ({"steps_per_window": 0}, "steps_per_window > 0, got 0"),
    ],
)
def test_config_refuses_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        HostTimeConfig(**kw)


def test_config_checks_every_block_count_it_moves():
    cfg = HostTimeConfig(gil_blocks=(64, 5), inline_blocks=(3,), back_to_back_blocks=(40,),
                         periodic_max_blocks=4)  # fmt: skip
    assert cfg.checked_blocks == [1, 2, 3, 4, 5, 40, 64]
    assert cfg.most_blocks == 64


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, ["staged"], 10.0), "device index >= 0, got -1"),
        ((True, ["staged"], 10.0), "device index >= 0, got True"),
        ((0, [], 10.0), "non-empty list of method names, got \\[\\]"),
        ((0, ["staged", ""], 10.0), "non-empty list of method names"),
        ((0, ["staged"], 0.0), "budget_s > 0 seconds, got 0.0"),
        ((0, ["staged"], float("nan")), "budget_s > 0 seconds, got nan"),
    ],
)
def test_bad_arguments_are_refused_before_any_cuda(args, match):
    with pytest.raises(ValueError, match=match):
        check_args(*args)
    with pytest.raises(ValueError, match=match):
        host_time.run(*args)


def test_run_without_cuda_says_so(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        host_time.run(0, ["staged"], 10.0)


# -- the loops on a CPU rig with the host backend -----------------------------------------------
TINY = HostTimeConfig(
    gil_blocks=(1, 4),
    window_s=0.02,
    gil_rounds=2,
    kernels_per_step=5,
    steps_per_window=3,
    step_rounds=2,
    inline_blocks=(1, 2),
    periodic_max_blocks=3,
    back_to_back_blocks=(1, 2),
)


class CpuRig:
    """An fp8 70B-TP8 page-layout engine in numpy arrays, with the benchmark's oracles."""

    def __init__(self, cfg: HostTimeConfig) -> None:
        self.rng = np.random.default_rng(4)
        pool = 2 * cfg.most_blocks + 16

        def fill(shape: tuple[int, ...]) -> np.ndarray:
            return self.rng.integers(0, 256, shape, dtype=np.uint8)

        self.tensors, self.block_dim = engine_tensors(
            MODELS["llama3-70b-tp8-fp8"], "page", pool, 16, fill
        )
        self.kv = KVLayout.from_tensors(self.tensors, block_size=16, block_dim=self.block_dim)
        self.arena = HostArena(cfg.most_blocks + 16, self.kv.slot_bytes)
        self.x = np.zeros(64)
        self.kernels = 0
        self.steps = 0
        self.rig = Rig(self.kv, self.arena, pool, self.kernel, self.end_step, self.scramble,
                       self.same_blocks, self.stored_ok)  # fmt: skip

    def kernel(self) -> None:
        self.x += 1.0
        self.kernels += 1

    def end_step(self) -> None:
        self.steps += 1

    def scramble(self, blocks: np.ndarray) -> None:
        for t in self.tensors:
            shape = list(t.shape)
            shape[self.block_dim] = len(blocks)
            noise = self.rng.integers(0, 256, shape, dtype=np.uint8)
            index = [slice(None)] * t.ndim
            index[self.block_dim] = blocks  # type: ignore[call-overload]
            t[tuple(index)] = noise

    def images(self, blocks: np.ndarray) -> np.ndarray:
        parts = [
            np.moveaxis(t.take(blocks, axis=self.block_dim), self.block_dim, 0).reshape(
                len(blocks), -1
            )
            for t in self.tensors
        ]
        return np.concatenate(parts, axis=1)

    def same_blocks(self, a: np.ndarray, b: np.ndarray) -> bool:
        return bool(np.array_equal(self.images(a), self.images(b)))

    def stored_ok(self, blocks: np.ndarray, slots: np.ndarray) -> bool:
        got = self.arena.slots[slots, : self.kv.slot_bytes]
        return bool(np.array_equal(got, self.images(blocks)))


@pytest.fixture
def cpu_rig():
    rig = CpuRig(TINY)
    yield rig
    rig.arena.close()


def rows_by(rows: Sequence[dict[str, Any]], measure: str) -> dict[str, dict[str, Any]]:
    return {r["case"]: r for r in rows if r["measure"] == measure}


def test_host_backend_gets_every_row_measured_and_checked(cpu_rig):
    rows = measure_method("host", cpu_rig.rig, TINY, 60.0)
    assert not [r for r in rows if r["measure"] == "error"]
    for measure in ("submit_us:store", "submit_us:load", "done_us:load", "wake_late_us:excess"):
        got = rows_by(rows, measure)
        assert set(got) == {"1 blocks", "4 blocks"}
        assert all(r["n"] > 0 and math.isfinite(r["median"]) for r in got.values())
    for r in rows_by(rows, "submit_us:store").values():
        assert 0 < r["median"] <= r["p99"]
    ratios = rows_by(rows, "step_ratio")
    assert set(ratios) == {
        "inline store 1",
        "inline store 2",
        "thread 1-3 every 2 ms",
        "thread 1 back to back",
        "thread 2 back to back",
    }
    assert all(r["n"] == TINY.step_rounds and r["median"] > 0 for r in ratios.values())
    assert rows_by(rows, "step_us")[BASELINE]["n"] >= TINY.step_rounds * TINY.steps_per_window
    # every step is split into its parts: the baseline's medians, each arm's excess over them
    base_parts = rows_by(rows, "step_us")[BASELINE]["phases_us"]
    assert set(base_parts) == set(PHASES) and all(v >= 0 for v in base_parts.values())
    assert base_parts["kernels"] > 0
    for r in ratios.values():
        assert set(r["phase_excess_us"]) == set(PHASES)
        assert "us over baseline: before" in r["note"]
    # the engine step ran its kernels: warm-up and measured windows, 5 kernels per step
    windows = len(schedule(list(ratios), TINY.step_rounds))
    warmup = 6 * host_time.warmup_steps(TINY)
    assert cpu_rig.steps == warmup + windows * TINY.steps_per_window
    assert cpu_rig.kernels == cpu_rig.steps * TINY.kernels_per_step


def test_a_spent_budget_skips_timing_but_not_the_byte_checks(cpu_rig):
    checked: list[int] = []

    class Counting(HostBackend):
        def submit(self, specs: Sequence[TransferSpec]) -> Pending:
            checked.append(len(specs[0]))
            return super().submit(specs)

    rows = measure_method("host", cpu_rig.rig, TINY, 0.0, make=lambda n, kv, a: Counting(kv, a))
    assert [r["note"] for r in rows] == ["skipped"] * 3
    assert checked == [n for n in TINY.checked_blocks for _ in (0, 1)]  # a store and a load each


def test_a_path_that_drops_loads_is_reported_not_timed(cpu_rig):
    class DropsLoads(HostBackend):
        def submit(self, specs: Sequence[TransferSpec]) -> Pending:
            if specs[0].direction == "load":
                return super().submit([])  # finishes at once, moves nothing
            return super().submit(specs)

    rows = measure_method(
        "broken", cpu_rig.rig, TINY, 60.0, make=lambda n, kv, a: DropsLoads(kv, a)
    )
    assert len(rows) == 1 and rows[0]["measure"] == "error"
    assert "1 blocks differ after a store and a load" in rows[0]["note"]


def test_a_store_that_lands_in_the_wrong_slots_is_reported(cpu_rig):
    class Shifted(HostBackend):
        def submit(self, specs: Sequence[TransferSpec]) -> Pending:
            s = specs[0]
            if s.direction == "store":
                specs = [TransferSpec.of("store", s.blocks, s.slots + 1)]
            return super().submit(specs)

    rows = measure_method("shifted", cpu_rig.rig, TINY, 60.0, make=lambda n, kv, a: Shifted(kv, a))
    assert len(rows) == 1 and "stored blocks differ from the layout's oracle" in rows[0]["note"]


def test_a_backend_that_does_not_build_is_reported_with_its_error(cpu_rig):
    def fails(name: str, kv: KVLayout, arena: HostArena) -> CopyBackend:
        raise ImportError("no module named triton")

    rows = measure_method("vllm-triton", cpu_rig.rig, TINY, 60.0, make=fails)
    assert rows == [
        {
            "method": "vllm-triton",
            "measure": "error",
            "note": "build: ImportError('no module named triton')",
        }
    ]


def test_run_assembles_every_method_into_json_rows_and_a_table(monkeypatch):
    """``run`` end to end with the GPU rig swapped for the CPU one (and CUDA's queries faked):
    one result, every method in it, a method that fails reported beside the others."""
    import json

    import torch

    rig = CpuRig(TINY)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(host_time, "gpu_rig", lambda device, cfg: rig.rig)
    out = host_time.run(0, ["host", "no-such-method"], 60.0, config=TINY)
    assert json.loads(json.dumps(out)) == out
    assert out["device"] == "fake GPU" and out["slot_bytes"] == rig.kv.slot_bytes
    assert {r["method"] for r in out["rows"]} == {"host", "no-such-method"}
    (error,) = [r for r in out["rows"] if r["measure"] == "error"]
    assert error["method"] == "no-such-method" and "expected a copy backend in" in error["note"]
    assert out["table"][0] == TABLE_HEADER and len(out["table"]) == len(out["rows"]) + 1
    assert rig.arena._mmap is None  # closed by run


class PassesAfter(Deadline):
    """A deadline that passes after ``k`` checks."""

    def __init__(self, k: int) -> None:
        self.k = k

    def left(self) -> float:
        return 0.0

    def passed(self) -> bool:
        self.k -= 1
        return self.k < 0


@pytest.mark.parametrize(("checks", "measured"), [(1, ["1 blocks"]), (2, ["1 blocks", "4 blocks"])])
def test_a_short_budget_covers_each_block_count_once_before_repeating(cpu_rig, checks, measured):
    backend = HostBackend(cpu_rig.kv, cpu_rig.arena)
    try:
        rows = host_time.gil_part("host", backend, cpu_rig.rig, TINY, PassesAfter(checks))
    finally:
        backend.close()
    assert sorted(rows_by(rows, "submit_us:load")) == measured
    skipped = sorted(r["case"] for r in rows if r.get("note") == "skipped")
    assert skipped == sorted({"1 blocks", "4 blocks"} - set(measured))
    assert all(r["n"] >= 1 for r in rows_by(rows, "done_us:store").values())


def test_phase_excess_is_each_parts_median_over_the_baselines():
    base = {"before": [1e-6, 3e-6, 2e-6], "kernels": [1e-3, 1e-3, 1e-3], "after": [0.0], "sync": []}
    arm = {"before": [5e-6, 4e-6, 6e-6], "kernels": [1.1e-3], "after": [2e-5], "sync": [1e-5]}
    # a part with no steps on either side is left out, not reported as 0
    assert phase_excess_us(arm, base) == {"before": 3.0, "kernels": 100.0, "after": 20.0}

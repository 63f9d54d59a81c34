"""``kvoffload bench transfer``'s GPU run without a GPU: a whole result assembled from synthetic
timings prints, plots and summarizes; the dry run lists cases, methods and sections; the methods
and the host section are resolved by name, and what is absent is skipped with a note."""

from __future__ import annotations

import argparse
import json
import sys
import types
from typing import Any

import pytest

from kvoffload.bench import transfer_gpu, transfer_methods
from kvoffload.bench.transfer import add_arguments, run
from kvoffload.bench.transfer_cases import CASES, METHODS, SECTIONS, case_blocks, parse_cases
from kvoffload.transfer.registry import BACKENDS

LINK = {
    k: {"median": v, "min": v, "max": v, "n": 3}
    for k, v in {"h2d": 50.0, "d2h": 40.0, "both": 90.0}.items()
}


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def synthetic_result() -> dict[str, Any]:
    """The GPU run's result as ``run_gpu`` assembles it, rows from ``transfer_row`` fed
    synthetic ``time_transfers`` timings."""
    from kvoffload.bench.transfer_sweep import transfer_row

    def timings(seconds: float) -> dict[str, list[float]]:
        return {
            "gpu_s": [seconds, seconds * 1.1, seconds * 0.9],
            "submit_s": [20e-6] * 3,
            "enqueue_s": [80e-6] * 3,
            "wake_s": [30e-6] * 3,
        }

    rows = []
    for model, layout, bs, slot, pieces in (
        ("llama3-8b", "page", 16, 2 << 20, 32),
        ("llama3-70b-tp8-fp8", "kv_split", 16, 320 << 10, 160),
    ):
        for n, asked in case_blocks(model, bs, [1, 16, 37, 64, 1000, 2048], 1024).items():
            for method in METHODS:
                t = n * slot / 45e9
                times = {(d, lead): timings(t) for d in ("store", "load") for lead in (False, True)}
                row = transfer_row(method, n, slot // pieces, pieces, n * slot, times)
                tag = {"model": model, "layout": layout, "block_size": bs}
                rows.append({**tag, **row, "asked_blocks": asked, "path": "dma"})
    return {
        "benchmark": "transfer",
        "device": "NVIDIA H100 (synthetic)",
        "driver": 13000,
        "date": "2026-11-25T00:00:00",
        "link": {"bytes": 1 << 30, "GBps": LINK},
        "link_after": {"bytes": 1 << 30, "GBps": LINK},
        "rows": rows,
        "store_and_load": [
            {
                "model": "llama3-8b",
                "layout": "page",
                "block_size": 16,
                "blocks": 512,
                "method": m,
                "GBps": 91.0,
                "runs_GBps": [91.0],
            }
            for m in METHODS
        ],
        "gemm": {"baseline_noise": 0.01, "slowdown": {m: 0.03 for m in METHODS}},
        "launch_stall": {
            "staged": {"slowdown": 0.05, "noise": 0.02, "host_cpu_us_per_transfer": 400.0}
        },
        "host_time": {  # as kvoffload.bench.host_time returns it: rows, a table (header first)
            "rows": [
                {
                    "method": "staged",
                    "measure": "wake_late_us:excess",
                    "case": "1 blocks",
                    "blocks": 1,
                    "median": 4.2,
                    "p99": 9.0,
                    "n": 40,
                }
            ],
            "table": [
                ["method", "measure", "case", "median", "p99", "n", "note"],
                ["staged", "wake_late_us:excess", "1 blocks", "4.2", "9.0", "40", ""],
            ],
        },
        "paths": {"staged": {"path": "dma", "path_reason": "no native engine yet"}},
        "method_notes": {"vllm-triton": "skipped: absent"},
        "failures": [
            {
                "model": "llama3-8b",
                "layout": "page",
                "block_size": 16,
                "blocks": 1,
                "method": "sm",
                "during": "sweep",
                "error": "RuntimeError: bytes",
            }
        ],
        "skipped_cases": ["llama3-8b:page:64 (~40 s)"],
        "binding_host_us": {"2048": {"ctypes_us": 1500.0}},
        "wall_s": 281.0,
    }


def test_a_whole_gpu_result_prints_plots_and_summarizes(tmp_path, capsys):
    """Every reader of the result (targets, tables, plot, JSON) finds the keys it needs: a GPU
    run is too scarce to find a missing key in."""
    from kvoffload.bench.common import write_json
    from kvoffload.bench.transfer_plot import plot
    from kvoffload.bench.transfer_report import print_gpu
    from kvoffload.bench.transfer_targets import summarize

    result = synthetic_result()
    result["targets"] = summarize(result)
    lines = {t["line"]: t for t in result["targets"]}
    assert lines["GIL per submit: a sleeping thread's extra lateness"]["value"] == 4.2
    big = lines["1,000 blocks load"]
    assert big["value"] == pytest.approx(0.9, rel=0.01)  # 45 GB/s of 50, median of 3 timings
    assert big["reached"] is False and "x512" in big["measured"]  # 2048 capped at 1 GiB
    print_gpu(result)
    printed = " ".join(capsys.readouterr().out.split())
    for text in (
        "issue 21's targets",
        "skipped (time budget)",
        "FAILED sm",
        "wake_late_us:excess",
        "no native engine yet",
        "vllm-triton: skipped",
    ):
        assert text in printed
    assert plot(result, tmp_path / "t.png").stat().st_size > 10_000
    path = write_json(tmp_path / "t.json", result)
    assert json.loads(path.read_text())["rows"][0]["path"] == "dma"


def test_the_dry_run_lists_cases_methods_and_sections_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(transfer_methods, "VLLM_TRITON", "kvoffload.bench.no_such_module")
    assert run(args("--dry-run")) == 0
    printed = " ".join(capsys.readouterr().out.split())  # the console wraps at 80 columns
    assert f"methods {','.join(METHODS)}" in printed and f"sections {','.join(SECTIONS)}" in printed
    assert "1,16,37,64,512" in printed  # Llama-3-8B's 2 MiB slots: 1,000 and 2,048 capped
    assert "vllm-triton: skipped: kvoffload.bench.no_such_module is absent" in printed
    assert len(parse_cases(CASES)) == 12
    assert case_blocks("llama3-8b", 16, [1, 1000, 2048], 1024) == {1: 1, 512: 2048}
    assert case_blocks("llama3-70b-tp8-fp8", 16, [16, 2048], 1024) == {16: 16, 2048: 2048}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "staged,nope"], "--methods: expected names from"),
        (["--sections", "sweep,gil"], "--sections: expected names from"),
        (["--cases", "llama3-8b:page"], "model:layout:block_size"),
        (["--cases", "llama3-8b:pages:16"], "a layout in"),
        (["--time-budget-s", "0"], "expected seconds > 0, got 0.0"),
    ],
)
def test_bad_gpu_arguments_are_refused_with_what_was_expected(argv, message):
    with pytest.raises(SystemExit, match=message):
        run(args("--dry-run", *argv))


def test_methods_by_name():
    with pytest.raises(ValueError, match="expected a method in"):
        transfer_methods.unavailable("cuda-graph")
    assert all(transfer_methods.unavailable(m) is None for m in METHODS if m != "vllm-triton")

    class Native:
        path, path_reason = "native", None

    assert transfer_methods.path_of(Native()) == {"path": "native", "path_reason": None}

    class Fallback:  # ``staged`` where the native engine cannot run
        name, path_reason = "dma", "disabled by KVOFFLOAD_NATIVE=0"

    assert transfer_methods.path_of(Fallback()) == {
        "path": "dma",
        "path_reason": "disabled by KVOFFLOAD_NATIVE=0",
    }
    assert transfer_methods.path_of(object()) == {"path": "", "path_reason": None}
    assert "staged-python" not in METHODS  # the Python staged path is gone (issue 26)


def test_the_host_section_gets_the_registry_methods_or_is_skipped(monkeypatch):
    calls = []

    def fake_run(device: int, methods: list[str], budget_s: float) -> dict[str, Any]:
        calls.append((device, methods, budget_s))
        return {"rows": [], "table": []}

    module = types.ModuleType(transfer_gpu.HOST_TIME)
    module.run = fake_run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, transfer_gpu.HOST_TIME, module)
    out = transfer_gpu.host_time(["staged", "vllm-triton", "no-such-method", "dma"], 50.0, 0)
    assert "no-such-method" not in BACKENDS
    assert calls == [(0, ["staged", "vllm-triton", "dma"], 50.0)]
    assert out["methods_left_out"] == ["no-such-method"]

    def broken(device: int, methods: list[str], budget_s: float) -> dict[str, Any]:
        raise ImportError("cannot import name 'Engine'")

    module.run = broken  # type: ignore[attr-defined]
    out = transfer_gpu.host_time(["staged"], 50.0, 0)  # the sweep's results are not lost
    assert out == {
        "skipped": f"{transfer_gpu.HOST_TIME}.run failed: ImportError: cannot import name 'Engine'"
    }
    monkeypatch.setattr(transfer_gpu, "HOST_TIME", "kvoffload.bench.no_such_module")
    assert transfer_gpu.host_time(["staged"], 50.0, 0) == {
        "skipped": "kvoffload.bench.no_such_module is absent from this checkout"
    }


class FakeBackend:
    def __init__(self, method: str) -> None:
        self.method, self.closed = method, False
        self.path = "native" if method == "staged" else method
        self.path_reason = None

    def close(self) -> None:
        self.closed = True


def test_the_case_loop_records_failures_caps_dma_and_keeps_to_its_budget(monkeypatch):
    """``Cases`` on CPU with the GPU measurements replaced: a method that moves a wrong byte is
    recorded and measured no further in that case, ``dma`` is capped by pieces, a method that
    fails to build costs only itself, every backend is closed, and a case whose estimate no
    longer fits the budget is skipped and listed."""
    built: list[FakeBackend] = []
    measured: list[tuple[str, int]] = []

    class KV:
        def __init__(self, model: str, layout: str, bs: int, pool: int) -> None:
            self.kv = types.SimpleNamespace(
                groups=[types.SimpleNamespace(regions=[0] * 32)], slot_bytes=2 << 20
            )

    def make(method: str, kv: Any, arena: Any) -> FakeBackend:
        if method == "auto":
            raise RuntimeError("no planner here")
        built.append(FakeBackend(method))
        return built[-1]

    def measure_method(sleeper, kv, arena, method, backend, n, *rest):
        measured.append((method, n))
        if method == "sm" and n == 16:
            raise RuntimeError("sm: round trip corrupted bytes (16 blocks)")
        return {"method": method, "blocks": n}

    monkeypatch.setattr(transfer_gpu, "SyntheticKV", KV)
    monkeypatch.setattr(transfer_gpu.Cases, "make_arena", lambda self, n, s: FakeBackend("arena"))
    monkeypatch.setattr(transfer_gpu, "make", make)
    monkeypatch.setattr(transfer_gpu, "measure_method", measure_method)
    monkeypatch.setattr(transfer_gpu, "measure_both", lambda *a: 90.0)
    monkeypatch.setattr(transfer_gpu, "measure_first_layer", lambda *a: {"layer0_ms": 1.0})
    a = args(
        "--cases",
        "llama3-8b:page:16,llama3-70b-tp8:kv_split:16",
        "--sections",
        "sweep",
        "--dma-max-pieces",
        "1024",
        "--gpu-blocks",
        "1,16,64",
    )
    a.methods = ["staged", "dma", "sm", "auto"]
    saved: list[int] = []  # rows at each checkpoint
    sleeper: Any = None  # the measurements that use it are replaced
    cases = transfer_gpu.Cases(
        a, sleeper, a.methods, float("inf"), lambda o: saved.append(len(o["rows"]))
    )
    out = cases.run()
    assert saved == [6, 12]  # after each case, the rows so far (7 measured, sm's 16 failed)
    first = [(m, n) for m, n in measured[: len(measured) // 2]]
    assert first == [
        ("staged", 1),
        ("dma", 1),
        ("sm", 1),
        ("staged", 16),
        ("dma", 16),
        ("sm", 16),
        ("staged", 64),
    ]  # dma: 64 x 32 pieces > 1024; sm dropped
    assert out["dma_skipped"][0] == "llama3-8b:page:16 x64"
    assert [(f["method"], f["during"]) for f in out["failures"]] == [
        ("auto", "build"),
        ("sm", "sweep"),
        ("auto", "build"),
        ("sm", "sweep"),
    ]
    row = out["rows"][0]
    assert row == {
        "model": "llama3-8b",
        "layout": "page",
        "block_size": 16,
        "method": "staged",
        "blocks": 1,
        "asked_blocks": 1,
        "path": "native",
    }
    # store+load at once: 64 blocks each way, dma's 2,048 pieces over its cap; sm had failed
    assert [b["method"] for b in out["store_and_load"]] == ["staged", "staged"]
    assert out["paths"]["staged"] == {"path": "native", "path_reason": None}
    assert all(b.closed for b in built) and len(out["first_layer"]) == 2
    measured.clear()
    late = transfer_gpu.Cases(a, sleeper, a.methods, deadline=0.0).run()
    assert (
        len(late["skipped_cases"]) == 1 and "llama3-70b-tp8:kv_split:16" in late["skipped_cases"][0]
    )
    assert {m for m, _ in measured} == {"staged", "dma", "sm"}  # the first case always runs


def test_the_driver_release_is_read_from_the_kernel_modules_version_line(tmp_path):
    version = tmp_path / "version"
    version.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue Sep 23 09:26:23 UTC 2025\n"
    )
    assert transfer_gpu.driver_release(str(version)) == "580.95.05"
    assert transfer_gpu.driver_release(str(tmp_path / "absent")) is None

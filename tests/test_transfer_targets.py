"""The transfer benchmark's target summary, on a synthetic result: each line reads the rows it
names, against the link of the same run."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from kvoffload.bench.transfer_targets import summarize

LINK_VALUES = {"h2d": 50.0, "d2h": 40.0, "both": 90.0}
LINK = {k: {"median": v} for k, v in LINK_VALUES.items()}


def row(model: str, layout: str, bs: int, blocks: int, slot: int, gbps: float) -> dict[str, Any]:
    return {
        "model": model,
        "layout": layout,
        "block_size": bs,
        "blocks": blocks,
        "slot_bytes": slot,
        "method": "auto",
        "store_GBps": gbps * 0.8,  # the same share of each direction's link
        "load_GBps": gbps,
        "store_p50_us": 90.0,
        "store_p99_us": 120.0,
        "load_p50_us": 95.0,
        "load_p99_us": 130.0,
    }


def result(fp8_gbps: float) -> dict[str, Any]:
    return {
        "link": {"GBps": LINK},
        "rows": [
            row("llama3-70b-tp8-fp8", "kv_split", 16, 1000, 320 << 10, fp8_gbps),
            row("llama3-70b-tp8-fp8", "page", 16, 1000, 320 << 10, 49.0),
            row("llama3-8b", "page", 16, 1, 2 << 20, 20.0),
            {**row("llama3-8b", "page", 16, 512, 2 << 20, 49.0), "method": "staged"},
        ],
        "store_and_load": [
            {"model": "x", "layout": "page", "block_size": 16, "method": "auto", "GBps": 96.0}
        ],
        "submit_parts": {"64": {"pieces": 2048, "submit_us": 60.0}},
    }


def lines(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["target"].split(" >=")[0].split(" <=")[0].split(" p50")[0]: t for t in summarize(res)}


def test_the_worst_layout_decides_and_the_link_of_the_run_is_the_yardstick():
    got = lines(result(fp8_gbps=45.0))
    load = got["1,000 blocks fp8 TP8 (2-4 KiB pieces, 320 KiB slots) load"]
    assert load["value"] == 45.0 / 50.0 and load["reached"] is False  # 0.90 < 0.93
    assert "kv_split" in load["measured"]
    store = got["1,000 blocks fp8 TP8 (2-4 KiB pieces, 320 KiB slots) store"]
    assert store["value"] == 36.0 / 40.0
    ok = lines(result(fp8_gbps=48.0))
    assert ok["1,000 blocks fp8 TP8 (2-4 KiB pieces, 320 KiB slots) load"]["reached"] is True


def test_unmeasured_targets_say_so_and_other_lines_read_their_rows():
    got = lines(result(fp8_gbps=48.0))
    latent = got["1,000 blocks K-only latent (18 KiB pieces, 486 KiB slots) load"]
    assert latent["reached"] is None and latent["measured"] == "not measured"
    one = got["1 block (2 MiB) load"]  # link time 2 MiB / 50 GB/s = 42 us, + 50 us
    assert one["value"] == 95.0 and one["reached"] is False
    assert got["1 block (2 MiB) store"]["reached"] is True  # 52 us + 50 us > 90 us
    assert got["store+load at once"]["reached"] is True
    assert got["host submit"]["reached"] is False


def test_a_whole_gpu_result_built_from_timings_prints_plots_and_summarizes(tmp_path, capsys):
    """The GPU run's result as ``run_gpu`` assembles it, from synthetic ``time_transfers``
    timings through ``transfer_row``: the summary, the printed tables and the plot read every key
    they need (a GPU run is too scarce to find a missing key in)."""
    import json

    from kvoffload.bench.common import write_json
    from kvoffload.bench.transfer import _print_gpu
    from kvoffload.bench.transfer_gpu import transfer_row
    from kvoffload.bench.transfer_plot import plot

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
        ("qwen2.5-7b", "kv_split", 32, 1792 << 10, 56),
    ):
        for n in (1, 16, 256, 1000):
            for method in ("staged", "dma", "auto"):
                t = n * slot / 45e9
                times = {(d, lead): timings(t) for d in ("store", "load") for lead in (False, True)}
                row = transfer_row(method, n, slot // pieces, pieces, n * slot, times)
                rows.append({"model": model, "layout": layout, "block_size": bs, **row})
    assert rows[0]["slot_bytes"] == 2 << 20 and rows[0]["pieces"] == 32
    link = {k: {"median": v, "min": v, "max": v, "n": 3} for k, v in LINK_VALUES.items()}
    result: dict[str, Any] = {
        "benchmark": "transfer",
        "device": "NVIDIA H100 (synthetic)",
        "driver": 13000,  # gpu_info() and machine_info() fill these in a real run
        "date": "2026-11-24T00:00:00",
        "link": {"bytes": 1 << 30, "GBps": link},
        "link_after": {"bytes": 1 << 30, "GBps": link},
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
            for m in ("staged", "dma", "auto")
        ],
        "first_layer": [
            {
                "model": "llama3-8b",
                "layout": "page",
                "block_size": 16,
                "blocks": 512,
                "layer0_ms": 0.9,
                "whole_ms": 20.1,
                "host0_us": 150.0,
                "host_us": 2000.0,
                "slices": 10,
                "GBps": 53.0,
            }
        ],
        "gemm": {"baseline_noise": 0.01, "slowdown": {"staged": 0.03, "dma": 0.0}},
        "launch_stall": {
            "staged": {"slowdown": 0.05, "noise": 0.02, "host_cpu_us_per_transfer": 400.0}
        },
        "submit_parts": {"64": {"pieces": 2048, "submit_us": 80.0, "submit_checked_us": 60.0}},
        "skipped_cases": ["llama3-8b:page:64"],
        "binding_host_us": {"2048": {"ctypes_us": 1500.0}},
        "seconds": 321.0,
    }
    targets = summarize(result)
    result["targets"] = targets
    by_name = {t["target"]: t for t in targets}
    assert any("60 us from a paired TransferWorker" in t["measured"] for t in by_name.values())
    assert any(t["target"].startswith("layer 0 of a 512-block load") for t in by_name.values())
    fp8 = [t for n, t in by_name.items() if n.startswith("1,000 blocks fp8 TP8") and "load" in n]
    median_s = statistics.median([1000 * (320 << 10) / 45e9 * f for f in (1, 1.1, 0.9)])
    assert fp8[0]["value"] == pytest.approx(1000 * (320 << 10) / median_s / 1e9 / 50.0)
    _print_gpu(result)
    printed = capsys.readouterr().out
    assert "target reached?" in printed and "skipped (time budget)" in printed
    png = plot(result, tmp_path / "transfer.png")
    assert png.stat().st_size > 10_000
    path = write_json(tmp_path / "transfer.json", result)
    assert json.loads(path.read_text())["rows"][0]["method"] == "staged"


def test_the_dry_run_lists_every_case_without_a_gpu(capsys):
    """``bench transfer --dry-run``: the sweep's cases, their transfer sizes (capped at
    ``--max-transfer-mib``) and a rough time; bad cases are refused with what was expected."""
    import argparse

    from kvoffload.bench.transfer import CASES, add_arguments, case_blocks, parse_cases, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--dry-run"])) == 0
    printed = capsys.readouterr().out
    assert "all cases ~" in printed and "1,3,16,256,512" in printed
    assert len(parse_cases(CASES)) == 12
    assert case_blocks("llama3-8b", 16, [1, 1000, 2048], 1024) == [1, 512]  # 2 MiB slots
    assert case_blocks("llama3-70b-tp8-fp8", 16, [3, 2048], 1024) == [3, 2048]
    with pytest.raises(SystemExit, match="model:layout:block_size"):
        parse_cases("llama3-8b:page")
    with pytest.raises(SystemExit, match="a layout in"):
        parse_cases("llama3-8b:pages:16")

"""The transfer benchmark's target rows (issue 21), on synthetic results: each row reads the rows
it names, against the link of the same run, and says what the machine allowed where a target was
not reached."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.bench.transfer.targets import link_limit, summarize

LINK_VALUES = {"h2d": 50.0, "d2h": 40.0, "both": 90.0}
LINK = {k: {"median": v, "min": v, "max": v, "n": 3} for k, v in LINK_VALUES.items()}
SLOT = 2 << 20


def row(
    model: str, layout: str, blocks: int, method: str, share: float, *, piece: int = 64 << 10
) -> dict[str, Any]:
    """A sweep row moving ``share`` of each direction's link end to end (copies alone: 0.99)."""
    out: dict[str, Any] = {
        "model": model,
        "layout": layout,
        "block_size": 16,
        "blocks": blocks,
        "asked_blocks": 2048 if blocks == 512 else blocks,
        "slot_bytes": SLOT,
        "piece_bytes": piece,
        "method": method,
        "path": "native" if method == "staged" else "python",
    }
    for d, key in (("store", "d2h"), ("load", "h2d")):
        gbps = LINK_VALUES[key]
        out[f"{d}_GBps"] = share * gbps
        out[f"{d}_gpu_GBps"] = 0.99 * gbps
        wire_us = SLOT / gbps / 1e3
        out[f"{d}_p50_us"] = wire_us / share
        out[f"{d}_p99_us"] = 2 * wire_us / share
        out[f"{d}_submit_us"] = 8.0 if method == "staged" else 400.0
    return out


def result(staged_fp8: float) -> dict[str, Any]:
    rows = []
    for method, share in (("staged", 0.9), ("dma", 0.97)):
        for n in (1, 16, 37, 64, 512):
            rows.append(row("llama3-8b", "page", n, method, share))
            fp8 = staged_fp8 if method == "staged" and n == 512 else share
            rows.append(row("llama3-70b-tp8-fp8", "kv_split", n, method, fp8, piece=2048))
    return {
        "link": {"GBps": LINK},
        "link_after": {"GBps": {**LINK, "h2d": {**LINK["h2d"], "median": 45.0}}},
        "rows": rows,
        "store_and_load": [
            {
                "model": "llama3-8b",
                "layout": "page",
                "block_size": 16,
                "blocks": 512,
                "method": m,
                "GBps": g,
            }
            for m, g in (("staged", 80.0), ("dma", 88.0))
        ],
        "gemm": {"baseline_noise": 0.01, "slowdown": {"staged": 0.01, "sm": 0.3}},
    }


def by_line(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["line"]: t for t in summarize(res)}


def test_the_link_is_the_higher_median_of_start_and_end():
    assert link_limit(result(0.9)) == LINK_VALUES  # the end's lower h2d was a disturbance


def test_the_worst_case_decides_and_the_best_method_there_is_what_the_machine_allowed():
    got = by_line(result(staged_fp8=0.6))
    big = got["1,000 blocks load"]
    assert big["value"] == pytest.approx(0.6) and big["reached"] is False
    assert "llama3-70b-tp8-fp8:kv_split:16 x512" in big["measured"]
    assert "dma 0.970" in big["allowed"] and "copies alone up to 0.990" in big["allowed"]
    mid = got["37-64 blocks store"]  # every staged row there moves 0.9 >= 0.85
    assert mid["value"] == pytest.approx(0.9) and mid["reached"] is True
    assert mid["allowed"] is None and "worst of 4" in mid["measured"]
    assert got["16 blocks load"]["reached"] is True
    big = by_line(result(staged_fp8=0.96))["1,000 blocks load"]  # now the bf16 page case is worst
    assert big["value"] == pytest.approx(0.9) and "llama3-8b:page:16 x512" in big["measured"]


def test_one_block_is_against_wire_time_plus_25_us():
    got = by_line(result(0.9))
    load = got["1 block load: submit to done"]
    wire = SLOT / 50.0 / 1e3  # 41.9 us at 50 GB/s
    assert load["value"] == pytest.approx(wire / 0.9 - wire)  # 4.7 us over the wire
    assert load["reached"] is True
    slow = result(0.9)
    for r in slow["rows"]:
        if r["method"] == "staged" and r["blocks"] == 1:
            r["load_p50_us"] = wire + 60.0
    load = by_line(slow)["1 block load: submit to done"]
    assert load["value"] == pytest.approx(60.0) and load["reached"] is False
    assert load["allowed"].startswith("best method there dma: wire + 1 us")


def test_store_and_load_gemm_and_coverage():
    got = by_line(result(0.9))
    both = got["store and load at once"]
    assert both["value"] == pytest.approx(80.0 / 90.0) and both["reached"] is False
    assert both["allowed"] == "best method there dma 0.978"
    assert got["a GEMM beside transfers"]["reached"] is True
    cover = got["the sweep covers every shape the targets name"]
    assert cover["reached"] is False and "K-only latent" in cover["measured"]
    assert "K/V split" in cover["measured"]  # 64 KiB bf16 pieces measured only in page


def test_unmeasured_lines_say_so():
    res = result(0.9)
    res["rows"] = [r for r in res["rows"] if r["method"] != "staged"]
    del res["gemm"]
    got = by_line(res)
    for name in ("16 blocks store", "1 block load: submit to done", "a GEMM beside transfers"):
        assert got[name]["reached"] is None and got[name]["measured"] == "not measured"


def host_row(method: str, measure: str, case: str, median: float, **extra: Any) -> dict[str, Any]:
    """A row as ``kvoffload.bench.transfer.host_time`` writes it."""
    return {
        "method": method,
        "measure": measure,
        "case": case,
        "median": median,
        "p99": None,
        "n": 5,
        "note": "",
        **extra,
    }


def test_host_lines_read_the_host_sections_rows():
    res = result(0.9)
    res["host_time"] = {
        "rows": [
            host_row("staged", "wake_late_us:excess", "1 blocks", 3.0, blocks=1),
            host_row("staged", "wake_late_us:excess", "2048 blocks", 14.0, blocks=2048),
            host_row("dma", "wake_late_us:excess", "2048 blocks", 9.0, blocks=2048),
            host_row("staged", "step_ratio", "inline store 1", 1.01),
            host_row("staged", "step_ratio", "inline store 16", 1.025),
            host_row("staged", "step_ratio", "thread 1-16 every 2 ms", 1.08),
            host_row("dma", "step_ratio", "thread 1-16 every 2 ms", 1.04),
            host_row("staged", "step_ratio", "thread 16 back to back", 1.9),
            {"method": "sm", "measure": "step_ratio", "case": "all", "note": "skipped"},
        ]
    }
    got = by_line(res)
    gil = got["GIL per submit: a sleeping thread's extra lateness"]
    assert gil["value"] == 14.0 and gil["reached"] is False and "2048 blocks" in gil["measured"]
    assert gil["allowed"] == "least there dma 9.0 us"  # at the worst case's 2,048 blocks
    own = got["eager engine step storing 1-16 blocks in its own thread"]
    assert own["value"] == pytest.approx(0.025) and own["reached"] is True
    beside = got["the same step, another thread storing and loading every 2 ms"]
    assert beside["reached"] is False and beside["allowed"] == "least there dma +4.0%"
    b2b = got["the same step, another thread transferring back to back"]
    assert b2b["reached"] is None and b2b["measured"].startswith("+90.0% worst")
    inside = got["GIL per submit: time inside the call (an upper bound)"]
    assert inside["value"] == 8.0 and inside["reached"] is True
    del res["host_time"]
    assert (
        by_line(res)["eager engine step storing 1-16 blocks in its own thread"]["reached"] is None
    )

"""The transfer benchmark's target summary, on a synthetic result: each line reads the rows it
names, against the link of the same run."""

from __future__ import annotations

from typing import Any

from kvoffload.bench.transfer_targets import summarize

LINK = {"h2d": {"median": 50.0}, "d2h": {"median": 40.0}, "both": {"median": 90.0}}


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

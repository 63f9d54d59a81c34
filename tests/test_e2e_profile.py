"""The trace summary behind ``bench e2e --profile`` (synthetic chrome-trace events)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvoffload.bench.e2e.runner.core_flags import configured, settings_of
from kvoffload.bench.e2e.runner.profile import compare, summarize_trace
from kvoffload.bench.e2e.runner.variants import parse_variant


def _k(name: str, ts: float, dur: float, stream: int = 7) -> dict[str, Any]:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def _m(name: str, ts: float, dur: float, nbytes: int = 1 << 30) -> dict[str, Any]:
    args = {"stream": 20, "bytes": nbytes}
    return {"cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur, "args": args}


def test_summary_splits_model_ours_and_dma_and_the_overlap():
    events = [
        _k("gemm", 0, 100),
        _k("gemm", 100, 100),
        _k("attn", 250, 50),
        _k("copy_blocks_0d1d", 50, 100, stream=21),  # beside gemm 50..150
        _m("Memcpy HtoD (Pinned -> Device)", 120, 60),  # beside 120..180: union 50..180
        _m("Memcpy DtoH (Device -> Pinned)", 400, 10),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
        {"ph": "M", "name": "process_name"},
    ]
    s = summarize_trace(events)
    assert s["model_kernels"] == 3 and s["ours_kernels"] == 1
    assert s["model_busy_ms"] == pytest.approx(0.25)
    assert s["model_span_ms"] == pytest.approx(0.30)
    assert s["model_beside_copy_ms"] == pytest.approx(0.13)  # 50..180 of gemm time
    assert s["ours_ms"] == pytest.approx(0.1)
    assert s["dma_ms"] == {"HtoD": pytest.approx(0.06), "DtoH": pytest.approx(0.01)}
    assert [t["name"] for t in s["top"]] == ["gemm", "attn"]
    assert s["top"][0]["count"] == 2 and s["top"][0]["median_us"] == 100


def test_compare_pairs_restored_requests_with_their_gpu_all_runs():
    slow = summarize_trace([_k("gemm", 0, 300), _k("copy_blocks", 0, 50, 3)])
    fast = summarize_trace([_k("gemm", 0, 200)])
    rec = {"round": 0, "conversation": 1, "turn": 2, "host_hit_tokens": 16, "profile": slow}
    ideal = [{"round": 0, "conversation": 1, "turn": 2, "profile": fast}]
    out = compare([rec], ideal)
    assert out["requests"] == 1
    assert out["model_busy_growth_ms"] == pytest.approx(0.1)
    assert out["kernel_growth_ms"] == {"gemm": pytest.approx(0.1)}
    assert compare([{**rec, "turn": 3}], ideal) == {"requests": 0}  # no gpu_all twin
    assert compare([{**rec, "host_hit_tokens": 0}], ideal) == {"requests": 0}  # not restored


def test_numbered_core_flags_and_refusals():
    assert settings_of("lp64") == {"load_programs": 64}
    assert settings_of("p32") == {"programs": 32}
    assert settings_of("ms8") == {"max_layer_slices": 8}
    assert settings_of("w16") == {"num_warps": 16}
    assert settings_of("ws100") == {"wait_spin_us": 100}  # not w + "s100"
    assert settings_of("lt4096") == {"layer_slice_transfer_bytes": 4 << 20}
    assert settings_of("wide") == {"load_programs": 0}
    assert settings_of("whole") == {"max_layer_slices": 1}  # a flag, not w + "hole"
    assert settings_of("narrow") == {"access_bytes": 8}
    assert settings_of("most") == {"plan_link_GBps": 0.0}  # a flag, not ms + "ost"
    assert settings_of("lp0") is None and settings_of("lpx") is None
    assert parse_variant("evict-lp48", "staged").backend == "staged-lp48"
    with pytest.raises(ValueError, match="lpN"):
        configured("staged", ["fast"])
    with pytest.raises(ValueError, match="expected backend 'staged'"):
        configured("dma", ["lp8"])


def test_timeline_offsets_from_the_first_device_event():
    events = [
        _m("Memcpy HtoD (Pinned -> Device)", 10, 40),
        _k("copy_blocks", 30, 30, 3),
        _k("gemm", 70, 20),
        _m("Memcpy DtoH (Device -> Pinned)", 200, 10),
    ]
    t = summarize_trace(events)["timeline_ms"]
    assert t == {
        "model_start": pytest.approx(0.06),
        "model_end": pytest.approx(0.08),
        "ours_start": pytest.approx(0.02),
        "ours_end": pytest.approx(0.05),
        "htod_start": 0.0,
        "htod_end": pytest.approx(0.04),
        "dtoh_start": pytest.approx(0.19),
        "dtoh_end": pytest.approx(0.2),
    }


def test_small_copies_are_listed_by_start_first_and_last_few():
    """Copies under a MiB (the engine's inputs and tokens) are listed with their direction and
    times from the timeline's start; past 2 x SMALL_LISTED only the first and last few."""
    from kvoffload.bench.e2e.runner.profile import SMALL_LISTED

    big = _m("Memcpy HtoD (Pinned -> Device)", 100, 50)
    smalls = [_m("Memcpy DtoH (Device -> Pinned)", 300 - 10 * i, 2, 64) for i in range(12)]
    listed = summarize_trace([big, *smalls])["small_copies_ms"]
    starts = sorted(300 - 10 * i for i in range(12))
    want = starts[:SMALL_LISTED] + starts[-SMALL_LISTED:]
    assert [c["start"] for c in listed] == [pytest.approx((t - 100) / 1e3) for t in want]
    assert {c["kind"] for c in listed} == {"DtoH"}
    assert listed[0]["end"] == pytest.approx((want[0] + 2 - 100) / 1e3)
    assert summarize_trace([big])["small_copies_ms"] == []


def test_first_events_interleave_host_calls_and_device_work_from_the_first_device_event():
    """A launch 5 us before its kernel shows at -0.005 ms beside it, sharing its correlation."""
    launch = {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 95, "dur": 3}
    launch["args"] = {"correlation": 9}
    kernel = _k("gemm", 100, 20)
    kernel["args"]["correlation"] = 9
    events = summarize_trace([kernel, launch])["first_events"]
    assert [(e["kind"], e["correlation"]) for e in events] == [("api", 9), ("device", 9)]
    assert events[0]["start"] == pytest.approx(-0.005) and events[1]["start"] == 0.0
    assert events[1]["stream"] == 7 and events[1]["ms"] == pytest.approx(0.02)


def test_api_totals_split_host_calls_by_name_with_their_threads():
    """kvoffload's driver calls (``cu*``) and torch's runtime calls add up apart, by name."""
    calls = [
        {"cat": "cuda_driver", "name": "cuMemcpy2DAsync_v2", "ts": 0, "dur": 2, "tid": 1},
        {"cat": "cuda_driver", "name": "cuMemcpy2DAsync_v2", "ts": 5, "dur": 3, "tid": 1},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9, "dur": 4, "tid": 1},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 20, "dur": 4, "tid": 2},
    ]
    api = summarize_trace([*calls, _k("gemm", 0, 10)])["api_ms"]
    assert list(api) == ["cudaLaunchKernel", "cuMemcpy2DAsync_v2"]  # largest total first
    assert api["cuMemcpy2DAsync_v2"] == {"count": 2, "ms": pytest.approx(0.005), "threads": 1}
    assert api["cudaLaunchKernel"]["threads"] == 2


def test_host_events_count_the_collections_inside_the_block():
    import gc

    import torch

    from kvoffload.bench.e2e.runner.timing import HostEvents

    with HostEvents(torch.device("cpu")) as events:
        gc.collect()
        gc.collect()
    assert events.counts["gc_collections"] >= 2 and events.counts["gc_ms"] > 0
    assert events.counts["num_alloc_retries"] == 0  # no CUDA: nothing counted
    assert events._on_gc not in gc.callbacks  # removed on exit
    gc.collect()
    assert events.counts["gc_collections"] >= 2


def test_the_stall_timers_records_are_kept_apart_from_the_waits_and_the_total() -> None:
    """``bench e2e`` times each layer's GPU wait with a StallTimer, whose two event records per
    timed wait run inside the wait's call: the per-layer wait and the calls per restore are
    kvoffload's own without them (``wait_call_us``), and with them (``wait_call_us_timed``)."""
    import numpy as np
    import torch

    from kvoffload.bench.e2e.runner.calls import INSTRUMENT, CallClock, total
    from kvoffload.bench.e2e.runner.engine import TurnResult
    from kvoffload.bench.e2e.runner.host_tier import LAYER_WAIT
    from kvoffload.bench.e2e.runner.results import record
    from kvoffload.bench.e2e.runner.workload import Turn

    clock = CallClock()
    clock.call(LAYER_WAIT, time.sleep, 0.002)
    clock.call(LAYER_WAIT, time.sleep, 0.002)
    clock.call("worker.step", time.sleep, 0.001)
    clock.note(INSTRUMENT, 0.003)  # of the waits' time, the timer's records
    calls = clock.take()
    waits_s, n = calls[LAYER_WAIT]
    assert n == 2 and total(calls) == pytest.approx(waits_s + calls["worker.step"][0] - 0.003)
    turn = Turn(0, 2, np.arange(4), np.arange(0))
    r = TurnResult(1, torch.zeros(1), [], 0.01, 4, 0, 4, 0, None, [0.0, 0.0], {}, kvo_calls=calls)
    rec = record(turn, r, 0)
    assert rec["wait_call_us_timed"] == pytest.approx(waits_s / 2 * 1e6)
    assert rec["wait_call_us"] == pytest.approx((waits_s - 0.003) / 2 * 1e6)
    assert rec["stall_timer_ms"] == pytest.approx(3.0)
    assert rec["kvo_ms_total"] == pytest.approx(total(calls) * 1e3)

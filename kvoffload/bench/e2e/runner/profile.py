"""Per-kernel device time of a few requests (``bench e2e --profile K``): where a restored
request's device time goes against the same request in ``gpu_all``.

The last ``K`` requests of each workload's first round run under ``torch.profiler`` (CUDA
activity: every kernel and copy of the context, kvoffload's own included) in the modes
``gpu_all`` and ``kvoffload``. ``summarize_trace`` reads the trace's device events and splits
them into the model's kernels, kvoffload's copy kernels (``copy_blocks``) and DMA copies, with
how long the model's kernels ran while a copy kernel or a DMA ran beside them. Tracing slows the
host, so a profiled request's TTFT is not comparable: a run with ``--profile`` is for this
attribution, not for the targets' table.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvoffload.bench.e2e.runner.results import request_key

OURS = "copy_blocks"  # kvoffload's gather/scatter kernel (kernels.py)
TOP = 12  # the model's kernels listed by name, largest total first
SMALL_COPY = 1 << 20  # bytes: a copy below this is the engine's own or an id upload, not KV
SMALL_LISTED = 4  # the first and the last this many small copies are listed per request
FIRST_EVENTS = 48  # host CUDA calls and device events listed per request, each
API_CATS = ("cuda_runtime", "cuda_driver")  # the trace's categories of host CUDA calls


@contextmanager
def traced(sink: dict[str, Any]) -> Iterator[None]:
    """Trace the block's device work; its summary (``summarize_trace``) lands in ``sink``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    sink.update(summarize_trace(events))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _covered(span: tuple[float, float], union: list[tuple[float, float]]) -> float:
    s, e = span
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in union if a < e and b > s)


def summarize_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Device time (ms) of a trace's kernels and copies: ``model`` (every kernel but ours), ours
    (``copy_blocks``), DMA copies by direction; ``model_busy_ms`` is the sum of the model's
    kernel durations, ``model_span_ms`` first start to last end, ``model_beside_copy_ms`` the
    part of the model's kernel time during which one of our kernels or a DMA ran (kernels of
    one stream never overlap, so the sum is device time), and ``top`` its largest kernels."""
    model: list[tuple[float, float]] = []
    ours: list[tuple[float, float]] = []
    dma: dict[str, float] = defaultdict(float)
    dma_spans: list[tuple[float, float]] = []
    htod: list[tuple[float, float]] = []
    dtoh: list[tuple[float, float]] = []
    small: list[tuple[str, float, float]] = []  # the engine's own copies (inputs, tokens)
    by_name: dict[str, list[float]] = defaultdict(list)
    streams: set[Any] = set()
    api: list[dict[str, Any]] = []  # the host's CUDA calls (launches, copies, waits)
    device: list[dict[str, Any]] = []
    for ev in events:
        cat, dur = ev.get("cat"), ev.get("dur")
        if dur is not None and cat in API_CATS:
            api.append(ev)
        elif dur is not None and cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            device.append(ev)
        if dur is None or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        span = (float(ev["ts"]), float(ev["ts"]) + float(dur))
        name = str(ev.get("name", ""))
        if cat == "gpu_memcpy":
            kind = "HtoD" if "HtoD" in name else ("DtoH" if "DtoH" in name else "other")
            dma[kind] += float(dur)
            dma_spans.append(span)
            if kind == "HtoD":
                htod.append(span)
            elif kind == "DtoH":
                dtoh.append(span)
            if int(ev.get("args", {}).get("bytes", SMALL_COPY)) < SMALL_COPY:
                small.append((kind, *span))
        elif cat == "kernel" and OURS in name:
            ours.append(span)
        elif cat == "kernel":
            model.append(span)
            by_name[name].append(float(dur))
            streams.add(ev.get("args", {}).get("stream"))
    copies = _union(ours + dma_spans)
    busy = sum(e - s for s, e in model)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    return {
        "model_kernels": len(model),
        "model_streams": len(streams),
        "model_busy_ms": busy / 1e3,
        "model_span_ms": (max(e for _, e in model) - min(s for s, _ in model)) / 1e3
        if model
        else 0.0,
        "model_beside_copy_ms": sum(_covered(sp, copies) for sp in model) / 1e3,
        "ours_kernels": len(ours),
        "ours_ms": sum(e - s for s, e in ours) / 1e3,
        "ours_span_ms": (max(e for _, e in ours) - min(s for s, _ in ours)) / 1e3 if ours else 0.0,
        "dma_ms": {k: v / 1e3 for k, v in dma.items()},
        "timeline_ms": _timeline(model, ours, htod, dtoh),
        "small_copies_ms": _small(small, model, ours, htod, dtoh),
        "first_events": _first_events(api, device, _t0(model, ours, htod, dtoh)),
        "api_ms": _api_totals(api),
        "top": [
            {
                "name": n[:120],
                "count": len(d),
                "ms": sum(d) / 1e3,
                "median_us": statistics.median(d),
            }
            for n, d in top
        ],
    }


def _api_totals(api: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Host time of the trace's CUDA calls by name: count, total ms and how many threads made
    them. kvoffload's native core calls the driver API (``cu*``); torch calls the runtime
    (``cuda*``), so the split tells whose calls a restored request's host time went to."""
    out: dict[str, dict[str, Any]] = {}
    threads: dict[str, dict[Any, int]] = defaultdict(lambda: defaultdict(int))
    for ev in api:
        name = str(ev.get("name", ""))[:60]
        row = out.setdefault(name, {"count": 0, "ms": 0.0})
        row["count"] += 1
        row["ms"] += float(ev["dur"]) / 1e3
        threads[name][ev.get("tid")] += 1
    for name, row in out.items():
        row["threads"] = len(threads[name])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def _t0(*kinds: list[tuple[float, float]]) -> float:
    return min((s for spans in kinds for s, _ in spans), default=0.0)


def _first_events(
    api: list[dict[str, Any]], device: list[dict[str, Any]], t0: float
) -> list[dict[str, Any]]:
    """The first ``FIRST_EVENTS`` host CUDA calls and device events of the trace by start, ms
    from the first device event (negative: the host before the device), with each one's stream
    and correlation id (a launch and its kernel share it): whether a late kernel was launched
    late or waited on the device."""
    out = []
    for kind, evs in (("api", api), ("device", device)):
        for ev in sorted(evs, key=lambda e: float(e["ts"]))[:FIRST_EVENTS]:
            args = ev.get("args", {})
            out.append(
                {
                    "kind": kind,
                    "name": str(ev.get("name", ""))[:60],
                    "start": (float(ev["ts"]) - t0) / 1e3,
                    "ms": float(ev["dur"]) / 1e3,
                    "stream": args.get("stream"),
                    "correlation": args.get("correlation"),
                }
            )
    return sorted(out, key=lambda e: e["start"])


def _small(
    small: list[tuple[str, float, float]], *kinds: list[tuple[float, float]]
) -> list[dict[str, Any]]:
    """The trace's copies under ``SMALL_COPY`` bytes (the engine's inputs, its sampled tokens;
    kvoffload's id uploads), first and last ``SMALL_LISTED`` each, ms from the timeline's start:
    when a copy the engine waits for ran against the model's kernels and the load."""
    t0 = _t0(*kinds)
    ordered = sorted(small, key=lambda x: x[1])
    if len(ordered) > 2 * SMALL_LISTED:
        ordered = ordered[:SMALL_LISTED] + ordered[-SMALL_LISTED:]
    return [{"kind": k, "start": (s - t0) / 1e3, "end": (e - t0) / 1e3} for k, s, e in ordered]


def _timeline(
    model: list[tuple[float, float]],
    ours: list[tuple[float, float]],
    htod: list[tuple[float, float]],
    dtoh: list[tuple[float, float]],
) -> dict[str, float]:
    """First start and last end of each kind, in ms from the earliest of them."""
    kinds = {"model": model, "ours": ours, "htod": htod, "dtoh": dtoh}
    t0 = _t0(*kinds.values())
    out = {}
    for name, spans in kinds.items():
        if spans:
            out[f"{name}_start"] = (min(s for s, _ in spans) - t0) / 1e3
            out[f"{name}_end"] = (max(e for _, e in spans) - t0) / 1e3
    return out


def compare(kvo: list[dict[str, Any]], gpu_all: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the profiled restored requests of ``kvo`` (records) paired with the same
    requests' profiled runs in ``gpu_all``: the model's busy time in both, the growth, and per
    top kernel name the growth of its total."""
    ideal = {request_key(r): r["profile"] for r in gpu_all if r.get("profile")}
    pairs = [
        (r["profile"], ideal[request_key(r)])
        for r in kvo
        if r["host_hit_tokens"] > 0 and r.get("profile") and request_key(r) in ideal
    ]
    if not pairs:
        return {"requests": 0}

    def med(values: list[float]) -> float:
        return float(statistics.median(values))

    growth: dict[str, list[float]] = defaultdict(list)
    for a, b in pairs:
        mine = {t["name"]: t["ms"] for t in a["top"]}
        for t in b["top"]:
            if t["name"] in mine:
                growth[t["name"]].append(mine[t["name"]] - t["ms"])
    return {
        "requests": len(pairs),
        "model_busy_ms": med([a["model_busy_ms"] for a, _ in pairs]),
        "gpu_all_model_busy_ms": med([b["model_busy_ms"] for _, b in pairs]),
        "model_busy_growth_ms": med([a["model_busy_ms"] - b["model_busy_ms"] for a, b in pairs]),
        "model_span_growth_ms": med([a["model_span_ms"] - b["model_span_ms"] for a, b in pairs]),
        "model_beside_copy_ms": med([a["model_beside_copy_ms"] for a, _ in pairs]),
        "ours_ms": med([a["ours_ms"] for a, _ in pairs]),
        "ours_kernels": med([a["ours_kernels"] for a, _ in pairs]),
        "dma_HtoD_ms": med([a["dma_ms"].get("HtoD", 0.0) for a, _ in pairs]),
        "dma_DtoH_ms": med([a["dma_ms"].get("DtoH", 0.0) for a, _ in pairs]),
        "timeline_ms": {
            k: med([a["timeline_ms"][k] for a, _ in pairs if k in a["timeline_ms"]])
            for k in sorted({k for a, _ in pairs for k in a["timeline_ms"]})
        },
        "kernel_growth_ms": {
            n: med(v) for n, v in sorted(growth.items(), key=lambda kv: -med(kv[1]))[:TOP]
        },
        "each": [
            {
                "timeline_ms": a["timeline_ms"],
                "small_copies_ms": a.get("small_copies_ms", []),
                "gpu_all_timeline_ms": b["timeline_ms"],
                "gpu_all_small_copies_ms": b.get("small_copies_ms", []),
                "first_events": a.get("first_events", []),
                "gpu_all_first_events": b.get("first_events", []),
            }
            for a, b in pairs
        ],
    }

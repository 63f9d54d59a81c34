"""The numbers of ``kvoffload bench e2e``'s runs (``bench.py`` runs the requests): one
request's ``record``, a mode's rounds pooled (``pool_rounds``) and summarized (``summarize``:
TTFT percentiles, hit ratios, the host tier's traffic, the load's ``overlap`` with compute), and
the ``attribution`` of a restored request's time against the same request in ``gpu_all``.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from kvoffload.bench.e2e.runner import calls as kvo_calls
from kvoffload.bench.e2e.runner.beside import MODE as BESIDE
from kvoffload.bench.e2e.runner.engine import TurnResult
from kvoffload.bench.e2e.runner.host_tier import LAYER_WAIT
from kvoffload.bench.e2e.runner.workload import Turn


def record(turn: Turn, r: TurnResult, round_: int) -> dict[str, Any]:
    """One request's numbers. ``load_exposed_ms``: how long attention waited for the host-tier
    load (a blocking load: all of it, where timed; full graphs: the layer waits plus the stream's
    wait at the gate's open, ``gate_open_ms``); ``load_ms`` is None where not timed (CPU)."""
    gate_open = r.sections.get("gate_open", 0.0)  # full graphs: the stream's wait at the open
    if r.layer_waits:
        exposed: float | None = sum(r.layer_waits) + gate_open
    elif r.wait_host_ms > 0:  # layered, its waits untimed (--untimed-waits): not measured
        exposed = None
    else:
        exposed = r.load_seconds
    waits = r.kvo_calls.get(LAYER_WAIT, (0.0, 0))
    timing = r.kvo_calls.get(kvo_calls.INSTRUMENT, (0.0, 0))[0]  # the StallTimer's, inside them
    return {
        "graph": r.graph,
        "round": round_,
        "conversation": turn.conversation,
        "turn": turn.index,
        "ttft_ms": r.ttft * 1e3,
        "prompt_tokens": r.prompt_tokens,
        "gpu_hit_tokens": r.gpu_hit_tokens,
        "host_hit_tokens": r.host_hit_tokens,
        "computed_tokens": r.computed_tokens,
        "load_ms": None if r.load_seconds is None else r.load_seconds * 1e3,
        "load_exposed_ms": None if exposed is None else exposed * 1e3,
        "layer_wait_ms": [w * 1e3 for w in r.layer_waits],
        "host_ms": {step: seconds * 1e3 for step, seconds in r.host.items()},
        "prefill_ms": r.sections.get("prefill", 0.0) * 1e3,
        "gather_ms": r.sections.get("gather", 0.0) * 1e3,
        "sdpa_ms": r.sections.get("sdpa", 0.0) * 1e3,
        "gate_open_ms": gate_open * 1e3,
        # device time between the events around each section on the engine's stream (a wait
        # enqueued in it, or work ahead of it, shows here): stage, load_submit, prefill, ...
        "device_ms": {k: v * 1e3 for k, v in r.sections.items() if not k.startswith("wait")},
        "load_bytes": r.load_bytes,
        "load_runs": r.load_runs,
        "beside_bytes": r.beside_bytes,
        "layer_launch_ms": r.layer_launch_ms,
        "wait_host_ms": r.wait_host_ms,
        "launch_ms": r.host.get("launch", 0.0) * 1e3,
        "kvo_ms": {name: s * 1e3 for name, (s, _) in r.kvo_calls.items()},
        "kvo_calls": {name: n for name, (_, n) in r.kvo_calls.items()},
        "kvo_ms_total": kvo_calls.total(r.kvo_calls) * 1e3,
        "kvo_ms_in_ttft": r.kvo_ttft_s * 1e3,
        # kvoffload's own per-layer wait; ``_timed``: with the StallTimer's records inside it
        "wait_call_us": (waits[0] - timing) / waits[1] * 1e6 if waits[1] else None,
        "wait_call_us_timed": waits[0] / waits[1] * 1e6 if waits[1] else None,
        "stall_timer_ms": timing * 1e3,
    }


def pool_rounds(rounds: list[dict[str, Any]], layers: int) -> dict[str, Any]:
    """One mode's rounds: records pooled, turns/s per round and their median."""
    records = [r for run in rounds for r in run["records"]]
    tier = {k: sum(run["tier"][k] for run in rounds) for k in rounds[0]["tier"]}
    out = summarize(records, tier, layers)
    tps = [run["turns_per_s"] for run in rounds]
    out["turns_per_s"] = statistics.median(tps)
    out["turns_per_s_rounds"] = tps
    out["wall_s"] = sum(run["wall_s"] for run in rounds)
    out["gpu_evicted_blocks"] = sum(run["gpu_evicted_blocks"] for run in rounds)
    out["late_stored_blocks"] = sum(run["late_stored_blocks"] for run in rounds)
    out["records"] = records
    return out


def summarize(records: list[dict[str, Any]], tier: dict[str, Any], layers: int) -> dict[str, Any]:
    def total(name: str, rows: list[dict[str, Any]] = records) -> float:
        return float(sum(r[name] for r in rows))

    prompt = total("prompt_tokens")
    ttft_s = total("ttft_ms") / 1e3
    returning = [r for r in records if r["turn"] >= 2]
    restored = [r for r in records if r["host_hit_tokens"] > 0]
    timed = all(r["load_ms"] is not None for r in restored)  # on a GPU
    load_s = sum(r["load_ms"] for r in restored) / 1e3 if timed else 0.0
    return {
        "turns": len(records),
        "ttft_ms": percentiles([r["ttft_ms"] for r in records]),
        "ttft_ms_returning": percentiles([r["ttft_ms"] for r in returning]),
        "ttft_ms_restored": percentiles([r["ttft_ms"] for r in restored]),
        "hit_ratio": {
            "gpu": total("gpu_hit_tokens") / prompt,
            "host": total("host_hit_tokens") / prompt,
            "computed": total("computed_tokens") / prompt,
        },
        "host": {
            "loaded_blocks": tier["loads"],
            "loaded_bytes": tier["load_bytes"],
            "load_GBps": tier["load_bytes"] / load_s / 1e9 if load_s else None,
            "stored_blocks": tier["stores"],
            "stored_bytes": tier["store_bytes"],
            "failed_blocks": tier["failures"],
        },
        "overlap": overlap(restored, layers),
        "host_ms_p50": {
            step: float(np.median([r["host_ms"].get(step, 0.0) for r in records]))
            for step in sorted({s for r in records for s in r["host_ms"]})
        },
        "ttft_s_total": ttft_s,
        "prefill_s": total("prefill_ms") / 1e3,
        "attention_share_of_ttft": (total("gather_ms") + total("sdpa_ms")) / 1e3 / ttft_s,
        "gather_share_of_ttft": total("gather_ms") / 1e3 / ttft_s,
    }


def overlap(restored: list[dict[str, Any]], layers: int) -> dict[str, Any] | None:
    """Where restored requests' load time went: hidden under compute or exposed (attention
    waiting for it), in total and per layer (medians over the requests). Load time is known
    only where the device timed it (a GPU); the waits are timed everywhere."""
    if not restored:
        return None
    timed = all(r["load_ms"] is not None for r in restored)
    load = sum(r["load_ms"] for r in restored) if timed else None
    known = all(r["load_exposed_ms"] is not None for r in restored)  # --untimed-waits: not
    exposed = sum(r["load_exposed_ms"] for r in restored) if known else None
    waits = [r["layer_wait_ms"] for r in restored if r["layer_wait_ms"]]
    load_med = statistics.median(r["load_ms"] for r in restored) if timed else None
    prefill_med = statistics.median(r["prefill_ms"] for r in restored)
    return {
        "requests": len(restored),
        "load_ms": load,
        "exposed_ms": exposed,
        "hidden_share": max(0.0, 1.0 - exposed / load) if load and exposed is not None else None,
        "median_per_request_ms": {
            "load": load_med,
            "exposed": statistics.median(r["load_exposed_ms"] for r in restored) if known else None,
            "prefill": prefill_med,
        },
        "per_layer_ms": {
            "load": None if load_med is None else load_med / layers,
            "compute": prefill_med / layers,
            "wait": [float(np.median(col)) for col in zip(*waits, strict=True)] if waits else [],
        },
    }


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


def known_median(values: list[float | None]) -> float | None:
    """The median of the values that are not None; None where none is."""
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known else None


def attribution(modes: dict[str, Any]) -> dict[str, Any] | None:
    """Where a restored request's time goes, per request and in medians: host time inside
    kvoffload's calls (per call), the per-layer wait call, the host launch phase against the same
    request's in ``gpu_all``, and the GPU's wait for the load per layer (exposed)."""
    if "kvoffload" not in modes:
        return None
    restored = [r for r in modes["kvoffload"]["records"] if r["host_hit_tokens"] > 0]
    if not restored:
        return None
    ideal = {request_key(r): r for r in modes.get("gpu_all", {}).get("records", [])}
    med = known_median
    names = sorted({n for r in restored for n in r["kvo_ms"]})
    paired = [(r, ideal[request_key(r)]) for r in restored if request_key(r) in ideal]
    launch = med([r["launch_ms"] for r in restored])
    ideal_launch = med([g["launch_ms"] for _, g in paired]) if paired else None
    layers = len(restored[0]["layer_wait_ms"])
    return {
        "requests": len(restored),
        "kvo_ms_total_p50": med([r["kvo_ms_total"] for r in restored]),
        "kvo_ms_total_p99": float(np.percentile([r["kvo_ms_total"] for r in restored], 99)),
        "kvo_ms_in_ttft_p50": med([r["kvo_ms_in_ttft"] for r in restored]),
        "kvo_ms_p50": {n: med([r["kvo_ms"].get(n, 0.0) for r in restored]) for n in names},
        "kvo_calls_p50": {n: med([r["kvo_calls"].get(n, 0) for r in restored]) for n in names},
        "wait_call_us_p50": med([r["wait_call_us"] for r in restored]),
        "wait_call_us_timed_p50": med([r.get("wait_call_us_timed") for r in restored]),
        "stall_timer_ms_p50": med([r.get("stall_timer_ms", 0.0) for r in restored]),
        "launch_ms_p50": launch,
        "gpu_all_launch_ms_p50": ideal_launch,
        "launch_vs_gpu_all": launch / ideal_launch if launch and ideal_launch else None,
        "gpu_wait_ms_p50": med([r["load_exposed_ms"] for r in restored]),
        "gate_open_ms_p50": med([r.get("gate_open_ms", 0.0) for r in restored]),
        # runs of consecutive host slots per load: each costs a pitched copy per layer slice
        "load_runs_p50": med([r.get("load_runs", 0) for r in restored]),
        "load_runs_max": max(r.get("load_runs", 0) for r in restored),
        "gpu_wait_ms_per_layer_p50": [
            float(np.median([r["layer_wait_ms"][i] for r in restored])) for i in range(layers)
        ]
        if all(len(r["layer_wait_ms"]) == layers for r in restored)
        else [],
        "host_ms_p50": {
            step: med([r["host_ms"].get(step, 0.0) for r in restored])
            for step in sorted({s for r in restored for s in r["host_ms"]})
        },
        "gpu_all_host_ms_p50": {
            step: med([g["host_ms"].get(step, 0.0) for _, g in paired])
            for step in sorted({s for _, g in paired for s in g["host_ms"]})
        },
        "beside": beside(restored, modes, ideal),
        "growth_ms_p50": growth(paired, modes),
        "layer_launch_growth_ms_p50": layer_growth(paired),
        "wait_host_ms_p50": med([r.get("wait_host_ms") for r in restored]),
    }


def growth(
    paired: list[tuple[dict[str, Any], dict[str, Any]]], modes: dict[str, Any]
) -> dict[str, float | None]:
    """Where a restored request's TTFT grew against the same request in ``gpu_all``, in ms,
    medians over requests (each term its own median, so they need not add up): ``ttft``; each
    host step (``host:<step>``, as ``host_ms``); ``device_prefill``, the forward's device time
    (``prefill_ms``: the GPU's wait for the load included, ``gpu_wait``); and
    ``copy_device_prefill``, the same growth of ``gpu_all_copy`` (a plain copy of the same bytes
    beside the forward: what the link's traffic alone costs the GPU)."""
    if not paired:
        return {}
    copies = {request_key(r): r for r in modes.get(BESIDE, {}).get("records", [])}
    med = known_median

    def diff(a: Any, b: Any) -> float | None:
        return None if a is None or b is None else float(a) - float(b)

    steps = list(dict.fromkeys(s for r, g in paired for s in (*r["host_ms"], *g["host_ms"])))
    out: dict[str, float | None] = {
        "ttft": med([r["ttft_ms"] - g["ttft_ms"] for r, g in paired]),
        "device_prefill": med([diff(r.get("prefill_ms"), g.get("prefill_ms")) for r, g in paired]),
        "gpu_wait": med([r["load_exposed_ms"] for r, _ in paired]),
    }
    for step in steps:
        out[f"host:{step}"] = med(
            [r["host_ms"].get(step, 0.0) - g["host_ms"].get(step, 0.0) for r, g in paired]
        )
    trio = [(copies[request_key(g)], g) for _, g in paired if request_key(g) in copies]
    out["copy_device_prefill"] = (
        med([diff(c.get("prefill_ms"), g.get("prefill_ms")) for c, g in trio]) if trio else None
    )
    return out


def layer_growth(paired: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[float]:
    """Per layer, the median over restored requests of how much later (host ms) its attention
    was launched than in the same request's ``gpu_all`` run, counted from the prefill's start:
    where in the forward the launch phase grew. Empty where no pair stamped every layer."""
    both = [
        (r["layer_launch_ms"], g["layer_launch_ms"])
        for r, g in paired
        if r.get("layer_launch_ms") and len(r["layer_launch_ms"]) == len(g["layer_launch_ms"])
    ]
    if not both:
        return []
    return [float(np.median([a[i] - b[i] for a, b in both])) for i in range(len(both[0][0]))]


RATIO_OF = {"launch_ms_p50": "launch", "ttft_ms_p50": "p50", "ttft_ms_p99": "p99"}


def beside(
    restored: list[dict[str, Any]], modes: dict[str, Any], ideal: dict[Any, dict[str, Any]]
) -> dict[str, Any] | None:
    """The restored requests beside the same requests in ``gpu_all`` and in ``gpu_all_copy``
    (``gpu_all`` with a plain copy of the same bytes beside its forward, ``beside.py``): host
    launch phase and TTFT (p50, p99) of each, and their ratios to ``gpu_all``. What the copy alone
    costs the ideal engine is the machine's share of a restore; the rest of kvoffload's growth is
    ours. None without ``gpu_all_copy`` records."""
    copies = {request_key(r): r for r in modes.get(BESIDE, {}).get("records", [])}
    keyed = [(r, request_key(r)) for r in restored]
    trio = [(r, ideal[k], copies[k]) for r, k in keyed if k in ideal and k in copies]
    if not trio:
        return None
    out: dict[str, Any] = {
        "requests": len(trio),
        "same_bytes": all(c["beside_bytes"] == r["load_bytes"] for r, _, c in trio),
    }
    for i, mode in enumerate(("kvoffload", "gpu_all", BESIDE)):
        launch = float(np.median([t[i]["launch_ms"] for t in trio]))
        p50, p99 = (float(v) for v in np.percentile([t[i]["ttft_ms"] for t in trio], [50, 99]))
        out[mode] = {"launch_ms_p50": launch, "ttft_ms_p50": p50, "ttft_ms_p99": p99}
    base = out["gpu_all"]
    for mode in ("kvoffload", BESIDE):
        m = out[mode]
        for key, name in RATIO_OF.items():
            m[f"{name}_vs_gpu_all"] = m[key] / base[key] if base[key] > 0 else None
    return out


def request_key(r: dict[str, Any]) -> tuple[int, int, int]:
    return (r["round"], r["conversation"], r["turn"])

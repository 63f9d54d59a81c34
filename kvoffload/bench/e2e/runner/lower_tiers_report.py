"""The numbers ``bench e2e --lower-tiers`` reports per workload (``lower_tiers.py`` runs it):
TTFT summaries, the paired per-document differences against ``recompute``, where each
request's time went, and issue 30's target."""

from __future__ import annotations

import math
import statistics
from typing import Any

from kvoffload.bench.e2e.runner.engine import TurnResult

TIER_WAIT = "tiers.wait_idle"  # the engine's thread waiting for tier I/O in a lookup (``calls``)
CI_LEVEL = 0.95  # the median's confidence interval in ``paired`` (distribution-free)


def request_orders(n: int, seed: int) -> list[tuple[str, str]]:
    """Which of ``recompute`` and ``lower`` runs first for each of ``n`` documents: half each
    way (the odd one recompute-first), in a seeded random order, so that whatever a request
    gains from coming second (warm caches, a clock that ramped up) falls on both sides."""
    import numpy as np

    first = ["recompute"] * (n - n // 2) + ["lower"] * (n // 2)
    np.random.default_rng(seed + 13).shuffle(first)
    return [("recompute", "lower") if f == "recompute" else ("lower", "recompute") for f in first]


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ms = sorted(v * 1e3 for v in values)
    return {
        "n": len(ms),
        "p50": statistics.median(ms),
        "p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
        "mean": statistics.fmean(ms),
    }


def median_ci(values: list[float], level: float = CI_LEVEL) -> tuple[float, float, float]:
    """A distribution-free confidence interval of the median of ``values`` from their order
    statistics (the sign test's): ``(low, high, coverage)``, coverage >= ``level`` where n allows
    it (n >= 6 for 95%), else the widest there is (the min and the max) with its coverage."""
    x = sorted(values)
    n = len(x)
    if n == 0:
        return math.nan, math.nan, 0.0

    def below(k: int) -> float:  # P(Binomial(n, 1/2) < k)
        return sum(math.comb(n, i) for i in range(k)) / (1 << n)

    k = 1
    while k + 1 <= n // 2 and 1 - 2 * below(k + 1) >= level:
        k += 1
    return x[k - 1], x[n - k], 1 - 2 * below(k)


def paired(requests: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """``mode``'s TTFT minus ``recompute``'s for the same document and the same question, per
    document (ms), and their median with its confidence interval: an interval holding 0 says
    the difference is within the noise of this many pairs. ``second_faster_ms`` estimates the
    order effect: half of how much lower the difference is when ``mode`` ran second."""
    diffs = [r[mode]["ttft_ms"] - r["recompute"]["ttft_ms"] for r in requests]
    if not diffs:
        return {"n": 0}
    low, high, coverage = median_ci(diffs)
    q = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
    out: dict[str, Any] = {
        "n": len(diffs),
        "per_document_ms": diffs,
        "median_ms": statistics.median(diffs),
        "q25_ms": q[0],
        "q75_ms": q[2],
        "min_ms": min(diffs),
        "max_ms": max(diffs),
        "above_zero": sum(d > 0 for d in diffs),
        "median_ci_ms": [low, high],
        "ci_coverage": coverage,
        "ci_holds_zero": low <= 0 <= high,
    }
    if mode == "lower":
        second = [d for d, r in zip(diffs, requests, strict=True) if r["order"][0] == "recompute"]
        first = [d for d, r in zip(diffs, requests, strict=True) if r["order"][0] == "lower"]
        if second and first:
            out["median_ms_lower_second"] = statistics.median(second)
            out["median_ms_lower_first"] = statistics.median(first)
            out["second_faster_ms"] = (statistics.median(first) - statistics.median(second)) / 2
    return out


def target(
    ttft: dict[str, list[float]], restored: list[int], rule: dict[str, float], pair: dict[str, Any]
) -> dict[str, Any]:
    """Issue 30's target for one workload: p50 TTFT restored from the lower tier <= recompute's,
    whichever bound applied (``load``: the rule loaded every timed prefix, the gain is reported;
    ``recompute``: it declined every one, the tier being slower than prefill; ``mixed``), with
    the paired difference's median and interval beside it."""
    if not restored:
        return {"met": False, "bound": "none", "why": "no timed request"}
    bound = "load" if all(restored) else "recompute" if not any(restored) else "mixed"
    lower = statistics.median(ttft["lower"]) * 1e3
    recompute = statistics.median(ttft["recompute"]) * 1e3
    return {
        "bound": bound,
        "p50_lower_ms": lower,
        "p50_recompute_ms": recompute,
        "gain_ms": recompute - lower,
        "met": lower <= recompute,
        "paired_median_ms": pair.get("median_ms"),
        "paired_median_ci_ms": pair.get("median_ci_ms"),
        "paired_ci_holds_zero": pair.get("ci_holds_zero"),
        "rule": rule,
    }


def attribution(turn: TurnResult, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Where one request's time went: its TTFT, the engine's host steps before the first token
    (``host_ms``: match includes hashing the prompt's keys, lookup the lower tiers' lookups),
    the host time inside each kvoffload call before the first token (``kvo_ttft_calls``; the
    engine's thread waiting for tier I/O is ``tiers.wait_idle``), the device sections, and what
    the tiers did during the whole request (``flow`` counters; ``busy``: the tiers' threads' ops,
    blocks and seconds, which overlap the engine's compute)."""
    flow = {
        k: v - before.get("flow", {}).get(k, 0)
        for k, v in after.get("flow", {}).items()
        if v != before.get("flow", {}).get(k, 0)
    }
    busy = {}
    for name, totals in after.get("busy", {}).items():
        was = before.get("busy", {}).get(name, {})
        delta = {k: v - was.get(k, 0) for k, v in totals.items()}
        if delta["ops"]:
            busy[name] = {**delta, "s": delta["s"] * 1e3}
    return {
        "ttft_ms": turn.ttft * 1e3,
        "restored_tokens": turn.host_hit_tokens,
        "host_ms": {step: s * 1e3 for step, s in turn.host.items()},
        "kvo_ttft_ms": turn.kvo_ttft_s * 1e3,
        "kvo_ttft_calls": {
            name: {"ms": s * 1e3, "calls": n} for name, (s, n) in turn.kvo_ttft_calls.items()
        },
        "tier_wait_ms": turn.kvo_ttft_calls.get(TIER_WAIT, (0.0, 0))[0] * 1e3,
        "device_ms": {name: s * 1e3 for name, s in turn.sections.items()},
        "flow": flow,
        "busy_ms": busy,
    }


def attribution_summary(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the timed requests: ``lower`` and ``host`` TTFT minus ``recompute``'s (the
    same request's), and the parts of ``lower``'s that recompute does not pay."""
    if not requests:
        return {}

    def median(f: Any) -> float:
        return float(statistics.median(f(r) for r in requests))

    def call_ms(r: dict[str, Any], prefix: str) -> float:
        calls = r["lower"]["kvo_ttft_calls"]
        return float(sum(c["ms"] for n, c in calls.items() if n.startswith(prefix)))

    def busy_ms(r: dict[str, Any]) -> float:
        return float(sum(b["s"] for b in r["lower"]["busy_ms"].values()))

    def minus_recompute(mode: str) -> float:
        return median(lambda r: r[mode]["ttft_ms"] - r["recompute"]["ttft_ms"])

    return {
        "lower_minus_recompute": minus_recompute("lower"),
        "host_minus_recompute": minus_recompute("host"),
        "lower_kvo_calls": median(lambda r: r["lower"]["kvo_ttft_ms"]),
        "lower_lookup_tiers": median(lambda r: call_ms(r, "offloader.lookup_tiers")),
        "lower_tier_wait": median(lambda r: r["lower"]["tier_wait_ms"]),
        "lower_host_match": median(lambda r: r["lower"]["host_ms"].get("match", 0.0)),
        "lower_host_lookup": median(lambda r: r["lower"]["host_ms"].get("lookup", 0.0)),
        "lower_tier_threads_busy": median(busy_ms),
        "lower_prefill_minus_recompute": median(
            lambda r: (
                r["lower"]["device_ms"].get("prefill", 0.0)
                - r["recompute"]["device_ms"].get("prefill", 0.0)
            )
        ),
    }

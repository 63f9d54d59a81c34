"""``kvoffload bench e2e --lower-tiers``: TTFT when a restored prefix comes from Valkey or disk.

Two workloads, each in two engine processes, one after the other:

- ``valkey``: a first engine process (spawned) prefills ``documents`` documents, each with a
  question, its blocks going to host and, written behind, to a Valkey server (started here unless
  ``--valkey-url``), then exits. A second engine process (this one) starts cold, against the same
  server: an empty GPU pool and an empty host tier.
- ``disk``: the same with a disk tier: the first process closes (its blocks on disk), and this
  one is the engine restarted against that directory.

In the second process every document comes back with a new question, as three requests in turn:
``recompute`` (no prefix cache), ``lower`` (GPU pool and host cold: the prefix comes up from the
lower tier, if the load rule expects that to beat recomputing it, else it is recomputed) and
``host`` (a third question, the GPU pool dropped: the prefix is now on host, loaded or stored by
the ``lower`` request). Every copy and tier write is finished before the next request. The
engine's prefill rate, measured on the ``recompute`` requests, is reported to the offloader
(``Offloader.report_prefill``) before each ``lower`` request, so the load rule weighs the tier's
measured read rate against it.

Correctness: the first ``--verify`` documents are restored before the rule has a prefill rate
(so they are loaded whatever the rates), and their first-token logits and greedy tokens are
compared bit for bit with a GPU-pool reference that computed the same prefix in this process
(the same chunks, so the same KV); those requests are not timed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kvoffload as kvo
from kvoffload.bench.e2e.runner.config import model_config
from kvoffload.bench.e2e.runner.engine import Offload, PagedEngine, TurnResult
from kvoffload.bench.e2e.runner.host_tier import HostTier
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Model

WORKLOADS = ("valkey", "disk")
# documents, document tokens, question tokens per model scale
SHAPES = {
    "llama3-8b": (6, 4096, 128),
    "qwen2.5-7b": (6, 4096, 128),
    "tiny": (10, 2048, 64),
    "micro": (5, 256, 16),
}
MODEL_ID = "kvoffload-bench-e2e-lower"
DECODE = 8  # greedy tokens compared in the bit-exact check
PENDING_TIMEOUT_S = 30.0  # a lookup waits at most this long for pending blocks
TIER_WAIT = "tiers.wait_idle"  # the engine's thread waiting for tier I/O in a lookup (``calls``)


@dataclass(frozen=True)
class Params:
    model: str
    device: str
    dtype: str
    block_size: int
    chunk_tokens: int
    documents: int
    document_tokens: int
    question_tokens: int
    verify: int
    seed: int

    def prompts(self, vocab: int) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
        """The documents, and per document three questions (the first engine's, lower, host)."""
        rng = np.random.default_rng(self.seed + 7)
        docs = [rng.integers(0, vocab, self.document_tokens) for _ in range(self.documents)]
        questions = [[rng.integers(0, vocab, self.question_tokens) for _ in range(3)] for _ in docs]
        return docs, questions

    def request_blocks(self) -> int:
        return -(-(self.document_tokens + self.question_tokens + DECODE) // self.block_size) + 1


class TieredHost(HostTier):
    """The engine's second tier with lower tiers below it: a lookup brings up what they hold
    (and the load rule says is worth it) and waits for those blocks."""

    def lookup(self, keys: Any) -> int:
        deadline = time.perf_counter() + PENDING_TIMEOUT_S
        while True:
            found = self.offloader.lookup_tiers(keys)
            if not (found.pending or found.probing) or time.perf_counter() > deadline:
                return found.ready
            # Woken when the mover's reads are done (a walk of the keys holds the GIL: no busy
            # polling under the reads); the runner lets no other tier op run at the same time.
            # Timed as the engine's thread waiting for tier I/O (``TIER_WAIT``).
            if self.local.mover is not None:
                self.calls.call(TIER_WAIT, self.local.mover.wait_idle, 0.01)

    def settle_tiers(self) -> None:
        """Wait for every read and write of the lower tiers (background ones too), so that none
        runs under the next timed request."""
        if self.local.mover is not None:
            self.local.mover.wait_idle(PENDING_TIMEOUT_S)
        self.offloader.drain_tiers(PENDING_TIMEOUT_S)


def _host(cache: PagedKVCache, blocks: int, tier: dict[str, Any]) -> TieredHost:
    config = kvo.OffloadConfig(host_capacity_blocks=blocks, model_id=MODEL_ID, **tier)
    return TieredHost(cache, config)


def first_engine(p: Params, tier: dict[str, Any], out: Any) -> None:
    """The first engine process: prefill every document with its first question, then close
    (every block written down)."""
    try:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        mc = model_config(p.model)
        model = Model(mc, p.device, p.seed, p.dtype)
        per = p.request_blocks()
        cache = PagedKVCache(mc, 2 * per, p.block_size, torch.device(p.device), model.dtype)
        host = _host(cache, p.documents * per + per, tier)
        stores = Offload(admission="all", store="behind")
        engine = PagedEngine(model, cache, "kvoffload", host, p.chunk_tokens, stores)
        docs, questions = p.prompts(mc.vocab)
        for doc, q in zip(docs, questions, strict=True):
            engine.run(np.concatenate([doc, q[0]]))
        engine.idle()
        t0 = time.perf_counter()
        host.close()  # writes what is still queued for the tiers
        out.put({"ok": True, "close_s": time.perf_counter() - t0})
    except BaseException as e:  # the parent reports it; nothing else would see it
        out.put({"ok": False, "error": f"{type(e).__name__}: {e}"})
        raise


def run_workload(p: Params, tier: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=first_engine, args=(p, tier, out))
    t0 = time.perf_counter()
    proc.start()
    first = out.get(timeout=900)
    proc.join(60)
    if not first["ok"]:
        raise RuntimeError(f"the first engine process failed: {first['error']}")
    first["seconds"] = time.perf_counter() - t0
    return {"first_engine": first, **_second_engine(p, tier)}


def _second_engine(p: Params, tier: dict[str, Any]) -> dict[str, Any]:
    mc = model_config(p.model)
    model = Model(mc, p.device, p.seed, p.dtype)
    per = p.request_blocks()
    pools = {"recompute": per, "reference": 2 * per, "lower": 2 * per}
    cache = PagedKVCache(mc, sum(pools.values()), p.block_size, torch.device(p.device), model.dtype)
    host = _host(cache, p.documents * per + per, tier)
    engines: dict[str, PagedEngine] = {}
    start = 0
    for name, blocks in pools.items():
        mode = {"recompute": "recompute", "reference": "gpu", "lower": "kvoffload"}[name]
        off = Offload(admission="all", store="behind") if name == "lower" else None
        engines[name] = PagedEngine(
            model,
            cache,
            mode,
            host if name == "lower" else None,
            p.chunk_tokens,
            off,
            blocks,
            start,
        )
        start += blocks
    docs, questions = p.prompts(mc.vocab)
    checks: list[dict[str, Any]] = []
    ttft: dict[str, list[float]] = {"recompute": [], "lower": [], "host": []}
    restored: list[int] = []
    requests: list[dict[str, Any]] = []
    stats = host.local.offloader.tier_stats
    try:
        for i, (doc, q) in enumerate(zip(docs, questions, strict=True)):
            prompt = np.concatenate([doc, q[1]])
            if i < p.verify:  # before any prefill rate is reported: restored whatever the rates
                checks.append(_check(engines, np.concatenate([doc, q[0]]), prompt))
                continue
            s0 = stats()
            rec = engines["recompute"].run(prompt, cache=False)
            host.offloader.report_prefill(rec.computed_tokens, rec.ttft)
            s1 = stats()
            low = engines["lower"].run(prompt)
            s2 = stats()
            engines["lower"].drop_gpu_cache()  # its blocks stored: a recomputed prefix too
            host.settle_tiers()
            s3 = stats()
            hit = engines["lower"].run(np.concatenate([doc, q[2]]))
            s4 = stats()
            engines["lower"].idle()
            host.settle_tiers()
            ttft["recompute"].append(rec.ttft)
            ttft["lower"].append(low.ttft)
            ttft["host"].append(hit.ttft)
            restored.append(low.host_hit_tokens)
            requests.append(
                {
                    "recompute": _attribution(rec, s0, s1),
                    "lower": _attribution(low, s1, s2),
                    "host": _attribution(hit, s3, s4),
                }
            )
        final = stats()
    finally:
        host.close()
    return {
        "ttft_ms": {mode: _summary(values) for mode, values in ttft.items()},
        "target": _target(ttft, restored, final.get("rule", {})),
        "restored_tokens": restored,
        "prompt_tokens": p.document_tokens + p.question_tokens,
        "tier_stats": final,
        "requests": requests,
        "attribution_ms": _attribution_summary(requests),
        "verify": checks,
    }


def _target(
    ttft: dict[str, list[float]], restored: list[int], rule: dict[str, float]
) -> dict[str, Any]:
    """Issue 30's target for one workload: p50 TTFT restored from the lower tier <= recompute's,
    whichever bound applied (``load``: the rule loaded every timed prefix, the gain is reported;
    ``recompute``: it declined every one, the tier being slower than prefill; ``mixed``)."""
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
        "rule": rule,
    }


def _attribution(turn: TurnResult, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
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


def _attribution_summary(requests: list[dict[str, Any]]) -> dict[str, Any]:
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


def _check(
    engines: dict[str, PagedEngine], first: np.ndarray, prompt: np.ndarray
) -> dict[str, Any]:
    """``prompt``'s prefix restored from the lower tier against the same prefix computed here."""
    ref_engine = engines["reference"]
    ref_engine.run(first)  # the first engine's request: the same chunks, so the same KV
    ref = ref_engine.run(prompt, decode=DECODE, cache=False)
    ref_engine.drop_gpu_cache()
    low = engines["lower"].run(prompt, decode=DECODE, cache=False)
    engines["lower"].drop_gpu_cache()
    return {
        "restored_tokens": low.host_hit_tokens,
        "reference_gpu_tokens": ref.gpu_hit_tokens,
        "logits_equal": bool(torch.equal(low.logits, ref.logits)),
        "tokens_equal": _same_tokens(low, ref),
        "ok": low.host_hit_tokens > 0
        and bool(torch.equal(low.logits, ref.logits))
        and _same_tokens(low, ref),
    }


def _same_tokens(a: TurnResult, b: TurnResult) -> bool:
    return a.first_token == b.first_token and a.tokens == b.tokens


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in values.items()}


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ms = sorted(v * 1e3 for v in values)
    return {
        "n": len(ms),
        "p50": statistics.median(ms),
        "p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
        "mean": statistics.fmean(ms),
    }


def run(args: argparse.Namespace, device: str, dtype: str) -> dict[str, Any]:
    """Every workload ``--lower-tiers`` names; the result dict for the JSON."""
    import contextlib

    names = [n for n in args.lower_tiers.split(",") if n]
    if not names or not set(names) <= set(WORKLOADS):
        raise SystemExit(
            f"kvoffload bench e2e: expected --lower-tiers from {','.join(WORKLOADS)}, got "
            f"{args.lower_tiers!r}"
        )
    model = args.model if args.model != "auto" else ("llama3-8b" if device != "cpu" else "tiny")
    docs, doc_tokens, question = SHAPES[model]
    p = Params(
        model,
        device,
        dtype,
        args.block_size,
        args.chunk_tokens or {"llama3-8b": 2048, "qwen2.5-7b": 2048, "tiny": 512}.get(model, 64),
        args.documents if args.documents is not None else docs,
        args.document_tokens if args.document_tokens is not None else doc_tokens,
        question,
        args.verify,
        args.seed,
    )
    if p.documents <= p.verify or p.document_tokens < p.block_size or p.block_size <= 0:
        raise SystemExit(
            "kvoffload bench e2e: expected --documents > --verify and --document-tokens >= "
            f"--block-size > 0, got {p.documents}, {p.verify}, {p.document_tokens}, "
            f"{p.block_size}"
        )
    result: dict[str, Any] = {"params": p.__dict__}
    with contextlib.ExitStack() as stack:
        for name in names:
            if name == "valkey":
                url = args.valkey_url or _server(stack, result)
                tier: dict[str, Any] = {"valkey_url": url, "valkey_namespace": _namespace()}
            else:
                where = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvo-e2e-"))
                tier = {"disk_path": where, "disk_capacity_bytes": 64 << 30}
            result[name] = run_workload(p, tier)
    return result


def _server(stack: Any, result: dict[str, Any]) -> str:
    from kvoffload.store.tiers.local_server import LocalServer, server_version

    server = stack.enter_context(LocalServer())
    result["valkey_server"] = f"{server_version()}, one server on loopback (started here)"
    return str(server.url)


def _namespace() -> str:
    import secrets

    return "bench-e2e-" + secrets.token_hex(4)


def main(args: argparse.Namespace, cuda: bool) -> int:
    """``bench e2e --lower-tiers ...``: run, write the JSON, print; 1 if a check failed."""
    import os

    from kvoffload.bench.common import console, default_out, machine_info, write_json
    from kvoffload.bench.e2e.runner import dtype as dtypes

    on_gpu = cuda and args.device != "cpu"
    device = args.device if args.device != "auto" else ("cuda" if on_gpu else "cpu")
    if not on_gpu:
        threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 2) - 1)
        torch.set_num_threads(threads)
    results = run(args, device, dtypes.resolve(args.dtype, "cuda" if on_gpu else "cpu"))
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    out = args.out or default_out(f"e2e_lower_{results['params']['model']}", name)
    write_json(out, {"benchmark": "e2e_lower_tiers", **machine_info(), "device": name, **results})
    failed = 0
    for workload in WORKLOADS:
        if workload not in results:
            continue
        r = results[workload]
        t = r["ttft_ms"]
        flow = r["tier_stats"].get("flow", {})
        console.print(
            f"{workload}: p50 TTFT recompute {t['recompute'].get('p50', 0):.1f} ms, from "
            f"{workload} {t['lower'].get('p50', 0):.1f} ms, from host {t['host'].get('p50', 0):.1f}"
            f" ms; restored tokens {r['restored_tokens']} of {r['prompt_tokens']}; loads taken "
            f"{flow.get('loads_taken', 0)}, unmeasured {flow.get('loads_unmeasured', 0)} blocks, "
            f"declined without lookup {flow.get('declined_without_lookup', 0)} keys, remeasured "
            f"{flow.get('remeasured', 0)} blocks; rule {r['tier_stats'].get('rule', {})}"
        )
        target = r["target"]
        console.print(
            f"{workload}: bound {target['bound']}, p50 TTFT restored <= recompute: "
            f"{'met' if target['met'] else 'NOT met'} (gain {target.get('gain_ms', 0):.1f} ms); "
            f"attribution (ms, medians) {_rounded(r['attribution_ms'])}"
        )
        bad = [c for c in r["verify"] if not c["ok"]]
        failed += len(bad)
        console.print(
            f"{workload}: {len(r['verify']) - len(bad)} of {len(r['verify'])} "
            "restored turns bit-exact"
        )
    console.print(f"JSON: {out}")
    return 1 if failed else 0

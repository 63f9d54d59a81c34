"""``kvoffload bench e2e --lower-tiers``: TTFT when a restored prefix comes from Valkey or disk.

Two workloads, each in two engine processes, one after the other:

- ``valkey``: a first engine process (spawned) prefills ``documents`` documents, each with a
  question, its blocks going to host and, written behind, to a Valkey server (started here unless
  ``--valkey-url``), then exits. A second engine process (this one) starts cold, against the same
  server: an empty GPU pool and an empty host tier.
- ``disk``: the same with a disk tier: the first process closes (its blocks on disk), and this
  one is the engine restarted against that directory.

- ``valkey-cluster``: as ``valkey``, against a cluster of 3 primaries + 3 replicas on loopback
  (started here, as ``bench tiers --cluster`` starts one, unless ``--valkey-cluster-url``).

In the second process every document comes back with a new question, as three requests:
``recompute`` (no prefix cache) and ``lower`` (GPU pool and host cold: the prefix comes up from
the lower tier, if the load rule expects that to beat recomputing it, else it is recomputed), in
an order drawn per document (``request_orders``: half the documents each way, seeded, recorded
as ``order``), then ``host`` (a third question, the GPU pool dropped: the prefix is now on host,
loaded or stored by the ``lower`` request). Every copy and tier write is finished before the
next request. The engine's prefill rate, measured on an untimed ``recompute`` request before
the timed ones and then on every ``recompute`` request, is reported to the offloader
(``Offloader.report_prefill``), so the load rule weighs the tier's measured read rate against
it. Besides the p50s, each document's ``lower`` and ``host`` TTFT minus its ``recompute`` TTFT
is reported (``paired_ms``: the median, its confidence interval, and the order effect).

Correctness: the first ``--verify`` documents are restored before the rule has a prefill rate
(so they are loaded whatever the rates), and their first-token logits and greedy tokens are
compared bit for bit with a GPU-pool reference that computed the same prefix in this process
(the same chunks, so the same KV); those requests are not timed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kvoffload as kvo
from kvoffload.bench.e2e.args import CHUNK
from kvoffload.bench.e2e.runner.config import GPU_MODELS, model_config
from kvoffload.bench.e2e.runner.engine import PagedEngine, TurnResult
from kvoffload.bench.e2e.runner.host_tier import HostTier
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.lower_tiers_report import (
    TIER_WAIT,
    attribution,
    attribution_summary,
    paired,
    request_orders,
    summary,
    target,
)
from kvoffload.bench.e2e.runner.model import Model
from kvoffload.bench.e2e.runner.offload_mode import Offload

WORKLOADS = ("valkey", "valkey-cluster", "disk")
# documents, document tokens, question tokens per model scale
SHAPES = {
    **dict.fromkeys(GPU_MODELS, (6, 4096, 128)),
    "tiny": (10, 2048, 64),
    "micro": (5, 256, 16),
}
MODEL_ID = "kvoffload-bench-e2e-lower"
DECODE = 8  # greedy tokens compared in the bit-exact check
PENDING_TIMEOUT_S = 30.0  # a lookup waits at most this long for pending blocks


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
    orders = request_orders(p.documents - p.verify, p.seed)
    stats = host.local.offloader.tier_stats
    try:
        for doc, q in zip(docs[: p.verify], questions, strict=False):
            # before any prefill rate is reported: restored whatever the rates
            checks.append(_check(engines, np.concatenate([doc, q[0]]), np.concatenate([doc, q[1]])))
        # Untimed: a prefill rate for the rule before the first timed request, which may be a
        # ``lower`` one (``orders``).
        warm = engines["recompute"].run(np.concatenate([docs[0], questions[0][1]]), cache=False)
        host.offloader.report_prefill(warm.computed_tokens, warm.ttft)
        timed = zip(docs[p.verify :], questions[p.verify :], orders, strict=True)
        for i, (doc, q, order) in enumerate(timed, start=p.verify):
            prompt = np.concatenate([doc, q[1]])
            turns: dict[str, TurnResult] = {}
            request: dict[str, Any] = {"document": i, "order": list(order)}
            for mode in order:  # the same prompt both ways, every tier op settled in between
                before = stats()
                if mode == "recompute":
                    turns[mode] = engines["recompute"].run(prompt, cache=False)
                    request[mode] = attribution(turns[mode], before, stats())
                    host.offloader.report_prefill(turns[mode].computed_tokens, turns[mode].ttft)
                else:
                    turns[mode] = engines["lower"].run(prompt)
                    request[mode] = attribution(turns[mode], before, stats())
                    engines["lower"].drop_gpu_cache()  # its blocks stored: a recomputed prefix too
                    host.settle_tiers()
            before = stats()
            turns["host"] = engines["lower"].run(np.concatenate([doc, q[2]]))
            request["host"] = attribution(turns["host"], before, stats())
            engines["lower"].idle()
            host.settle_tiers()
            for mode, turn in turns.items():
                ttft[mode].append(turn.ttft)
            restored.append(turns["lower"].host_hit_tokens)
            requests.append(request)
        final = stats()
    finally:
        host.close()
    pair = paired(requests, "lower")
    return {
        "ttft_ms": {mode: summary(values) for mode, values in ttft.items()},
        "paired_ms": {"lower": pair, "host": paired(requests, "host")},
        "target": target(ttft, restored, final.get("rule", {}), pair),
        "warmup_recompute_ms": warm.ttft * 1e3,
        "restored_tokens": restored,
        "prompt_tokens": p.document_tokens + p.question_tokens,
        "tier_stats": final,
        "requests": requests,
        "attribution_ms": attribution_summary(requests),
        "verify": checks,
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
        args.chunk_tokens or CHUNK[model],
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
    if args.tier_threads is not None and args.tier_threads <= 0:
        raise SystemExit(
            f"kvoffload bench e2e: expected --tier-threads > 0, got {args.tier_threads}"
        )
    threads = {} if args.tier_threads is None else {"tier_threads": args.tier_threads}
    result: dict[str, Any] = {"params": p.__dict__, "tier_threads": args.tier_threads or "default"}
    with contextlib.ExitStack() as stack:
        for name in names:
            if name == "valkey":
                url = args.valkey_url or _server(stack, result, cluster=False)
                tier: dict[str, Any] = {"valkey_url": url, "valkey_namespace": _namespace()}
            elif name == "valkey-cluster":
                url = args.valkey_cluster_url or _server(stack, result, cluster=True)
                tier = {"valkey_url": url, "valkey_namespace": _namespace()}
            else:
                where = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvo-e2e-"))
                tier = {"disk_path": where, "disk_capacity_bytes": 64 << 30}
            result[name] = run_workload(p, {**tier, **threads})
    return result


def _server(stack: Any, result: dict[str, Any], cluster: bool) -> str:
    """A server (or a cluster of 3 primaries + 3 replicas, as ``bench tiers --cluster`` starts
    one) on loopback, started here and stopped by ``stack``."""
    from kvoffload.store.tiers.local_server import LocalCluster, LocalServer, server_version

    made = LocalCluster() if cluster else LocalServer()
    stack.enter_context(made)
    shape = "3 primaries + 3 replicas" if cluster else "one server"
    key = "valkey_cluster" if cluster else "valkey_server"
    result[key] = f"{server_version()}, {shape} on loopback (started here)"
    return str(made.url)


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
        pair = r["paired_ms"]["lower"]
        if pair["n"]:
            low, high = pair["median_ci_ms"]
            console.print(
                f"{workload}: per document, {workload} minus recompute (ms): median "
                f"{pair['median_ms']:+.2f}, {pair['ci_coverage']:.0%} interval [{low:+.2f}, "
                f"{high:+.2f}]{' (holds 0)' if pair['ci_holds_zero'] else ''}, quartiles "
                f"[{pair['q25_ms']:+.2f}, {pair['q75_ms']:+.2f}], {pair['above_zero']} of "
                f"{pair['n']} above 0; coming second is faster by "
                f"{pair.get('second_faster_ms', float('nan')):+.2f} ms"
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

"""Engine and library variants side by side on one workload, to find where time goes.

``python -m kvoffload.bench.e2e.runner.variants --model llama3-8b --workload fits --rounds 2
--variants gpu,behind,behind-inline,none,evict --out result.json`` runs each variant on the same
workload ``--rounds`` times in rotating order (fresh token ids per round) and prints turns/s, TTFT
and where the host time of a request goes (before prefill, enqueuing prefill), beside the device
time of prefill. ``docs/e2e.md`` reports what it found.

Variants: the modes (``recompute``, ``gpu``, ``gpu_all``), and kvoffload with one thing changed:
``evict`` / ``behind`` (when blocks are stored), ``none`` (nothing stored: lookups only),
``blocking`` (the whole load before prefill), ``*-inline`` (the native ``staged`` engine enqueues
every copy in the caller's thread, the GIL released: ``native_inline_bytes`` unbounded),
``*-thread`` (every copy is enqueued by the engine's thread: ``native_inline_bytes=0``),
``*-ramp`` (ramped load slices: the first holds one layer where a layer is >= 64 KiB a block,
then doubling), ``*-prio`` (the copy streams at the highest CUDA priority), ``*-whole`` (one slice
per load: the fewest descriptors, layer 0 waits for the whole load), ``*-poller`` (a thread that
wakes every 100 us and takes the GIL, as the former Python submitter
threads did after each job until the data plane stopped polling: what such a thread costs the
engine). ``dma`` always enqueues in the caller's thread: it takes neither -inline nor -thread.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import queue
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvoffload as kvo
from kvoffload.bench.e2e.runner.bench import freeze_heap, tier_delta
from kvoffload.bench.e2e.runner.bench_config import Advance
from kvoffload.bench.e2e.runner.config import model_config
from kvoffload.bench.e2e.runner.core_flags import SETTINGS, configured, settings_of
from kvoffload.bench.e2e.runner.engine import PagedEngine
from kvoffload.bench.e2e.runner.host_tier import HostTier
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Model
from kvoffload.bench.e2e.runner.offload_mode import Offload
from kvoffload.bench.e2e.runner.results import pool_rounds, record
from kvoffload.bench.e2e.runner.timing import sync
from kvoffload.bench.e2e.runner.workload import Turn, Workload

OFFLOADS = {
    "evict": Offload(store="evict"),
    "behind": Offload(store="behind"),
    "none": Offload(admission="none"),
    "blocking": Offload(load="blocking"),
    "all": Offload(admission="all"),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    mode: str
    offload: Offload
    backend: str  # the copy backend's registered name
    poller: bool  # a GIL-taking polling thread runs beside the engine


def parse_variant(name: str, backend: str) -> Variant:
    base, *flags = name.split("-")
    if base in ("recompute", "gpu", "gpu_all") and flags in ([], ["poller"]):
        return Variant(name, base, Offload(), backend, bool(flags))
    if base not in OFFLOADS or any(f != "poller" and settings_of(f) is None for f in flags):
        raise ValueError(
            f"expected a mode or one of {sorted(OFFLOADS)} with flags from "
            f"{sorted([*SETTINGS, 'poller'])} or lpN / pN (scatter programs) / msN (load "
            f"slices) / wN (warps) / dsN (DMA streams) / fcN (a store's first chunk, KiB) / "
            f"xpN (exposed kernel programs) / hiN (host ids) / cpN (completion poll us), got "
            f"{name!r}"
        )
    core_flags = [f for f in flags if f != "poller"]
    if core_flags:
        backend = configured(backend, core_flags)
    return Variant(name, "kvoffload", OFFLOADS[base], backend, "poller" in flags)


@contextmanager
def poller(enabled: bool) -> Iterator[None]:
    """A thread that looks at an empty queue every 100 us (the former submitter's poll loop)."""
    if not enabled:
        yield
        return
    stop = threading.Event()
    q: queue.SimpleQueue[None] = queue.SimpleQueue()

    def poll() -> None:
        while not stop.is_set():
            try:
                q.get_nowait()
            except queue.Empty:
                time.sleep(100e-6)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvoffload.bench.e2e import args as e2e

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    variants = [parse_variant(v, args.backend) for v in args.variants.split(",")]
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)  # the workload as ``kvoffload bench e2e`` builds it
    ns = parser.parse_args(["--model", args.model, "--block-size", str(args.block_size)])
    wrun = e2e._workload_run(ns, args.model, args.workload)
    workload: Workload = wrun.workload
    mc = model_config(args.model)
    dtype = "bfloat16" if cuda else "float32"
    model = Model(mc, device, 0, dtype)
    bs = args.block_size
    blocks = max(wrun.gpu_blocks, wrun.all_blocks(bs))
    cache = PagedKVCache(mc, blocks, bs, torch.device(device), getattr(torch, dtype))
    hosts: dict[str, HostTier] = {}
    chunk = args.chunk_tokens

    submitted: list[tuple[str, Any]] = []  # (direction, the backend's pending) of every copy

    def host_for(backend: str) -> HostTier:
        if backend not in hosts:
            config = kvo.OffloadConfig(host_capacity_blocks=wrun.host_blocks, backend=backend)
            hosts[backend] = HostTier(cache, config)
            _watch(hosts[backend], submitted)
        return hosts[backend]

    def engine(v: Variant) -> PagedEngine:
        pool = wrun.all_blocks(bs) if v.mode == "gpu_all" else wrun.gpu_blocks
        host = host_for(v.backend) if v.mode == "kvoffload" else None
        return PagedEngine(model, cache, v.mode, host, chunk, v.offload, pool)

    out: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "workload": workload.as_dict(),
        "gpu_blocks": wrun.gpu_blocks,
        "host_blocks": wrun.host_blocks,
        "variants": {},
    }
    try:
        for v in variants:  # warm-up: one request of the workload, and a load
            e = engine(v)
            first = workload.turns(mc.vocab, 99)[: 2 if e.host is None else 1]
            for t in first:
                e.run(t.prompt, t.answer)
            e.idle()
        freeze_heap()
        rounds: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
        for i in range(args.rounds):
            for v in variants if i % 2 == 0 else variants[::-1]:
                # fresh token ids per variant and round: variants share a host tier, and must not
                # hit what another one stored
                turns = workload.turns(mc.vocab, 1009 * i + 7919 * variants.index(v))
                e = engine(v)
                tier = e.host if e.host is not None else host_for(args.backend)
                submitted.clear()
                with poller(v.poller):
                    one = run_turns(e, tier, turns, v.name, lambda _: None, i)
                sync(model.device)
                one["enqueue_ms_p50"] = _enqueue_ms(submitted)
                rounds[v.name].append(one)
                _line(v.name, i, one)
        for v in variants:
            summary = pool_rounds(rounds[v.name], mc.layers)
            out["variants"][v.name] = summary
    finally:
        for h in hosts.values():
            h.close()
    return out


def run_turns(
    engine: PagedEngine,
    host: HostTier,
    turns: Sequence[Turn],
    label: str,
    advance: Advance,
    round_: int = 0,
) -> dict[str, Any]:
    before = copy.copy(host.stats)
    device = engine.model.device
    sync(device)
    t0 = time.perf_counter()
    records = []
    for turn in turns:
        r = engine.run(turn.prompt, turn.answer)
        records.append(record(turn, r, round_))
        advance(label)
    sync(device)
    wall = time.perf_counter() - t0  # the last turn's stores run on, as they would in service
    engine.idle()
    return {
        "wall_s": wall,
        "turns_per_s": len(records) / wall,
        "tier": dataclasses.asdict(tier_delta(host.stats, before)),
        "gpu_evicted_blocks": engine.pool.evictions,
        "late_stored_blocks": engine.late_stores,
        "records": records,
    }


def _watch(host: HostTier, sink: list[tuple[str, Any]]) -> None:
    """Keep every pending copy the backend hands out, to read its host enqueue time later."""
    backend = host.worker.backend
    submit = backend.submit

    def watched(specs: Any, *args: Any, **kwargs: Any) -> Any:
        pending = submit(specs, *args, **kwargs)
        sink.append((specs[0].direction if specs else "none", pending))
        return pending

    backend.submit = watched  # type: ignore[method-assign]


def _enqueue_ms(submitted: list[tuple[str, Any]]) -> dict[str, dict[str, float]]:
    """Per direction, medians of the host time enqueuing a copy and of its wait to start."""
    out = {}
    for direction in ("load", "store"):
        got = [p for d, p in submitted if d == direction and hasattr(p, "enqueue_seconds")]
        if got:
            started = [p for p in got if p.started_at]
            out[direction] = {
                "count": float(len(got)),
                "enqueue": 1e3 * float(np.median([p.enqueue_seconds for p in got])),
                "queued": 1e3 * float(np.median([p.started_at - p.queued_at for p in started]))
                if started
                else 0.0,
                "inline_share": float(np.mean([bool(getattr(p, "inline", False)) for p in got])),
            }
    return out


def _line(name: str, i: int, one: dict[str, Any]) -> None:
    recs = one["records"]

    def med(values: list[float | None]) -> float:
        known = sorted(v for v in values if v is not None)
        return float(known[len(known) // 2]) if known else 0.0

    ttft = sorted(r["ttft_ms"] for r in recs)
    steps = sorted({s for r in recs for s in r["host_ms"]})
    host = ", ".join(f"{s} {med([r['host_ms'].get(s) for r in recs]):.2f}" for s in steps)
    fields = ("prefill_ms", "load_ms", "load_exposed_ms")
    device = ", ".join(f"{f[:-3]} {med([r[f] for r in recs]):.2f}" for f in fields)
    print(
        f"round {i} {name:>14}: {one['turns_per_s']:6.2f} turns/s, TTFT p50 "
        f"{med([r['ttft_ms'] for r in recs]):6.1f} max {ttft[-1]:6.1f} ms; host ms p50: {host}; "
        f"device ms p50: {device}; stored {one['tier']['stores']}, late "
        f"{one['late_stored_blocks']}; enqueue {one.get('enqueue_ms_p50')}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", help="model shapes")
    p.add_argument("--workload", default="fits", help="chat, fits, docs or mixed")
    p.add_argument("--variants", default="gpu,evict,behind", help="comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="prefill chunk")
    p.add_argument("--backend", default="staged", help="copy backend (GPU: staged or dma)")
    p.add_argument("--out", type=Path, required=True, help="JSON path")
    args = p.parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result) + "\n")
    for name, s in result["variants"].items():
        t = s["ttft_ms"]
        print(
            f"{name:>16}: turns/s {s['turns_per_s']:.2f} {s['turns_per_s_rounds']}, TTFT p50 "
            f"{t['p50']:.1f} p99 {t['p99']:.1f}, returning p50 "
            f"{s['ttft_ms_returning'].get('p50', 0):.1f} p99 "
            f"{s['ttft_ms_returning'].get('p99', 0):.1f}; overlap {s['overlap']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

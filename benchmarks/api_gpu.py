"""The public API end to end on a GPU, host time per phase included (issue 27, "What it must show").

For each shape of the sweep and 1, 37 and 1,000 blocks: ``schedule_store`` + ``submit`` + wait +
``get_finished`` + ``complete`` (then ``lookup`` of the stored keys and the same for a load into
other engine blocks, its per-layer waits through ``TransferWorker.layer_waiter`` timed), keys given
as a list of bytes with a list of block ids, and as an (n, 16) uint8 array with an int64 array. Per
phase the median host time; submit to done including schedule and complete against the link
(a contiguous pinned copy of the same bytes, timed alike), as a fraction. Bytes are checked: the
loaded blocks equal the stored ones. ``fits``: per call + per block lines over the job sizes of
schedule + submit + complete (the host time of our calls on the engine's thread, the wait left
out), of each phase and of ``lookup``, and the median per-layer wait, against issue 27's and 25's
targets with ``met`` (``kvoffload.bench.store.api.TARGETS``, as ``kvoffload bench store``).

    python benchmarks/api_gpu.py OUT.json            # CUDA: backend 'staged' (native)
    python benchmarks/api_gpu.py OUT.json --cpu      # a smoke run on CPU tensors (host backend)
    python benchmarks/api_gpu.py OUT.json --backends staged,staged-wide-ds1 --shapes llama3-8b:page

``--wait block,poll``: each transfer waited for both ways, alternated (``one``).
``--driver-times``: the native core's driver calls timed in the caller's thread
(``KVOFFLOAD_DRIVER_TIMES``): ``submit_driver`` (us) and ``submit_driver_calls`` per submit, and
in ``fits`` the driver's line (``driver``) and the API's without it (``api_less_driver``: the host
time of our own code, against the same targets). ``--refit IN.json``: recompute ``fits`` from a
results file's rows, no run.
``--backends``: the native core's variants side by side (``staged-FLAG-...``, flags of
``kvoffload.bench.e2e.runner.core_flags``), run in turn per shape, ``--rounds`` times, each
round starting one backend later (the first run of a shape read slower host phases on an H100,
2026-11-26); ``--shapes``: model:layout pairs of the sweep to run (default: all).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvoffload import KVLayout, OffloadConfig, StallTimer, build_local
from kvoffload.bench.e2e.command import device_info
from kvoffload.bench.e2e.runner.core_flags import configured
from kvoffload.bench.store.api import TARGETS, line, met
from kvoffload.transfer.cuda.extension import driver_times
from kvoffload.transfer.shapes import MODELS, engine_tensors

SWEEP = (  # (model, layout): bf16 pages, K/V split (32, 8 KiB pieces), fp8 2 KiB, K-only latent
    ("llama3-8b", "page"),
    ("llama3-8b", "kv_split"),
    ("qwen2.5-1.5b", "kv_split"),
    ("llama3-70b-tp8-fp8", "page"),
    ("deepseek-v2-lite-mla", "page"),
)
COUNTS = (1, 37, 1000)
TIMED = ("launch", "copy", "copy2d", "record", "wait", "memops", "ctx_get", "ctx_set")
REPS = 15
_ORDER = itertools.count()  # transfers so far: which of a load's two waiters goes first
_STALLS: dict[int, StallTimer] = {}  # layers -> the timed waits' StallTimer (one per process)


def link_us(nbytes: int, device: str) -> dict[str, float]:
    """Median time of one contiguous pinned copy of ``nbytes`` each way (the wire)."""
    if device == "cpu":
        return {"store": float("nan"), "load": float("nan")}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for d, (dst, src) in {"store": (host, dev), "load": (dev, host)}.items():
        times = []
        for _ in range(REPS + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[d] = statistics.median(times[1:]) * 1e6
    return out


def one(
    off: Any, worker: Any, direction: str, req: str, keys: Any, ids: Any, layers: int, wait: str
) -> dict[str, float]:
    """One transfer, each phase timed (µs); a load's ``layers`` waits too (µs per layer, as the
    engine makes them: bound once, then one call per layer on the current stream). ``wait``:
    "block" sleeps in ``worker.wait``, then ``get_finished``; "poll" calls ``get_finished`` until
    it has the job, as an engine's step loop does, so the thread never sleeps (its ``complete`` is
    that last call and ``Offloader.complete``)."""
    out: dict[str, float] = {}
    driver_times(reset=True)  # here, outside every timed phase (~4 us a call on a CPU VM)
    if direction == "load":
        t0 = time.perf_counter()
        off.lookup(keys)
        out["lookup"] = (time.perf_counter() - t0) * 1e6
    t0 = time.perf_counter()
    sched = off.schedule_store if direction == "store" else off.schedule_load
    job = sched(req, keys, ids)
    t1 = time.perf_counter()
    worker.submit(job)
    t2 = time.perf_counter()
    spent = driver_times(reset=True)  # {} unless --driver-times
    if spent:
        out["submit_driver"] = sum(us for _, us in spent.values())
        out["submit_driver_calls"] = sum(c for c, _ in spent.values())
        for name in TIMED:  # per entry point: us, calls
            out[f"submit_{name}"], out[f"submit_{name}_calls"] = spent.get(name, (0, 0.0))[::-1]
    if direction == "load":
        # the waits as the engine makes them (bound once, one call per layer), and the same
        # waits through a StallTimer (the core records its events around each wait it enqueues):
        # what timing them costs the engine's thread. Their order alternates by transfer (the
        # second may find slices landed and enqueue less); the timer is the process's, so its
        # events exist after the first transfer of a backend.
        timer = _STALLS.setdefault(layers, StallTimer(layers))
        timer.reset()
        first_timed = next(_ORDER) % 2 == 1
        for timed in (first_timed, not first_timed):
            driver_times(reset=True)
            tw = time.perf_counter()
            waiter = worker.layer_waiter(job.job_id, timer=timer if timed else None)
            for layer in range(layers):
                waiter(layer)
            out["layer_wait_timed" if timed else "layer_wait"] = (
                (time.perf_counter() - tw) / layers * 1e6
            )
            spent = driver_times(reset=True)
            if spent and not timed:
                out["layer_wait_driver_calls"] = sum(c for c, _ in spent.values())
    t2w = time.perf_counter()
    if wait == "block":
        worker.wait([job.job_id], 60)
        t3 = time.perf_counter()
        results = worker.get_finished()
    else:
        deadline = t2w + 60
        while True:
            t3 = time.perf_counter()
            results = worker.get_finished()
            if results or t3 > deadline:
                break
    off.complete(results)
    t4 = time.perf_counter()
    if not all(r.ok for r in results) or not off.is_settled(req):
        raise RuntimeError(f"{direction} {req} failed: {results}")
    us = 1e6
    out.update(
        {
            "schedule": (t1 - t0) * us,
            "submit": (t2 - t1) * us,
            "wait": (t3 - t2w) * us,
            "complete": (t4 - t3) * us,
            "api": (t1 - t0 + t2 - t1 + t4 - t3) * us,
            "total": (t4 - t0 - (t2w - t2)) * us,
        }
    )
    return out


def fits(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, layout, keys, direction): lines over the job sizes with ``met``."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["backend"], r["model"], r["layout"], r["keys"], r["direction"], r["wait"])
        groups.setdefault(key, []).append(r)
    out = []
    for (backend, model, layout, keys, direction, wait), rs in groups.items():
        blocks = [r["blocks"] for r in rs]
        phases = rs[0]["phases_us"]
        fit: dict[str, Any] = {"backend": backend, "model": model, "layout": layout, "keys": keys}
        fit["direction"], fit["wait"] = direction, wait
        fit["api"] = met(line(blocks, [r["phases_us"]["api"] for r in rs]), TARGETS["per_block_us"])
        fit["phases"] = {
            p: line(blocks, [r["phases_us"][p] for r in rs])
            for p in ("schedule", "submit", "complete")
        }
        if "submit_driver" in phases:  # --driver-times: the CUDA driver's enqueue apart
            driver = [r["phases_us"]["submit_driver"] for r in rs]
            fit["driver"] = line(blocks, driver)
            ours = [r["phases_us"]["api"] - d for r, d in zip(rs, driver, strict=True)]
            fit["api_less_driver"] = met(line(blocks, ours), TARGETS["per_block_us"])
        if "lookup" in phases:
            lookup = line(blocks, [r["phases_us"]["lookup"] for r in rs])
            fit["lookup"] = met(lookup, TARGETS["lookup_per_block_us"], per_call=False)
            per_layer = statistics.median(r["phases_us"]["layer_wait"] for r in rs)
            fit["layer_wait_us"] = {
                "per_call_us": per_layer,
                "met": per_layer <= TARGETS["layer_wait_us"],
                "timed_per_call_us": statistics.median(
                    r["phases_us"]["layer_wait_timed"] for r in rs
                ),
            }
        out.append(fit)
        api = fit["api"]
        print(
            f"{backend:16} {model:22} {layout:9} {keys:5} {direction:5} {wait:5} fit "
            f"{api['per_call_us']:8.1f} + "
            f"{api['per_block_us']:.3f}/block met {api['met']}"
            + (
                f"  less the driver's {fit['driver']['per_call_us']:.1f} + "
                f"{fit['driver']['per_block_us']:.3f}/block: "
                f"{fit['api_less_driver']['per_call_us']:.1f} + "
                f"{fit['api_less_driver']['per_block_us']:.3f}/block met "
                f"{fit['api_less_driver']['met']}"
                if "driver" in fit
                else ""
            )
            + (
                f"  lookup {fit['lookup']['per_block_us']:.4f}/block"
                f"  layer wait {fit['layer_wait_us']['per_call_us']:.2f} us"
                f" (timed {fit['layer_wait_us']['timed_per_call_us']:.2f})"
                if "lookup" in fit
                else ""
            )
        )
    return out


def shape(
    model: str, layout: str, device: str, backend: str, waits: list[str]
) -> list[dict[str, Any]]:
    counts = COUNTS if device != "cpu" else (1, 37, 100)  # a CPU smoke run stays small
    pool = 2 * max(counts) + 8
    gen = torch.Generator().manual_seed(0)
    dtype = torch.int8 if MODELS[model].dtype_bytes == 1 else torch.int16  # the model's bytes
    tensors, block_dim = engine_tensors(
        MODELS[model],
        layout,
        pool,
        16,
        lambda s: torch.randint(-100, 100, s, dtype=dtype, generator=gen).to(device),
    )
    kv = KVLayout.from_tensors(tensors, block_size=16, block_dim=block_dim)
    slots = 3 * max(counts)  # stores evict the oldest keys; a load's keys were just stored
    local = build_local(kv, OffloadConfig(host_capacity_blocks=slots, backend=backend))
    off, worker = local.offloader, local.worker
    rng = np.random.default_rng(1)
    rows = []
    try:
        for kind in ("list", "array"):
            for n in counts:
                src = np.arange(n, dtype=np.int64)
                dst = np.arange(pool - n, pool, dtype=np.int64)
                ids = (src, dst) if kind == "array" else (src.tolist(), dst.tolist())
                runs: dict[tuple[str, str], list[dict[str, float]]] = {}
                layers = kv.groups[0].num_layers
                for r in range(REPS + 1):
                    for w in waits[r % len(waits) :] + waits[: r % len(waits)]:  # alternated
                        arr = rng.integers(0, 256, (n, 16), dtype=np.uint8)
                        keys = arr if kind == "array" else arr.view("V16").ravel().tolist()
                        for d, i in (("store", 0), ("load", 1)):
                            got = one(off, worker, d, f"{d}{w}{r}", keys, ids[i], layers, w)
                            runs.setdefault((w, d), []).append(got)
                for t in tensors:  # the last load brought back exactly what was stored
                    a, b = (
                        (t[:n], t[pool - n :]) if block_dim == 0 else (t[:, :n], t[:, pool - n :])
                    )
                    if not torch.equal(a, b):
                        raise RuntimeError(f"{model} {layout} {n}: loaded bytes differ")
                wire = link_us(n * kv.slot_bytes, device)
                for (w, d), rs in runs.items():
                    # a phase a rep did not reach (a layer wait with no driver call) counts 0
                    keys = {p: None for x in rs for p in x}
                    med = {p: statistics.median(x.get(p, 0.0) for x in rs[1:]) for p in keys}
                    frac = wire[d] / med["total"] if device != "cpu" else None
                    rows.append(
                        {
                            "backend": backend,
                            "model": model,
                            "layout": layout,
                            "keys": kind,
                            "blocks": n,
                            "direction": d,
                            "wait": w,
                            "slot_bytes": kv.slot_bytes,
                            "phases_us": med,
                            "wire_us": wire[d],
                            "fraction_of_link": frac,
                        }
                    )
                    print(
                        f"{backend:16} {model:22} {layout:9} {kind:5} {d:5} {w:5} {n:5}  "
                        + "  ".join(f"{p} {v:8.1f}" for p, v in med.items())
                        + (f"  wire {wire[d]:8.1f}  link {frac:.2f}" if frac else "")
                    )
    finally:
        local.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the JSON file to write")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors, backend 'host'")
    ap.add_argument("--backends", default="staged", help="comma-separated staged[-FLAG...]")
    ap.add_argument("--shapes", default="", help="comma-separated model:layout (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each backend per shape")
    ap.add_argument(
        "--driver-times",
        action="store_true",
        help="time the native core's driver calls (KVOFFLOAD_DRIVER_TIMES=1): submit_driver us",
    )
    ap.add_argument(
        "--wait",
        default="block",
        help="comma-separated: block (sleep in worker.wait) and/or poll (get_finished until done)",
    )
    ap.add_argument(
        "--refit",
        metavar="IN.json",
        help="no run: the fits of IN.json's rows recomputed (this version's lines) into OUT",
    )
    args = ap.parse_args()
    if args.refit:
        with open(args.refit) as f:
            data = json.load(f)
        data["fits"] = fits(data["rows"])
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
        return 0
    if args.driver_times:
        os.environ["KVOFFLOAD_DRIVER_TIMES"] = "1"
    waits = [w for w in args.wait.split(",") if w]
    if not waits or any(w not in ("block", "poll") for w in waits):
        raise ValueError(f"expected --wait of block and/or poll, got {args.wait!r}")
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    backends = ["host"] if device == "cpu" else [b for b in args.backends.split(",") if b]
    names = [
        b if b in ("host", "staged") else configured("staged", b.split("-")[1:]) for b in backends
    ]
    sweep = [tuple(s.split(":")) for s in args.shapes.split(",") if s] or list(SWEEP)
    unknown = [s for s in sweep if s not in SWEEP]
    if unknown:
        raise ValueError(f"expected shapes from {SWEEP}, got {unknown}")
    rows = []
    for m, lay in sweep:
        for k in range(args.rounds):  # each round starts one backend later: none always first
            for b in names[k % len(names) :] + names[: k % len(names)]:
                rows += [{**r, "round": k} for r in shape(m, lay, device, b, waits)]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    with open(args.out, "w") as f:
        json.dump(
            {
                "benchmark": "api_gpu",
                "device": name,
                "host": device_info(device),
                "backends": names,
                "waits": waits,
                "date": time.strftime("%Y-%m-%d"),
                "targets": TARGETS,
                "fits": fits(rows),
                "rows": rows,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

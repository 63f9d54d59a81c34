"""``kvoffload bench tiers --cluster``: engine processes sharing prefixes through the shared tier,
on one server and on a cluster, side by side.

Each of ``processes`` processes (spawned, one ``ValkeyTier`` each, as engines would have) walks
the same ``prefixes`` in its own random order, ``rounds`` times. Per prefix it reads the prefix's
blocks in one ``get`` (the mover's 16-block op), counts the leading blocks found (what a prefix
hit can use), checks their bytes, and writes the rest (as an engine that recomputed them would).
A prefix is thus written by whichever process reaches it first and read by the others.

Reported per target and block size: ``hit_rate`` (blocks found / blocks asked for), ``get_MBps``
(the sum over processes of the bytes each read over the seconds it spent in ``get``: the read
rate the processes saw together), ``put_MBps`` (likewise), ``get_per_block`` p50/p99 (the time
of a ``get`` whose blocks were all found, divided by its blocks) and ``wrong_blocks`` (must be 0).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import secrets
import time
from typing import Any

import numpy as np

from kvoffload.bench.tiers.common import FP

PREFIX_BLOCKS = 16  # one mover op
POOL = 8  # distinct block contents per process (a block's content: POOL[(prefix + block) % POOL])


def run_sharing(
    url: str, size: int, total_bytes: int, processes: int, rounds: int = 2
) -> dict[str, Any]:
    """One target, one block size: ``processes`` processes sharing ``total_bytes`` of prefixes."""
    prefixes = max(processes, total_bytes // (size * PREFIX_BLOCKS))
    namespace = "bench-" + secrets.token_hex(4)  # this run's keys only; deleted at the end
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(processes)
    results = ctx.Queue()
    workers = [
        ctx.Process(
            target=_worker,
            args=(url, namespace, size, prefixes, rounds, p, start, results),
            daemon=True,
        )
        for p in range(processes)
    ]
    for w in workers:
        w.start()
    done = [results.get(timeout=600) for _ in workers]
    for w in workers:
        w.join(60)
    _clean(url, namespace, size, prefixes)
    failed = [d["error"] for d in done if "error" in d]
    if failed:
        raise RuntimeError(f"a sharing process failed: {failed[0]}")
    per_block = np.concatenate([np.asarray(d["hit_get_s_per_block"]) for d in done]) * 1e3
    asked = sum(d["asked"] for d in done)
    return {
        "processes": processes,
        "prefixes": prefixes,
        "blocks_per_prefix": PREFIX_BLOCKS,
        "rounds": rounds,
        "blocks_asked": asked,
        "hit_rate": sum(d["hit"] for d in done) / asked,
        "get_MBps": sum(d["hit_bytes"] / d["get_s"] / 1e6 for d in done if d["get_s"]),
        "put_MBps": sum(d["put_bytes"] / d["put_s"] / 1e6 for d in done if d["put_s"]),
        "get_per_block": {
            "p50_ms": float(np.percentile(per_block, 50)) if per_block.size else 0.0,
            "p99_ms": float(np.percentile(per_block, 99)) if per_block.size else 0.0,
        },
        "wrong_blocks": sum(d["wrong"] for d in done),
        "tier_errors": sum(d["errors"] for d in done),
    }


def _keys(size: int, prefix: int) -> list[bytes]:
    return [f"share:{size}:{prefix}:{b}".encode() for b in range(PREFIX_BLOCKS)]


def _worker(
    url: str,
    namespace: str,
    size: int,
    prefixes: int,
    rounds: int,
    proc: int,
    start: Any,
    results: Any,
) -> None:
    try:
        results.put(_walk(url, namespace, size, prefixes, rounds, proc, start))
    except Exception as e:  # noqa: BLE001 (reported to the parent, which fails the run)
        results.put({"error": f"{type(e).__name__}: {e}"})


def _walk(
    url: str, namespace: str, size: int, prefixes: int, rounds: int, proc: int, start: Any
) -> dict[str, Any]:
    from kvoffload.store.tiers.valkey import ValkeyTier

    tier = ValkeyTier(url, FP, size, ttl_s=600, timeout_s=5.0, namespace=namespace)
    pool = np.random.default_rng(size).integers(0, 256, (POOL, size), dtype=np.uint8)
    out = np.empty((PREFIX_BLOCKS, size), dtype=np.uint8)
    outs = [row.data for row in out]
    order = random.Random(proc)
    stats = {"asked": 0, "hit": 0, "hit_bytes": 0, "get_s": 0.0, "put_bytes": 0, "put_s": 0.0}
    per_block: list[float] = []
    wrong = 0
    start.wait(120)
    for _ in range(rounds):
        for prefix in order.sample(range(prefixes), prefixes):
            keys = _keys(size, prefix)
            want = [pool[(prefix + b) % POOL] for b in range(PREFIX_BLOCKS)]
            t0 = time.perf_counter()
            found = tier.get(keys, outs)
            took = time.perf_counter() - t0
            lead = found.index(False) if False in found else PREFIX_BLOCKS
            wrong += sum(not np.array_equal(out[b], want[b]) for b in range(lead))
            stats["asked"] += PREFIX_BLOCKS
            stats["hit"] += lead
            stats["hit_bytes"] += lead * size
            stats["get_s"] += took
            if lead == PREFIX_BLOCKS:
                per_block.append(took / PREFIX_BLOCKS)
                continue
            t0 = time.perf_counter()
            tier.put(keys[lead:], [w.data for w in want[lead:]])
            stats["put_s"] += time.perf_counter() - t0
            stats["put_bytes"] += (PREFIX_BLOCKS - lead) * size
    errors = tier.stats.errors + tier.stats.put_failures
    tier.close()
    return {**stats, "hit_get_s_per_block": per_block, "wrong": wrong, "errors": errors}


def _clean(url: str, namespace: str, size: int, prefixes: int) -> None:
    from kvoffload.store.tiers.valkey import ValkeyTier

    tier = ValkeyTier(url, FP, size, namespace=namespace)
    for prefix in range(prefixes):
        tier.discard(_keys(size, prefix))
    tier.close()

"""``disk`` and ``valkey``: the real tiers, ``put``/``get`` of one block per call (latency p50/p99)
and of 16-block batches from 2 threads (throughput, as the mover drives them), every byte read
back checked."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvoffload.bench.tiers.common import BATCH, Fatal, drop_cache, keys, lat, mbps, seconds, timed


def tier_round(
    make: Callable[[int], Any], data: np.ndarray, cold: Callable[[Any], None]
) -> dict[str, Any]:
    """One round on a fresh tier: per-block put/get latency, then 2-thread batched throughput."""
    n, size = data.shape
    tier = make(size)
    views = [memoryview(row) for row in data]
    out = np.empty_like(data)
    outs = [memoryview(row) for row in out]
    ka, kb = keys(n, "one"), keys(n, "batch")
    pt, pl = timed(lambda i: _all(tier.put([ka[i]], [views[i]]), tier, "put"), n)
    flush = seconds(lambda: cold(tier))  # disk: until the bytes are on the device
    gt, gl = timed(lambda i: _all(tier.get([ka[i]], [outs[i]]), tier, "get"), n)
    if not np.array_equal(out, data):
        raise RuntimeError(f"bench tiers: {tier.name} returned different bytes")

    def threaded(
        fn: Callable[[list[bytes], list[memoryview]], list[bool]], bufs: list[memoryview]
    ) -> float:
        def part(p: int) -> None:
            for s in range(p * BATCH, n, 2 * BATCH):
                _all(fn(kb[s : s + BATCH], bufs[s : s + BATCH]), tier, "batch")

        threads = [threading.Thread(target=part, args=(p,)) for p in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    bput = threaded(tier.put, views)
    bflush = seconds(lambda: cold(tier))
    out[:] = 0
    bget = threaded(tier.get, outs)
    if not np.array_equal(out, data):
        raise RuntimeError(f"bench tiers: {tier.name} returned different bytes (batched)")
    tier.close()
    total = n * size
    return {
        "put_MBps": mbps(total, pt),
        "put_flushed_MBps": mbps(total, pt + flush),
        "get_MBps": mbps(total, gt),
        "put_batched_2threads_MBps": mbps(total, bput),
        "put_batched_2threads_flushed_MBps": mbps(total, bput + bflush),
        "get_batched_2threads_MBps": mbps(total, bget),
        "put": lat(pl),
        "get": lat(gl),
    }


def _all(ok: list[bool], tier: Any, what: str) -> None:
    """A tier that drops blocks mid-run (a server gone, out of memory) ends the run clearly."""
    if not all(ok):
        raise Fatal(
            f"the {tier.name} tier lost a {what} mid-run ({tier.stats.snapshot()}); is the "
            "server down or short of memory (maxmemory)?"
        )


def disk_cold(tier: Any) -> None:
    """The disk tier's slabs on the device and out of the page cache: the next reads are cold."""
    for fd in tier._fds:
        drop_cache(fd)
